"""Structural check of the cost model on hardware we have: does it rank a model's nodes the way a real CPU does?

    python benchmarks/bench_cost_rank.py [--profile CPU2Core] [--threads 2] [--runs 10] [MODEL ...]

For each model: npufuse normalises it (the graph the cost model prices, node names included), the normalised
model is written to a temp file and run on onnxruntime's CPU provider with its profiler on (graph optimisations
off so one node is one kernel, sequential, fixed intra-op threads, warm-up runs left out, each node's median
kernel time; npufuse/calibrate/ort_profile.py), and every compute node is priced on the CPU profile
(npufuse/npu_model/profiles/CPU2Core.toml, written by tools/fit_cpu_profile.py) at the same input sizes as the
feeds. The table gives, per model, the nodes compared, Spearman's rank correlation of modeled and measured
per-node time (all compared nodes, and the nodes the model prices as kernels, i.e. not as free views), and the
modeled and measured totals over the compared nodes; "retest" is the rank correlation of two independent
measurements of the same nodes, the most any model could reach on this machine.

This is a rank check, not a precision claim: the profile maps a CPU onto the NPU model's terms, and a node's
onnxruntime time includes per-node overhead the NPU model only knows as a launch cost. Results go to
benchmarks/results/cost_rank.json with the command that made them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from npufuse.cost_model import estimate_ops  # noqa: E402
from npufuse.fusion.costing import CostShapes, model_ops  # noqa: E402
from npufuse.ir.graph import Graph  # noqa: E402
from npufuse.ir.modelio import load_model, model_dir, write_model  # noqa: E402
from npufuse.prepare.normalize import normalize  # noqa: E402
from npufuse.npu_model.spec import load_profile  # noqa: E402
from npufuse.calibrate.ort_profile import node_times_us, spearman  # noqa: E402
from npufuse.verify.inputs import model_inputs  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
LIGHT = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
# transformers (text and vision), then CNNs: the fixtures' tiny configs and the onnx wheel's full-size light CNNs
DEFAULT_MODELS = [
    *(FIXTURES / f"{n}.onnx" for n in ("bert_ts17", "bert_dynamo", "distilbert_ts17", "gpt2_ts17", "gpt2_dynamo",
                                       "llama_ts17", "llama_dynamo", "t5_ts17", "vit_ts17", "vit_dynamo",
                                       "swin_ts17", "resnet_ts17", "resnet_dynamo", "mobilenetv2_ts17",
                                       "convnext_ts17", "regnet_ts17")),
    *(LIGHT / f"light_{n}.onnx" for n in ("resnet50", "squeezenet", "shufflenet", "inception_v1", "densenet121")),
]
# Sizes for symbolic input dims, by what the name suggests (as npufuse's --dim defaults do); both the feeds and the
# cost model get exactly these, so modeled and measured nodes see the same shapes.
BENCH_DIMS = {"batch": 1, "seq": 64, "sequence": 64, "len": 64, "past": 0, "height": 224, "width": 224}
OTHER_DIM = 1
RESULTS = ROOT / "benchmarks" / "results" / "cost_rank.json"


def symbol_dims(model: onnx.ModelProto) -> dict[str, int]:
    """Every symbolic dim of the graph inputs, with its benchmark size."""
    inits = {t.name for t in model.graph.initializer}
    out: dict[str, int] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param:
                key = d.dim_param.lower()
                out[d.dim_param] = next((v for k, v in BENCH_DIMS.items() if k in key), OTHER_DIM)
    return out


def compare(path: Path, spec, threads: int, warmup: int, runs: int) -> dict:
    """Modeled and measured per-node times of one model, and how they agree."""
    original = load_model(path)
    base = model_dir(path)
    model, types = normalize(original, base)
    dims = symbol_dims(model)
    g = Graph(model, base, types)
    feeds = model_inputs(g, seed=0, dims=dims)
    est = estimate_ops(model_ops(g, CostShapes(model, dims)), spec)
    modeled = {k.name: k.t_total_us for k in est.kernels}
    kinds = {k.name: k.kind for k in est.kernels}
    with tempfile.TemporaryDirectory(prefix="npufuse_rank_") as tmp:
        saved = os.path.join(tmp, "normalized.onnx")
        write_model(model, saved, base)
        loaded = onnx.load(saved)
        measured = node_times_us(loaded, feeds, threads=threads, warmup=warmup, runs=runs)
        # a second, independent measurement: how well the CPU agrees with itself bounds what any model can reach
        again = node_times_us(loaded, feeds, threads=threads, warmup=warmup, runs=runs)
    names = [n for n in modeled if n in measured]
    kernels = [n for n in names if kinds[n] != "view"]
    by_type: dict[str, dict] = {}
    op_of = {n.name: n.op_type for n in model.graph.node}
    for n in names:
        row = by_type.setdefault(op_of.get(n, "?"), {"count": 0, "modeled_us": 0.0, "measured_us": 0.0})
        row["count"] += 1
        row["modeled_us"] += modeled[n]
        row["measured_us"] += measured[n]
    return {
        "model": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else f"onnx:{path.name}"),
        "dims": dims,
        "nodes_priced": len(modeled), "nodes_measured": len(measured), "nodes_compared": len(names),
        "kernels_compared": len(kernels),
        "spearman_all": _r(spearman([modeled[n] for n in names], [measured[n] for n in names])),
        "spearman_kernels": _r(spearman([modeled[n] for n in kernels], [measured[n] for n in kernels])),
        "spearman_retest": _r(spearman([measured[n] for n in names], [again.get(n, 0.0) for n in names])),
        "modeled_total_us": round(sum(modeled[n] for n in names), 1),
        "measured_total_us": round(sum(measured[n] for n in names), 1),
        "by_op_type": {k: {"count": v["count"], "modeled_us": round(v["modeled_us"], 1),
                           "measured_us": round(v["measured_us"], 1)}
                       for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]["measured_us"])},
    }


def _r(x: float) -> float | None:
    return None if x != x else round(x, 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", type=Path, help="ONNX files (default: the fixture set in this file)")
    ap.add_argument("--profile", default="CPU2Core")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("-o", "--output", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    spec = load_profile(args.profile)
    rows = []
    head = (f"{'model':<34} {'nodes':>6} {'kern':>5} {'rho all':>8} {'rho kern':>8} {'retest':>7} {'modeled ms':>11} "
            f"{'measured ms':>12}")
    print(head)
    print("-" * len(head))
    for path in args.models or DEFAULT_MODELS:
        row = compare(path.resolve(), spec, args.threads, args.warmup, args.runs)
        rows.append(row)
        print(f"{Path(row['model']).name:<34} {row['nodes_compared']:>6} {row['kernels_compared']:>5} "
              f"{_fmt(row['spearman_all']):>8} {_fmt(row['spearman_kernels']):>8} {_fmt(row['spearman_retest']):>7} "
              f"{row['modeled_total_us'] / 1e3:>11.3f} {row['measured_total_us'] / 1e3:>12.3f}", flush=True)
    import statistics

    import onnxruntime

    summary = {}
    for group, pick in (("tiny fixtures (tests/fixtures)", lambda r: not r["model"].startswith("onnx:")),
                        ("full-size light CNNs (onnx wheel)", lambda r: r["model"].startswith("onnx:"))):
        vals = [r["spearman_all"] for r in rows if pick(r) and r["spearman_all"] is not None]
        if vals:
            summary[group] = {"models": len(vals), "median_spearman_all": round(statistics.median(vals), 3),
                              "min_spearman_all": min(vals)}
            print(f"{group}: median rho {statistics.median(vals):+.3f}, min {min(vals):+.3f} over {len(vals)} models")

    cmd = "python benchmarks/bench_cost_rank.py" + "".join(
        f" --{k} {getattr(args, k)}" for k, d in (("profile", "CPU2Core"), ("threads", 2), ("warmup", 3), ("runs", 10))
        if getattr(args, k) != d) + "".join(f" {p}" for p in args.models)
    doc = {
        "command": cmd,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs",
        "profile": spec.name, "threads": args.threads, "warmup": args.warmup, "runs": args.runs,
        "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
        "what": "per model: Spearman rank correlation of modeled (cost model on the profile) and measured "
                "(onnxruntime CPU profiler, median per node) per-node time over the nodes both name; "
                "'kernels' leaves out nodes the model prices as free views (Reshape, Squeeze, ...); 'retest' is the "
                "rank correlation of two independent measurements of the same nodes (the ceiling noise allows)",
        "summary": summary,
        "models": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, args.output)
    print(f"wrote {args.output}")
    return 0


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.3f}"


if __name__ == "__main__":
    sys.exit(main())
