"""Conv -> BatchNormalization -> activation: positives, near-misses, numerics, function bodies."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from builders import conv_chain, ops, random_feeds
from onnx import helper, numpy_helper

from npufuse.patterns import kernels
from npufuse.fusion.engine import ROLLED_BACK, OptimizeOptions, optimize
from npufuse.patterns.conv_bn_act import FUSED_CONV, ConvBnActivation, batchnorm_affine, fold_into_conv
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

ACTIVATIONS = ["Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Silu"]


def _optimize(model: onnx.ModelProto, **kw):
    return optimize(model, options=OptimizeOptions(**kw))


def _assert_same_outputs(original: onnx.ModelProto, optimized: onnx.ModelProto, rtol: float = 1e-4) -> None:
    feeds = random_feeds(original)
    want, got = run(original, feeds), run(optimized, feeds)
    assert set(want) == set(got)
    for name in want:
        c = compare(name, got[name], want[name])
        assert c.ok, c.detail
        assert c.min_passing_rtol <= rtol


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("opset", [9, 13, 17])
def test_conv_bn_activation_fuses_into_fusedconv(act: str, opset: int) -> None:
    if act == "HardSwish" and opset < 14:
        pytest.skip("HardSwish exists from opset 14")
    model = conv_chain(act=act, opset=opset)
    res = _optimize(model)
    assert ops(res.model) == ["FusedConv"]
    node = res.model.graph.node[0]
    assert node.domain == "npufuse"
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["activation"] == act.encode()
    assert res.model_check is not None and res.model_check.ok
    assert [r.match.kind for r in res.applied] == [f"FusedConv[{act}]"]
    assert res.applied[0].check.ok
    _assert_same_outputs(model, res.model)
    onnx.checker.check_model(res.model, full_check=True)


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("group,cin,cout", [(1, 4, 6), (2, 4, 6), (4, 4, 4)], ids=["dense", "grouped", "depthwise"])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_ranks_groups_bias(rank: int, group: int, cin: int, cout: int, bias: bool) -> None:
    model = conv_chain(rank=rank, group=group, cin=cin, cout=cout, bias=bias, act="Relu", spatial=5)
    res = _optimize(model)
    assert ops(res.model) == ["FusedConv"]
    _assert_same_outputs(model, res.model)


def test_conv_bn_without_activation_becomes_plain_conv_with_folded_weights() -> None:
    model = conv_chain(act=None, conv_attrs={"strides": [2, 2]})
    res = _optimize(model)
    assert ops(res.model) == ["Conv", "Identity"]
    conv = res.model.graph.node[0]
    assert conv.domain == ""
    assert {i.name for i in res.model.graph.initializer}.isdisjoint({"scale", "bbias", "mean", "var"})
    assert {m.key: m.value for m in conv.metadata_props}["npufuse.replaced"] == "conv,bn"
    _assert_same_outputs(model, res.model)


def test_conv_activation_without_bn_fuses() -> None:
    model = conv_chain(bn=False, act="Silu")
    res = _optimize(model)
    assert ops(res.model) == ["FusedConv"]
    _assert_same_outputs(model, res.model)


def test_fp16_conv_bn_relu6() -> None:
    model = conv_chain(act="Clip", dtype=np.float16, opset=17)
    res = _optimize(model)
    assert ops(res.model) == ["FusedConv"]
    assert res.model_check.ok


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
@pytest.mark.parametrize("act", [None, "Relu"])
def test_low_precision_bn_is_kept_exact_as_a_float32_epilogue(dtype, act: str | None) -> None:
    """fp16/bf16: W and B stay the model's own bytes; the BN becomes float32 Scale/Shift inputs of FusedConv."""
    if dtype == "bfloat16":
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    model = conv_chain(act=act, dtype=dtype, opset=17)
    res = _optimize(model)
    assert ops(res.model) == ["FusedConv"] + (["Identity"] if act is None else [])
    node = res.model.graph.node[0]
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    assert a["affine"] == 1 and a.get("activation") == (act.encode() if act else None)
    inits = {i.name: i for i in res.model.graph.initializer}
    original = {i.name: i for i in model.graph.initializer}
    assert node.input[1] == "W" and inits["W"].SerializeToString() == original["W"].SerializeToString()
    assert node.input[2] == "B" and inits["B"].SerializeToString() == original["B"].SerializeToString()
    for name in node.input[4:6]:
        assert inits[name].data_type == onnx.TensorProto.FLOAT and list(inits[name].dims) == [6, 1, 1]
    assert res.model_check.ok and not res.rolled_back
    assert [r.match.kind for r in res.applied] == [f"FusedConv[BN{',' + act if act else ''}]"]


