"""Time `npufuse optimize` on a CNN with and without verification, beside onnxruntime's own offline
Conv+BN fusion, and report peak memory.

    python benchmarks/bench_optimize.py [--model PATH] [--runs 5]

Each configuration runs in a fresh subprocess (so peak RSS is its own); wall time is measured inside
the process around the work (load + optimize + write), excluding interpreter start-up and imports.
Quote medians and ratios: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx

LIGHT = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light" / "light_resnet50.onnx"

_NPUFUSE = """
import json, resource, sys, time
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.modelio import load_model, model_dir, write_model
from npufuse.npu_model.spec import load_profile
src, out, verify = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
spec = load_profile("Ascend910B2")
t = time.perf_counter()
m = load_model(src)
r = optimize(m, model_dir(src), OptimizeOptions(spec=spec, verify=verify))
write_model(r.model, out, model_dir(src))
dt = time.perf_counter() - t
print(json.dumps({"s": dt, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "fused": len(r.applied), "stages": r.timings_s}))
"""

_ORT = """
import json, resource, sys, time
import onnxruntime as ort
src, out = sys.argv[1], sys.argv[2]
t = time.perf_counter()
so = ort.SessionOptions()
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
so.optimized_model_filepath = out
ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
dt = time.perf_counter() - t
print(json.dumps({"s": dt, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _run(code: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(LIGHT))
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.onnx")
        configs = {
            "npufuse optimize --no-verify": lambda: _run(_NPUFUSE, args.model, out, "0"),
            "npufuse optimize (verify)": lambda: _run(_NPUFUSE, args.model, out, "1"),
            "onnxruntime offline optimize (EXTENDED)": lambda: _run(_ORT, args.model, out),
        }
        results = {}
        for name, fn in configs.items():
            runs = [fn() for _ in range(args.runs)]
            results[name] = {"median_s": statistics.median(r["s"] for r in runs),
                             "min_s": min(r["s"] for r in runs),
                             "peak_rss_mib": max(r["rss_mib"] for r in runs),
                             "fused": runs[0].get("fused")}
    base = results["onnxruntime offline optimize (EXTENDED)"]["median_s"]
    print(f"model: {args.model}  runs: {args.runs}  python {sys.version.split()[0]}  cores: {os.cpu_count()}")
    print(f"{'configuration':42s} {'median s':>9s} {'min s':>7s} {'vs ORT':>7s} {'peak RSS MiB':>13s} {'fused':>6s}")
    for name, r in results.items():
        print(f"{name:42s} {r['median_s']:9.3f} {r['min_s']:7.3f} {r['median_s'] / base:7.2f} "
              f"{r['peak_rss_mib']:13.0f} {str(r['fused'] or ''):>6s}")


if __name__ == "__main__":
    main()
