"""A bounded slice of the differential fuzzer (tools/fuzz.py): a few hundred random graphs of every fusion family,
no crash, no invalid model, no wrong output, no fused near-miss; and sub-slices for what the fuzzer first found
(fused-op bodies at opset 11, bf16 graphs, a NaN reference called drift), each now a plain test."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

REPO = Path(__file__).resolve().parents[1]
SEED = 12
PER_FAMILY = 20


def _load_fuzz():
    spec = importlib.util.spec_from_file_location("_npufuse_fuzz", REPO / "tools" / "fuzz.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


fuzz = _load_fuzz()
FAMILIES = list(fuzz.FAMILIES)


def _slice(families=None, opsets=None, dtypes=None, count=None, seed=SEED) -> list:
    results = []
    names = families or FAMILIES
    fuzz.run_cases(seed, count or PER_FAMILY * len(names), names, opsets=opsets, dtypes=dtypes,
                   on_case=results.append)
    return results


def _describe(results) -> list[str]:
    return [f"{r.case.family} #{r.case.index} opset {r.case.opset} {r.case.dtype} "
            f"{r.case.perturbation or '-'}: {r.outcome}: {r.message}" for r in results]


@pytest.fixture(scope="module")
def bounded_slice() -> list:
    return _slice()


def test_bounded_slice_has_no_failure(bounded_slice) -> None:
    assert len(bounded_slice) == PER_FAMILY * len(FAMILIES)
    bad = [r for r in bounded_slice if r.outcome in fuzz.FAILURES]
    assert not bad, "\n".join(_describe(bad))


def test_bounded_slice_exercises_every_family_opset_dtype_and_near_miss(bounded_slice) -> None:
    """The slice is not vacuous: each family's own fusion happens on unperturbed graphs, near-misses are drawn for
    each family that has them, the whole opset range and every dtype appear, and graphs run on onnxruntime."""
    for name in FAMILIES:
        mine = [r for r in bounded_slice if r.case.family == name]
        plain = [r for r in mine if not r.case.perturbation]
        assert sum(r.target_fused for r in plain) >= len(plain) // 2, (name, _describe(plain))
        if fuzz.FAMILIES[name].perturbations:
            assert any(r.case.perturbation for r in mine), name
    assert {r.case.opset for r in bounded_slice} == set(fuzz.OPSETS)
    assert {r.case.dtype for r in bounded_slice} == {"fp32", "fp16", "bf16"}
    ran = [r for r in bounded_slice if r.outcome == "ok"]
    assert len(ran) >= len(bounded_slice) * 3 // 4


def test_norm_families_at_opset_11_give_valid_models() -> None:
    results = _slice(["layernorm", "rmsnorm", "add_norm", "mla_prolog"], opsets=[11], count=24)
    bad = [r for r in results if r.outcome in fuzz.FAILURES]
    assert not bad, "\n".join(_describe(bad))


def test_bf16_graphs_are_optimized_and_verified() -> None:
    results = _slice(["matmul_epilogue", "layernorm", "rmsnorm", "gelu", "add_norm", "gated_mlp"], dtypes=["bf16"],
                     opsets=list(range(13, 24)), count=18)
    bad = [r for r in results if r.outcome in fuzz.FAILURES]
    assert not bad, "\n".join(_describe(bad))


def test_nan_reference_is_not_reported_as_drift() -> None:
    results = []
    for index in range(200):
        case, model, kinds = fuzz.draw(SEED, index, ["layernorm", "rmsnorm"], list(range(12, 24)), ["fp32"])
        if case.perturbation == "nan_reference":
            results.append(fuzz.evaluate(case, model, kinds))
        if len(results) == 6:
            break
    assert len(results) == 6
    bad = [r for r in results if r.outcome in fuzz.FAILURES]
    assert not bad, "\n".join(_describe(bad))
    # and npufuse says so: the check is inconclusive, not passed and not drift
    assert [r.outcome for r in results] == ["inconclusive"] * 6, _describe(results)


# ---- the harness itself: it must see what it claims to see -------------------------------------------------------

def _first_case(family: str, perturbed: bool, seed: int = SEED):
    for index in range(500):
        case, model, kinds = fuzz.draw(seed, index, [family], list(range(13, 24)), ["fp32"])
        if bool(case.perturbation) == perturbed:
            return case, model, kinds
    raise AssertionError(f"no {'perturbed' if perturbed else 'plain'} {family} case")


def test_a_wrong_rewrite_is_classified_wrong_output(monkeypatch) -> None:
    """Replace optimize by one that fuses correctly and then changes a weight: the fuzzer must call it wrong."""
    real = fuzz.optimize

    def broken(model, base_dir=None, options=None):
        res = real(model, base_dir, options)
        w = max(res.model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
        w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * 1.5, w.name))
        return res

    monkeypatch.setattr(fuzz, "optimize", broken)
    case, model, kinds = _first_case("matmul_epilogue", perturbed=False)
    res = fuzz.evaluate(case, model, kinds)
    assert res.outcome == "wrong-output", res.to_dict()


def test_a_crash_and_an_invalid_model_are_classified(monkeypatch) -> None:
    case, model, kinds = _first_case("gelu", perturbed=False)

    def crash(model, base_dir=None, options=None):
        raise KeyError("boom")

    monkeypatch.setattr(fuzz, "optimize", crash)
    res = fuzz.evaluate(case, model, kinds)
    assert res.outcome == "crash" and "KeyError" in res.message and "boom" in res.traceback

    monkeypatch.undo()
    real = fuzz.optimize

    def invalid(model, base_dir=None, options=None):
        res = real(model, base_dir, options)
        res.model.graph.node[0].input[0] = "no_such_value"
        return res

    monkeypatch.setattr(fuzz, "optimize", invalid)
    res = fuzz.evaluate(case, model, kinds)
    assert res.outcome == "invalid-model" and "checker" in res.message


def test_a_fused_near_miss_is_classified(monkeypatch) -> None:
    """Report the perturbed chain's own pattern as applied: the fuzzer must flag the near-miss."""
    case, model, kinds = _first_case("gated_mlp", perturbed=True)
    real = fuzz.optimize

    def lying(model, base_dir=None, options=None):
        res = real(model, base_dir, options)
        from npufuse.fusion.engine import APPLIED, FusionRecord
        from npufuse.ir.candidates import Match
        res.records.append(FusionRecord(Match("gated_mlp", (), (), (), "GatedMLP[silu]"), APPLIED))
        return res

    monkeypatch.setattr(fuzz, "optimize", lying)
    res = fuzz.evaluate(case, model, kinds)
    assert res.outcome == "near-miss-violated" and case.perturbation in res.message