def test_fp16_bn_fold_near_cancellation_stays_within_fp16_error() -> None:
    """Found by the fuzzer (seed 20000, case 16666): the folded bias (~1.5) nearly cancels the conv output, so
    rounding W * scale to fp16 put the output 1.4e-3 from the unfused model's (tolerance 1e-3 + 1e-2 * |y|). Kept as
    an fp32 epilogue the fused model matches on every input; the folded form would not (checked here too)."""
    from pathlib import Path

    model = onnx.load(Path(__file__).parent / "fixtures" / "fuzz_regressions" / "conv_bn_fp16_cancellation.onnx")
    res = _optimize(model)
    assert [r.match.kind for r in res.applied] == ["FusedConv[BN]"] and res.model_check.ok
    # the folded alternative, built the way npufuse folded before
    g = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    conv, bn = model.graph.node[0], model.graph.node[1]
    s, t = batchnorm_affine(*(g[v].astype(np.float64) for v in bn.input[1:5]),
                            eps=float(helper.get_attribute_value(bn.attribute[0])))
    w_f, b_f = fold_into_conv(g[conv.input[1]], s, g[conv.input[2]].astype(np.float64) * s + t)
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    del folded.graph.initializer[:]
    folded.graph.initializer.extend([numpy_helper.from_array(w_f, "wf"), numpy_helper.from_array(b_f, "bf")])
    del folded.graph.node[:2]
    folded.graph.node.insert(0, helper.make_node("Conv", ["X", "wf", "bf"], [bn.output[0]], pads=[1, 1, 1, 1],
                                                 kernel_shape=[3, 3]))
    # 200 samples in one batch (the conv is per sample); the fuzzer's input stream for that case
    for m in (model, res.model, folded):
        m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 200
    rng = np.random.default_rng([20000, 16666, 1 << 20])
    feeds = {"X": rng.standard_normal((200, 3, 6, 6)).astype(np.float16)}
    want, got, old = run(model, feeds), run(res.model, feeds), run(folded, feeds)
    for name in want:
        c = compare(name, got[name], want[name])
        assert c.ok, c.detail
        per_sample = [compare(name, old[name][i], want[name][i]).ok for i in range(200)]
        folded_fails = per_sample.count(False)
    assert folded_fails > 0   # the fixture does discriminate: the old fold drifts on it


def test_fold_batchnorm_is_the_affine_map() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 2, 1, 1))
    b = rng.standard_normal(3)
    scale, beta, mean, var = rng.uniform(0.5, 2, 3), rng.standard_normal(3), rng.standard_normal(3), rng.uniform(0.1, 1, 3)
    s, t = batchnorm_affine(scale, beta, mean, var, 1e-5)
    wf, bf = fold_into_conv(w, s, b * s + t)
    x = rng.standard_normal(2)
    conv = w[:, :, 0, 0] @ x + b
    bn = (conv - mean) / np.sqrt(var + 1e-5) * scale + beta
    np.testing.assert_allclose(wf[:, :, 0, 0] @ x + bf, bn, rtol=1e-12)


def _append_affine(model: onnx.ModelProto, ops_consts: list[tuple[str, np.ndarray, bool]]) -> onnx.ModelProto:
    """Insert `op(cur, const)` nodes between the BN output "b" and the activation (const first if flagged)."""
    act = next(n for n in model.graph.node if n.name == "act")
    cur = "b"
    for i, (op, const, const_first) in enumerate(ops_consts):
        name = f"aff{i}_c"
        model.graph.initializer.append(numpy_helper.from_array(const.astype(np.float32), name))
        ins = [name, cur] if const_first else [cur, name]
        idx = list(model.graph.node).index(act)
        model.graph.node.insert(idx, helper.make_node(op, ins, [f"aff{i}"], name=f"aff{i}"))
        cur = f"aff{i}"
    act.input[0] = cur
    return model


