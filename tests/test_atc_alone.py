"""The report's `atc_alone`: the export as ATC compiles it by itself (the patterns a CANN fusion pass does the work of,
less those the target's calibration ran disabled), priced as the calibration prices a published ATC compile, beside
npufuse's own result (docs/report.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from npufuse import api

FIXTURES = Path(__file__).parent / "fixtures"
VIT = str(FIXTURES / "vit_ts17.onnx")
RESNET = str(FIXTURES / "resnet_ts17.onnx")
LLAMA = str(FIXTURES / "llama_ts14.onnx")


def _summary(model: str, target: str = "Ascend310P3", dims: dict | None = None, **kw) -> dict:
    return api.report(model, target=target, verify=False, dims={"batch": 8} if dims is None else dims,
                      **kw)["summary"]


@pytest.fixture(scope="module")
def vit_310p3() -> dict:
    return _summary(VIT)


def test_atc_alone_is_the_export_fused_without_the_patterns_atc_has_no_pass_for(vit_310p3):
    alone = vit_310p3["atc_alone"]
    # Ascend310P3's calibration rows ran without a fused attention, and CANN has a pass for the rest a ViT fuses
    assert "attention" in alone["without"] and "attention" not in alone["patterns"]
    assert {"layernorm", "add_layernorm", "gelu", "matmul_epilogue", "conv_bn_act"} <= set(alone["patterns"])
    # the same figure as npufuse's own result with attention disabled, to the microsecond
    disabled = _summary(VIT, disable=["attention"])
    assert alone["time_us"] == disabled["modeled_time_us"]["after"]
    # npufuse fuses the attention on top of ATC's own fusions: faster than ATC alone, slower than the fully
    # unfused graph's gain suggests
    t = vit_310p3["modeled_time_us"]
    assert t["after"] < alone["time_us"] < t["before"]
    assert alone["speedup"] == pytest.approx(alone["time_us"] / t["after"], rel=1e-4)
    assert 1.0 < alone["speedup"] < t["speedup"]


def test_atc_alone_does_not_follow_the_runs_own_pattern_flags(vit_310p3):
    # ATC's passes do not read npufuse's --disable: its figure is the same whatever this run left out
    narrowed = _summary(VIT, disable=["matmul_epilogue"])
    assert narrowed["modeled_time_us"]["after"] > vit_310p3["modeled_time_us"]["after"]
    assert narrowed["atc_alone"]["time_us"] == vit_310p3["atc_alone"]["time_us"]


def test_a_cnn_gains_nothing_over_atc_alone_on_310p3():
    # no attention to fuse: everything npufuse does, ATC's own passes do too
    s = _summary(RESNET, dims={})
    assert s["atc_alone"]["time_us"] == s["modeled_time_us"]["after"]
    assert s["atc_alone"]["speedup"] == 1.0


def test_no_atc_alone_where_the_calibration_timed_no_whole_compile():
    s = _summary(VIT, target="Ascend910B2")   # its calibration rows are single kernels
    assert s["atc_alone"] is None


def test_text_and_markdown_print_it():
    doc = api.report(VIT, target="Ascend310P3", verify=False, dims={"batch": 8})
    line = next(x for x in doc.render("text").splitlines() if x.startswith("ATC alone"))
    assert "matmul_epilogue" in line and f"{doc['summary']['atc_alone']['time_us']:.1f} us" in line
    assert "ATC alone" in doc.render("markdown") and "over ATC alone" in doc.render("html")


def test_what_no_cann_pass_fuses_stays_unfused_in_atc_alone():
    # a Llama's RMSNorm and gated MLP: the fusion switch table has no CANN pass for either, so ATC by itself is not
    # credited with them, and npufuse's gain over ATC alone is theirs
    s = _summary(LLAMA, dims={})
    alone, t = s["atc_alone"], s["modeled_time_us"]
    assert {"rmsnorm", "gated_mlp", "rotary"} <= set(alone["without"])
    assert t["after"] < alone["time_us"] <= t["before"]
    only = _summary(LLAMA, dims={}, only=alone["patterns"])
    assert only["modeled_time_us"]["after"] == alone["time_us"]
