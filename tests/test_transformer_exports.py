"""Every transformer fixture, optimized as a user would (default target, cost model on, verification on):
the fused structure equals the architecture's, every rewrite verified, the whole model unchanged, and
npufuse fuses at least what the best peer fused on the same file (recorded by
benchmarks/peers_fusion_counts.py in benchmarks/results/peers_fusion_counts.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npufuse.fusion.census import fusion_census
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.modelio import load_model
from npufuse.npu_model.spec import load_profile

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
PEERS = ROOT / "benchmarks" / "results" / "peers_fusion_counts.json"
KINDS = ("attention", "layernorm", "rmsnorm", "gelu")

ENTRIES = [e for e in json.loads((FIXTURES / "manifest.json").read_text())["fixtures"] if "attention" in e["expected"]]


@pytest.fixture(scope="module")
def spec():
    return load_profile("Ascend910B2")


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"] for e in ENTRIES])
def test_fused_structure_matches_the_architecture(entry: dict, spec) -> None:
    model = load_model(FIXTURES / entry["file"])
    res = optimize(model, str(FIXTURES), OptimizeOptions(spec=spec))
    census = fusion_census(res.model)
    for kind in KINDS:
        assert census.get(kind, 0) == entry["expected"].get(kind, 0), (kind, dict(census))
    # Llama's SwiGLU MLP (one SiLU per layer, counted by the fixture generator) is one GatedMLP per layer
    want_gated = entry["expected"].get("silu", 0) if entry["base_family"] == "llama" else 0
    assert census.get("gated_mlp", 0) == want_gated, dict(census)
    assert not res.rolled_back
    assert res.applied and all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok, res.model_check.reason
    for c in res.model_check.comparisons:
        assert c.min_passing_rtol <= 1e-4  # within 1e-4 relative (with the fp32 absolute floor)
    # No decomposed leftovers of the fused families.
    ops = {n.op_type for n in res.model.graph.node}
    assert not ops & {"Softmax", "Erf", "Tanh", "ReduceMean"}, ops & {"Softmax", "Erf", "Tanh", "ReduceMean"}


def _peer_results() -> dict[str, dict]:
    return {f["file"]: f for f in json.loads(PEERS.read_text())["files"]}


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"] for e in ENTRIES])
def test_npufuse_fuses_at_least_what_the_best_peer_fused(entry: dict, spec) -> None:
    rec = _peer_results().get(entry["file"])
    assert rec is not None, "no recorded peer run for this fixture: run benchmarks/peers_fusion_counts.py --json " \
        "benchmarks/results/peers_fusion_counts.json"
    assert any(not n.startswith("npufuse") and p.get("ok") for n, p in rec["peers"].items())
    model = load_model(FIXTURES / entry["file"])
    census = fusion_census(optimize(model, str(FIXTURES), OptimizeOptions(spec=spec, verify=False)).model)
    for name, peer in rec["peers"].items():
        if name.startswith("npufuse") or not peer.get("ok") or not peer.get("runs_in_ort"):
            continue  # a peer whose output does not run has fused nothing usable
        for kind in KINDS:
            assert census.get(kind, 0) >= peer["kinds"].get(kind, 0), (name, kind)