def test_per_channel_affine_after_bn_folds_into_conv() -> None:
    rng = np.random.default_rng(4)
    model = _append_affine(conv_chain(act="Relu"), [
        ("Mul", rng.uniform(0.5, 2, (6, 1, 1)), False), ("Add", rng.standard_normal((1, 6, 1, 1)), True),
        ("Sub", np.array([0.3]), False), ("Div", rng.uniform(1, 2, (6, 1, 1)), False)])
    res = _optimize(model)
    assert ops(res.model) == ["FusedConv"]
    assert len(res.applied[0].match.nodes) == 7
    _assert_same_outputs(model, res.model)


@pytest.mark.parametrize("op,const,const_first", [
    ("Mul", np.ones((1, 6, 7, 7)), False),   # varies over space: not per channel
    ("Sub", np.ones((6, 1, 1)), True),       # c - x: only x - c is folded (kept simple on purpose)
    ("Div", np.ones((6, 1, 1)), True),       # c / x is not affine
])
def test_non_per_channel_ops_are_not_folded(op: str, const: np.ndarray, const_first: bool) -> None:
    model = _append_affine(conv_chain(act="Relu"), [(op, const, const_first)])
    res = _optimize(model)
    assert ops(res.model) == ["Conv", op, "Relu"]  # BN folded, the op and the Relu stay
    _assert_same_outputs(model, res.model)


# ---- near-misses: must not fuse ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,reason", [
    ({"training_mode": 1}, "bn-training-mode"),
    ({"bn_params_as_inputs": True}, "bn-nonconstant-params"),
    ({"weight_as_input": True}, "dynamic-weight"),
    ({"extra_conv_consumer": True}, "shared-intermediate"),
    ({"conv_out_is_graph_output": True}, "intermediate-is-output"),
])
def test_near_misses_do_not_fuse(kwargs: dict, reason: str) -> None:
    model = conv_chain(act="Relu", opset=17, **kwargs)
    res = _optimize(model)
    assert "BatchNormalization" in ops(res.model)
    assert "FusedConv" not in ops(res.model)
    assert reason in {f.reason for f in res.refusals}


def test_bn_output_used_as_graph_output_folds_bn_but_keeps_activation_separate() -> None:
    model = conv_chain(act="Relu", bn_out_is_graph_output=True)
    res = _optimize(model)
    assert ops(res.model) == ["Conv", "Relu"]
    _assert_same_outputs(model, res.model)


def test_activation_with_dynamic_clip_bound_is_not_fused() -> None:
    model = conv_chain(act="Clip", opset=17, bn=False)
    # make the upper bound a graph input: not a constant, so not an epilogue parameter
    inits = [t for t in model.graph.initializer if t.name != "clip_max"]
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)
    model.graph.input.append(helper.make_tensor_value_info("clip_max", onnx.TensorProto.FLOAT, []))
    res = _optimize(model, verify=False)
    assert "FusedConv" not in ops(res.model)


# ---- verification catches a wrong rewrite -----------------------------------------------------------

class _BrokenFold(ConvBnActivation):
    """Folds BN, then nudges one weight: a bug the verifier must catch."""

    def build(self, g, m):
        rep = super().build(g, m)
        w = numpy_helper.to_array(rep.initializers[0]).copy()
        w.flat[0] += 0.05
        rep.initializers[0] = numpy_helper.from_array(w, rep.initializers[0].name)
        return rep


def test_broken_rewrite_is_rolled_back_and_never_written() -> None:
    model = conv_chain(act="Relu")
    res = optimize(model, options=OptimizeOptions(patterns=[_BrokenFold()]))
    assert [r.status for r in res.records] == [ROLLED_BACK]
    assert res.records[0].check is not None and not res.records[0].check.ok
    assert ops(res.model) == ops(model)
    assert res.model_check is None  # nothing applied, nothing to compare
    _assert_same_outputs(model, res.model)


def test_input_model_is_not_modified() -> None:
    model = conv_chain(act="Relu")
    before = model.SerializeToString()
    _optimize(model)
    assert model.SerializeToString() == before


