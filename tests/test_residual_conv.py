"""Conv -> [BN] -> residual Add -> [activation] into one FusedConv with the residual as its fourth input (issue 9):
positives, near-misses that must not fuse, numerics against onnxruntime, the function body, the cost model, the
Ascend kernel, and ResNets (onnx's light_resnet50 and the transformers exports)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import random_feeds, with_output_shapes
from onnx import TensorProto, helper, numpy_helper

from npufuse.patterns import kernels
from npufuse.cost_model import estimate_op
from npufuse.cost_model.workload import OpWork, TensorInfo
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import attributes
from npufuse.ir.modelio import load_model
from npufuse.npu_model.ascend_kernels import kernel_label
from npufuse.npu_model.spec import load_profile
from npufuse.patterns.conv_bn_act import FUSED_CONV
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

FIXTURES = Path(__file__).parent / "fixtures"
C, S = 6, 7


def residual_block(*, act: str | None = "Relu", bn: bool = True, bias: bool = True, op: str = "Add",
                   residual_first: bool = False, residual: str = "input", z_shape=None, sum_inputs: int = 2,
                   dtype=np.float32, add_is_output: bool = False, two_convs: bool = False, seed: int = 0
                   ) -> onnx.ModelProto:
    """X -> Conv -> [BN] -> Add(., Z) -> [act] -> Y. residual='input': Z is X itself (an identity shortcut);
    'tensor': Z is a graph input of `z_shape` (default: the conv output's shape). two_convs: Z is a second
    Conv -> BN of X (ResNet's downsample shortcut)."""
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs = [helper.make_tensor_value_info("X", elem, [1, C, S, S])]
    inits = [numpy_helper.from_array((rng.standard_normal((C, C, 3, 3)) * 0.2).astype(dtype), "W")]
    conv_in = ["X", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(C).astype(dtype), "B"))
        conv_in.append("B")
    nodes = [helper.make_node("Conv", conv_in, ["c"], name="conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3])]
    cur = "c"

    def bn_of(x: str, tag: str) -> str:
        for name, v in {"scale": rng.uniform(0.5, 1.5, C), "bbias": rng.standard_normal(C),
                        "mean": rng.standard_normal(C) * 0.5, "var": rng.uniform(0.2, 2.0, C)}.items():
            inits.append(numpy_helper.from_array(v.astype(dtype), f"{tag}_{name}"))
        nodes.append(helper.make_node("BatchNormalization", [x] + [f"{tag}_{n}" for n in
                                      ("scale", "bbias", "mean", "var")], [f"{tag}_out"], name=tag, epsilon=1e-3))
        return f"{tag}_out"

    if bn:
        cur = bn_of(cur, "bn")
    if two_convs:
        inits.append(numpy_helper.from_array((rng.standard_normal((C, C, 1, 1)) * 0.3).astype(dtype), "Wd"))
        nodes.append(helper.make_node("Conv", ["X", "Wd"], ["cd"], name="conv_down", kernel_shape=[1, 1]))
        z = bn_of("cd", "bn_down")
    elif residual == "input":
        z = "X"
    else:
        z = "Z"
        inputs.append(helper.make_tensor_value_info("Z", elem, list(z_shape or [1, C, S, S])))
    operands = [z, cur] if residual_first else [cur, z]
    if op == "Sum" and sum_inputs > 2:
        inputs.append(helper.make_tensor_value_info("Z2", elem, [1, C, S, S]))
        operands.append("Z2")
    nodes.append(helper.make_node(op, operands, ["s"], name="add"))
    outputs = []
    if act is not None:
        nodes.append(helper.make_node(act, ["s"], ["Y"], name="act"))
        if add_is_output:
            outputs.append(helper.make_tensor_value_info("s", elem, None))
    else:
        nodes.append(helper.make_node("Identity", ["s"], ["Y"], name="out"))
    outputs.insert(0, helper.make_tensor_value_info("Y", elem, None))
    g = helper.make_graph(nodes, "residual_block", inputs, outputs, inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION))


def _assert_same_as_original(model: onnx.ModelProto, optimized: onnx.ModelProto, rtol: float = 1e-4) -> None:
    feeds = random_feeds(model, seed=3)
    want, got = run(model, feeds), run(optimized, feeds)
    for name in want:
        c = compare(name, got[name], want[name])
        assert c.ok, c.detail
        assert c.min_passing_rtol <= rtol, (name, c.min_passing_rtol)


def _fused_convs(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "FusedConv"]


# ---- positives ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("act", ["Relu", None, "Sigmoid"])
@pytest.mark.parametrize("bn", [True, False])
@pytest.mark.parametrize("residual_first", [False, True])
@pytest.mark.parametrize("op", ["Add", "Sum"])
def test_conv_residual_add_fuses(act: str | None, bn: bool, residual_first: bool, op: str) -> None:
    model = residual_block(act=act, bn=bn, residual_first=residual_first, op=op)
    res = optimize(model, options=OptimizeOptions())
    want_kind = "FusedConv[Add" + (f",{act}]" if act else "]")
    assert [r.match.kind for r in res.applied] == [want_kind]
    fused = _fused_convs(res.model)
    assert len(fused) == 1 and [n.op_type for n in res.model.graph.node if n.op_type != "Identity"] == ["FusedConv"]
    a = attributes(fused[0])
    assert a["residual"] == 1 and a.get("activation") == act
    assert fused[0].input[3] == "X"          # the identity shortcut is the residual input
    assert res.model_check is not None and res.model_check.ok
    onnx.checker.check_model(res.model, full_check=True)
    _assert_same_as_original(model, res.model)


def test_conv_without_bias_takes_the_residual_as_fourth_input() -> None:
    model = residual_block(bias=False, bn=False, residual="tensor")
    res = optimize(model, options=OptimizeOptions())
    node = _fused_convs(res.model)[0]
    assert list(node.input) == ["X", "W", "", "Z"]
    _assert_same_as_original(model, res.model)


def test_downsample_block_gives_the_add_to_one_conv_and_folds_the_other() -> None:
    """Both operands of the Add are Conv -> BN chains: one takes the Add and the Relu, the other stays a Conv with
    its BN folded, feeding the residual input."""
    model = residual_block(two_convs=True)
    res = optimize(model, options=OptimizeOptions())
    assert Counter(r.match.kind for r in res.applied) == Counter({"FusedConv[Add,Relu]": 1, "Conv(BN folded)": 1})
    assert Counter(n.op_type for n in res.model.graph.node) == Counter({"FusedConv": 1, "Conv": 1})
    assert not res.rolled_back
    _assert_same_as_original(model, res.model)


def test_add_output_read_elsewhere_keeps_the_activation_outside() -> None:
    model = residual_block(add_is_output=True)
    res = optimize(model, options=OptimizeOptions())
    assert [r.match.kind for r in res.applied] == ["FusedConv[Add]"]
    assert "Relu" in [n.op_type for n in res.model.graph.node]
    _assert_same_as_original(model, res.model)


def test_fp16_residual_block() -> None:
    model = residual_block(dtype=np.float16)
    res = optimize(model, options=OptimizeOptions())
    # fp16: the BN stays a float32 per-channel epilogue (its fold into fp16 weights loses precision)
    assert [r.match.kind for r in res.applied] == ["FusedConv[BN,Add,Relu]"]
    _assert_same_as_original(model, res.model, rtol=1e-2)


# ---- near-misses ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("z_shape", [[1, C, 1, 1], [1, 1, S, S], [1, 1, 1, 1], [C, 1, 1]],
                         ids=["per-channel", "per-pixel", "scalar", "rank-3"])
def test_broadcast_residual_is_a_near_miss(z_shape: list[int]) -> None:
    model = residual_block(residual="tensor", z_shape=z_shape)
    res = optimize(model, options=OptimizeOptions())
    # the BN still folds; the Add and the Relu stay outside
    assert [r.match.kind for r in res.applied] == ["Conv(BN folded)"]
    assert {"Add", "Relu", "Conv"} <= {n.op_type for n in res.model.graph.node}
    refusal = next(f for f in res.refusals if f.reason == "residual-broadcast")
    assert refusal.pattern == "conv_bn_act" and refusal.node == "add" and "broadcasts" in refusal.detail
    _assert_same_as_original(model, res.model)


def test_broadcast_residual_after_a_bare_conv_is_a_near_miss_only() -> None:
    model = residual_block(residual="tensor", z_shape=[1, C, 1, 1], bn=False, act=None)
    res = optimize(model, options=OptimizeOptions())
    assert res.applied == []
    assert "residual-broadcast" in {f.reason for f in res.refusals}


def test_sum_of_three_is_a_near_miss() -> None:
    model = residual_block(op="Sum", residual="tensor", sum_inputs=3)
    res = optimize(model, options=OptimizeOptions())
    assert [r.match.kind for r in res.applied] == ["Conv(BN folded)"]
    assert "residual-arity" in {f.reason for f in res.refusals}


def test_conv_output_read_by_the_add_and_another_node_is_not_fused() -> None:
    model = residual_block(bn=False)
    model.graph.node.append(helper.make_node("Neg", ["c"], ["side"], name="side"))
    model.graph.output.append(helper.make_tensor_value_info("side", TensorProto.FLOAT, [1, C, S, S]))
    res = optimize(model, options=OptimizeOptions())
    assert res.applied == [] and not _fused_convs(res.model)


# ---- the fused op ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("act", [None, "Relu", "LeakyRelu", "Clip"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_residual_body_matches_reference_and_the_math(act: str | None, bias: bool, dtype) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 3, 6, 6)).astype(dtype)
    w = (rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(dtype)
    b = rng.standard_normal(4).astype(dtype)
    z = rng.standard_normal((1, 4, 6, 6)).astype(dtype)
    attrs = {"pads": [1, 1, 1, 1], "kernel_shape": [3, 3], "residual": 1}
    if act is not None:
        attrs["activation"] = act
    if act == "LeakyRelu":
        attrs["alpha"] = 0.1
    if act == "Clip":
        attrs.update(min=0.0, max=6.0)
    names = ["x", "w", "b" if bias else "", "z"]
    want = FUSED_CONV.reference([x, w, b if bias else None, z], attrs)[0]
    conv = kernels.conv(x, w, b if bias else None, pads=[1, 1, 1, 1])
    s = conv.astype(np.float64) + z
    textbook = {None: s, "Relu": np.maximum(s, 0), "LeakyRelu": np.where(s >= 0, s, 0.1 * s),
                "Clip": np.clip(s, 0, 6)}[act]
    tol = 1e-2 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(want.astype(np.float64), textbook, rtol=tol, atol=tol)
    assert np.abs(want.astype(np.float64) - np.maximum(conv, 0)).max() > 0.1   # the residual really is added
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node, fn = FUSED_CONV.make_node(names, ["y"], "fc", attrs, 17, elem)
    inits = [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(b, "b")] if bias else [])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, x.shape),
                                        helper.make_tensor_value_info("z", elem, z.shape)],
                          [helper.make_tensor_value_info("y", elem, want.shape)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("npufuse", 1)],
                          functions=[fn], ir_version=IR_VERSION)
    onnx.checker.check_model(m, full_check=True)
    c = compare("y", run(m, {"x": x, "z": z})["y"], want)
    assert c.ok, c.detail


