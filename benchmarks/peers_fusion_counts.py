#!/usr/bin/env python3
"""What do the peers fuse on our transformer fixtures, and how fast?

For every transformer fixture listed in tests/fixtures/manifest.json this runs

* ``ort-o0`` / ``ort-o1``: onnxruntime's transformers optimizer,
  ``onnxruntime.transformers.optimizer.optimize_model(model_type=..., num_heads, hidden_size,
  opt_level=0|1)`` (python fusions; level 1 runs ORT's basic graph optimizations first);
* ``osx-ort``: onnxscript's ``onnxscript.rewriter.ort_fusions.optimize_for_ort`` (returns the
  model and a dict of fusion counts, which is recorded too);
* ``osx-default``: ``onnxscript.optimizer.optimize`` then ``onnxscript.rewriter.rewrite`` with
  its default rules;

counts the fused ops in the result (Attention, MultiHeadAttention, GroupQueryAttention,
(Skip)LayerNormalization, (Skip)SimplifiedLayerNormalization, Gelu / FastGelu / BiasGelu, ...),
times each (median of --repeat runs), checks that the result still runs in onnxruntime and
matches the input model on seeded inputs, and prints a table. Exceptions are results too:
they are recorded per peer per file.

    python benchmarks/peers_fusion_counts.py --json peers.json
    python benchmarks/peers_fusion_counts.py --round3 --repeat 3 --json benchmarks/results/peers_round3_fixtures.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import logging
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # npufuse from this checkout, not a stale installed copy
FIXTURES = ROOT / "tests" / "fixtures"

# ORT transformers-optimizer model_type per family (llama has no own type: qwen3 is the
# closest llama-like one (RMSNorm, rotary, GQA); gpt2 and bert are tried too).
ORT_MODEL_TYPES = {
    "bert": ["bert"],
    "gpt2": ["gpt2"],
    "vit": ["vit"],
    "llama": ["qwen3", "gpt2", "bert"],
}
# The LLM decoder fixtures (manifest "llm_fixtures", --llm): the transformers optimizer's closest types.
ORT_MODEL_TYPES_LLM = {
    "qwen2": ["qwen3", "gpt2"],
    "qwen3": ["qwen3", "gpt2"],
    "gemma": ["qwen3", "gpt2"],
    "deepseek_v3": ["qwen3", "gpt2"],
    "phi": ["phi", "gpt2"],
    "gptj": ["gpt2"],
}

# The census fixtures (manifest "census_fixtures", --census): each family's own optimizer type where onnxruntime
# has one, else the closest (bert for encoders, gpt2 for decoders).
ORT_MODEL_TYPES_CENSUS = {
    "distilbert": ["bert"], "albert": ["bert"], "electra": ["bert"], "deberta_v2": ["bert"],
    "t5": ["t5", "bert"], "bart": ["bart", "bert"],
    "mistral": ["qwen3", "gpt2"], "falcon": ["gpt2"], "bloom": ["gpt2"], "gpt_neox": ["gpt_neox", "gpt2"],
    "swin": ["swin", "vit"], "beit": ["vit"], "clip_vision": ["clip", "vit"], "convnext": ["vit"],
    "regnet": ["bert"], "mha_torch": ["bert"], "attn_pool": ["bert"],
}

# Generalisation round 3 (--round3): MoE, diffusion, efficient vision nets, soft-capping. onnxruntime's own type
# where it has one (unet, mmdit for Flux's DiT), else the closest; the kinds these families add are counted too.
ORT_MODEL_TYPES_ROUND3 = {
    "unet": ["unet", "bert"], "flux": ["mmdit", "gpt2"],
    "mixtral": ["qwen3", "gpt2"], "mixtral_fp16": ["qwen3", "gpt2"], "qwen2_moe": ["qwen3", "gpt2"],
    "gemma2": ["qwen3", "gpt2"], "gemma2_fp16": ["qwen3", "gpt2"],
    "levit": ["vit"], "swiftformer": ["vit"], "cohere2_moe": ["qwen3", "gpt2"], "gpt_oss": ["qwen3", "gpt2"],
}
ROUND3_KINDS = ("group_norm", "group_norm_silu", "moe_gating", "gated_mlp", "conv_gelu")

# what counts as a fusion of each kind
KINDS = {
    "attention": (
        "Attention",
        "MultiHeadAttention",
        "GroupQueryAttention",
        "PackedAttention",
        "PackedMultiHeadAttention",
        "DecoderMaskedMultiHeadAttention",
        "SDPA",
    ),
    "layernorm": ("LayerNormalization", "SkipLayerNormalization", "EmbedLayerNormalization"),
    "rmsnorm": (
        "SimplifiedLayerNormalization",
        "SkipSimplifiedLayerNormalization",
        "RMSNormalization",
    ),
    "gelu": ("Gelu", "FastGelu", "BiasGelu", "BiasFastGelu", "QuickGelu", "GeluNew"),
    "rotary": ("RotaryEmbedding",),
}
ALSO_SHOW = ("Softmax", "FusedMatMul", "MatMul", "Gemm", "Erf", "Tanh", "Sigmoid")


def op_counts(model: onnx.ModelProto) -> dict:
    c = collections.Counter()
    for n in model.graph.node:
        c[n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}:{n.op_type}"] += 1
    return dict(sorted(c.items()))


def kind_counts(model: onnx.ModelProto) -> dict:
    """Fused structure per kind, counted by npufuse's census (the same rule for every tool: a LayerNorm
    inside a FusedMatMul epilogue or a SkipLayerNormalization counts as a LayerNorm)."""
    from npufuse.fusion.census import fusion_census

    counts = op_counts(model)
    plain = collections.Counter()
    for k, v in counts.items():
        plain[k.split(":")[-1]] += v
    census = fusion_census(model)
    out = {kind: census.get(kind, 0) for kind in ("attention", "layernorm", "rmsnorm", "gelu", "rotary") + ROUND3_KINDS}
    fused_names = {o for ops in KINDS.values() for o in ops} | {"FusedAttention", "FusedMatMul", "FusedConv"}
    out["custom_ops"] = {k: v for k, v in counts.items() if ":" in k or k in fused_names}
    out["also"] = {o: plain[o] for o in ALSO_SHOW if plain[o]}
    return out


# ----------------------------------------------------------------------------- inputs
def seeded_feed(model: onnx.ModelProto, entry: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    dims = {"batch": 2, "sequence": 8}
    vocab = entry["config"].get("vocab", 100)
    feed = {}
    inits = {i.name for i in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [
            d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param, 2) for d in tt.shape.dim
        ]
        dt = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        name = vi.name
        if "mask" in name:
            a = np.ones(shape, dtype=dt)
            if shape[0] > 1 and shape[-1] > 2:
                a[1, -2:] = 0
        elif "token_type" in name:
            a = np.zeros(shape, dtype=dt)
            a[..., shape[-1] // 2 :] = 1
        elif np.issubdtype(dt, np.integer):
            a = rng.integers(0, vocab, size=shape).astype(dt)
        else:
            a = rng.standard_normal(shape).astype(dt)
        feed[name] = a
    return feed


def run(model: onnx.ModelProto, feed: dict):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feed.items() if k in names})


# ----------------------------------------------------------------------------- peers
def peer_ort(model_type: str, opt_level: int):
    def f(proto: onnx.ModelProto, entry: dict):
        from onnxruntime.transformers.optimizer import optimize_model

        cfg = entry["config"]
        # a path, as users pass it: given a ModelProto, opt_level>=1 round-trips it through a temp
        # file with its constants as external data and then fails in ORT shape inference
        m = optimize_model(
            str(FIXTURES / entry["file"]),
            model_type=model_type,
            # 0 lets the optimizer detect them (Swin's heads differ per stage; CNNs have none)
            num_heads=cfg["heads"] if isinstance(cfg.get("heads"), int) else 0,
            hidden_size=cfg.get("hidden", 0),
            opt_level=opt_level,
            use_gpu=False,
            only_onnxruntime=False,
        )
        extra = {}
        with contextlib.suppress(Exception):
            extra["fused_operator_statistics"] = m.get_fused_operator_statistics()
        return m.model, extra

    return f


def peer_osx_ort(proto: onnx.ModelProto, entry: dict):
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model = ir.from_proto(onnx.ModelProto.FromString(proto.SerializeToString()))
    model, counts = optimize_for_ort(model)
    return ir.to_proto(model), {"fusion_count": {k: v for k, v in counts.items() if v}}


def peer_osx_default(proto: onnx.ModelProto, entry: dict):
    import onnxscript.optimizer
    import onnxscript.rewriter

    m = onnx.ModelProto.FromString(proto.SerializeToString())
    m = onnxscript.optimizer.optimize(m)
    m = onnxscript.rewriter.rewrite(m)
    return m, {}


def peer_npufuse(verify: bool):
    def f(proto: onnx.ModelProto, entry: dict):
        from npufuse.fusion.engine import OptimizeOptions, optimize
        from npufuse.npu_model.spec import load_profile

        res = optimize(proto, str(FIXTURES), OptimizeOptions(spec=load_profile("Ascend910B2"), verify=verify))
        return res.model, {"applied_by_kind": dict(res.applied_by_kind()),
                           "model_check_ok": res.model_check.ok if res.model_check else None}

    return f


def peers_for(family: str):
    out = [("npufuse", "npufuse optimize --target Ascend910B2 (verification on)", peer_npufuse(True)),
           ("npufuse-noverify", "npufuse optimize --target Ascend910B2 --no-verify", peer_npufuse(False))]
    for mt in ORT_MODEL_TYPES[family]:
        for lvl in (0, 1):
            name = f"ort-o{lvl}" + ("" if mt == ORT_MODEL_TYPES[family][0] else f"[{mt}]")
            if mt != ORT_MODEL_TYPES[family][0] and lvl == 0:
                continue  # alternates only at the default level, to keep the table short
            out.append((name, f"onnxruntime.transformers optimize_model(model_type={mt!r}, opt_level={lvl})", peer_ort(mt, lvl)))
    out.append(("osx-ort", "onnxscript.rewriter.ort_fusions.optimize_for_ort", peer_osx_ort))
    out.append(("osx-default", "onnxscript.optimizer.optimize + onnxscript.rewriter.rewrite", peer_osx_default))
    return out


TOTAL_KINDS = ("attention", "layernorm", "rmsnorm", "gelu", "rotary")   # --round3 adds ROUND3_KINDS
_EXPECTED_KEY = {"rotary": "rotary_applications"}


def totals(files: list) -> dict:
    """Per peer, the fused count of each kind summed over the files (capped at what the torch model has, so an
    exporter's own ops or a double count never make up for a miss), and the summed median time. `ort-best` and
    `osx-best` take each file's best variant of that tool (model type, level)."""
    out: dict = {"expected": {"kinds": collections.Counter(), "time_s": None}}
    for f in files:
        exp = f["expected"]
        for k in TOTAL_KINDS:
            out["expected"]["kinds"][k] += exp.get(_EXPECTED_KEY.get(k, k), 0) or 0
        best: dict = {}
        for name, pr in f["peers"].items():
            if not pr.get("ok") or not pr.get("runs_in_ort", True):
                continue
            got = {k: min(pr["kinds"].get(k, 0), exp.get(_EXPECTED_KEY.get(k, k), 0) or 0) for k in TOTAL_KINDS}
            t = out.setdefault(name, {"kinds": collections.Counter(), "time_s": 0.0})
            t["kinds"].update(got)
            t["time_s"] += pr["median_s"]
            tool = "ort-best" if name.startswith("ort-") else "osx-best" if name.startswith("osx-") else None
            if tool and (tool not in best or sum(got.values()) > sum(best[tool].values())):
                best[tool] = got
        for tool, got in best.items():
            out.setdefault(tool, {"kinds": collections.Counter(), "time_s": None})["kinds"].update(got)
    return {p: {"kinds": {k: int(t["kinds"][k]) for k in TOTAL_KINDS}, "time_s": t["time_s"]} for p, t in out.items()}


def measure(fn, proto, entry, repeat):
    times = []
    result = None
    for _ in range(repeat):
        buf = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fn(proto, entry)
        times.append(time.perf_counter() - t0)
    return result, statistics.median(times), times


def main(argv=None) -> int:
    global TOTAL_KINDS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write results here")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", nargs="+", help="fixture file names (default: all transformer fixtures)")
    ap.add_argument("--llm", action="store_true", help="the LLM decoder fixtures (qwen2, qwen3, phi, gptj, gemma, "
                    "deepseek_v3) instead of the original transformer families")
    ap.add_argument("--round3", action="store_true", help="the census fixtures of generalisation round 3 (MoE "
                    "routers and experts, UNet GroupNorm+SiLU, LeViT Linear+BN, SwiftFormer Conv+GELU, Gemma-2 "
                    "soft-capping, Flux), counting their kinds too")
    ap.add_argument("--census", action="store_true", help="the census fixtures (19 architectures beyond the "
                    "original and LLM families: encoders, encoder-decoders, decoders with GQA/MQA/ALiBi, vision "
                    "transformers with windowed or relative attention, CNNs with residual blocks)")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)

    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    if args.llm:
        ORT_MODEL_TYPES.update(ORT_MODEL_TYPES_LLM)
    if args.census:
        ORT_MODEL_TYPES.update(ORT_MODEL_TYPES_CENSUS)
    if args.round3:
        ORT_MODEL_TYPES.clear()
        ORT_MODEL_TYPES.update(ORT_MODEL_TYPES_ROUND3)
        TOTAL_KINDS = TOTAL_KINDS + ROUND3_KINDS
    listed = manifest["llm_fixtures"] if args.llm else manifest["census_fixtures"] if args.census or args.round3 \
        else manifest["fixtures"]
    entries = [e for e in listed if e.get("base_family", e["family"]) in ORT_MODEL_TYPES]
    if args.only:
        entries = [e for e in entries if e["file"] in args.only]

    import onnxscript

    results = {
        "versions": {"onnxruntime": ort.__version__, "onnxscript": onnxscript.__version__, "onnx": onnx.__version__},
        "repeat": args.repeat,
        "files": [],
    }
    rows = []
    for e in entries:
        path = FIXTURES / e["file"]
        proto = onnx.load(str(path))
        fam = e.get("base_family", e["family"])
        feed = seeded_feed(proto, e)
        ref = run(proto, feed)[0]
        rec = {
            "file": e["file"],
            "family": fam,
            "exporter": e["exporter"],
            "expected": e["expected"],
            "input": {"kinds": kind_counts(proto), "num_nodes": len(proto.graph.node)},
            "peers": {},
        }
        rows.append((e["file"], "input", "", kind_counts(proto), len(proto.graph.node), None, None))
        for name, desc, fn in peers_for(fam):
            pr = {"peer": desc}
            try:
                (out, extra), med, times = measure(fn, proto, e, args.repeat)
                counts = op_counts(out)
                pr.update(
                    ok=True,
                    median_s=med,
                    times_s=times,
                    num_nodes=len(out.graph.node),
                    kinds=kind_counts(out),
                    op_counts=counts,
                    **extra,
                )
                try:
                    got = run(out, feed)[0]
                    pr["runs_in_ort"] = True
                    pr["max_abs_err_vs_input"] = float(np.max(np.abs(got - ref)))
                except Exception as ex:  # noqa: BLE001
                    pr["runs_in_ort"] = False
                    pr["run_error"] = f"{type(ex).__name__}: {str(ex)[:1000]}"
                err = pr.get("max_abs_err_vs_input")
                rows.append((e["file"], name, "", pr["kinds"], pr["num_nodes"], med,
                             ("%.1e" % err) if err is not None else "NO-RUN"))
            except Exception as ex:  # noqa: BLE001
                pr.update(ok=False, error=f"{type(ex).__name__}: {str(ex)[:1000]}",
                          traceback=traceback.format_exc(limit=4)[-2000:])
                rows.append((e["file"], name, f"FAILED {type(ex).__name__}: {str(ex)[:60]}", None, None, None, None))
            rec["peers"][name] = pr
        results["files"].append(rec)
        exp = e["expected"]
        print(f"{e['file']}: expected {exp}", file=sys.stderr)

    # table
    hdr = f"{'fixture':24s} {'peer':16s} {'attn':>4s} {'LN':>3s} {'RMS':>3s} {'gelu':>4s} {'rot':>3s} {'smax':>4s} {'nodes':>5s} {'time ms':>8s} {'err':>8s}  custom ops"
    print(hdr)
    print("-" * len(hdr))
    last = None
    exp_by_file = {e["file"]: e["expected"] for e in entries}
    for file, peer, err_msg, k, nodes, med, err in rows:
        if file != last:
            ex = exp_by_file[file]
            print(f"{file:24s} {'expected':16s} {ex.get('attention', ''):>4} {ex.get('layernorm', '-'):>3} "
                  f"{ex.get('rmsnorm', '-'):>3} {ex.get('gelu', '-'):>4} {ex.get('rotary_applications', '-'):>3}")
            last = file
        if k is None:
            print(f"{'':24s} {peer:16s} {err_msg}")
            continue
        custom = ", ".join(f"{n.split(':')[-1]}:{v}" for n, v in k["custom_ops"].items())
        if "custom_ops" in k and peer == "input":
            custom = ("(exporter) " + custom) if custom else ""
        print(f"{'':24s} {peer:16s} {k['attention']:>4} {k['layernorm']:>3} {k['rmsnorm']:>3} {k['gelu']:>4} "
              f"{k['rotary']:>3} {k['also'].get('Softmax', 0):>4} {nodes:>5} "
              f"{(f'{med * 1000:.1f}' if med is not None else ''):>8s} {err or '':>8s}  {custom}")
    results["totals"] = totals(results["files"])
    print()
    print(f"{'totals over ' + str(len(results['files'])) + ' files':30s} " + " ".join(f"{k:>9s}" for k in TOTAL_KINDS)
          + f" {'time s':>8s}")
    for peer, t in results["totals"].items():
        print(f"{peer:30s} " + " ".join(f"{t['kinds'][k]:>9}" for k in TOTAL_KINDS)
              + (f" {t['time_s']:>8.2f}" if t.get("time_s") is not None else f" {'':>8s}"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
