"""The census fixtures (issue 9, "matching that generalises"): architectures the patterns were not written against,
listed in `manifest.json`'s "census_fixtures" (tools/make_fixtures.py `CENSUS_FAMILIES`): encoders (distilbert,
albert, electra, deberta-v2), decoders with GQA / MQA / ALiBi / partial rotary (mistral, falcon, bloom, gpt_neox),
encoder-decoders with cross-attention (t5, bart), a diffusers UNet (GroupNorm + SiLU, unet) and an fp16 VAE decoder
(vae_decoder_fp16: deep fp16 features, verify/precision.py), MoE decoders (the
router's Softmax -> TopK [-> renormalise]: mixtral, qwen2_moe, mixtral_fp16), vision transformers with windowed or
relative attention (swin, beit, clip), CNNs (convnext, regnet), hybrid CNNs (LeViT's Linear -> BatchNorm1d,
SwiftFormer's Conv -> GELU and BN -> Conv: levit, swiftformer), torch.nn.MultiheadAttention and an attention-pooling
head, and ultralytics' own exports of YOLOv8n and YOLO11n (yolov8n, yolo11n: Conv-SiLU, C2PSA attention); TorchScript
opset 17 and dynamo exports, static and dynamic shapes, fp32 and fp16.

Each optimizes with the default options with every rewrite and the whole model verified, and for each kind the
fused count equals what the torch model has (counted by the generator with hooks, never on the ONNX graph). A
count npufuse does not reach today is an `xfail(strict=True)` in KNOWN_GAPS naming what is left, so it flips (and
fails) the day it is fixed; `python tools/census_report.py` prints the whole table with the near-misses.

Optimizing all of them takes a few minutes on 2 cores: the fixtures in SLOW are marked `slow` (run with -m slow).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from npufuse.fusion.census import result_counts
from npufuse.fusion.engine import OptimizeOptions, OptimizeResult, optimize
from npufuse.ir.modelio import load_model

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
ENTRIES = {e["file"]: e for e in MANIFEST.get("census_fixtures", [])}
FAMILIES = ("distilbert", "albert", "electra", "deberta_v2", "t5", "bart", "mistral", "falcon", "bloom", "gpt_neox",
            "swin", "beit", "clip_vision", "convnext", "regnet", "mha_torch", "attn_pool", "mistral_fp16", "bart_fp16",
            "mistral_static", "mistral_static_fp16", "mistral_sdpa_static_fp16", "unet", "bert_mlm", "olmo2",
            "mixtral", "qwen2_moe", "mixtral_fp16", "levit", "swiftformer", "gemma2", "gemma2_fp16",
            "flux", "yolov8n", "yolo11n", "cohere2_moe", "gpt_oss", "vae_decoder_fp16")
# report kind -> key of the manifest entry's "expected" (see tools/census_report.py for how each fused count is read)
KINDS = {"attention": "attention", "layernorm": "layernorm", "rmsnorm": "rmsnorm", "gelu": "gelu",
         "gated_mlp": "gated_mlp", "rotary": "rotary_applications", "conv_epilogue": "conv_epilogue",
         "batchnorm": "batchnorm", "conv_residual": "conv_residual", "group_norm": "group_norm",
         "group_norm_silu": "group_norm_silu", "moe_gating": "moe_gating", "conv_gelu": "conv_gelu",
         "linear_bn": "linear_bn"}

_DEBERTA_LN = ("the 6th LayerNorm (encoder.LayerNorm over encoder.rel_embeddings.weight) is weight-only: normalize "
               "folds it as a constant subgraph, so no pattern ever sees it and no near-miss is recorded (torch runs "
               "it every forward, hence the expected count)")
# (file, kind) -> what is left unfused today. Strict: the test fails once npufuse reaches the count.
KNOWN_GAPS: dict[tuple[str, str], str] = {
    ("deberta_v2_ts17.onnx", "layernorm"): _DEBERTA_LN,
    ("deberta_v2_dynamo.onnx", "layernorm"): _DEBERTA_LN,
    **{(f"swiftformer_{tag}.onnx", "attention"): (
        "SwiftFormer's efficient additive attention is not scaled-dot-product attention: its softmax runs over "
        "per-token query scores (query @ w_g, [B, N, 1]) and no QK^T or probabilities x V follows (the near-miss "
        "attention/not-attention); no fused op computes it") for tag in ("ts17", "dynamo_noopt")},
}

# fixtures whose optimize takes long enough to leave the default run (measured on 2 cores)
SLOW: set[str] = set()


@functools.lru_cache(maxsize=None)
def _optimized(file: str) -> OptimizeResult:
    return optimize(load_model(FIXTURES / file), str(FIXTURES), OptimizeOptions())


def _marks(file: str, kind: str | None = None) -> list:
    marks = [pytest.mark.slow] if file in SLOW else []
    gap = KNOWN_GAPS.get((file, kind)) if kind else None
    if gap:
        marks.append(pytest.mark.xfail(strict=True, reason=gap))
    return marks


def _count_params() -> list:
    out = []
    for file, e in ENTRIES.items():
        for kind, key in KINDS.items():
            if e["expected"].get(key, 0):
                out.append(pytest.param(file, kind, marks=_marks(file, kind), id=f"{file}-{kind}"))
    return out


def test_every_family_is_in_the_manifest() -> None:
    fams = {e["family"] for e in ENTRIES.values()}
    errors = {e["family"] for e in MANIFEST["errors"] if e["family"] in FAMILIES}
    assert sorted(fams | errors) == sorted(FAMILIES)
    assert len(fams) >= 12
    for e in ENTRIES.values():
        assert (FIXTURES / e["file"]).is_file()
        assert e["exporter"] in ("ts17", "dynamo", "dynamo_noopt", "ultralytics")
        assert e["dtype"] in ("float32", "float16") and e["shapes"] in ("static", "dynamic")
        assert e["verification"]["passed"] and e["max_abs_err"] <= e["verification"]["tolerance"]
        assert e["verification"]["tolerance"] == (1e-2 if e["dtype"] == "float16" else 1e-4)
        assert not e["torch_structure"]["formula_mismatch"], e["torch_structure"]["formula_mismatch"]
    assert {e["dtype"] for e in ENTRIES.values()} == {"float32", "float16"}
    assert {e["shapes"] for e in ENTRIES.values()} == {"static", "dynamic"}
    assert {e["exporter"] for e in ENTRIES.values()} >= {"ts17", "dynamo"}
    # the census files stay small (about 10.8 MB with the two UNets: 1.7 MB of convolution weights; 12.7 MB with
    # the MoE decoders, 0.8 MB in six files of mostly export scaffolding; 13.5 MB with the hybrid CNNs (levit,
    # swiftformer), 0.8 MB in four files, two thirds of it node metadata and shape scaffolding of the exports)
    # 14.1 MB with Gemma 2 (soft-capped attention, fp32 and fp16: 0.6 MB in four files)
    # 14.9 MB with Flux (a double- and a single-stream block, pairwise rotary: 0.8 MB in two files)
    # 17.9 MB with ultralytics' YOLOv8n and YOLO11n (2.9 MB in two files: the Detect head's weights, 20 classes)
    # 19.1 MB with the fp16 VAE decoder (0.6 MB in two files: the smallest decoder whose fp16 output moves by a step
    # or two, verify/precision.py)
    assert sum((FIXTURES / f).stat().st_size for f in ENTRIES) < 19_300_000


@pytest.mark.parametrize("file", [pytest.param(f, marks=_marks(f), id=f) for f in ENTRIES])
def test_optimizes_with_the_whole_model_verified(file: str) -> None:
    res = _optimized(file)
    assert not res.rolled_back, [(r.match.kind, r.reason) for r in res.rolled_back]
    assert res.applied and all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok, res.model_check.reason


@pytest.mark.parametrize("file", [pytest.param(f, marks=_marks(f), id=f) for f in ENTRIES])
def test_nothing_fused_the_architecture_lacks(file: str) -> None:
    got = result_counts(_optimized(file))
    extra = {k: got[k] for k, key in KINDS.items() if not ENTRIES[file]["expected"].get(key, 0) and got[k]}
    assert not extra, extra


@pytest.mark.parametrize("file,kind", _count_params())
def test_fused_count_matches_the_architecture(file: str, kind: str) -> None:
    res = _optimized(file)
    want = ENTRIES[file]["expected"][KINDS[kind]]
    if kind == "batchnorm":   # the BNs the dynamo exporter's optimizer already folded into Conv are not there to fold
        want -= ENTRIES[file].get("exporter_rewrite_rules", {}).get("FuseBatchNormIntoConv", 0)
    got = result_counts(res)[kind]
    near = sorted({(f.pattern, f.reason) for f in res.refusals})
    assert got == want, (kind, got, want, near)
