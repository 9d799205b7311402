"""The LLM decoder fixtures beyond llama (qwen2, qwen3, phi, gptj, gemma, deepseek_v3, qwen2 in fp16), listed in
`manifest.json`'s "llm_fixtures": each optimizes with the default options with every rewrite and the whole model
verified, and the fusion families that exist fuse what the architecture has (counts measured on the torch model by
the fixture generator). A count npufuse does not reach today is an `xfail(strict=True)` naming what is left, so it
flips (and fails) the day it is fixed. Rotary counts are asserted once a `rotary` pattern is registered."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from npufuse.fusion.census import fusion_census
from npufuse.fusion.engine import OptimizeOptions, OptimizeResult, optimize
from npufuse.ir.modelio import load_model
from npufuse.patterns import PATTERNS

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
ENTRIES = {e["file"]: e for e in MANIFEST["llm_fixtures"]}
FAMILIES = ("qwen2", "qwen3", "phi", "gptj", "gemma", "deepseek_v3", "qwen2_fp16")
# census kind -> key of the manifest entry's "expected"
KINDS = {"attention": "attention", "gated_mlp": "gated_mlp", "rmsnorm": "rmsnorm", "layernorm": "layernorm",
         "gelu": "gelu", "mla_prolog": "mla_prolog"}

# (file, kind) -> what is left unfused today. Strict: the test fails once npufuse reaches the count.
KNOWN_GAPS: dict[tuple[str, str], str] = {
}


@functools.lru_cache(maxsize=None)
def _optimized(file: str) -> OptimizeResult:
    return optimize(load_model(FIXTURES / file), str(FIXTURES), OptimizeOptions())


def _params(kinds):
    out = []
    for file in ENTRIES:
        for kind in kinds:
            gap = KNOWN_GAPS.get((file, kind))
            marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
            out.append(pytest.param(file, kind, marks=marks, id=f"{file}-{kind}"))
    return out


def test_every_family_is_in_the_manifest() -> None:
    assert sorted({e["family"] for e in ENTRIES.values()}) == sorted(FAMILIES)
    assert not [e for e in MANIFEST["errors"] if e["family"] in FAMILIES]
    for e in ENTRIES.values():
        assert e["exporter"] in ("ts17", "dynamo") and (FIXTURES / e["file"]).is_file()
        assert e["verification"]["passed"] and e["max_abs_err"] <= e["verification"]["tolerance"]
        assert e["expected"]["attention"] == e["config"]["num_layers"]
        assert e["expected"]["rotary_applications"] == 2 * e["config"]["num_layers"]
        # one MLA prolog per DeepSeek attention layer (the manifest's count, added by hand: see test_mla_prolog.py)
        want_mla = e["config"]["num_layers"] if e["config"].get("attention") == "MLA" else 0
        assert e["expected"].get("mla_prolog", 0) == want_mla
    assert sum((FIXTURES / f).stat().st_size for f in ENTRIES) < 5_000_000


@pytest.mark.parametrize("file", sorted(ENTRIES))
def test_optimizes_with_the_whole_model_verified(file: str) -> None:
    res = _optimized(file)
    assert not res.rolled_back, res.rolled_back
    assert res.applied and all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok, res.model_check.reason


@pytest.mark.parametrize("file,kind", _params(KINDS))
def test_fused_count_matches_the_architecture(file: str, kind: str) -> None:
    res = _optimized(file)
    want = ENTRIES[file]["expected"].get(KINDS[kind], 0)
    got = fusion_census(res.model).get(kind, 0)
    near = [(f.pattern, f.reason, f.detail) for f in res.refusals]
    assert got == want, (kind, got, want, near)


def _has_rotary() -> bool:
    return any(getattr(p, "name", "") == "rotary" for p in PATTERNS)


@pytest.mark.parametrize("file,kind", _params(["rotary"]))
def test_rotary_count(file: str, kind: str) -> None:
    if not _has_rotary():
        pytest.skip("no `rotary` pattern registered in npufuse.patterns.PATTERNS yet")
    res = _optimized(file)
    got = sum(1 for r in res.applied if r.match.pattern == "rotary")
    want = ENTRIES[file]["expected"]["rotary_applications"]
    assert got == want, (got, want, [(f.reason, f.detail) for f in res.refusals if f.pattern == "rotary"])


@pytest.mark.parametrize("file", sorted(f for f in ENTRIES if ENTRIES[f]["family"] == "qwen3"))
def test_qk_norm_stays_rmsnorm_then_rotary(file: str) -> None:
    """Qwen3's QK-norm (RMSNorm over head_dim of q and k, before rotary) fuses as RMSNorm then the rotation
    (RotaryEmbedding per tensor, or the q/k RotaryEmbeddingPair that phase 1 joins them into where no target prices it):
    RmsNorm then RotaryPositionEmbedding / ApplyRotaryPosEmb, since no Ascend kernel applies a norm and the rope
    together."""
    res = _optimized(file)
    g = res.model.graph
    producer = {o: n for n in g.node for o in n.output}
    qk = 0
    for n in g.node:
        if n.op_type not in ("RotaryEmbedding", "RotaryEmbeddingPair"):
            continue
        for x in n.input[:2 if n.op_type == "RotaryEmbeddingPair" else 1]:
            p = producer.get(x)
            while p is not None and p.op_type in ("Transpose", "Reshape"):
                p = producer.get(p.input[0])
            qk += p is not None and p.op_type in ("RMSNorm", "RMSNormalization")
    assert qk == ENTRIES[file]["expected"]["qk_norm"] == 2 * ENTRIES[file]["config"]["num_layers"]


@functools.lru_cache(maxsize=None)
def _optimized_on_910b(file: str) -> OptimizeResult:
    from npufuse.npu_model.spec import load_profile

    return optimize(load_model(FIXTURES / file), str(FIXTURES),
                    OptimizeOptions(spec=load_profile("Ascend910B2"), verify=False))


@pytest.mark.parametrize("file", sorted(ENTRIES))
def test_the_cost_model_prices_every_fused_kernel_on_real_shapes(file: str) -> None:
    """Every kernel of every priced candidate has shapes the cost model understands, including values a
    replacement computes for itself (DeepSeek dynamo's K transpose before FusedAttention was priced shapeless,
    judged not to fit UB and left unfused on the CLI's default target); and on Ascend910B2 every attention fuses."""
    res = _optimized_on_910b(file)
    for r in res.records:
        if r.decision is None:
            continue
        for k in tuple(r.decision.unfused) + tuple(r.decision.fused):
            assert not [n for n in k.notes if "not understood" in n], (r.match.pattern, k.name, k.notes)
    got = fusion_census(res.model).get("attention", 0)
    assert got == ENTRIES[file]["expected"]["attention"], \
        [(r.match.pattern, r.reason) for r in res.records if r.match.pattern == "attention"]


@pytest.mark.parametrize("file", sorted(ENTRIES))
def test_census_counts_every_rotated_tensor(file: str) -> None:
    """The census (what the peers' table counts) sees each rotated tensor once, whichever op holds it: a
    RotaryEmbedding, one side of a RotaryEmbeddingPair, or q_pe / k_pe inside an MlaProlog."""
    assert fusion_census(_optimized(file).model)["rotary"] == ENTRIES[file]["expected"]["rotary_applications"]
