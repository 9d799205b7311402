"""Diagnosis for benchmarks/heldout.py: what bounds each modeled kernel of a held-out model (issue 22).

    PYTHONPATH=. python benchmarks/heldout_bounds.py vit_small_patch16_224:8 hrnet_w18:1 ... \
        --cache /tmp/heldout_exports -o benchmarks/results/heldout_Ascend310P3_bounds.json

Prices each cached export (WORKLOAD:BATCH) through the same npufuse.api.report call the CLI makes (--target
Ascend310P3 --no-verify --dim batch=B) and sums the fused graph's kernel times by `bound_by` (cube, vector, mte2,
mte3, gm_bandwidth, launch) and by kernel kind. The report JSON has no per-kernel records (ModelEstimate.to_dict
leaves them out), so this script asks for them; nothing else changes.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from npufuse import api
from npufuse.cost_model import estimate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("items", nargs="+", metavar="WORKLOAD:BATCH")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/heldout_exports"))
    ap.add_argument("-o", "--output", type=Path)
    a = ap.parse_args()
    to_dict = estimate.ModelEstimate.to_dict
    estimate.ModelEstimate.to_dict = lambda self, include_kernels=False: to_dict(self, True)
    out = {}
    for item in a.items:
        w, b = item.split(":")
        doc = api.report(a.cache / f"{w}.onnx", target="Ascend310P3", format="json", verify=False,
                         dims=(f"batch={b}",))
        d = doc if isinstance(doc, dict) else json.loads(doc.render("json"))
        ks = d["model_estimate"]["after"]["kernels"]
        total = sum(k["t_total_us"] for k in ks)
        bound, kind = collections.Counter(), collections.Counter()
        for k in ks:
            bound[k["bound_by"]] += k["t_total_us"]
            kind[k["kind"]] += k["t_total_us"]
        out[item] = {"time_us": round(total, 1),
                     "bound_by": {k: round(v / total, 3) for k, v in bound.most_common() if v > 0},
                     "kind": {k: round(v / total, 3) for k, v in kind.most_common() if v > 0}}
        print(item, out[item], flush=True)
    if a.output:
        a.output.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
