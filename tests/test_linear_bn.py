"""Linear -> BatchNorm1d over a MatMul's output columns (matmul_bn, issue 23): LeViT's MLPLayerWithBN in both
exporters' spellings (MatMul -> Flatten -> BN -> Reshape(Shape(MatMul)) from TorchScript, MatMul -> Reshape -> BN ->
Reshape from dynamo), a BatchNorm1d over a transposed 3-D view, a bias Add before it; near-misses that must not fold
(training mode, a weight that is no constant, a BN over another axis than the columns, a shared MatMul output,
fp16); numerics that fail if the fold is wrong; and the real LeViT exports."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import with_output_shapes
from onnx import helper, numpy_helper

from npufuse.fusion.census import result_counts
from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.modelio import load_model
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.patterns.batchnorm import batchnorm_affine
from npufuse.verify.compare import compare

FIXTURES = Path(__file__).parent / "fixtures"
B, N, K, C = 2, 5, 8, 6


def _bn_params(rng: np.random.Generator, c: int, dtype=np.float32) -> dict[str, np.ndarray]:
    return {"gamma": rng.uniform(0.5, 1.5, c).astype(dtype), "beta": rng.standard_normal(c).astype(dtype),
            "mean": rng.standard_normal(c).astype(dtype), "var": rng.uniform(0.2, 2.0, c).astype(dtype)}


def linear_bn_model(form: str = "ts", *, bias: bool = False, training_mode: int = 0, weight_as_input: bool = False,
                    extra_reader: bool = False, dtype=np.float32, affine_after: bool = False) -> onnx.ModelProto:
    """X [B, N, K] -> MatMul(W [K, C]) [-> Add(bias)] -> the form's layout ops -> BatchNormalization -> back -> Y.

    form: "ts" (Flatten(axis=2), then Reshape(Shape(MatMul output)); a symbolic batch), "dynamo" (Reshape to [-1, C]
    and back with constants), "3d" (Transpose to [B, C, N] and back: BatchNorm1d over a 3-D tensor), "2d" (X [B*N, K],
    MatMul -> BN directly), "tokens" (the BN reads the [B, N, C] MatMul output directly: it normalises axis 1, the
    tokens, not the columns), "merge" (Reshape to [B*N*C/2, 2]: the columns do not reach the BN's axis)."""
    rng = np.random.default_rng(7)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    w = (rng.standard_normal((K, C)) * 0.4).astype(dtype)
    x_shape = [B * N, K] if form == "2d" else (["batch", N, K] if form == "ts" else [B, N, K])
    inputs = [helper.make_tensor_value_info("X", elem, x_shape)]
    inits = []
    if weight_as_input:
        inputs.append(helper.make_tensor_value_info("W", elem, [K, C]))
    else:
        inits.append(numpy_helper.from_array(w, "W"))
    nodes = [helper.make_node("MatMul", ["X", "W"], ["mm"], name="matmul")]
    cur = "mm"
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(C).astype(dtype), "bias"))
        nodes.append(helper.make_node("Add", [cur, "bias"], ["mm_b"], name="bias_add"))
        cur = "mm_b"
    back: list[onnx.NodeProto] = []
    if form == "ts":
        nodes += [helper.make_node("Flatten", [cur], ["flat"], name="flatten", axis=2),
                  helper.make_node("Shape", [cur], ["mm_shape"], name="shape")]
        cur = "flat"
        back = [helper.make_node("Reshape", ["bn", "mm_shape"], ["Y"], name="reshape_back")]
    elif form in ("dynamo", "merge"):
        shape = [-1, C] if form == "dynamo" else [-1, 2]
        inits += [numpy_helper.from_array(np.array(shape, np.int64), "to2d"),
                  numpy_helper.from_array(np.array([B, N, C], np.int64), "to3d")]
        nodes.append(helper.make_node("Reshape", [cur, "to2d"], ["flat"], name="reshape"))
        cur = "flat"
        back = [helper.make_node("Reshape", ["bn", "to3d"], ["Y"], name="reshape_back")]
    elif form == "3d":
        nodes.append(helper.make_node("Transpose", [cur], ["tok_last"], name="transpose", perm=[0, 2, 1]))
        cur = "tok_last"
        back = [helper.make_node("Transpose", ["bn"], ["Y"], name="transpose_back", perm=[0, 2, 1])]
    else:   # "2d", "tokens": the BN reads the MatMul's output
        back = [helper.make_node("Identity", ["bn"], ["Y"], name="out")]
    channels = N if form == "tokens" else (2 if form == "merge" else C)
    p = _bn_params(rng, channels, dtype)
    inits += [numpy_helper.from_array(v, k) for k, v in p.items()]
    bn_out = ["bn"] + (["rm", "rv"] if training_mode else [])
    nodes.append(helper.make_node("BatchNormalization", [cur, "gamma", "beta", "mean", "var"], bn_out, name="bn",
                                  epsilon=1e-3, **({"training_mode": 1} if training_mode else {})))
    if affine_after:   # a learned per-channel scale after the BN (folds too)
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 2.0, (1, C)).astype(dtype), "gain"))
        nodes.append(helper.make_node("Mul", ["bn", "gain"], ["bn_scaled"], name="gain_mul"))
        back = [_renamed_input(n, "bn", "bn_scaled") for n in back]
    nodes += back
    outputs = [helper.make_tensor_value_info("Y", elem, None)]
    if extra_reader:
        nodes.append(helper.make_node("Neg", ["mm"], ["side"], name="side"))
        outputs.append(helper.make_tensor_value_info("side", elem, None))
    g = helper.make_graph(nodes, "linear_bn", inputs, outputs, inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION))


