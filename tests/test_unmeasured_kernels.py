"""A fused kernel the profile's calibration never measured (its rows ran with that pattern disabled: Ascend310P3's
attention) is said to be so, in the decision and in the whole-model figure; elsewhere nothing is said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npufuse import api

VIT = Path(__file__).parent / "fixtures" / "vit_ts17.onnx"


def _report(fmt: str = "json", **kw):
    out = api.report(VIT, format=fmt, verify=False, **kw)
    if fmt == "json":
        return out if isinstance(out, dict) else json.loads(out.render("json"))
    return out if isinstance(out, str) else out.render(fmt)


def test_fused_attention_on_310p_is_named_with_its_share_of_the_time():
    d = _report(target="Ascend310P3")
    h = d["summary"]["unmeasured_kernels"]
    assert h["patterns"] == ["attention"] and h["kernels"] >= 1
    fused = [c for c in d["candidates"] if c["pattern"] == "attention" and c["status"] == "applied"]
    assert fused and all(c["decision"]["confidence"] == "uncalibrated" for c in fused)
    assert all("never measured" in c["decision"]["reason"] for c in fused)
    # the same kernels the decisions priced, at the same sizes
    attention_us = sum(k["t_total_us"] for c in fused for k in c["decision"]["fused"]
                       if k["op_type"] == "FusedAttention")
    assert h["kernels"] == len(fused) and h["time_us"] == pytest.approx(attention_us, abs=1e-3)
    assert 0 < h["share_pct"] < 100
    assert h["share_pct"] == pytest.approx(100 * h["time_us"] / d["summary"]["modeled_time_us"]["after"], abs=0.06)


@pytest.mark.parametrize("fmt", ["text", "markdown", "html"])
def test_every_format_prints_the_note(fmt):
    assert "calibration never measured them" in _report(fmt, target="Ascend310P3")


@pytest.mark.parametrize("kw", [{"target": "Ascend310P3", "disable": ("attention",)},   # nothing unmeasured fused
                                {"target": "Ascend910B2"}])                           # fitted on flash attention
def test_no_note_where_every_fused_kernel_was_measured(kw):
    d = _report(**kw)
    assert d["summary"]["unmeasured_kernels"] is None
    assert all("never measured" not in c["decision"]["reason"] for c in d["candidates"] if c.get("decision"))