# ---- the fused op: reference kernel vs function body ------------------------------------------------

@pytest.mark.parametrize("act,params", [("Relu", {}), ("Clip", {"min": 0.0, "max": 6.0}), ("Clip", {"max": 1.0}),
                                        ("LeakyRelu", {"alpha": 0.2}), ("Sigmoid", {}),
                                        ("HardSigmoid", {"alpha": 0.3, "beta": 0.6}), ("HardSwish", {}), ("Silu", {})])
@pytest.mark.parametrize("opset", [9, 11, 13, 18])
def test_fusedconv_function_body_matches_reference_kernel(act: str, params: dict, opset: int) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 4, 6, 5)).astype(np.float32) * 3
    w = rng.standard_normal((6, 2, 3, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    attrs = dict(group=2, strides=[2, 1], pads=[1, 0, 1, 2], activation=act, **params)
    want = FUSED_CONV.reference([x, w, b], attrs)[0]
    node, fn = FUSED_CONV.make_node(["x", "w", "b"], ["y"], "fc", attrs, opset, onnx.TensorProto.FLOAT)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, want.shape)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("npufuse", 1)],
                          functions=[fn], ir_version=IR_VERSION)
    onnx.checker.check_model(m, full_check=True)
    got = run(m, {"x": x})["y"]
    c = compare("y", got, want)
    assert c.ok, c.detail
    raw = kernels.conv(x, w, b, group=2, strides=[2, 1], pads=[1, 0, 1, 2])
    assert not np.allclose(want, raw, atol=1e-3)  # the epilogue really ran


@pytest.mark.parametrize("act", [None, "Relu", "Silu"])
@pytest.mark.parametrize("residual", [False, True])
def test_fusedconv_affine_reference_applies_the_scale_and_shift(act: str | None, residual: bool) -> None:
    """affine=1 (fp16 BN kept as a float32 epilogue): the reference applies Scale and Shift per channel, in float32,
    before the residual and the activation. Its ONNX body is checked against it at opset 7 and the highest in
    tests/test_body_opsets.py (the FusedConv "affine" cases)."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((1, 4, 5, 5)) * 2).astype(np.float16)
    w = rng.standard_normal((6, 4, 3, 3)).astype(np.float16)
    b = rng.standard_normal(6).astype(np.float16)
    z = rng.standard_normal((1, 6, 5, 5)).astype(np.float16)
    scale = rng.uniform(0.5, 2.0, (6, 1, 1)).astype(np.float32)
    shift = rng.standard_normal((6, 1, 1)).astype(np.float32)
    attrs = dict(pads=[1, 1, 1, 1], affine=1, **({"activation": act} if act else {}),
                 **({"residual": 1} if residual else {}))
    got = FUSED_CONV.reference([x, w, b, z if residual else None, scale, shift], attrs)[0]
    c = kernels.conv(x, w, b, pads=[1, 1, 1, 1])
    c = (c.astype(np.float32) * scale + shift).astype(np.float16)
    if residual:
        c = c + z
    want = kernels.activation(act, c, {}) if act else c
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)
    without = FUSED_CONV.reference([x, w, b, z if residual else None, np.ones_like(scale), np.zeros_like(shift)],
                                   attrs)[0]
    assert not np.allclose(got.astype(np.float32), without.astype(np.float32), atol=1e-2)


# ---- Gemm -> BatchNormalization (Linear + BatchNorm1d) ------------------------------------------------

def gemm_bn_model(*, trans_b: int = 1, alpha: float = 1.0, beta: float = 1.0, bias: str = "vector",
                  relu: bool = False, training_mode: int = 0, weight_as_input: bool = False,
                  extra_consumer: bool = False, m: int = 4, k: int = 8, n: int = 6) -> onnx.ModelProto:
    rng = np.random.default_rng(11)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    inits = [numpy_helper.from_array(rng.uniform(0.5, 1.5, n).astype(np.float32), "scale"),
             numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "bbias"),
             numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "mean"),
             numpy_helper.from_array(rng.uniform(0.2, 2.0, n).astype(np.float32), "var")]
    inputs = [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, [m, k])]
    if weight_as_input:
        inputs.append(helper.make_tensor_value_info("B", onnx.TensorProto.FLOAT, list(b.shape)))
    else:
        inits.append(numpy_helper.from_array(b, "B"))
    gemm_in = ["A", "B"]
    if bias != "none":
        shape = {"vector": (n,), "scalar": (), "matrix": (m, n)}[bias]
        inits.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), "C"))
        gemm_in.append("C")
    nodes = [helper.make_node("Gemm", gemm_in, ["g"], name="gemm", transB=trans_b, alpha=alpha, beta=beta)]
    bn_out = ["b"] + (["rm", "rv"] if training_mode else [])
    nodes.append(helper.make_node("BatchNormalization", ["g", "scale", "bbias", "mean", "var"], bn_out, name="bn",
                                  epsilon=1e-5, **({"training_mode": 1} if training_mode else {})))
    outputs = []
    last = "b"
    if relu:
        nodes.append(helper.make_node("Relu", ["b"], ["r"], name="relu"))
        last = "r"
    if extra_consumer:
        nodes.append(helper.make_node("Neg", ["g"], ["side"], name="side"))
        outputs.append(helper.make_tensor_value_info("side", onnx.TensorProto.FLOAT, None))
    nodes.append(helper.make_node("Identity", [last], ["Y"], name="out"))
    outputs.insert(0, helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "gemm_bn", inputs, outputs, inits)
    from builders import with_output_shapes
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10))


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("bias", ["vector", "scalar", "none"])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (0.5, 2.0)])
def test_gemm_batchnorm_folds_into_the_gemm(trans_b: int, bias: str, alpha: float, beta: float) -> None:
    model = gemm_bn_model(trans_b=trans_b, bias=bias, alpha=alpha, beta=beta)
    res = _optimize(model)
    assert ops(res.model) == ["Gemm", "Identity"]
    assert [r.match.kind for r in res.applied] == ["Gemm(BN folded)"]
    _assert_same_outputs(model, res.model)


def test_gemm_batchnorm_relu_becomes_one_fused_matmul() -> None:
    """BN folds into the Gemm (phase 1); the Gemm's bias and the Relu then become its epilogue (phase 2)."""
    model = gemm_bn_model(relu=True)
    res = _optimize(model)
    assert ops(res.model) == ["FusedMatMul", "Identity"]
    _assert_same_outputs(model, res.model)