def test_residual_and_plain_bodies_are_different_overloads() -> None:
    base = {"kernel_shape": [3, 3], "activation": "Relu"}
    assert FUSED_CONV.body(base, 17, TensorProto.FLOAT).overload != \
        FUSED_CONV.body(dict(base, residual=1), 17, TensorProto.FLOAT).overload


# ---- cost model and kernel --------------------------------------------------------------------------------

def _conv_work(residual: bool, act: str | None = "Relu") -> OpWork:
    x, out = TensorInfo((1, 256, 56, 56), "float16"), TensorInfo((1, 256, 56, 56), "float16")
    ins = (x, TensorInfo((256, 256, 3, 3), "float16", True), TensorInfo((256,), "float16", True))
    attrs: dict = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    if act:
        attrs["activation"] = act
    if residual:
        ins += (out,)
        attrs["residual"] = 1
    return OpWork("fc", "FusedConv", "npufuse", ins, (out,), attrs)


def test_cost_model_reads_the_residual_once_and_adds_it_on_the_vector() -> None:
    spec = load_profile("Ascend910B2")
    plain, with_res = estimate_op(_conv_work(False), spec), estimate_op(_conv_work(True), spec)
    z_bytes = 256 * 56 * 56 * 2
    assert with_res.gm_bytes_read - plain.gm_bytes_read == z_bytes     # an extra GM read of the output's size
    assert with_res.gm_bytes_written == plain.gm_bytes_written
    assert with_res.vector_cycles > plain.vector_cycles                # the add on the Vector
    only_add = estimate_op(_conv_work(True, act=None), spec)
    assert only_add.kind == "cube+vector" and only_add.gm_bytes_read == with_res.gm_bytes_read


