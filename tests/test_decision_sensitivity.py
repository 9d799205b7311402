"""No fuse/skip decision may rest on a profile number that is only an assumption (issue 11's done-means).

tools/decision_sensitivity.py scales each parameter whose source says "assumption" by x0.5 and x2 and re-runs the
decisions; here on two real exports (a BERT and a ResNet). The full run over 29 models is
benchmarks/results/decision_sensitivity.json.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("decision_sensitivity", REPO / "tools" / "decision_sensitivity.py")
sensitivity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sensitivity)

MODELS = [REPO / "tests" / "fixtures" / "bert_ts17.onnx", REPO / "tests" / "fixtures" / "resnet_ts17.onnx"]


def test_the_probe_sees_a_dependency_when_there_is_one() -> None:
    """The tool is a real check: launch moved on a profile whose launch is its only per-kernel cost flips some."""
    from npufuse.npu_model.spec import load_profile

    spec = load_profile("Ascend910B2")
    assert "launch.kernel_launch_us" in sensitivity.assumed_parameters(spec)
    r = sensitivity.run(["Ascend910B2"], paths=MODELS[1:])["profiles"]["Ascend910B2"]
    assert r["decisions"] > 0 and r["flips_by_parameter"].get("launch.kernel_launch_us", 0) > 0


def test_ascend310p3_decisions_rest_on_sourced_or_calibrated_numbers() -> None:
    r = sensitivity.run(["Ascend310P3"], paths=MODELS)["profiles"]["Ascend310P3"]
    assert r["decisions"] > 20 and r["assumed_parameters"]
    assert r["flips"] == []


@pytest.mark.xfail(strict=True, reason="open (issue 11): Ascend910B2's graph-mode launch is the unsourced 3.0 us; "
                   "the one published whole-model 910B-class timing (ViT-Base, batch 256) cannot identify it, and "
                   "small-kernel fusions flip at 1.5 us")
def test_ascend910b2_decisions_rest_on_sourced_or_calibrated_numbers() -> None:
    r = sensitivity.run(["Ascend910B2"], paths=MODELS)["profiles"]["Ascend910B2"]
    assert r["flips"] == []
