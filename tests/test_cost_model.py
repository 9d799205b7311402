"""The cost model on known answers (roofline limits), properties (monotone, UB-monotone feasibility) and
the fuse/skip decisions the issue names, including two profiles that decide differently."""

from __future__ import annotations

import dataclasses
import json

import pytest

from npufuse.cost_model import (FusionCandidate, FusionDecision, KernelEstimate, ModelEstimate, OpWork,
                                TensorInfo, decide, estimate_op, estimate_ops)
from npufuse.cost_model.cube_ops import conv_gemm
from npufuse.npu_model import load_profile

T = TensorInfo
F16, F32 = "float16", "float32"
PROFILES = ("Ascend910B2", "Ascend910A", "Ascend310P3")
KiB = 1024


@pytest.fixture(scope="module")
def specs():
    # the physics of each profile: these tests hold the arithmetic to known answers; the calibrated terms have
    # their own tests (test_calibrated_terms.py, test_known_answers.py); each tensor priced in the dtype it is
    # given (ATC's must_keep_origin_dtype): how precision modes retype work is test_precision_mode.py's
    return {n: load_profile(n).physics().with_precision("must_keep_origin_dtype") for n in PROFILES}


# ---- builders -------------------------------------------------------------------------------------

def matmul(m: int, n: int, k: int, dtype: str = F16, batch: tuple[int, ...] = ()) -> OpWork:
    return OpWork("mm", "MatMul", "", (T(batch + (m, k), dtype), T((k, n), dtype, True)), (T(batch + (m, n), dtype),),
                  {})


def unary(op_type: str, n: int, dtype: str = F16) -> OpWork:
    return OpWork(op_type.lower(), op_type, "", (T((n,), dtype),), (T((n,), dtype),), {})


def add(n: int, dtype: str = F16) -> OpWork:
    return OpWork("add", "Add", "", (T((n,), dtype), T((n,), dtype)), (T((n,), dtype),), {})