@pytest.mark.parametrize("kwargs,reason", [
    ({"training_mode": 1}, "bn-training-mode"),
    ({"weight_as_input": True}, "dynamic-weight"),
    ({"extra_consumer": True}, "shared-intermediate"),
    ({"bias": "matrix"}, "bias-shape"),
])
def test_gemm_batchnorm_near_misses(kwargs: dict, reason: str) -> None:
    res = _optimize(gemm_bn_model(**kwargs))
    assert "BatchNormalization" in ops(res.model)
    assert reason in {f.reason for f in res.refusals}


def test_batchnorm_after_a_concat_is_a_named_near_miss() -> None:
    """DenseNet's BN reads a Concat of earlier features: no conv weights to fold into, so nothing fuses and the
    near-miss says why (before, it was silent)."""
    rng = np.random.default_rng(0)
    c = 4
    stats = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in
             (("scale", rng.uniform(0.5, 1.5, c)), ("bias", rng.standard_normal(c)), ("mean", rng.standard_normal(c)),
              ("var", rng.uniform(0.5, 1.5, c)))]
    g = helper.make_graph(
        [helper.make_node("Concat", ["a", "b"], ["cat"], axis=1, name="concat"),
         helper.make_node("BatchNormalization", ["cat", "scale", "bias", "mean", "var"], ["bn"], name="bn"),
         helper.make_node("Relu", ["bn"], ["y"], name="relu")],
        "densenet_block", [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, 2, 5, 5]) for n in "ab"],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 5, 5])], stats)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    res = _optimize(model)
    assert not res.applied and "BatchNormalization" in ops(res.model)
    [r] = [r for r in res.refusals if r.pattern == "conv_bn_act"]
    assert (r.node, r.reason) == ("bn", "bn-without-conv") and "Concat 'concat'" in r.detail
