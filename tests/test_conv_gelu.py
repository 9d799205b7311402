"""FusedConv's GELU epilogue and the BatchNorm a Conv absorbs from before it (issue 23).

GELU after a Conv (ConvNeXtV2, EfficientFormerV2, RepViT, FastViT, SwiftFormer): every form the exporters write
(the erf and tanh decompositions, ONNX's Gelu at opset 20, x * sigmoid(1.702 x)), fused whether the gelu pattern made
it one op in phase 0 or not; a GELU whose input something else reads stays out. A lone BN before an unpadded Conv
folds into the conv's input channels; before a padded Conv only with a zero shift (else the near-miss
bn-before-padded-conv); a BN no op can take is named. Numerics against onnxruntime on the original graph; the kernel
record, the cost recipe and the census count of the new epilogue."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from builders import random_feeds, with_output_shapes
from onnx import helper, numpy_helper

from npufuse.cost_model import OpWork, TensorInfo
from npufuse.cost_model.estimate import estimate_op
from npufuse.fusion.census import fusion_census, result_counts
from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.npu_model.ascend_kernels import region_kernel
from npufuse.npu_model.spec import load_profile
from npufuse.patterns import PATTERNS, kernels
from npufuse.patterns.conv_bn_act import FUSED_CONV, fold_input_bn
from npufuse.verify.compare import compare

CIN, COUT, HW = 4, 6, 6
NO_GELU_PATTERN = [p for p in PATTERNS if p.name != "gelu"]


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _gelu_nodes(form: str, x: str, y: str, inits: list, dtype) -> list[onnx.NodeProto]:
    """GELU of x as the exporters write it: erf (TorchScript's nn.GELU), tanh (gelu_new), quick (CLIP), std and
    std_tanh (ONNX Gelu, dynamo at opset 20)."""
    def c(name: str, v: float) -> str:
        inits.append(numpy_helper.from_array(np.array(v, dtype), name))
        return name
    if form == "std":
        return [helper.make_node("Gelu", [x], [y], name="gelu")]
    if form == "std_tanh":
        return [helper.make_node("Gelu", [x], [y], name="gelu", approximate="tanh")]
    if form == "quick":
        return [helper.make_node("Mul", [x, c("k", 1.702)], ["kx"], name="q_scale"),
                helper.make_node("Sigmoid", ["kx"], ["s"], name="q_sig"),
                helper.make_node("Mul", [x, "s"], [y], name="q_mul")]
    if form == "erf":
        head = [helper.make_node("Div", [x, c("sqrt2", math.sqrt(2.0))], ["arg"], name="g_div"),
                helper.make_node("Erf", ["arg"], ["t"], name="g_erf")]
    else:   # tanh
        head = [helper.make_node("Pow", [x, c("three", 3.0)], ["x3"], name="g_pow"),
                helper.make_node("Mul", ["x3", c("cubic", 0.044715)], ["cx3"], name="g_cubic"),
                helper.make_node("Add", [x, "cx3"], ["inner"], name="g_inner"),
                helper.make_node("Mul", ["inner", c("k", math.sqrt(2.0 / math.pi))], ["arg"], name="g_scale"),
                helper.make_node("Tanh", ["arg"], ["t"], name="g_tanh")]
    return head + [helper.make_node("Add", ["t", c("one", 1.0)], ["onep"], name="g_add"),
                   helper.make_node("Mul", [x, "onep"], ["xm"], name="g_mul"),
                   helper.make_node("Mul", ["xm", c("half", 0.5)], [y], name="g_half")]


def conv_model(*, gelu: str | None = "erf", bn_after: bool | str = False, bn_before: bool = False, pads: int = 0,
               kernel: int = 1, group: int = 1, zero_shift: bool = False, bn_extra_reader: bool = False,
               conv_extra_reader: bool = False, dtype=np.float32, opset: int = 17, before_op: str | None = "Relu",
               cout: int = COUT, seed: int = 0) -> onnx.ModelProto:
    """X -> [Relu] -> [BN] -> Conv -> [BN] -> [GELU] -> Y, weights and statistics non-trivial."""
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [numpy_helper.from_array((rng.standard_normal((cout, CIN // group, kernel, kernel)) * 0.4).astype(dtype),
                                     "W"),
             numpy_helper.from_array(rng.standard_normal(cout).astype(dtype), "B")]
    nodes, outputs, cur = [], [], "X"
    if before_op:   # what feeds the BN: not a Conv, Gemm or MatMul (RepViT's Add, SwiftFormer's residual)
        nodes.append(helper.make_node(before_op, [cur], ["pre"], name="pre"))
        cur = "pre"

    def bn(name: str, x: str, c: int, training: bool = False) -> str:
        gamma, var = rng.uniform(0.5, 1.5, c), rng.uniform(0.2, 2.0, c)
        # a zero shift: beta = mean * s, exactly 0 only with both 0 (a freshly initialised BN's, say)
        mean, beta = (np.zeros(c), np.zeros(c)) if zero_shift else (rng.standard_normal(c), rng.standard_normal(c))
        for k, v in (("gamma", gamma), ("beta", beta), ("mean", mean), ("var", var)):
            inits.append(numpy_helper.from_array(v.astype(dtype), f"{name}_{k}"))
        nodes.append(helper.make_node("BatchNormalization", [x] + [f"{name}_{k}" for k in ("gamma", "beta", "mean",
                                                                                         "var")],
                                      [f"{name}_out"] + ([f"{name}_rm", f"{name}_rv"] if training else []), name=name,
                                      epsilon=1e-5, **({"training_mode": 1} if training else {})))
        return f"{name}_out"
    if bn_before:
        cur = bn("bn_in", cur, CIN)
        if bn_extra_reader:
            nodes.append(helper.make_node("Neg", [cur], ["bn_side"], name="bn_side"))
            outputs.append(helper.make_tensor_value_info("bn_side", elem, None))
    nodes.append(helper.make_node("Conv", [cur, "W", "B"], ["c"], name="conv", kernel_shape=[kernel, kernel],
                                  pads=[pads] * 4, group=group))
    cur = "c"
    if bn_after:
        cur = bn("bn_out", cur, cout, training=bn_after == "training")
    if conv_extra_reader:
        nodes.append(helper.make_node("Neg", [cur], ["side"], name="side"))
        outputs.append(helper.make_tensor_value_info("side", elem, None))
    if gelu is not None:
        nodes += _gelu_nodes(gelu, cur, "g", inits, dtype)
        cur = "g"
    nodes.append(helper.make_node("Identity", [cur], ["Y"], name="out"))
    outputs.insert(0, helper.make_tensor_value_info("Y", elem, None))
    g = helper.make_graph(nodes, "conv_gelu", [helper.make_tensor_value_info("X", elem, [2, CIN, HW, HW])], outputs,
                          inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                                                ir_version=IR_VERSION))


def _same_outputs(original: onnx.ModelProto, optimized: onnx.ModelProto, rtol: float = 1e-5) -> None:
    feeds = random_feeds(original)
    want, got = run(original, feeds), run(optimized, feeds)
    for name, w in want.items():
        c = compare(name, got[name], w)
        assert c.ok and c.min_passing_rtol <= rtol, c.detail


def _fused_convs(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "FusedConv"]


# ---- Conv -> GELU -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form,opset,approximate", [
    ("erf", 17, "none"), ("tanh", 17, "tanh"), ("quick", 17, "quick"), ("erf", 9, "none"), ("tanh", 7, "tanh"),
    ("std", 20, "none"), ("std_tanh", 20, "tanh"), ("erf", 20, "none")])
@pytest.mark.parametrize("bn_after", [False, True])
@pytest.mark.parametrize("gelu_pattern", [True, False], ids=["after-gelu-pattern", "decomposed"])
def test_conv_gelu_fuses_into_fusedconv(form: str, opset: int, approximate: str, bn_after: bool,
                                        gelu_pattern: bool) -> None:
    if not gelu_pattern and form.startswith("std"):
        pytest.skip("ONNX's Gelu is one op already")
    model = conv_model(gelu=form, bn_after=bn_after, opset=opset, kernel=3, pads=1)
    res = optimize(model, options=OptimizeOptions(patterns=list(PATTERNS) if gelu_pattern else NO_GELU_PATTERN))
    [fc] = _fused_convs(res.model)
    a = _attrs(fc)
    assert a["activation"] == b"Gelu" and a["approximate"] == approximate.encode()
    assert [n.op_type for n in res.model.graph.node] == ["Relu", "FusedConv", "Identity"]
    label = "Gelu" if approximate == "none" else f"Gelu({approximate})"
    assert [r.match.kind for r in res.applied if r.match.pattern == "conv_bn_act"] == [f"FusedConv[{label}]"]
    assert res.model_check is not None and res.model_check.ok and not res.rolled_back
    assert unaccounted(res) == []
    _same_outputs(model, res.model)
    onnx.checker.check_model(res.model, full_check=True)
    fn = next(f for f in res.model.functions if f.name == "FusedConv")
    assert ("Gelu" in [n.op_type for n in fn.node]) == (opset >= 20 and approximate != "quick")


def test_fp16_conv_gelu_fuses() -> None:
    model = conv_model(gelu="erf", dtype=np.float16, bn_after=True)
    res = optimize(model, options=OptimizeOptions())
    [fc] = _fused_convs(res.model)
    assert _attrs(fc)["activation"] == b"Gelu" and _attrs(fc)["affine"] == 1   # the BN kept exact in float32
    assert res.model_check.ok and not res.rolled_back


@pytest.mark.parametrize("form", ["erf", "std"])
def test_a_gelu_whose_input_is_read_elsewhere_does_not_fuse(form: str) -> None:
    model = conv_model(gelu=form, conv_extra_reader=True, opset=20 if form == "std" else 17)
    res = optimize(model, options=OptimizeOptions())
    assert not _fused_convs(res.model)
    [f] = [f for f in res.refusals if f.pattern == "conv_bn_act"]
    assert f.reason == "shared-intermediate" and "'side'" in f.detail and "GELU" in f.detail
    _same_outputs(model, res.model)


@pytest.mark.parametrize("approximate", ["none", "tanh", "quick"])
def test_the_reference_kernel_is_conv_then_that_gelu(approximate: str) -> None:
    """The epilogue really is the named GELU: each approximation differs from the others on large inputs, so a
    kernel that mixed them up would fail here (and the bodies are checked against it in test_body_opsets)."""
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal((1, 3, 5, 5)) * 3, rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(4)
    x, w, b = x.astype(np.float32), w.astype(np.float32), b.astype(np.float32)
    got = FUSED_CONV.reference([x, w, b], {"pads": [1, 1, 1, 1], "activation": "Gelu", "approximate": approximate})[0]
    c = kernels.conv(x, w, b, pads=[1, 1, 1, 1]).astype(np.float64)
    want = {"none": kernels.gelu(c), "tanh": kernels.gelu(c, "tanh"),
            "quick": c * kernels.sigmoid(1.702 * c)}
    np.testing.assert_allclose(got, want[approximate].astype(np.float32), rtol=1e-6, atol=1e-6)
    for other, v in want.items():
        if other != approximate:
            assert np.max(np.abs(got - v)) > 1e-4


def test_the_gelu_epilogue_is_priced_as_fusedmatmuls_and_mapped_to_atcs_ub_fusion() -> None:
    spec = load_profile("Ascend910B2")
    x, w, y = TensorInfo((1, 64, 56, 56), "float16"), TensorInfo((64, 64, 1, 1), "float16"), \
        TensorInfo((1, 64, 56, 56), "float16")
    times = {}
    for approximate in ("none", "tanh", "quick"):
        est = estimate_op(OpWork("c", "FusedConv", "npufuse", (x, w), (y,),
                                 {"activation": "Gelu", "approximate": approximate}), spec)
        assert not any("not modeled" in n for n in est.notes), est.notes
        times[approximate] = est.t_total_us
    plain = estimate_op(OpWork("c", "Conv", "", (x, w), (y,), {}), spec)
    assert all(t >= plain.t_total_us for t in times.values())
    for approximate, op in (("none", "Gelu"), ("tanh", "Gelu"), ("quick", "FastGelu")):
        node = helper.make_node("FusedConv", ["x", "w", "b"], ["y"], name="fc", domain="npufuse", activation="Gelu",
                                approximate=approximate, kernel_shape=[1, 1])
        rec = region_kernel([node], chip="ascend910b")
        assert rec["op"] == "Conv2D" and rec["available"] and rec["problem"] is None
        assert rec["epilogue"][-1]["op"] == op and rec["fusion"] == f"ATC UB fusion: Conv2D + {op}"
        assert any("TbeCommonRules0FusionPass" in n for n in rec["notes"])
        assert any("tanh form" in n for n in rec["notes"]) == (approximate == "none")


def test_the_census_counts_a_conv_gelu_as_a_gelu_and_a_conv_gelu() -> None:
    res = optimize(conv_model(gelu="erf", bn_after=True), options=OptimizeOptions())
    assert fusion_census(res.model)["gelu"] == 1 and fusion_census(res.model)["conv_gelu"] == 1
    counts = result_counts(res)
    assert (counts["gelu"], counts["conv_gelu"], counts["conv_epilogue"], counts["batchnorm"]) == (1, 1, 0, 1)


# ---- BatchNormalization before a Conv ---------------------------------------------------------------------------

@pytest.mark.parametrize("kernel,pads,group,zero_shift", [
    (1, 0, 1, False), (3, 0, 1, False), (3, 0, 2, False), (3, 0, CIN, False), (3, 1, 1, True), (3, 1, 2, True)],
    ids=["1x1", "3x3-valid", "3x3-grouped", "3x3-depthwise", "3x3-padded-zero-shift", "grouped-padded-zero-shift"])
@pytest.mark.parametrize("gelu", [None, "erf"])
def test_a_batchnorm_before_a_conv_folds_into_its_input_channels(kernel: int, pads: int, group: int,
                                                                 zero_shift: bool, gelu: str | None) -> None:
    model = conv_model(gelu=gelu, bn_before=True, kernel=kernel, pads=pads, group=group, zero_shift=zero_shift,
                       cout=2 * CIN if group == CIN else COUT)
    res = optimize(model, options=OptimizeOptions())
    assert "BatchNormalization" not in {n.op_type for n in res.model.graph.node}
    [r] = [r for r in res.applied if r.match.pattern == "conv_bn_act"]
    assert r.match.kind == ("Conv(input BN folded)" if gelu is None else "FusedConv[input BN,Gelu]")
    assert "bn_in" in r.match.nodes
    assert res.model_check is not None and res.model_check.ok and not res.rolled_back
    assert result_counts(res)["batchnorm"] == 1
    _same_outputs(model, res.model)


def test_fold_input_bn_is_the_conv_of_the_scaled_and_shifted_input() -> None:
    """Independent of the pattern: a grouped 3x3 conv of x * s + t (no padding) against the folded weights."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 4, 5, 5))
    w, b = rng.standard_normal((6, 2, 3, 3)), rng.standard_normal(6)
    s, t = rng.uniform(0.5, 2.0, 4), rng.standard_normal(4)
    want = kernels.conv(x * s[None, :, None, None] + t[None, :, None, None], w, b, group=2)
    w2, b2 = fold_input_bn(w, b, s, t, 2)
    np.testing.assert_allclose(kernels.conv(x, w2, b2, group=2), want, rtol=1e-10, atol=1e-10)
    # with padding the borders differ (why a non-zero shift before a padded conv is refused)
    padded = kernels.conv(x * s[None, :, None, None] + t[None, :, None, None], w, b, group=2, pads=[1, 1, 1, 1])
    assert not np.allclose(kernels.conv(x, w2, b2, group=2, pads=[1, 1, 1, 1]), padded)


@pytest.mark.parametrize("kwargs,reason,detail", [
    ({"kernel": 3, "pads": 1}, "bn-before-padded-conv", "zero padding"),
    ({"dtype": np.float16}, "bn-low-precision", "float16"),
    ({"bn_extra_reader": True}, "bn-without-conv", "no weights to fold it into"),
])
def test_a_batchnorm_before_a_conv_that_cannot_take_it_is_named(kwargs: dict, reason: str, detail: str) -> None:
    model = conv_model(gelu=None, bn_before=True, **kwargs)
    res = optimize(model, options=OptimizeOptions())
    assert "BatchNormalization" in {n.op_type for n in res.model.graph.node}
    [f] = [f for f in res.refusals if f.node == "bn_in"]
    assert (f.pattern, f.reason) == ("conv_bn_act", reason) and detail in f.detail, f.detail
    assert unaccounted(res) == []
    _same_outputs(model, res.model)


def test_a_batchnorm_between_two_convs_folds_into_the_one_before() -> None:
    """Conv -> BN -> Conv: the first conv's post-fold takes it (exact everywhere); the second leaves it alone."""
    model = conv_model(gelu=None, bn_before=True, before_op="Relu")
    # put a Conv in front of the BN: X -> Conv0 -> BN -> Conv
    g = model.graph
    rng = np.random.default_rng(9)
    g.initializer.append(numpy_helper.from_array((rng.standard_normal((CIN, CIN, 1, 1)) * 0.5).astype(np.float32),
                                                 "W0"))
    pre = next(n for n in g.node if n.name == "pre")
    pre.op_type, pre.input[:] = "Conv", ["X", "W0"]
    model = with_output_shapes(model)
    res = optimize(model, options=OptimizeOptions())
    [r] = [r for r in res.applied if "bn_in" in r.match.nodes]
    assert r.match.info["conv"] == "pre" and r.match.kind == "Conv(BN folded)"
    _same_outputs(model, res.model)


def test_a_batchnorm_before_a_conv_whose_chain_is_refused_is_named_by_that_refusal() -> None:
    """BN -> Conv -> BN(training): the conv's near-miss names the BN before it too (its own anchor left it to the
    conv), so it is not a silent refusal."""
    model = conv_model(gelu=None, bn_before=True, bn_after="training")
    res = optimize(model, options=OptimizeOptions())
    [f] = [f for f in res.refusals if f.pattern == "conv_bn_act"]
    assert f.reason == "bn-training-mode" and "bn_in" in f.nodes
    assert unaccounted(res) == []