def test_cases_are_reproducible_and_saved_failures_replay(tmp_path, monkeypatch) -> None:
    a = [fuzz.draw(5, i, FAMILIES)[1].SerializeToString(deterministic=True) for i in range(len(FAMILIES))]
    b = [fuzz.draw(5, i, FAMILIES)[1].SerializeToString(deterministic=True) for i in range(len(FAMILIES))]
    assert a == b and len(set(a)) == len(a)

    def crash(model, base_dir=None, options=None):
        raise ValueError("planted")

    monkeypatch.setattr(fuzz, "optimize", crash)
    code = fuzz.main(["--seed", "5", "--count", "2", "--family", "gelu", "--out", str(tmp_path)])
    assert code == 1
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    assert summary["totals"] == {"crash": 2} and summary["count"] == 2 and summary["graphs_per_s"] > 0
    saved = sorted((tmp_path / "gelu").glob("*.json"))
    assert len(saved) == 2
    doc = json.loads(saved[0].read_text(encoding="utf-8"))
    assert doc["outcome"] == "crash" and "planted" in doc["traceback"]
    saved_model = onnx.load(str(saved[0].with_suffix(".onnx")))
    assert saved_model.SerializeToString(deterministic=True) == \
        fuzz.replay_case(doc)[1].SerializeToString(deterministic=True)
    monkeypatch.undo()
    assert fuzz.main(["--replay", str(saved[0])]) == 0


def test_a_narrowed_run_skips_what_it_cannot_draw() -> None:
    """`--dtype bf16` leaves out the families that have no bf16 form and counts draws onnx cannot build (bf16 Conv
    before opset 22) instead of stopping; bf16 graphs are run, not skipped as unrunnable."""
    summary = fuzz.run_cases(3, 40, dtypes=["bf16"])
    assert "attention" not in summary["families"]
    assert sum(summary["totals"].values()) == 40
    assert summary["totals"].get("ok", 0) >= 20 and not summary["totals"].get("original-unrunnable")
    with pytest.raises(ValueError):
        fuzz.run_cases(3, 5, families=["attention"], dtypes=["bf16"])
