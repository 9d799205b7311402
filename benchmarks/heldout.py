"""Held-out validation of the Ascend310P3 cost profile (issue 22): price models the calibration never saw.

Reproduce (exports once into the cache, then prices every published figure the way a user does):

    PYTHONPATH=. python benchmarks/heldout.py --cache /tmp/heldout_exports

Data: benchmarks/data/heldout_Ascend310P3.toml (published 310P3 om throughputs from ModelZoo-PyTorch READMEs, written
by tools/build_heldout_data.py; none of its models is a calibration workload). Output: a per-figure table and the
summary on stdout, and benchmarks/results/heldout_Ascend310P3.json.

Per model, the plain fp32 ONNX a user exports: TorchScript exporter (dynamo=False), opset 17, eval mode, constant
folding on (the exporter's default), random weights (timm pretrained=False, transformers configs), symbolic dim
`batch`. Exports are cached under --cache (outside the repository); torch / timm / transformers are needed only
for a model whose export is not cached. Each figure is then priced exactly as

    npufuse report MODEL.onnx --target Ascend310P3 --dim batch=B --no-verify --format json -o OUT

(a subprocess per figure; the JSON is cached next to the exports, --reprice redoes it), with the operator
implementation flags of the model's published ATC command where it passed any (`ATC_IMPLMODE`), and its
--enable_small_channel (`ATC_SMALL_CHANNEL`). Modeled time is the report's
`summary.modeled_time_us.after` (the fused graph, priced in the profile's precision mode), and beside it the report's
`summary.atc_alone` (the export as ATC compiles it by itself: the like-for-like figure); modeled fps =
1e6 * B / time; error = modeled fps / published fps - 1 (positive: modeled too fast).

The headline is batches 1/8/32 (issue 22's bar: median |error| <= 20%, no figure off by more than 2x, i.e.
modeled/published outside [0.5, 2]); --all also summarises every published batch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "heldout_Ascend310P3.toml"
RESULT = ROOT / "benchmarks" / "results" / "heldout_Ascend310P3.json"
FAMILIES = ROOT / "npufuse" / "npu_model" / "calibration" / "families.toml"
TARGET = "Ascend310P3"
HEADLINE_BATCHES = (1, 8, 32)
# Families of the held-out set that families.toml does not list (it would make each its own class).
EXTRA_CLASS = {"xcit": "vision_transformer", "convnext": "cnn", "hrnet": "cnn", "repvgg": "cnn", "dpn": "cnn",
               "ghostnet": "cnn", "nasnet": "cnn"}


# ---------------------------------------------------------------------------------------------------------- export

def _export(workload: str, build: dict, path: Path) -> str:
    """Export one model to fp32 ONNX (opset 17, TorchScript exporter, symbolic batch). Returns how it was built."""
    import torch

    torch.manual_seed(0)
    kind = build["kind"]
    if kind == "timm":
        import timm

        model = timm.create_model(build["name"], pretrained=False).eval()
        args = (torch.randn(1, 3, build["image"], build["image"]),)
        names, outs = ["image"], ["logits"]
        dyn = {"image": {0: "batch"}, "logits": {0: "batch"}}
        how = f"timm {timm.__version__} {build['name']}"
    elif kind == "bert":
        import transformers
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(num_hidden_layers=build["layers"], hidden_size=build["hidden"],
                         num_attention_heads=build["heads"], intermediate_size=build["intermediate"], num_labels=2)
        model = BertForSequenceClassification(cfg).eval()
        seq = build["seq"]
        ids = torch.randint(0, cfg.vocab_size, (1, seq))
        args = (ids, torch.ones(1, seq, dtype=torch.int64), torch.zeros(1, seq, dtype=torch.int64))
        names, outs = ["input_ids", "attention_mask", "token_type_ids"], ["logits"]
        dyn = {n: {0: "batch"} for n in names} | {"logits": {0: "batch"}}
        how = f"transformers {transformers.__version__} BertForSequenceClassification ({cfg._attn_implementation})"
    elif kind == "wav2vec2":
        import transformers
        from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

        model = Wav2Vec2ForCTC(Wav2Vec2Config()).eval()
        args = (torch.randn(1, build["samples"]),)
        names, outs = ["modelInput"], ["logits"]
        dyn = {"modelInput": {0: "batch"}, "logits": {0: "batch"}}
        how = f"transformers {transformers.__version__} Wav2Vec2ForCTC(Wav2Vec2Config()) ({model.config._attn_implementation})"
    else:
        raise ValueError(f"{workload}: unknown build kind {kind!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.onnx")
    with torch.no_grad():
        torch.onnx.export(model, args, str(tmp), dynamo=False, opset_version=17, input_names=names,
                          output_names=outs, dynamic_axes=dyn, do_constant_folding=True)
    tmp.replace(path)
    return how


def ensure_export(workload: str, build: dict, cache: Path) -> Path:
    path = cache / f"{workload}.onnx"
    meta = cache / f"{workload}.export.json"
    if not path.exists():
        t = time.perf_counter()
        how = _export(workload, build, path)
        meta.write_text(json.dumps({"built_with": how, "export_s": round(time.perf_counter() - t, 1),
                                    "opset": 17, "dynamo": False}))
        print(f"  exported {workload} ({how}) in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return path


# ------------------------------------------------------------------------------------------------------- pricing

# The operator implementation flags of each model's published ATC command, as `npufuse report` takes them (the user
# prices the compile they run). Only these two READMEs pass a Sigmoid flag; ConvMixer's Gelu flag changes no price.
# The models whose published atc command sets --enable_small_channel=1 (at the cited commit):
# ACL_PyTorch/contrib/cv/classfication/vit-small/README.md:176, MobileNetV3_large_100/README.md:168.
ATC_SMALL_CHANNEL = frozenset({"vit_small_patch16_224", "mobilenetv3_large_100"})
ATC_IMPLMODE = {
    # ACL_PyTorch/built-in/cv/EfficientNetV2_for_Pytorch/README.md:160
    "efficientnetv2_rw_t": ("--op-select-implmode=high_performance", "--optypelist-for-implmode=Sigmoid"),
    # ACL_PyTorch/built-in/cv/EfficientNet_b7_for_Pytorch/atc.sh:12-13 (README.md:173 spells it high_preformance)
    "efficientnet_b7": ("--op-select-implmode=high_performance", "--optypelist-for-implmode=Sigmoid"),
}

def price(onnx: Path, batch: int, cache: Path, reprice: bool, extra: tuple[str, ...] = ()) -> dict:
    tag = "" if not extra else "_" + "_".join(a.lstrip("-").replace("=", "-").replace("/", "-") for a in extra)
    out = cache / "reports" / f"{onnx.stem}_b{batch}{tag}.json"
    if reprice or not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "npufuse", "report", str(onnx), "--target", TARGET, "--dim", f"batch={batch}",
               "--no-verify", "--format", "json", "-o", str(out), "-q", *extra]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"npufuse report failed for {onnx.name} batch {batch}:\n{proc.stderr[-2000:]}")
        print(f"  priced {onnx.stem} b{batch} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    doc = json.loads(out.read_text())
    after = doc["model_estimate"]["after"]
    ops = sorted(after["by_op_type"].items(), key=lambda kv: -kv[1]["time_us"])
    return {
        "time_us": doc["summary"]["modeled_time_us"]["after"],
        "time_us_unfused": doc["summary"]["modeled_time_us"]["before"],
        # the export as ATC compiles it by itself (summary.atc_alone): what a published ATC timing measures
        "time_us_atc_alone": (doc["summary"].get("atc_alone") or {}).get("time_us"),
        "launches": after["launches"], "gm_bytes": after["gm_bytes"], "flops": after["flops"],
        "precision_mode": doc["target"].get("precision_mode"),
        "assumed_shapes_share": round(doc["summary"]["assumed_shapes"]["share_pct"] / 100, 4),
        "graph_kernel_us": float(doc["target"]["numbers"].get("launch.graph_kernel_us", "nan")),
        "applied_by_kind": doc["summary"].get("applied_by_kind", {}),
        "by_op_type": {k: {"count": v["count"], "launches": v["launches"], "time_us": round(v["time_us"], 3),
                           "share": round(v["time_us"] / after["time_us"], 4) if after["time_us"] else 0.0}
                       for k, v in ops if v["time_us"] > 0},
    }


# ------------------------------------------------------------------------------------------------------ summary

def classes() -> dict[str, str]:
    fam = tomllib.loads(FAMILIES.read_text())
    out = {f: cls for cls, fs in fam.items() for f in fs}
    return out | {k: v for k, v in EXTRA_CLASS.items() if k not in out}


def summarise(rows: list[dict], error: str = "error") -> dict:
    rows = [r for r in rows if r.get(error) is not None]
    if not rows:
        return {"figures": 0}
    errs = [r[error] for r in rows]
    ratio = [1 + e for e in errs]
    worst = sorted(rows, key=lambda r: -abs(r[error]))[:5]
    return {
        "figures": len(rows), "models": len({r["workload"] for r in rows}),
        "median_abs_error_pct": round(100 * statistics.median(abs(e) for e in errs), 1),
        "signed_median_error_pct": round(100 * statistics.median(errs), 1),
        "share_off_more_than_2x": round(sum(1 for q in ratio if q > 2 or q < 0.5) / len(rows), 3),
        "worst": [f"{r['workload']} b{r['batch']} {100 * r[error]:+.0f}%" for r in worst],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("NPUFUSE_HELDOUT_CACHE", "/tmp/heldout_exports")),
                    help="folder for the exported ONNX files and cached reports (keep it outside the repo)")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--only", action="append", default=[], metavar="WORKLOAD", help="price only these (repeatable)")
    ap.add_argument("--all", action="store_true", help="price every published batch, not only 1/8/32")
    ap.add_argument("--reprice", action="store_true", help="rerun npufuse report even where a cached JSON exists")
    ap.add_argument("--export-only", action="store_true")
    ap.add_argument("--jobs", type=int, default=1, help="reports priced in parallel")
    ap.add_argument("--report-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for npufuse report, for diagnosis (repeatable, e.g. --report-arg=--disable "
                         "--report-arg=attention); the headline is without any")
    ap.add_argument("-o", "--output", type=Path, default=RESULT)
    a = ap.parse_args()
    a.cache = a.cache.resolve()
    if ROOT in a.cache.parents or a.cache == ROOT:
        ap.error("--cache must be outside the repository")

    meas = tomllib.loads(a.data.read_text())["measurement"]
    if a.only:
        meas = [m for m in meas if m["workload"] in a.only]
    todo = [m for m in meas if a.all or m["batch"] in HEADLINE_BATCHES]
    models = {m["workload"]: m for m in meas}
    for w, m in models.items():
        ensure_export(w, m["build"], a.cache)
    if a.export_only:
        return

    cls = classes()
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        priced = list(pool.map(lambda m: price(a.cache / f"{m['workload']}.onnx", m["batch"], a.cache, a.reprice,
                                                   tuple(a.report_arg) + ATC_IMPLMODE.get(m["workload"], ()) +
                                                   (("--enable-small-channel",) if m["workload"] in ATC_SMALL_CHANNEL
                                                    else ())),
                               todo))
    rows = []
    for m, p in zip(todo, priced):
        fps = 1e6 * m["batch"] / p["time_us"]
        alone = p.get("time_us_atc_alone")
        meta_path = a.cache / f"{m['workload']}.export.json"
        rows.append({
            "workload": m["workload"], "family": m["family"], "class": cls.get(m["family"], m["family"]),
            "batch": m["batch"], "published_fps": m["value"], "published_us": round(1e6 * m["batch"] / m["value"], 1),
            "modeled_us": round(p["time_us"], 1), "modeled_fps": round(fps, 2), "error": round(fps / m["value"] - 1, 4),
            "modeled_us_atc_alone": round(alone, 1) if alone else None,
            "error_atc_alone": round(1e6 * m["batch"] / alone / m["value"] - 1, 4) if alone else None,
            "recipe_exact": m["recipe_exact"], "recipe": m["recipe"], "source": m["source"], "table_row": m["table_row"],
            "built_with": json.loads(meta_path.read_text())["built_with"] if meta_path.exists() else None,
            **{k: p[k] for k in ("assumed_shapes_share", "time_us_unfused", "launches", "gm_bytes", "flops", "precision_mode",
                                 "applied_by_kind", "by_op_type")},
            "launch_floor_us": round(p["launches"] * p["graph_kernel_us"], 1),
        })

    head = [r for r in rows if r["batch"] in HEADLINE_BATCHES]
    print(f"{'workload':28s} {'class':18s} {'B':>3s} {'pub fps':>9s} {'mod fps':>9s} {'err':>7s} {'kern':>5s} "
          f"{'floor%':>6s}  top op types (share of modeled time); '!' = over 1% of the time on assumed shapes")
    for r in sorted(rows, key=lambda r: (r["class"], r["workload"], r["batch"])):
        top = ", ".join(f"{k} {100 * v['share']:.0f}%" for k, v in list(r["by_op_type"].items())[:4])
        print(f"{r['workload']:28s} {r['class']:18s} {r['batch']:3d} {r['published_fps']:9.1f} {r['modeled_fps']:9.1f} "
              f"{100 * r['error']:+6.0f}% {r['launches']:5d} {100 * r['launch_floor_us'] / r['modeled_us']:5.0f}% "
              f"{'!' if r['assumed_shapes_share'] > 0.01 else ' '}{top}")

    def block(rs: list[dict], e: str = "error") -> dict:
        return {"all": summarise(rs, e),
                "by_class": {c: summarise([r for r in rs if r["class"] == c], e)
                             for c in sorted({r["class"] for r in rs})},
                "by_batch": {str(b): summarise([r for r in rs if r["batch"] == b], e)
                             for b in sorted({r["batch"] for r in rs})},
                "recipe_exact": summarise([r for r in rs if r["recipe_exact"]], e),
                # the report's summary.assumed_shapes: ops priced on shapes no inference could tell (computed pads
                # whose arithmetic is not folded); their figures say nothing about the cost model's terms
                "shapes_known": summarise([r for r in rs if r["assumed_shapes_share"] <= 0.01], e),
                "recipe_approx": summarise([r for r in rs if not r["recipe_exact"]], e)}

    # the headline prices npufuse's result (`after`); the like-for-like figure for a published ATC compile of the
    # plain export is the report's `atc_alone` (the export as ATC fuses it by itself, as the calibration prices a row)
    summary = {"headline_batches_1_8_32": block(head),
               "headline_atc_alone_batches_1_8_32": block(head, "error_atc_alone")}
    if a.all:
        summary["all_batches"] = block(rows)
    for name, s in summary.items():
        al = s["all"]
        print(f"\n[{name}] {al['figures']} figures / {al['models']} models: median |err| {al['median_abs_error_pct']}%, "
              f"signed median {al['signed_median_error_pct']:+}%, off >2x {100 * al['share_off_more_than_2x']:.0f}%")
        for key in ("by_class", "by_batch"):
            for k, v in s[key].items():
                print(f"  {key[3:]:5s} {k:20s} n={v['figures']:3d}  median |err| {v['median_abs_error_pct']:5.1f}%  "
                      f"signed {v['signed_median_error_pct']:+6.1f}%  >2x {100 * v['share_off_more_than_2x']:3.0f}%")
        sk = s["shapes_known"]
        print(f"  without the figures priced on assumed shapes: {sk['figures']} figures / {sk['models']} models: median "
              f"|err| {sk['median_abs_error_pct']}%, signed {sk['signed_median_error_pct']:+}%, off >2x "
              f"{100 * sk['share_off_more_than_2x']:.0f}%")
        print("  worst: " + "; ".join(al["worst"]))

    commit = subprocess.run(["git", "log", "-1", "--format=%H", "--", "npufuse"], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    doc = {"schema": "npufuse.heldout/1", "target": TARGET, "npufuse_commit": commit,
           "command": "PYTHONPATH=. python benchmarks/heldout.py" + (" --all" if a.all else "")
                      + "".join(f" --report-arg={x}" for x in a.report_arg) + "".join(f" --only {w}" for w in a.only),
           "priced_as": f"npufuse report MODEL --target {TARGET} --dim batch=B --no-verify --format json"
                        + "".join(f" {x}" for x in a.report_arg),
           "bar": "median |modeled/published - 1| <= 20%, no figure outside [0.5x, 2x], batches 1/8/32",
           "data": str(a.data.relative_to(ROOT)) if ROOT in a.data.resolve().parents else str(a.data),
           "summary": summary, "rows": rows}
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"\nwrote {a.output}")


if __name__ == "__main__":
    main()
