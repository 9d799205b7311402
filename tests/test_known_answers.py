"""Known answers on the shipped (calibrated) profiles, priced by the cost model itself (not the fit's re-pricer):
- GEMM 6144^3 fp16 (B transposed, fp32 C) on Ascend910B2 within 15% of the published 1506 µs (pto-isa);
- BERT-base (bert-base-uncased-squad, seq 384, batch 1) on Ascend310P3 within 15% of its published 224.96 fps
  (ModelZoo-PyTorch Bert_Uncased_Huggingface), npufuse's fused graph priced in fp16 as ATC runs it."""

from __future__ import annotations

import dataclasses

import pytest

from npufuse.calibrate import data
from npufuse.calibrate.workloads import CALIBRATION_DIR, INDEX, Builder, kernel_work, read_index
from npufuse.cost_model import estimate_op
from npufuse.npu_model import load_profile


def _row(file: str, workload: str, **match) -> data.Row:
    rows = data.load([str(CALIBRATION_DIR / file)])[0].rows
    return next(r for r in rows if r.workload == workload and all(getattr(r, k) == v for k, v in match.items()))


def test_gemm_6144_on_910b2():
    spec = load_profile("Ascend910B2")
    assert "cube.efficiency_max" in spec.calibration_info().get("parameters", [])
    row = _row("ascend910b.toml", "gemm_6144")
    assert row.time_us == pytest.approx(1506.0)
    # a kernel's device time: no launch (the timing is of the kernel alone)
    bare = dataclasses.replace(spec, launch_graph_kernel_us=0.0)
    t = estimate_op(kernel_work(row), bare).t_total_us
    assert t == pytest.approx(1506.0, rel=0.15)
    # and the calibration is what brings it there: the physics alone is 13-34% optimistic on these GEMMs
    neutral = dataclasses.replace(bare, cube_efficiency_max=1.0, cube_efficiency_knee_cycles=0.0)
    assert estimate_op(kernel_work(row), neutral).t_total_us < 0.9 * 1506.0


@pytest.mark.skipif(not INDEX.is_file() or "bert-base-uncased-squad" not in read_index()
                    or bool(read_index()["bert-base-uncased-squad"].get("missing")),
                    reason="the BERT-base recipe is not in this checkout")
def test_bert_base_on_310p3():
    spec = load_profile("Ascend310P3")
    info = spec.calibration_info()
    assert info.get("parameters")
    row = _row("ascend310p3.toml", "bert-base-uncased-squad", batch=1, seq_len=384)
    assert row.value == pytest.approx(224.96)
    built = Builder(spec, disable=tuple(info.get("disabled_patterns", ()))).build(row)
    modeled_us = sum(k.t_total_us for k in built.kernels)
    assert modeled_us == pytest.approx(row.time_us, rel=0.15)
    fps = 1e6 * row.batch / modeled_us
    assert fps == pytest.approx(224.96, rel=0.15)