@pytest.mark.parametrize("act", ["Relu", None])
def test_residual_fusion_pays_on_ascend910b_and_names_conv2d_add(act: str | None) -> None:
    model = residual_block(act=act, residual="tensor")
    res = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend910B2")))
    rec = next(r for r in res.records if r.match.kind.startswith("FusedConv[Add"))
    assert rec.status == "applied", rec.reason
    dec = rec.decision
    assert dec.fuse and dec.gain_us > 0
    # the Add's output write and its two reads are saved; the residual is read once by the fused kernel instead
    out_bytes = C * S * S * 4
    assert dec.gm_bytes_saved >= 2 * out_bytes
    k = rec.ascend_kernel
    assert kernel_label(k) == ("Conv2D+Add+Relu (ATC)" if act else "Conv2D+Add (ATC)")
    assert k["epilogue"][0]["inputs"] == [{"name": "x2", "value": "Z"}]
    assert [i["name"] for i in k["inputs"]] == ["x", "filter", "bias"]


# ---- ResNets ------------------------------------------------------------------------------------------------

def test_light_resnet50_fuses_every_residual_sum_and_relu(light_dir: Path) -> None:
    model = load_model(light_dir / "light_resnet50.onnx")
    assert Counter(n.op_type for n in model.graph.node)["Sum"] == 16
    res = optimize(model, str(light_dir), OptimizeOptions())
    after = Counter(n.op_type for n in res.model.graph.node)
    assert after["Sum"] == 0 and after["Relu"] == 0 and after["BatchNormalization"] == 0
    assert res.applied_by_kind() == Counter({"FusedConv[Relu]": 33, "FusedConv[Add,Relu]": 16, "Conv(BN folded)": 4})
    assert res.model_check.ok and not res.rolled_back


@pytest.mark.parametrize("file", ["resnet_ts14.onnx", "resnet_ts17.onnx", "resnet_dynamo.onnx",
                                  "resnet_dynamo_noopt.onnx"])
def test_resnet_exports_fuse_the_residual_add_and_relu(file: str) -> None:
    model = load_model(FIXTURES / file)
    n_add = Counter(n.op_type for n in model.graph.node)["Add"]
    assert n_add > 0
    res = optimize(model, str(FIXTURES), OptimizeOptions())
    after = Counter(n.op_type for n in res.model.graph.node)
    assert after["Add"] == 0 and after["Relu"] == 0
    assert res.applied_by_kind()["FusedConv[Add,Relu]"] == n_add
    assert res.model_check.ok and not res.rolled_back
    for c in res.model_check.comparisons:
        assert c.min_passing_rtol <= 1e-4