def conv(c_in: int, c_out: int, hw: int, k: int = 3, stride: int = 1, group: int = 1, dtype: str = F32,
         batch: int = 1, bias: bool = False, op_type: str = "Conv", **extra) -> OpWork:
    out = (hw + 2 * (k // 2) - k) // stride + 1
    ins = (T((batch, c_in, hw, hw), dtype), T((c_out, c_in // group, k, k), dtype, True))
    if bias:
        ins += (T((c_out,), dtype, True),)
    attrs = {"kernel_shape": [k, k], "pads": [k // 2] * 4, "strides": [stride, stride], "group": group, **extra}
    return OpWork("conv", op_type, "npufuse" if op_type == "FusedConv" else "", ins,
                  (T((batch, c_out, out, out), dtype),), attrs)


def bn(x: TensorInfo) -> OpWork:
    c = x.shape[1]
    return OpWork("bn", "BatchNormalization", "", (x,) + tuple(T((c,), x.dtype, True) for _ in range(4)), (x,),
                  {"epsilon": 1e-5})


def conv_bn_relu(dtype: str = F32) -> FusionCandidate:
    """Conv 1x64x56x56, 3x3, 64->64 + BatchNormalization + Relu  =>  FusedConv(activation=Relu)."""
    c = conv(64, 64, 56, dtype=dtype)
    y = c.outputs[0]
    relu = OpWork("relu", "Relu", "", (y,), (y,), {})
    fused = conv(64, 64, 56, dtype=dtype, bias=True, op_type="FusedConv", activation="Relu")
    return FusionCandidate("conv_bn_act", (c, bn(y), relu), (fused,))


def matmul_layernorm(hidden: int, m: int = 128, k: int = 1024, dtype: str = F16) -> FusionCandidate:
    """MatMul [1, m, k] x [k, hidden] -> LayerNormalization over hidden  =>  FusedMatMul(epilogue=[layernorm])."""
    a, b, y = T((1, m, k), dtype), T((k, hidden), dtype, True), T((1, m, hidden), dtype)
    gamma, beta = T((hidden,), dtype, True), T((hidden,), dtype, True)
    mm = OpWork("mm", "MatMul", "", (a, b), (y,), {})
    ln = OpWork("ln", "LayerNormalization", "", (y, gamma, beta), (y,), {"axis": -1, "epsilon": 1e-5})
    fused = OpWork("fmm", "FusedMatMul", "npufuse", (a, b, None, gamma, beta), (y,),
                   {"epilogue": ["layernorm"], "epsilon": 1e-5})
    return FusionCandidate("matmul_epilogue", (mm, ln), (fused,))


def layernorm_decomposition(hidden: int, rows: int = 2048, dtype: str = F16) -> FusionCandidate:
    """The opset < 17 export of LayerNorm (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add)."""
    x, st, c, g = T((1, rows, hidden), dtype), T((1, rows, 1), dtype), T((), dtype, True), T((hidden,), dtype, True)
    ops = (OpWork("mean", "ReduceMean", "", (x,), (st,), {"axes": [-1]}),
           OpWork("sub", "Sub", "", (x, st), (x,), {}),
           OpWork("pow", "Pow", "", (x, c), (x,), {}),
           OpWork("var", "ReduceMean", "", (x,), (st,), {"axes": [-1]}),
           OpWork("eps", "Add", "", (st, c), (st,), {}),
           OpWork("sqrt", "Sqrt", "", (st,), (st,), {}),
           OpWork("div", "Div", "", (x, st), (x,), {}),
           OpWork("gamma", "Mul", "", (x, g), (x,), {}),
           OpWork("beta", "Add", "", (x, g), (x,), {}))
    fused = OpWork("ln", "LayerNormalization", "", (x, g, g), (x,), {"axis": -1})
    return FusionCandidate("layernorm", ops, (fused,))


def attention(seq: int, heads: int = 16, head_dim: int = 64, dtype: str = F16) -> FusionCandidate:
    q, kt = T((1, heads, seq, head_dim), dtype), T((1, heads, head_dim, seq), dtype)
    s, one = T((1, heads, seq, seq), dtype), T((), dtype, True)
    ops = (OpWork("qk", "MatMul", "", (q, kt), (s,), {}), OpWork("scale", "Div", "", (s, one), (s,), {}),
           OpWork("softmax", "Softmax", "", (s,), (s,), {"axis": -1}), OpWork("pv", "MatMul", "", (s, q), (q,), {}))
    fused = OpWork("fa", "FusedAttention", "npufuse", (q, q, q), (q,),
                   {"scale": head_dim ** -0.5, "causal": 0, "num_heads": heads})
    return FusionCandidate("attention", ops, (fused,))


# ---- known answers --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PROFILES)
def test_large_gemm_is_compute_bound_near_peak(specs, name):
    spec = specs[name]
    e = estimate_op(matmul(4096, 4096, 4096), spec)
    ideal_us = 2 * 4096 ** 3 / spec.peak_flops(F16) * 1e6
    assert e.flops == 2 * 4096 ** 3
    assert e.bound_by == "cube"
    assert abs(e.t_total_us - ideal_us) / ideal_us < 0.10


@pytest.mark.parametrize("name", ["Ascend910B2", "Ascend910A"])
def test_large_elementwise_is_bandwidth_bound_near_gm_bandwidth(specs, name):
    spec = specs[name]
    n = 64 * 1024 * 1024
    e = estimate_op(add(n), spec)
    assert e.gm_bytes == 3 * n * 2
    ideal_us = e.gm_bytes / spec.gm_bandwidth_bytes_per_s * 1e6
    assert e.bound_by == "gm_bandwidth"
    assert abs(e.t_total_us - ideal_us) / ideal_us < 0.10


def test_large_elementwise_on_310p3_runs_on_all_15_vector_units(specs):
    """310P3: a Vector kernel runs on the 8 AI cores' Vector units and the 7 Vector cores: 15 x 17 B/cycle x
    1.06 GHz = 270 GB/s of reads, above the 204.8 GB/s of the chip, which bounds it (on the 7 Vector cores alone,
    as before, the per-core read rate held it at 126 GB/s)."""
    e = estimate_op(add(64 * 1024 * 1024), specs["Ascend310P3"])
    assert e.cores_used == 15
    assert e.bound_by == "gm_bandwidth"
    assert e.t_total_us - e.t_launch_us == pytest.approx(e.gm_bytes / 204.8e9 * 1e6, rel=1e-6)


@pytest.mark.parametrize("name", PROFILES)
def test_tiny_op_is_launch_bound(specs, name):
    spec = specs[name]
    for op in (unary("Relu", 256), matmul(16, 16, 16), add(1000)):
        e = estimate_op(op, spec)
        assert e.bound_by == "launch"
        assert spec.kernel_launch_us <= e.t_total_us < 2 * spec.kernel_launch_us


# ---- properties -----------------------------------------------------------------------------------

def _nondecreasing(times, label):
    for (a, ta), (b, tb) in zip(times, times[1:]):
        assert tb >= ta - 1e-9, f"{label}: {b} costs {tb:.4f} µs < {ta:.4f} µs at {a}"


@pytest.mark.parametrize("name", PROFILES)
def test_more_bytes_or_flops_never_cost_less(specs, name):
    spec = specs[name]
    sizes = sorted({1, 7, 31, 100, 1000, 4096, 12345, 65536, 100003, 1 << 20, 3 << 20, 1 << 24})
    _nondecreasing([(n, estimate_op(add(n), spec).t_total_us) for n in sizes], "Add")
    _nondecreasing([(n, estimate_op(unary("Gelu", n), spec).t_total_us) for n in sizes], "Gelu")
    dims = list(range(1, 200, 13)) + list(range(200, 3000, 173))
    for which in range(3):
        pts = []
        for v in dims:
            m, n, k = (v if i == which else 768 for i in range(3))
            pts.append((v, estimate_op(matmul(m, n, k), spec).t_total_us))
        _nondecreasing(pts, f"MatMul dim {'mnk'[which]}")
    _nondecreasing([(hw, estimate_op(conv(64, 64, hw), spec).t_total_us) for hw in range(4, 120, 9)], "Conv")
    # Channels change the tile count, and with it how many cores run: 448 channels make 7 tiles of 64 on 310P3's
    # 8 cores, 464 make 8, so the wider conv reads its first-touch bytes over one more core and may come out a
    # little cheaper. The dip is bounded by one core's share; anything larger is a pricing error.
    chans = [(c, estimate_op(conv(c, c, 28), spec).t_total_us) for c in range(8, 520, 24)] + \
        [(c, estimate_op(conv(c, c, 28), spec).t_total_us) for c in (448, 464)]
    chans.sort()
    for (a, ta), (b, tb) in zip(chans, chans[1:]):
        assert tb >= ta * (1 - 1 / spec.cube_cores), f"Conv channels: {b} costs {tb:.4f} µs, {ta:.4f} µs at {a}"
    ln = [(r, estimate_op(layernorm_decomposition(1024, rows=r).fused[0], spec).t_total_us)
          for r in (1, 5, 48, 100, 1000, 5000)]
    _nondecreasing(ln, "LayerNorm rows")
    # more flops on the same bytes: a transcendental costs more Vector work than an add
    relu, gelu = estimate_op(unary("Relu", 1 << 22), spec), estimate_op(unary("Gelu", 1 << 22), spec)
    assert gelu.vector_cycles > relu.vector_cycles and gelu.t_total_us >= relu.t_total_us
    # fp32 kept as fp32 (must_keep_origin_dtype, as `specs` prices) moves more bytes and runs the Cube at a lower rate than fp16
    # (profile assumption); under ATC's default force_fp16 the two are one kernel
    assert estimate_op(matmul(2048, 2048, 2048, F32), spec).t_total_us > \
        estimate_op(matmul(2048, 2048, 2048, F16), spec).t_total_us
    default = spec.with_precision("force_fp16")
    assert estimate_op(matmul(2048, 2048, 2048, F32), default).t_total_us == \
        estimate_op(matmul(2048, 2048, 2048, F16), default).t_total_us


def test_bigger_ub_never_makes_a_fusion_infeasible(specs):
    for name in ("Ascend910B2", "Ascend910A"):        # one split AIC/AIV part, one L0C -> UB part
        base = specs[name]
        for hidden in (1024, 8192, 12288, 16384):
            for cand in (matmul_layernorm(hidden, k=256), layernorm_decomposition(hidden, rows=256)):
                seen = False
                for ub in (64 * KiB, 128 * KiB, 192 * KiB, 256 * KiB, 320 * KiB, 384 * KiB, 512 * KiB, 1024 * KiB):
                    ok = decide(cand, dataclasses.replace(base, ub_bytes=ub)).feasible
                    assert ok or not seen, f"{name} hidden={hidden}: feasible below UB={ub} but not at it"
                    seen |= ok


# ---- decisions ------------------------------------------------------------------------------------

def test_matmul_layernorm_small_hidden_is_fused_on_910b2(specs):
    d = decide(matmul_layernorm(1024), specs["Ascend910B2"])
    assert d.feasible and d.fuse and not d.forced
    assert d.gain_us > 0 and d.t_fused_us is not None and d.t_fused_us < d.t_unfused_us
    assert d.launches_saved == 1 and d.gm_bytes_saved == 2 * 128 * 1024 * 2   # the intermediate, out and back
    assert d.reason.startswith("fused: saves 1 kernel launch")
    fused = d.fused[0]
    assert fused.l2_handoff_bytes == 128 * 1024 * 2 and fused.t_handoff_us > 0   # split AIC/AIV: through L2


def test_matmul_layernorm_huge_hidden_is_refused_for_ub(specs):
    d = decide(matmul_layernorm(16384), specs["Ascend910B2"])
    assert not d.fuse and not d.feasible
    assert d.t_fused_us is None and d.gain_us == 0.0
    assert d.reason == ("not fused: a row of 16384 float16 elements with double buffering needs 320 KiB of UB, "
                        "more than the 192 KiB on Ascend910B2")
    assert "UB" in d.fused[0].infeasible_reason


def test_two_profiles_disagree_on_matmul_layernorm_through_the_cube_to_vector_path(specs):
    """MatMul [1,128,1024] x [1024,1024] -> LayerNorm fp16: the same candidate, two answers.

    On 910B2 (split AIC/AIV) the Cube writes its tiles to an L2 workspace, charged at the L2 rate, and the
    Vector cores normalise whole rows read back from it: the Cube keeps full tiles and the fusion pays. On
    910A (L0C -> UB direct) whole rows must sit in the 256 KiB UB beside the Cube: 15 rows of 1024 fp16 with
    double buffering, so the m tile drops below the 16-row fractal, the Cube is starved and every 15 rows
    re-read all of B: the fusion loses, and the reason says so.
    """
    cand = matmul_layernorm(1024)
    b2, a = decide(cand, specs["Ascend910B2"]), decide(cand, specs["Ascend910A"])
    assert b2.fuse and not a.fuse
    assert a.feasible and a.gain_us < 0
    assert "UB holds only 15 rows of 1024" in a.reason and "starved" in a.reason


def test_layernorm_at_gpt3_hidden_falls_back_to_single_buffering_where_ub_is_small(specs):
    """Decomposed LayerNorm at hidden 12288 (GPT-3) fp16: one row with double buffering and two fp32 work rows
    needs 240 KiB of UB: it fits the 256 KiB of 910A / 310P3, not the 192 KiB of 910B2. There CANN's tiling
    single-buffers the row (before: the fusion was refused outright, so the profiles disagreed); the fusion still
    pays, the kernel says which strategy it runs, and it costs more than with a UB that holds it double
    buffered."""
    cand = layernorm_decomposition(12288)
    b2 = decide(cand, specs["Ascend910B2"])
    assert b2.fuse and b2.feasible and b2.launches_saved == 8
    fused = b2.fused[0]
    assert fused.tile is not None and fused.tile.strategy == "single-buffered" and fused.tile.depth == 1
    assert "single-buffered" in b2.tile
    assert any("needs 240 KiB of UB, more than the 192 KiB on Ascend910B2" in n and "single-buffered" in n
               for n in fused.notes)
    roomy = decide(cand, dataclasses.replace(specs["Ascend910B2"], ub_bytes=256 * KiB))
    assert roomy.fused[0].tile.strategy == "" and roomy.t_fused_us < b2.t_fused_us
    # 310P3's LayerNorm takes no FRACTAL_NZ at a normalised dim of 4096 or more (cost_model.formats): the fused
    # norm runs between two TransData, which the decomposed ops (elementwise and reductions) do not need
    for name, saved in (("Ascend910A", 8), ("Ascend310P3", 6)):
        d = decide(cand, specs[name])
        assert d.fuse and d.launches_saved == saved and d.gain_us > 0 and d.fused[0].tile.strategy == ""
    assert [k.op_type for k in decide(cand, specs["Ascend310P3"]).fused[1:]] == ["TransData", "TransData"]


def test_a_row_too_long_for_ub_runs_split_row_two_pass(specs):
    """LayerNorm over 65536 fp16 elements: not even single-buffered does a row fit 192 KiB; the row is split in
    chunks, statistics then normalise, the input read twice."""
    spec = specs["Ascend910B2"]
    x, g = T((1, 64, 65536), F16), T((65536,), F16, True)
    op = OpWork("ln", "LayerNormalization", "", (x, g, g), (x,), {"axis": -1, "epsilon": 1e-5})
    e = estimate_op(op, spec)
    assert e.feasible and e.tile is not None and e.tile.strategy == "two-pass"
    assert e.tile.cols < 65536 and e.tile.ub_bytes_needed <= spec.ub_bytes
    assert e.gm_bytes_read == 2 * x.nbytes + 2 * g.nbytes
    assert any("two-pass" in n for n in e.notes) and "two-pass" in e.tile.describe()


def test_conv_bn_relu_fused(specs):
    for name in PROFILES:
        d = decide(conv_bn_relu(), specs[name])
        assert d.fuse and d.launches_saved == 2 and d.gm_bytes_saved > 0
        assert d.reason.startswith("fused: saves 2 kernel launches and ")


@pytest.mark.parametrize("name", PROFILES)
def test_conv_bn_folding_is_always_accepted(specs, name):
    spec = specs[name]
    shapes = [(3, 32, 224, 3, 2, 1), (32, 32, 112, 3, 1, 32), (64, 64, 56, 3, 1, 1), (64, 256, 56, 1, 1, 1),
              (512, 512, 7, 3, 1, 1), (16, 16, 8, 1, 1, 1), (96, 96, 14, 3, 2, 96), (1024, 2048, 14, 1, 2, 1)]
    for dtype in (F32, F16):
        for c_in, c_out, hw, k, stride, group in shapes:
            c = conv(c_in, c_out, hw, k, stride, group, dtype)
            folded = conv(c_in, c_out, hw, k, stride, group, dtype, bias=True)
            d = decide(FusionCandidate("conv_bn_act", (c, bn(c.outputs[0])), (folded,)), spec)
            assert d.fuse and d.gain_us > 0 and d.launches_saved == 1, (c_in, c_out, hw, k, dtype, d.reason)


@pytest.mark.parametrize("name", PROFILES)
def test_fused_attention_keeps_scores_off_gm(specs, name):
    d = decide(attention(1024), specs[name])
    scores_bytes = 16 * 1024 * 1024 * 2
    assert d.fuse and d.gm_bytes_saved > 4 * scores_bytes
    assert d.fused[0].gm_bytes < scores_bytes
    assert (d.fused[0].l2_handoff_bytes > 0) == (specs[name].cube_to_vector_path == "l2")


def test_forced_fusion_says_why_the_model_refused(specs):
    d = decide(matmul_layernorm(16384), specs["Ascend910B2"], force=True)
    assert d.fuse and d.forced and not d.feasible
    assert d.reason.startswith("forced: ") and "320 KiB of UB" in d.reason
    d = decide(matmul_layernorm(1024), specs["Ascend910A"], force=True)
    assert d.fuse and d.forced and "starved" in d.reason
    d = decide(matmul_layernorm(1024), specs["Ascend910B2"], force=True)
    assert d.fuse and not d.forced


# ---- records --------------------------------------------------------------------------------------

def test_records_are_plain_and_json_safe(specs):
    spec = specs["Ascend910B2"]
    d = decide(conv_bn_relu(), spec)
    assert isinstance(d, FusionDecision) and all(isinstance(k, KernelEstimate) for k in d.unfused + d.fused)
    doc = json.loads(json.dumps(d.to_dict()))
    for key in ("pattern", "fuse", "feasible", "forced", "reason", "t_unfused_us", "t_fused_us", "gain_us",
                "gm_bytes_saved", "launches_saved", "unfused", "fused"):
        assert key in doc
    k = doc["fused"][0]
    for key in ("op_type", "name", "flops", "cube_cycles", "vector_cycles", "gm_bytes_read", "gm_bytes_written",
                "l2_handoff_bytes", "t_mte2_us", "t_compute_us", "t_mte3_us", "t_launch_us", "t_total_us",
                "bound_by", "tile", "ub_bytes_needed", "feasible", "infeasible_reason"):
        assert key in k
    assert k["tile"]["m"] % 16 == 0 and k["tile"]["summary"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.fuse = False  # type: ignore[misc]


def test_views_cost_nothing_and_unknown_ops_never_crash(specs):
    spec = specs["Ascend910B2"]
    x = T((1, 128, 768), F16)
    for op_type in ("Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten", "Shape", "Constant"):
        e = estimate_op(OpWork("v", op_type, "", (x,), (x,), {}), spec)
        assert e.t_total_us == 0 and e.launches == 0 and e.gm_bytes == 0 and e.kind == "view"
    e = estimate_op(OpWork("w", "MysteryOp", "com.example", (x, None), (x,), {"k": [1, 2]}), spec)
    assert e.kind == "generic" and e.launches == 1 and e.gm_bytes == 2 * x.nbytes and "not modeled" in e.notes[0]
    e = estimate_op(OpWork("bad", "MatMul", "", (T((), F16), None), (T((), F16),), {}), spec)
    assert e.kind == "generic" and "not understood" in e.notes[0]


def test_estimate_ops_totals_and_breakdown(specs):
    spec = specs["Ascend910B2"]
    cand = matmul_layernorm(1024)
    ops = list(cand.unfused) + [OpWork("r", "Reshape", "", (cand.unfused[0].outputs[0],),
                                       (cand.unfused[0].outputs[0],), {})]
    total = estimate_ops(ops, spec)
    assert isinstance(total, ModelEstimate)
    parts = [estimate_op(op, spec) for op in ops]
    assert total.time_us == pytest.approx(sum(p.t_total_us for p in parts))
    assert total.gm_bytes == sum(p.gm_bytes for p in parts) and total.launches == 2
    assert set(total.by_op_type) == {"MatMul", "LayerNormalization", "Reshape"}
    assert total.by_op_type["MatMul"]["count"] == 1
    doc = json.loads(json.dumps(total.to_dict(include_kernels=True)))
    assert len(doc["kernels"]) == 3 and doc["profile"] == "Ascend910B2"


def test_split_parts_charge_the_l2_hand_off(specs):
    a, b = T((1, 512, 1024), F16), T((1024, 4096), F16, True)
    op = OpWork("ffn", "FusedMatMul", "npufuse", (a, b, T((4096,), F16, True)), (T((1, 512, 4096), F16),),
                {"epilogue": ["bias", "gelu"]})
    on_b2, on_a = estimate_op(op, specs["Ascend910B2"]), estimate_op(op, specs["Ascend910A"])
    assert on_b2.l2_handoff_bytes == 512 * 4096 * 2 and on_b2.handoff_cycles > 0
    assert on_a.l2_handoff_bytes == 0 and on_a.handoff_cycles == 0
    assert on_b2.vector_cycles > 0 and on_b2.kind == "cube+vector"


# ---- defects of the review (issue 11) -------------------------------------------------------------

@pytest.mark.parametrize("name", PROFILES)
def test_gemm_is_never_faster_than_the_gm_floor_of_the_cores_it_runs_on(specs, name):
    """Every operand byte is read from GM at least once through the MTE2 of a core that runs: a GEMM on c cores
    cannot beat bytes / (c x the per-core GM read rate). A GEMM of one 16 x 16 output tile runs on one core
    (the bug divided its first reads by all the chip's cores), unless split-K spreads its k over more."""
    spec = specs[name]
    one = estimate_op(matmul(16, 16, 256), spec)    # one output tile, k too short to split: one core
    assert one.cores_used == 1
    for e in (one, estimate_op(matmul(16, 16, 65536), spec), estimate_op(matmul(32, 48, 4096), spec)):
        floor_us = e.gm_bytes_read / (e.cores_used * spec.gm_read_bytes_per_cycle_per_core * spec.clock_hz) * 1e6
        assert e.t_total_us - e.t_launch_us >= floor_us * 0.999, (e.cores_used, e.notes)


def test_split_k_spreads_a_deep_narrow_gemm_over_idle_cores(specs):
    spec = specs["Ascend910B2"]
    e = estimate_op(matmul(16, 16, 65536), spec)
    assert e.cores_used > 1 and any("split-K" in n for n in e.notes)
    assert e.gm_bytes_written == 16 * 16 * 4 * e.cores_used     # fp32 partial sums, one set per core


def _fused_matmul(epilogue: list[str], bias: bool = True, hidden: int = 4096, norm: bool = False) -> OpWork:
    a, b, y = T((1, 512, 1024), F16), T((1024, hidden), F16, True), T((1, 512, hidden), F16)
    ins = (a, b, T((hidden,), F16, True) if bias else None)
    if norm:
        ins += (T((hidden,), F16, True), T((hidden,), F16, True))
    return OpWork("fmm", "FusedMatMul", "npufuse", ins, (y,), {"epilogue": epilogue, "epsilon": 1e-5})


@pytest.mark.parametrize("name", PROFILES)
def test_the_bias_is_added_by_fixpipe_not_held_in_ub(specs, name):
    """MatMul + bias: no Vector work; with a norm epilogue, only gamma and beta sit in UB beside the rows."""
    spec = specs[name]
    e = estimate_op(_fused_matmul(["bias"]), spec)
    assert e.vector_cycles == 0 and e.l2_handoff_bytes == 0 and e.kind == "cube"
    with_bias = estimate_op(_fused_matmul(["bias", "layernorm"], norm=True), spec)
    without = estimate_op(_fused_matmul(["layernorm"], bias=False, norm=True), spec)
    assert with_bias.epilogue_tile is not None and without.epilogue_tile is not None
    assert with_bias.epilogue_tile.ub_bytes_needed == without.epilogue_tile.ub_bytes_needed
    assert with_bias.epilogue_tile.rows == without.epilogue_tile.rows


def test_fixpipe_applies_relu_on_910b(specs):
    """MatMul + bias + ReLU on 910B: FixPipe adds the bias and applies the ReLU on the way out of L0C, so the
    kernel costs what MatMul + bias costs (no Vector work, no L2 hand-off). Coupled parts keep the Vector ReLU."""
    spec = specs["Ascend910B2"]
    relu, plain = estimate_op(_fused_matmul(["bias", "relu"]), spec), estimate_op(_fused_matmul(["bias"]), spec)
    assert relu.l2_handoff_bytes == 0 and relu.handoff_cycles == 0 and relu.vector_cycles == 0
    assert relu.t_total_us == pytest.approx(plain.t_total_us)
    assert any("FixPipe" in n for n in relu.notes)
    gelu = estimate_op(_fused_matmul(["bias", "gelu"]), spec)           # GELU is Vector work: handed off
    assert gelu.l2_handoff_bytes > 0 and gelu.vector_cycles > 0
    fc = estimate_op(conv(64, 64, 56, dtype=F16, bias=True, op_type="FusedConv", activation="Relu"), spec)
    assert fc.l2_handoff_bytes == 0 and fc.vector_cycles == 0
    on_a = estimate_op(_fused_matmul(["bias", "relu"]), specs["Ascend910A"])
    assert on_a.vector_cycles > 0


@pytest.mark.parametrize("dtype, k0", [(F16, 16), (F32, 8), ("int8", 32), ("bfloat16", 16)])
def test_cube_k0_is_32_bytes_of_the_input_dtype(specs, dtype, k0):
    """The Cube's fractal is 16 x k0 x 16 with k0 = 32 bytes / itemsize (was MACs per cycle / 256: fp32 got 4)."""
    spec = specs["Ascend910B2"]
    k = 250                                       # short enough that split-K does not apply; not a multiple of 8
    e = estimate_op(matmul(256, 256, k, dtype), spec)
    assert e.tile is not None and e.tile.k % k0 == 0 and e.tile.k_l1 % k0 == 0
    # the MAC rate still sets the time: one fractal costs 16*16*k0 / (MACs per cycle), k padded up to k0
    fractal_cycles = spec.cube_block ** 2 * k0 / spec.cube_macs_per_cycle(dtype)
    tiles = -(-256 // e.tile.m) * -(-256 // e.tile.n)
    per_tile = -(-min(e.tile.m, 256) // 16) * -(-min(e.tile.n, 256) // 16) * -(-k // k0) * fractal_cycles
    assert e.cube_cycles == pytest.approx(-(-tiles // e.cores_used) * per_tile)


def test_fp32_cube_work_on_310p3_is_priced_as_fp16(specs):
    """310P3's Cube has no fp32 path; ATC runs fp32 MatMul/Conv in fp16: the Cube time is fp16's, with a note
    (before: a quarter of the fp16 rate)."""
    spec = specs["Ascend310P3"]
    f32, f16 = estimate_op(matmul(2048, 2048, 2048, F32), spec), estimate_op(matmul(2048, 2048, 2048, F16), spec)
    assert f32.cube_cycles == pytest.approx(f16.cube_cycles, rel=0.05)
    assert any("priced as float16" in n for n in f32.notes) and not any("priced as" in n for n in f16.notes)
    assert f32.gm_bytes_read >= f16.gm_bytes_read      # the bytes in GM stay fp32
    on_b2 = estimate_op(matmul(2048, 2048, 2048, F32), specs["Ascend910B2"])
    assert on_b2.cube_cycles > 3 * estimate_op(matmul(2048, 2048, 2048, F16), specs["Ascend910B2"]).cube_cycles
    c32 = estimate_op(conv(64, 64, 56, dtype=F32), spec)
    assert any("priced as float16" in n for n in c32.notes)


def test_shape_arithmetic_runs_on_the_host(specs):
    """Shape -> Gather -> Unsqueeze -> Concat on int64 shape tensors: ATC computes it on the host, so no device
    time and no launch (before: Gather and Concat were priced as device kernels, a launch each)."""
    spec = specs["Ascend910B2"]
    i64 = "int64"
    shape, idx, one = T((3,), i64), T((), i64, True), T((1,), i64)
    ops = [OpWork("g", "Gather", "", (shape, idx), (T((), i64),), {"axis": 0}),
           OpWork("u", "Unsqueeze", "", (T((), i64), T((1,), i64, True)), (one,), {}),
           OpWork("c", "Concat", "", (one, T((2,), i64, True)), (shape,), {"axis": 0}),
           OpWork("m", "Mul", "", (one, one), (one,), {}),
           OpWork("s", "Slice", "", (shape, one, one), (T((2,), i64),), {})]
    for op in ops:
        e = estimate_op(op, spec)
        assert e.t_total_us == 0 and e.launches == 0 and e.gm_bytes == 0, op.op_type
        assert e.op_type in ("Unsqueeze",) or any("host" in n for n in e.notes), op.op_type
    total = estimate_ops(ops, spec)
    assert total.time_us == 0 and total.launches == 0
    # the same ops on data are device kernels: a float Gather, an int64 Concat of token ids, a big int64 Add
    emb = OpWork("e", "Gather", "", (T((30522, 768), F16, True), T((1, 512), i64)), (T((1, 512, 768), F16),), {})
    ids = OpWork("c", "Concat", "", (T((1, 512), i64), T((1, 1), i64)), (T((1, 513), i64),), {"axis": 1})
    for op in (emb, ids, add(4096, i64)):
        assert estimate_op(op, spec).launches == 1


def _matmul_relu(m: int, n: int, k: int) -> FusionCandidate:
    a, b, y = T((m, k), F16), T((k, n), F16, True), T((m, n), F16)
    mm = OpWork("mm", "MatMul", "", (a, b), (y,), {})
    relu = OpWork("relu", "Relu", "", (y,), (y,), {})
    fused = OpWork("fmm", "FusedMatMul", "npufuse", (a, b), (y,), {"epilogue": ["relu"]})
    return FusionCandidate("matmul_epilogue", (mm, relu), (fused,))


def test_the_margin_is_taken_of_the_time_at_stake(specs):
    """A deep GEMM + ReLU: fusing saves the ReLU kernel, a few % of the GEMM's time. The GEMM's Cube work is on
    both sides (the fused kernel is the GEMM plus an epilogue), so its time, and its modeling error, cannot make
    the fusion a loss: the margin is taken of the time at stake, the unfused time less that shared GEMM. Before,
    it was taken of the whole unfused time and this pure saving was refused; the threshold is exact either side."""
    spec = specs["Ascend910A"]
    cand = _matmul_relu(2048, 2048, 16384)
    d = decide(cand, spec)
    gemm, relu = d.unfused
    assert d.gain_us < 0.05 * d.t_unfused_us              # refused when the base was the whole unfused time
    assert d.t_at_stake_us == pytest.approx(d.t_unfused_us - min(gemm.t_total_us, d.fused[0].t_total_us))
    assert d.t_at_stake_us == pytest.approx(relu.t_total_us, rel=0.2)
    assert d.fuse and "above the 5% margin" in d.reason and "at stake" in d.reason
    assert gemm.bound_by == d.fused[0].bound_by and gemm.mte2_cycles == d.fused[0].mte2_cycles
    share = d.gain_us / d.t_at_stake_us
    tight = decide(cand, spec, margin=share * 1.01)
    assert not tight.fuse and tight.margin == pytest.approx(share * 1.01)
    assert "at stake" in tight.reason and "--margin" in tight.reason
    assert decide(cand, spec, margin=share * 0.99).fuse
    forced = decide(cand, spec, force=True, margin=share * 1.01)
    assert forced.fuse and forced.forced and "margin" in forced.reason


def test_cube_work_tiled_differently_is_not_shared(specs):
    """A MatMul + LayerNorm epilogue does the MatMul's MACs, but the norm needs whole rows in UB, so the fused GEMM
    runs a smaller tile and is modeled 45% slower than the plain MatMul on 910A (its MTE2 stage grows): that time
    is not the same on both sides and neither is its error. The whole unfused time stays at stake and the 3% gain
    is refused (pairing by MACs alone put only the LayerNorm at stake and fused it)."""
    d = decide(matmul_layernorm(256, m=4096, k=1024), specs["Ascend910A"])
    mm, fused = d.unfused[0], d.fused[0]
    assert mm.cube_peak_us == fused.cube_peak_us and mm.tile != fused.tile
    assert mm.bound_by == fused.bound_by == "mte2" and fused.mte2_cycles > mm.mte2_cycles
    assert fused.t_total_us > 1.2 * mm.t_total_us
    assert d.t_at_stake_us == d.t_unfused_us
    assert 0 < d.gain_us < 0.05 * d.t_unfused_us and not d.fuse
    assert "within the 5% margin" in d.reason


def test_without_shared_cube_work_the_whole_unfused_time_is_at_stake(specs):
    """Attention (the flash kernel's Cube work is both MatMuls', tiled differently) and a decomposed LayerNorm
    (Vector only) share no kernel with their unfused chain: the margin's base is the whole unfused time."""
    spec = specs["Ascend910B2"]
    for cand in (attention(512), layernorm_decomposition(1024)):
        d = decide(cand, spec)
        assert d.fuse and d.t_at_stake_us == d.t_unfused_us
        share = d.gain_us / d.t_unfused_us
        tight = decide(cand, spec, margin=min(share * 1.01, 0.999))
        assert not tight.fuse and "of the " in tight.reason and "unfused, within the" in tight.reason
    assert not decide(matmul_layernorm(1024), spec, margin=0.99).fuse

def test_conv_pads_cin_to_c0_per_kernel_position(specs):
    """The Cube reads a conv's input as NC1HWC0: Cin is padded to C0 (16 for fp16) at every kernel position, so a
    3-channel stem costs the Cube what a 16-channel one does, and 17 channels what 32 do (before, K = Cin x 49 was
    padded once, and the stem came out 5x cheaper than the Cube runs it)."""
    spec = specs["Ascend910B2"]

    def cube(c_in: int) -> float:
        return estimate_op(conv(c_in, 64, 224, k=7, stride=2, dtype=F16), spec).cube_cycles

    assert cube(3) == cube(16) and cube(17) == cube(32)
    assert cube(16) < cube(17)
    g = conv_gemm(conv(3, 64, 224, k=7, stride=2, dtype=F16), spec)
    assert (g.batch, g.k, g.n) == (1, 16 * 49, 64)
    assert g.a_bytes == 2 * 16 * 224 * 224     # the activations in GM are NC1HWC0 too
    fp32_310p = conv_gemm(conv(3, 64, 224, k=7, stride=2, dtype=F32), specs["Ascend310P3"])
    assert fp32_310p.k == 16 * 49               # 310P3 runs fp32 Cube work as fp16: C0 = 16


@pytest.mark.parametrize("c_in,group,expect", [
    (64, 64, (4, 16 * 9, 16)),      # depthwise: 16 channels per block-diagonal GEMM, ceil(64 / 16) of them
    (128, 32, (8, 16 * 9, 16)),     # ResNeXt-like, 4 channels per group: 4 groups share a C0 block
    (8, 8, (1, 16 * 9, 16)),        # fewer groups than C0: one block, padded
    (256, 2, (2, 128 * 9, 128)),    # wide groups: no enlargement
])
def test_grouped_conv_is_enlarged_as_cann_tiles_it(specs, c_in, group, expect):
    """Groups share C0 blocks as CANN's conv tiling enlarges them (mag = min(lcm(lcm(cin_g, C0) / cin_g,
    lcm(cout_g, 16) / cout_g), groups)): a depthwise conv is ceil(C / 16) GEMMs with K = 16 x kernel positions,
    not C GEMMs with K = 9 (priced before at 16 x 16 fractals each, about twice what the Cube runs)."""
    spec = specs["Ascend910B2"]
    g = conv_gemm(conv(c_in, c_in, 56, k=3, group=group, dtype=F16), spec)
    assert (g.batch, g.k, g.n) == expect


def test_conv_c0_follows_the_cube_dtype(specs):
    """C0 is the Cube's k0: 32 int8 channels, 8 fp32 channels on 910B2 (which runs fp32 on the Cube), 16 on 310P3
    (which runs fp32 as fp16); the output's GM bytes are Cout padded to 16 (NC1HWC0)."""
    int8 = conv_gemm(conv(3, 64, 56, k=3, dtype="int8"), specs["Ascend910B2"])
    assert int8.k == 32 * 9
    assert conv_gemm(conv(3, 64, 56, k=3, dtype=F32), specs["Ascend910B2"]).k == 8 * 9
    assert conv_gemm(conv(3, 64, 56, k=3, dtype=F32), specs["Ascend310P3"]).k == 16 * 9
    odd = conv(64, 1000, 7, k=1, dtype=F16)
    assert conv_gemm(odd, specs["Ascend910B2"]).out_bytes == 2 * 1008 * 7 * 7
