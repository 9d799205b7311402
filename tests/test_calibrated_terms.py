"""The calibrated profile terms (launch per execution mode, Cube efficiency, GM fraction, Vector cost factor):
each moves prices the way its physics says, and a profile that sets none prices exactly as before."""

from __future__ import annotations

import dataclasses

import pytest

from npufuse.cost_model import OpWork, TensorInfo, estimate_op
from npufuse.cost_model.decide import decide
from npufuse.cost_model.kernel import price
from npufuse.cost_model.workload import FusionCandidate
from npufuse.npu_model import load_profile
from npufuse.npu_model.spec import CALIBRATED_KEYS, ProfileError

T = TensorInfo
F16 = "float16"


def gemm(n: int) -> OpWork:
    return OpWork("mm", "MatMul", "", (T((n, n), F16), T((n, n), F16, True)), (T((n, n), F16),), {})


def add(n: int) -> OpWork:
    return OpWork("add", "Add", "", (T((n,), F16), T((n,), F16)), (T((n,), F16),), {})


def layernorm(rows: int, width: int) -> OpWork:
    return OpWork("ln", "LayerNormalization", "", (T((rows, width), F16), T((width,), F16, True),
                                                    T((width,), F16, True)), (T((rows, width), F16),), {"axis": -1})


OPS = (gemm(64), gemm(2048), add(1 << 10), add(1 << 24), layernorm(4096, 1024))


@pytest.fixture(scope="module")
def spec():
    return load_profile("Ascend910B2").physics()


def t(op: OpWork, spec, **terms) -> float:
    return estimate_op(op, dataclasses.replace(spec, **terms)).t_total_us


def test_neutral_terms_change_nothing(spec):
    """Every term at its default (set explicitly) prices as the profile without them, in both modes' default."""
    neutral = dataclasses.replace(spec, **{f: d for _, f, _, d in CALIBRATED_KEYS})
    for op in OPS:
        a, b = estimate_op(op, spec), estimate_op(op, neutral)
        assert a.t_total_us == b.t_total_us and a.t_launch_us == spec.kernel_launch_us
        assert a.t_total_us == pytest.approx(max(a.t_pipeline_us, a.t_roofline_us) + spec.kernel_launch_us)


def test_graph_launch_overlaps_and_eager_adds(spec):
    small, big = add(1 << 10), gemm(2048)
    body_small = t(small, spec) - spec.kernel_launch_us
    body_big = t(big, spec) - spec.kernel_launch_us
    # graph mode: the launch hides behind the previous kernel; a tiny kernel still takes at least the launch
    assert t(small, spec, launch_graph_kernel_us=10.0) == pytest.approx(max(body_small, 10.0))
    assert t(big, spec, launch_graph_kernel_us=10.0) == pytest.approx(body_big)
    assert estimate_op(small, dataclasses.replace(spec, launch_graph_kernel_us=1e3)).bound_by == "launch"
    # a fixed per-kernel cost is never hidden
    assert t(big, spec, launch_graph_kernel_us=10.0, launch_kernel_fixed_us=2.0) == pytest.approx(body_big + 2.0)
    # eager mode: the launch adds to every kernel (kernel_launch_us unless eager_kernel_us is set)
    eager = spec.with_mode("eager")
    assert t(big, eager, launch_graph_kernel_us=10.0) == pytest.approx(body_big + spec.kernel_launch_us)
    assert t(big, eager, launch_eager_kernel_us=40.0) == pytest.approx(body_big + 40.0)
    with pytest.raises(ValueError):
        spec.with_mode("lazy")


def test_cube_efficiency_slows_cube_work_more_when_small(spec):
    for op in (gemm(256), gemm(4096)):
        assert t(op, spec, cube_efficiency_max=0.8) > t(op, spec)
    # the knee costs a small GEMM a larger share of its time than a large one
    knee = 20000.0
    small = t(gemm(256), spec, cube_efficiency_knee_cycles=knee) / t(gemm(256), spec)
    large = t(gemm(4096), spec, cube_efficiency_knee_cycles=knee) / t(gemm(4096), spec)
    assert small > large > 1.0
    # Vector-only kernels have no Cube work: untouched
    assert t(add(1 << 24), spec, cube_efficiency_max=0.5, cube_efficiency_knee_cycles=knee) == t(add(1 << 24), spec)


def test_gm_fraction_slows_memory_bound_kernels_only(spec):
    stream = add(1 << 24)
    assert estimate_op(stream, spec).bound_by == "gm_bandwidth"
    assert t(stream, spec, gm_fraction=0.5) > 1.5 * (t(stream, spec) - spec.kernel_launch_us)
    assert t(gemm(4096), spec, gm_fraction=0.5) == t(gemm(4096), spec)   # Cube-bound


def test_vector_cost_factor_scales_vector_cycles(spec):
    ln = layernorm(4096, 1024)
    base = estimate_op(ln, spec)
    slow = estimate_op(ln, dataclasses.replace(spec, vector_cost_factor=3.0))
    assert slow.vector_cycles == pytest.approx(3.0 * base.vector_cycles)
    assert slow.t_total_us > base.t_total_us
    assert t(gemm(2048), spec, vector_cost_factor=3.0) == t(gemm(2048), spec)   # no epilogue: no Vector work