def _renamed_input(node: onnx.NodeProto, old: str, new: str) -> onnx.NodeProto:
    out = onnx.NodeProto()
    out.CopyFrom(node)
    del out.input[:]
    out.input.extend(new if v == old else v for v in node.input)
    return out


def _feeds(model: onnx.ModelProto, batch: int = B, seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        shape = [d.dim_value or batch for d in i.type.tensor_type.shape.dim]
        out[i.name] = rng.standard_normal(shape).astype(helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
    return out


def _same_outputs(original: onnx.ModelProto, optimized: onnx.ModelProto, batch: int = B) -> None:
    feeds = _feeds(original, batch)
    want, got = run(original, feeds), run(optimized, feeds)
    for name, w in want.items():
        c = compare(name, got[name], w)
        assert c.ok and c.min_passing_rtol <= 1e-5, c.detail


@pytest.mark.parametrize("form", ["ts", "dynamo", "3d", "2d"])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_batchnorm_folds_into_a_fused_matmul_with_bias(form: str, bias: bool) -> None:
    model = linear_bn_model(form, bias=bias)
    res = optimize(model, options=OptimizeOptions())
    assert [r.match.kind for r in res.applied if r.match.pattern == "matmul_bn"] == ["FusedMatMul[bias,folded BN]"]
    ops = Counter(n.op_type for n in res.model.graph.node)
    assert "BatchNormalization" not in ops and "MatMul" not in ops and ops["FusedMatMul"] == 1
    assert res.model_check is not None and res.model_check.ok and not res.rolled_back
    assert result_counts(res)["linear_bn"] == 1
    _same_outputs(model, res.model)
    if form == "ts":   # the symbolic batch: the Shape the TorchScript Reshape back reads is rebuilt, any batch works
        _same_outputs(model, res.model, batch=3)
    onnx.checker.check_model(res.model, full_check=True)


def test_the_folded_weight_and_bias_are_the_batchnorm_applied_to_the_columns() -> None:
    """W' = W * s per column and bias' = c * s + t: computed here independently; a fold along the rows, or one that
    forgot the bias Add's constant, differs."""
    model = linear_bn_model("dynamo", bias=True)
    res = optimize(model, options=OptimizeOptions(verify=False))
    [fm] = [n for n in res.model.graph.node if n.op_type == "FusedMatMul"]
    inits = {i.name: numpy_helper.to_array(i) for i in res.model.graph.initializer}
    orig = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    s, t = batchnorm_affine(*(orig[k].astype(np.float64) for k in ("gamma", "beta", "mean", "var")), 1e-3)
    np.testing.assert_allclose(inits[fm.input[1]], orig["W"] * s[None, :], rtol=1e-6)
    np.testing.assert_allclose(inits[fm.input[2]], orig["bias"] * s + t, rtol=1e-6, atol=1e-7)
    assert [helper.get_attribute_value(a) for a in fm.attribute if a.name == "epilogue"] == [[b"bias"]]


def test_a_per_channel_scale_after_the_batchnorm_folds_too() -> None:
    model = linear_bn_model("2d", affine_after=True)
    res = optimize(model, options=OptimizeOptions())
    assert {n.op_type for n in res.model.graph.node} == {"FusedMatMul", "Identity"}
    _same_outputs(model, res.model)


@pytest.mark.parametrize("kwargs,reason", [
    ({"training_mode": 1}, "bn-training-mode"),
    ({"weight_as_input": True}, "dynamic-weight"),
    ({"form": "tokens"}, "bn-axis"),
    ({"form": "merge"}, "bn-axis"),
    ({"extra_reader": True}, "shared-intermediate"),
    ({"dtype": np.float16}, "bn-low-precision"),
])
def test_matmul_batchnorm_near_misses(kwargs: dict, reason: str) -> None:
    res = optimize(linear_bn_model(**kwargs), options=OptimizeOptions())
    assert "BatchNormalization" in {n.op_type for n in res.model.graph.node}
    assert not [r for r in res.applied if r.match.pattern == "matmul_bn"]
    mine = {(f.reason, f.node) for f in res.refusals if f.pattern == "matmul_bn"}
    assert reason in {r for r, _ in mine}, res.refusals
    # the BN is matmul_bn's to name: conv_bn_act says nothing about it
    assert not [f for f in res.refusals if f.pattern == "conv_bn_act" and f.node == "bn"]
    assert unaccounted(res) == []   # the BN left is named by the near-miss


def test_a_batchnorm_over_the_tokens_says_which_axis_holds_the_columns() -> None:
    res = optimize(linear_bn_model("tokens"), options=OptimizeOptions())
    [f] = [f for f in res.refusals if f.pattern == "matmul_bn"]
    assert f.reason == "bn-axis" and "axis 1" in f.detail and "axis 2" in f.detail and "per row or token" in f.detail


# ---- the real exports ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("file", ["levit_ts17.onnx", "levit_dynamo.onnx"])
def test_levit_every_linear_batchnorm_folds(file: str) -> None:
    """LeViT's 22 MLPLayerWithBN: Flatten + Reshape(Shape) from TorchScript, constant Reshapes from dynamo; the
    four stem Conv -> BN fold into their convs (TorchScript; dynamo's optimizer folded those itself)."""
    entry = next(e for e in json.loads((FIXTURES / "manifest.json").read_text())["census_fixtures"]
                 if e["file"] == file)
    res = optimize(load_model(FIXTURES / file), str(FIXTURES), OptimizeOptions())
    assert res.model_check is not None and res.model_check.ok and not res.rolled_back
    counts = result_counts(res)
    assert counts["linear_bn"] == entry["expected"]["linear_bn"] == 22
    assert "BatchNormalization" not in {n.op_type for n in res.model.graph.node}
    assert not [f for f in res.refusals if f.reason == "bn-without-conv"]
