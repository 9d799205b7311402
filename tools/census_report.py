#!/usr/bin/env python3
"""Fusion census of the census fixtures (manifest.json "census_fixtures", made by tools/make_fixtures.py):
what each architecture has (counted on the torch model) against what npufuse fuses, and why the rest is left.

For every census fixture: run `optimize(load_model(path), fixtures_dir, OptimizeOptions())` (default options:
every rewrite and the whole model verified), then print

* per kind (attention, layernorm, rmsnorm, gelu, gated_mlp, rotary, conv_epilogue, batchnorm, conv_residual,
  conv_gelu, linear_bn, moe_gating) the
  expected count (manifest "expected", measured on the torch model) and the fused count:
  - attention, layernorm, rmsnorm, gelu, gated_mlp, conv_epilogue: `npufuse.fusion.census.fusion_census` of the
    optimized model (a GeGLU's GELU counts as a GELU, a FusedMatMul epilogue's norm/GELU in its kind);
  - rotary: applied rewrites of the `rotary` pattern (one per rotated tensor, as the manifest counts them);
  - batchnorm: BatchNormalization nodes removed by applied rewrites (folded into a Conv/Gemm);
  - conv_epilogue, conv_residual: FusedConv nodes (fusion_census "conv_epilogue") split by their `residual`
    attribute: with residual=1 the FusedConv took a residual block's Add (-> activation) and counts as
    conv_residual, one with a GELU epilogue as conv_gelu (its GELU in gelu too), the others as conv_epilogue
    (Conv [-> BN] -> activation);
  - linear_bn: BatchNormalization nodes folded into a Gemm or MatMul (gemm_bn, matmul_bn);
  - moe_gating: MoeGatingTopKSoftmax nodes (fusion_census "moe_gating"), one per MoE router;
* every anchor node left in the optimized graph (Softmax; ReduceMean and a Pow feeding a ReduceMean: the starts of
  LayerNorm/RMSNorm decompositions; Erf, Tanh, Sigmoid: GELU erf/tanh/quick forms and SiLU; BatchNormalization) and
  whether a near-miss (`result.refusals`) names it (as its `node` or in its `nodes`), with pattern, reason, detail;
* every refusal, by (pattern, reason), with one detail.

A kind is listed when its expected or fused count is non-zero. "gap" is fused - expected.

Usage::

    python tools/census_report.py                      # all census fixtures; table to stdout
    python tools/census_report.py --only swin t5_ts17  # fixtures whose file name contains any of these
    python tools/census_report.py --json out.json      # also the whole report as JSON ("-" for stdout)
    python tools/census_report.py > /tmp/census_baseline.txt
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's npufuse, not an installed one


from npufuse.fusion.census import result_counts  # noqa: E402
from npufuse.fusion.engine import OptimizeOptions, optimize  # noqa: E402
from npufuse.ir.modelio import load_model  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
MANIFEST = FIXTURES / "manifest.json"

# report kind -> (manifest "expected" key, how the fused count is read)
KINDS: dict[str, str] = {
    "attention": "attention",
    "layernorm": "layernorm",
    "rmsnorm": "rmsnorm",
    "gelu": "gelu",
    "gated_mlp": "gated_mlp",
    "rotary": "rotary_applications",
    "conv_epilogue": "conv_epilogue",
    "batchnorm": "batchnorm",
    "conv_residual": "conv_residual",
    "conv_gelu": "conv_gelu",
    "linear_bn": "linear_bn",
    "moe_gating": "moe_gating",
}
ANCHOR_OPS = ("Softmax", "ReduceMean", "Pow", "Erf", "Tanh", "Sigmoid", "BatchNormalization")


def census_entries() -> list[dict]:
    return json.loads(MANIFEST.read_text()).get("census_fixtures", [])


def _anchors(model) -> list:
    """Anchor nodes of the graph: see ANCHOR_OPS; a Pow only where it feeds a ReduceMean (x^2 of a variance)."""
    consumers = collections.defaultdict(list)
    for n in model.graph.node:
        for i in n.input:
            consumers[i].append(n)
    out = []
    for n in model.graph.node:
        if n.op_type not in ANCHOR_OPS:
            continue
        if n.op_type == "Pow" and not any(c.op_type == "ReduceMean" for c in consumers.get(n.output[0], [])):
            continue
        out.append(n)
    return out


def report_one(entry: dict) -> dict:
    path = FIXTURES / entry["file"]
    t0 = time.perf_counter()
    res = optimize(load_model(path), str(FIXTURES), OptimizeOptions())
    secs = time.perf_counter() - t0
    fused = result_counts(res)
    exp = entry["expected"]
    kinds = []
    for kind, key in KINDS.items():
        e, f = int(exp.get(key, 0)), fused.get(kind, 0)
        if kind == "batchnorm":   # the BNs the dynamo exporter's optimizer folded into Conv are not there to fold
            e -= int(entry.get("exporter_rewrite_rules", {}).get("FuseBatchNormIntoConv", 0))
        if e or f:
            kinds.append({"kind": kind, "expected": e, "fused": f, "gap": f - e})
    by_node = collections.defaultdict(list)
    for r in res.refusals:
        for name in {r.node, *r.nodes}:
            by_node[name].append(r)
    anchors = []
    for n in _anchors(res.model):
        rs = by_node.get(n.name, [])
        anchors.append({"op": n.op_type, "node": n.name,
                        "near_misses": [{"pattern": r.pattern, "reason": r.reason, "detail": r.detail,
                                         "as": "node" if r.node == n.name else "chain"} for r in rs]})
    reasons = collections.OrderedDict()
    for r in res.refusals:
        k = (r.pattern, r.reason)
        if k not in reasons:
            reasons[k] = {"pattern": r.pattern, "reason": r.reason, "count": 0, "detail": r.detail, "nodes": []}
        reasons[k]["count"] += 1
        reasons[k]["nodes"].append(r.node)
    mc = res.model_check
    return {
        "file": entry["file"], "family": entry["family"], "exporter": entry["exporter"],
        "dtype": entry.get("dtype", "float32"), "shapes": "dynamic" if entry.get("dynamic") else "static",
        "opset": entry.get("opset"), "nodes_before": res.nodes_before, "nodes_after": res.nodes_after,
        "seconds": round(secs, 2), "kinds": kinds,
        "applied": len(res.applied), "rolled_back": [r.match.kind for r in res.rolled_back],
        "rewrites_verified": all(r.check is not None and r.check.ok for r in res.applied),
        "model_check": None if mc is None else {"ok": mc.ok, "reason": getattr(mc, "reason", "")},
        "anchors_left": anchors, "refusals": list(reasons.values()),
        "notes": list(res.notes),
    }


def _fmt_table(rows: list[list[str]], header: list[str]) -> str:
    w = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).ljust(n) for x, n in zip(r, w)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * n for n in w])] + [line(r) for r in rows])


def render(reports: list[dict]) -> str:
    out = []
    rows = []
    for r in reports:
        for k in r["kinds"]:
            rows.append([r["file"], k["kind"], k["expected"], k["fused"],
                         "ok" if k["gap"] == 0 else f"{k['gap']:+d}"])
    out.append("# Fusion census: expected (torch model) vs fused (npufuse, default options)\n")
    out.append(_fmt_table(rows, ["fixture", "kind", "expected", "fused", "gap"]))
    gaps = [(r["file"], k) for r in reports for k in r["kinds"] if k["gap"]]
    out.append(f"\n{len(reports)} fixtures, {len(rows)} (fixture, kind) rows, {len(gaps)} with a gap")
    by_kind = collections.Counter(k["kind"] for _, k in gaps)
    if by_kind:
        out.append("gaps by kind: " + ", ".join(f"{k} {n}" for k, n in by_kind.most_common()))
    for r in reports:
        mc = r["model_check"]
        out.append(f"\n== {r['file']}  ({r['family']}, {r['exporter']}, opset {r['opset']}, {r['dtype']}, "
                   f"{r['shapes']} shapes)  nodes {r['nodes_before']} -> {r['nodes_after']}, {r['seconds']} s")
        out.append(f"   applied {r['applied']} (every rewrite verified: {r['rewrites_verified']}), rolled back "
                   f"{len(r['rolled_back'])}{' ' + str(r['rolled_back']) if r['rolled_back'] else ''}, whole model: "
                   f"{'not checked' if mc is None else ('ok' if mc['ok'] else 'FAILED ' + mc['reason'])}")
        out.append("   " + ", ".join(f"{k['kind']} {k['fused']}/{k['expected']}" for k in r["kinds"]))
        left = collections.Counter(a["op"] for a in r["anchors_left"])
        named = collections.Counter(a["op"] for a in r["anchors_left"] if a["near_misses"])
        if left:
            out.append("   anchors left: " + ", ".join(f"{op} {n} ({named[op]} named by a near-miss)"
                                                        for op, n in sorted(left.items())))
        for a in r["anchors_left"]:
            if a["near_misses"]:
                for nm in a["near_misses"]:
                    out.append(f"     {a['op']:<18} {a['node']:<40} {nm['pattern']}/{nm['reason']} "
                               f"({'at this node' if nm['as'] == 'node' else 'in the matched chain'}): {nm['detail']}")
            else:
                out.append(f"     {a['op']:<18} {a['node']:<40} -- no near-miss names it")
        if r["refusals"]:
            out.append("   refusals:")
            for f in r["refusals"]:
                out.append(f"     {f['pattern']}/{f['reason']} x{f['count']} (e.g. {f['nodes'][0]}): {f['detail']}")
        for n in r["notes"]:
            out.append(f"   note: {n}")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", help="fixtures whose file name contains any of these")
    ap.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH ('-': stdout, instead of the table)")
    args = ap.parse_args(argv)
    entries = [e for e in census_entries() if not args.only or any(s in e["file"] for s in args.only)]
    if not entries:
        print("no census fixtures (manifest.json 'census_fixtures'); run tools/make_fixtures.py", file=sys.stderr)
        return 2
    reports = []
    for e in entries:
        print(f"optimizing {e['file']} ...", file=sys.stderr, flush=True)
        reports.append(report_one(e))
    if args.json == "-":
        print(json.dumps(reports, indent=2))
    else:
        print(render(reports), end="")
        if args.json:
            Path(args.json).write_text(json.dumps(reports, indent=2) + "\n")
    failed = [r["file"] for r in reports if r["rolled_back"] or not r["rewrites_verified"]
              or (r["model_check"] is not None and not r["model_check"]["ok"])]
    if failed:
        print(f"verification problems: {failed}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