def test_price_reproduces_every_kernel(spec):
    """`price(basis)` is the formula finish() used: re-pricing a recorded kernel gives its time."""
    tuned = dataclasses.replace(spec, launch_graph_kernel_us=4.0, launch_kernel_fixed_us=1.0,
                                cube_efficiency_max=0.85, cube_efficiency_knee_cycles=5000.0, gm_fraction=0.8,
                                vector_cost_factor=1.5)
    for op in OPS:
        k = estimate_op(op, tuned)
        assert price(k.basis, tuned).t_total_us == k.t_total_us


def _profile_text(extra: str) -> str:
    from importlib import resources

    text = resources.files("npufuse.npu_model").joinpath("profiles", "Ascend910A.toml").read_text("utf-8")   # uncalibrated
    return text.replace("[launch]\n", "[launch]\n" + extra + "\n", 1)


@pytest.mark.parametrize("line, field, value", [
    ("graph_kernel_us = 2.5", "launch_graph_kernel_us", 2.5),
    ("kernel_fixed_us = 0", "launch_kernel_fixed_us", 0.0),
])
def test_profile_reads_the_terms(tmp_path, line, field, value):
    p = tmp_path / "chip.toml"
    p.write_text(_profile_text(line), encoding="utf-8")
    assert getattr(load_profile(str(p)), field) == value


@pytest.mark.parametrize("line", ["graph_kernel_us = -1", "graph_kernel_us = \"fast\"", "kernel_fixed_us = inf"])
def test_profile_refuses_bad_terms(tmp_path, line):
    p = tmp_path / "chip.toml"
    p.write_text(_profile_text(line), encoding="utf-8")
    with pytest.raises(ProfileError, match="launch."):
        load_profile(str(p))


def test_profile_refuses_efficiency_above_one(tmp_path):
    text = _profile_text("").replace("[cube]\n", "[cube]\nefficiency_max = 1.2\n", 1)
    p = tmp_path / "chip.toml"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(ProfileError, match=r"cube.efficiency_max.*\(0, 1\]"):
        load_profile(str(p))


# ---- the decision's confidence and the report's calibration block --------------------------------------------

def _candidate():
    from npufuse.cost_model import FusionCandidate

    x = T((4096, 4096), F16)
    unfused = (OpWork("a", "Add", "", (x, x), (x,)), OpWork("r", "Relu", "", (x,), (x,)))
    fused = (OpWork("f", "Add", "", (x, x), (x,)),)      # one streaming kernel instead of two
    return FusionCandidate("add_relu", unfused, fused)


def test_decision_confidence_is_gain_over_validated_error(spec):
    from npufuse.cost_model import decide

    plain = decide(_candidate(), dataclasses.replace(spec, calibration=()))
    assert plain.confidence == "uncalibrated" and plain.validated_error is None
    for err, want in ((0.05, "high"), (0.3, "medium"), (0.9, "low")):
        cal = dataclasses.replace(spec, calibration=(("lomo_median_abs_error_pct", err * 100),))
        d = decide(_candidate(), cal)
        frac = d.gain_us / d.t_unfused_us
        assert d.validated_error == pytest.approx(err)
        assert d.gain_over_error == pytest.approx(frac / err, rel=1e-3)
        assert d.confidence == want, (frac, err)
        assert d.fuse == plain.fuse and d.reason == plain.reason       # confidence never changes the decision
        assert d.to_dict()["confidence"] == want


def test_report_blocks_say_what_the_target_is_calibrated_against():
    from npufuse.calibrate.provenance import calibration_block, calibration_line

    cal = load_profile("Ascend910B2")
    block = calibration_block(cal)["calibration"]
    assert block["calibrated"] and "cube.efficiency_max" in block["parameters"]
    line = calibration_line(block)
    assert "ascend910b.toml" in line and "leave-one-model-out median |error|" in line
    plain = calibration_block(load_profile("Ascend910A"))["calibration"]
    assert plain == {"calibrated": False, "profile": "Ascend910A"}
    assert "not calibrated" in calibration_line(plain)
    assert calibration_block(None) == {}


def _bmm(b_shape):
    a = TensorInfo((2, 6, b_shape[-1], 64), "float16")
    return OpWork("qk", "MatMul", "", (a, TensorInfo(tuple(b_shape), "float16")),
                  (TensorInfo((2, 6, b_shape[-1], b_shape[-1]), "float16"),))


def test_a_fusion_the_calibration_never_measured_has_no_validated_confidence():
    """Ascend310P3's calibration ran with attention disabled (its [calibration] disabled_patterns): a fused
    attention's price there rests on the physics alone, and the decision says so instead of claiming the profile's
    validated error."""
    mm = _bmm((2, 6, 64, 208))   # aligned: no conversion kernels in the way
    fused = (dataclasses.replace(mm, name="f"),)
    P310 = load_profile("Ascend310P3")
    assert "attention" in P310.calibration_info()["disabled_patterns"]
    d = decide(FusionCandidate("attention", unfused=(mm, mm), fused=fused), P310)
    assert d.confidence == "uncalibrated" and d.validated_error is None and d.gain_over_error is None
    assert "never measured this fusion's kernel" in d.reason
    other = decide(FusionCandidate("matmul_epilogue", unfused=(mm, mm), fused=fused), P310)
    lomo = P310.calibration_info()["lomo_median_abs_error_pct"] / 100   # the profile's own validated error
    assert other.confidence in ("high", "medium", "low") and other.validated_error == pytest.approx(lomo, abs=1e-4)
    assert "never measured" not in other.reason
