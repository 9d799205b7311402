"""Residual Add + LayerNorm / RMSNorm into npufuse.AddLayerNorm / AddRMSNorm: positives (post-LN, pre-LN with
the sum as a second output) per opset and dtype, near-misses with their refusal reasons, function bodies vs
reference kernels, the cost model's view, and the real exporter fixtures."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import random_feeds, with_output_shapes
from onnx import TensorProto, helper, numpy_helper

from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import attributes
from npufuse.patterns import PATTERNS, fused_op_defs
from npufuse.patterns.add_norm import (ADD_LAYER_NORM, ADD_RMS_NORM, add_layer_norm_body, add_rms_norm_body,
                                       residual_sum)
from npufuse.patterns.norms import NPU_LAYER_NORM, NPU_RMS_NORM
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

FIXTURES = Path(__file__).parent / "fixtures"
SHAPE = [2, 5, 16]
H = SHAPE[-1]
OPSETS = (14, 17, 20, 23)
MY_PATTERNS = ("add_layernorm", "add_rmsnorm")
LN_KEYS = {("", "LayerNormalization"), ("npufuse", "LayerNorm")}
RMS_KEYS = {("", "RMSNormalization"), ("npufuse", "RMSNorm")}


# ---- a small graph: A + B -> [Cast] -> norm -> Y, the sum maybe read elsewhere ------------------------------

def _norm_node(kind: str, opset: int, x: str, y: str, gamma: str, beta: str | None, dtype, *, force_npufuse: bool,
               axis: int, extra_outputs: list[str], stash: int | None
               ) -> tuple[onnx.NodeProto, onnx.FunctionProto | None]:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    standard = (opset >= 17 if kind == "layernorm" else opset >= 23) and not force_npufuse
    if standard:
        op = "LayerNormalization" if kind == "layernorm" else "RMSNormalization"
        ins = [x, gamma] + ([beta] if beta and kind == "layernorm" else [])
        attrs = {"axis": axis, "epsilon": 1e-5}
        if stash is not None:
            attrs["stash_type"] = stash
        return helper.make_node(op, ins, [y] + extra_outputs, name="norm", **attrs), None
    fused = NPU_LAYER_NORM if kind == "layernorm" else NPU_RMS_NORM
    ins = [x, gamma] + ([beta] if beta and kind == "layernorm" else [])
    attrs = {"epsilon": 1e-5, "stash_type": stash}
    node, fn = fused.make_node(ins, [y], "norm", attrs, opset, elem)
    if kind == "layernorm" and not beta:
        from npufuse.patterns.norms import layer_norm_body
        fn = layer_norm_body(attrs, opset, elem, has_beta=False)
        node.overload = fn.overload
    return node, fn


def add_norm_model(kind: str = "layernorm", opset: int = 17, dtype=np.float32, *, sum_use: str = "none",
                   cast: str = "none", sum_from: str = "cast", a_shape=SHAPE, b_shape=SHAPE, const_b: bool = False,
                   same_operand: bool = False, axis: int = -1, mean_used: bool = False, beta: bool = True,
                   force_npufuse: bool = False, stash: int | None = None, seed: int = 0) -> onnx.ModelProto:
    """A + B -> [Cast] -> norm -> Identity -> Y.

    sum_use: "none" (post-LN: the sum feeds only the norm), "next" (pre-LN: the sum also feeds the next residual
    Add, after the norm), "output" (the sum is a graph output), "before" (a reader of the sum listed before the
    norm). cast: "none", "noop" (a Cast to the sum's own type, HF llama), "real" (fp16 sum -> float32 norm).
    sum_from: with a Cast, which value the next residual reads ("cast": llama TorchScript, "add", "both").
    """
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    norm_dtype = np.float32 if cast == "real" else dtype
    norm_elem = helper.np_dtype_to_tensor_dtype(np.dtype(norm_dtype))
    inputs = [helper.make_tensor_value_info("A", elem, a_shape)]
    hidden = a_shape[-1] if isinstance(a_shape[-1], int) else H
    inits = [numpy_helper.from_array((1 + 0.3 * rng.standard_normal(hidden)).astype(norm_dtype), "gamma"),
             numpy_helper.from_array((0.3 * rng.standard_normal(hidden)).astype(norm_dtype), "beta")]
    b = "A" if same_operand else "B"
    if const_b:
        inits.append(numpy_helper.from_array(rng.standard_normal(b_shape).astype(dtype), "B"))
    elif not same_operand:
        inputs.append(helper.make_tensor_value_info("B", elem, b_shape))
    nodes = [helper.make_node("Add", ["A", b], ["S"], name="residual")]
    outputs = ["Y"]
    x = "S"
    if cast != "none":
        nodes.append(helper.make_node("Cast", ["S"], ["Sc"], name="cast",
                                      to=TensorProto.FLOAT if cast == "real" else elem))
        x = "Sc"
    if sum_use == "before":
        nodes.append(helper.make_node("Neg", [x], ["early"], name="early"))
        outputs.append("early")
    extra = ["mean"] if mean_used else []
    norm, fn = _norm_node(kind, opset, x, "n", "gamma", "beta" if beta else None, norm_dtype,
                          force_npufuse=force_npufuse, axis=axis, extra_outputs=extra, stash=stash)
    nodes.append(norm)
    outputs += extra
    nodes.append(helper.make_node("Identity", ["n"], ["Y"], name="out"))
    if sum_use == "next":
        readers = {"cast": [x], "add": ["S"], "both": ["S", x]}[sum_from if cast != "none" else "add"]
        for i, r in enumerate(readers):
            nodes.append(helper.make_node("Add", [r, "Y"], [f"side{i}"], name=f"next_residual{i}"))
            outputs.append(f"side{i}")
    if sum_use == "output":
        outputs.append(x)
    out_types = {"Y": norm_elem, "mean": TensorProto.FLOAT}
    outs = [helper.make_tensor_value_info(o, out_types.get(o, elem), None) for o in outputs]
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("npufuse", 1)] if fn is not None else [])
    g = helper.make_graph(nodes, "add_norm", inputs, outs, inits)
    return with_output_shapes(helper.make_model(g, opset_imports=imports, functions=[fn] if fn is not None else [],
                                                ir_version=IR_VERSION))


# ---- helpers ---------------------------------------------------------------------------------------------------

def _optimize(model: onnx.ModelProto, **kw):
    return optimize(model, options=OptimizeOptions(**kw))


def _fused_nodes(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "npufuse" and n.op_type == op_type]


def _reasons(res, pattern: str) -> set[str]:
    return {f.reason for f in res.refusals if f.pattern == pattern}


def _assert_same_outputs(original: onnx.ModelProto, optimized: onnx.ModelProto) -> None:
    feeds = random_feeds(original, seed=5)
    want, got = run(original, feeds), run(optimized, feeds)
    assert set(want) == set(got)
    for name in want:
        c = compare(name, got[name], want[name])
        assert c.ok, f"{name}: {c.detail}"


def _assert_fused(model: onnx.ModelProto, res, op_type: str, outputs: list[str]) -> onnx.NodeProto:
    nodes = _fused_nodes(res.model, op_type)
    assert len(nodes) == 1, [(n.domain, n.op_type) for n in res.model.graph.node]
    assert list(nodes[0].output) == outputs
    assert res.applied and all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok, res.model_check
    onnx.checker.check_model(res.model, full_check=True)
    _assert_same_outputs(model, res.model)
    return nodes[0]


def _fused_op_for(kind: str) -> str:
    return "AddLayerNorm" if kind == "layernorm" else "AddRMSNorm"


# ---- positives ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("sum_use", ["none", "next"])
def test_residual_add_and_norm_fuse(kind: str, opset: int, dtype, sum_use: str) -> None:
    """Post-LN (BERT: the sum feeds only the norm) -> (Y); pre-LN (GPT-2, llama, ViT: the sum also feeds the next
    residual) -> (Y, S), whichever op the norm is at this opset."""
    model = add_norm_model(kind, opset, dtype, sum_use=sum_use)
    res = _optimize(model)
    outputs = ["n"] + (["S"] if sum_use == "next" else [])
    node = _assert_fused(model, res, _fused_op_for(kind), outputs)
    assert list(node.input) == ["A", "B", "gamma"] + (["beta"] if kind == "layernorm" else [])
    a = attributes(node)
    assert a["epsilon"] == pytest.approx(1e-5) and a["stash_type"] == TensorProto.FLOAT
    assert node.overload.endswith("__y_s" if sum_use == "next" else "__y")
    rec = next(r for r in res.applied if r.match.pattern.startswith("add_"))
    assert rec.match.kind == _fused_op_for(kind) + ("[sum]" if sum_use == "next" else "")


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_npufuse_norm_at_a_standard_opset_and_stash_type_are_kept(kind: str) -> None:
    """npufuse.LayerNorm / RMSNorm at opset 17 (a model may carry them) and a non-default stash_type."""
    model = add_norm_model(kind, 17, np.float16, sum_use="next", force_npufuse=True, stash=TensorProto.FLOAT16)
    res = _optimize(model)
    node = _assert_fused(model, res, _fused_op_for(kind), ["n", "S"])
    assert attributes(node)["stash_type"] == TensorProto.FLOAT16


def test_layernorm_without_beta() -> None:
    model = add_norm_model("layernorm", 14, beta=False, sum_use="next")
    res = _optimize(model)
    node = _assert_fused(model, res, "AddLayerNorm", ["n", "S"])
    assert list(node.input) == ["A", "B", "gamma"] and "nobeta" in node.overload


@pytest.mark.parametrize("opset", [17, 23])
def test_sum_as_graph_output_is_the_second_output(opset: int) -> None:
    model = add_norm_model("rmsnorm" if opset == 23 else "layernorm", opset, sum_use="output")
    res = _optimize(model)
    _assert_fused(model, res, _fused_op_for("rmsnorm" if opset == 23 else "layernorm"), ["n", "S"])
    assert "S" in {o.name for o in res.model.graph.output}


@pytest.mark.parametrize("sum_from", ["cast", "add"])
@pytest.mark.parametrize("opset", [17, 23])
def test_noop_cast_between_add_and_norm_is_absorbed(sum_from: str, opset: int) -> None:
    """HF llama's `hidden_states.to(float32)` on a float32 export: Add -> Cast(to float) -> RMSNorm, the next
    residual reading the Cast's output (TorchScript) or the Add's. The canonicaliser drops the no-op Cast, so the
    sum is S either way."""
    model = add_norm_model("rmsnorm", opset, cast="noop", sum_use="next", sum_from=sum_from)
    res = _optimize(model)
    _assert_fused(model, res, "AddRMSNorm", ["n", "S"])
    assert not [n for n in res.model.graph.node if n.op_type == "Cast"]


def test_residual_broadcast_over_leading_axes_is_refused() -> None:
    """A [1, S, H] position embedding added to [B, S, H]: Ascend's AddLayerNorm takes x2 of x1's shape only (issue 9;
    this used to fuse with Add's broadcasting). The Add stays, the norm stays the LayerNormalization it is."""
    model = add_norm_model("layernorm", 17, a_shape=[1, 5, 16], b_shape=[2, 5, 16], sum_use="next")
    res = _optimize(model)
    assert not _fused_nodes(res.model, "AddLayerNorm")
    assert "operand-broadcast" in _reasons(res, "add_layernorm")


def test_differently_named_input_dims_are_not_provably_equal() -> None:
    """'b0' and 'b1' (two graph inputs' own names) may differ at run time, one of them 1: refused, named (issue 9;
    operands whose names differ but whose dims follow from one shape computation fuse: test_norm_forms.py)."""
    model = add_norm_model("layernorm", 17, a_shape=["b0", "s0", 16], b_shape=["b1", "s1", 16])
    res = optimize(model, options=OptimizeOptions(dims={"b0": 2, "b1": 2, "s0": 5, "s1": 5}))
    assert not _fused_nodes(res.model, "AddLayerNorm")
    assert "residual-shape-unproven" in _reasons(res, "add_layernorm")


def test_a_one_against_an_unknown_dim_is_unproven_not_a_broadcast() -> None:
    """[1, S, H] + [?, S, H] (ViT-MAE's TorchScript export: the residual comes through a data-dependent Gather, the
    attention output has static dims): the unknown dim may well be 1, so nothing is shown to broadcast; the refusal
    says the shapes are unproven rather than naming a broadcast."""
    for unknown in (None, "unk__7"):    # lost by inference, or named by it
        model = add_norm_model("layernorm", 17, a_shape=[1, 5, 16], b_shape=[unknown, 5, 16])
        res = _optimize(model, verify=False)
        assert not _fused_nodes(res.model, "AddLayerNorm")
        assert _reasons(res, "add_layernorm") == {"residual-shape-unproven"}, unknown


# ---- near-misses ---------------------------------------------------------------------------------------------

def test_constant_operand_of_the_sums_shape_fuses() -> None:
    """A constant table of the sum's own shape is a valid x2 of the kernel (issue 9: constants were ignored)."""
    model = add_norm_model("layernorm", 17, const_b=True)
    res = _optimize(model)
    _assert_fused(model, res, "AddLayerNorm", ["n"])


@pytest.mark.parametrize("b_shape", [[5, 16], [16]])
def test_broadcasting_constant_operand_is_reported(b_shape) -> None:
    """A [S, H] position table or a [H] bias broadcasts: the norm is left alone, the near-miss says why."""
    res = _optimize(add_norm_model("layernorm", 17, const_b=True, b_shape=b_shape))
    assert not _fused_nodes(res.model, "AddLayerNorm")
    assert _reasons(res, "add_layernorm") == {"operand-broadcast"}


def test_same_value_twice_is_not_a_residual() -> None:
    res = _optimize(add_norm_model("layernorm", 17, same_operand=True))
    assert not _fused_nodes(res.model, "AddLayerNorm")


def test_norm_over_a_non_last_axis_is_refused() -> None:
    model = add_norm_model("layernorm", 17, axis=1)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.ones((5, 16), np.float32), "gamma"))
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.zeros((5, 16), np.float32), "beta"))
    res = _optimize(model)
    assert not _fused_nodes(res.model, "AddLayerNorm")
    assert "norm-not-last-axis" in _reasons(res, "add_layernorm")


@pytest.mark.parametrize("b_shape", [[2, 5, 1], [1, 1, 1], [1]])
def test_residual_broadcasting_along_the_normalised_axis_is_refused(b_shape) -> None:
    """[B,S,1] + [B,S,H]: the sum's rows are not rows of both operands; refused with a reason."""
    res = _optimize(add_norm_model("layernorm", 17, b_shape=b_shape))
    assert not _fused_nodes(res.model, "AddLayerNorm")
    assert "residual-broadcast" in _reasons(res, "add_layernorm")


def test_dynamic_vector_operand_is_refused() -> None:
    """A dynamic [H] operand broadcasts over the leading axes: not an x2 of x1's shape (issue 9; it used to fuse)."""
    res = _optimize(add_norm_model("layernorm", 17, b_shape=[H]))
    assert not _fused_nodes(res.model, "AddLayerNorm")
    assert "operand-broadcast" in _reasons(res, "add_layernorm")


def test_unknown_residual_shape_is_refused() -> None:
    """B = Reshape(B0, dynamic shape): its dims are unknown, so its last axis may broadcast."""
    model = add_norm_model("layernorm", 17)
    model.graph.input.append(helper.make_tensor_value_info("target", TensorProto.INT64, [3]))
    model.graph.node.insert(0, helper.make_node("Reshape", ["B0", "target"], ["B"], name="reshape"))
    model.graph.input[1].name = "B0"
    res = _optimize(model, verify=False)    # no sensible inputs can be made for a dynamic target shape
    assert not _fused_nodes(res.model, "AddLayerNorm")
    assert _reasons(res, "add_layernorm") & {"unknown-shape", "residual-broadcast"}


def test_used_mean_output_is_refused() -> None:
    res = _optimize(add_norm_model("layernorm", 17, mean_used=True))
    assert not _fused_nodes(res.model, "AddLayerNorm")
    assert "norm-extra-outputs" in _reasons(res, "add_layernorm")


def test_real_cast_between_add_and_norm_is_refused() -> None:
    res = _optimize(add_norm_model("layernorm", 17, np.float16, cast="real"))
    assert not _fused_nodes(res.model, "AddLayerNorm")
    assert "mixed-precision" in _reasons(res, "add_layernorm")


def test_sum_read_at_both_ends_of_a_noop_cast_fuses_once_the_cast_is_dropped() -> None:
    """The sum read before and after a no-op Cast is one value once the canonicaliser drops the Cast."""
    model = add_norm_model("rmsnorm", 17, cast="noop", sum_use="next", sum_from="both")
    res = _optimize(model)
    _assert_fused(model, res, "AddRMSNorm", ["n", "S"])


def test_sum_read_before_the_norm_in_node_order_still_fuses() -> None:
    """A reader of S listed before the norm: the rewrite re-sorts the graph so it reads S after the fused
    node produces it."""
    model = add_norm_model("layernorm", 17, sum_use="before")
    res = _optimize(model)
    assert len(_fused_nodes(res.model, "AddLayerNorm")) == 1
    assert res.model_check.ok
    onnx.checker.check_model(res.model, full_check=True)


def test_patterns_are_registered_in_phase_three() -> None:
    by_name = {p.name: p for p in PATTERNS}
    assert by_name["add_layernorm"].phase == by_name["add_rmsnorm"].phase == 3
    assert max(p.phase for p in PATTERNS if p.name == "matmul_epilogue") < 3
    defs = fused_op_defs()
    assert defs[("npufuse", "AddLayerNorm")] is ADD_LAYER_NORM and defs[("npufuse", "AddRMSNorm")] is ADD_RMS_NORM


# ---- function bodies vs reference kernels ----------------------------------------------------------------------

def _run_fused(fn: onnx.FunctionProto, op_type: str, opset: int, feeds: dict, inits: dict, attrs: dict,
               with_sum: bool) -> list[np.ndarray]:
    elem = helper.np_dtype_to_tensor_dtype(feeds["A"].dtype)
    outs = ["Y"] + (["S"] if with_sum else [])
    node = helper.make_node(op_type, list(feeds) + list(inits), outs, name="fused", domain="npufuse", **attrs)
    node.overload = fn.overload
    shape = np.broadcast_shapes(*(v.shape for v in feeds.values()))
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(k, elem, v.shape) for k, v in feeds.items()],
                          [helper.make_tensor_value_info(o, elem, shape) for o in outs],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("npufuse", 1)],
                          functions=[fn], ir_version=IR_VERSION)
    onnx.checker.check_model(m, full_check=True)
    res = run(m, feeds)
    return [res[o] for o in outs]


def _case(dtype, seed: int = 0, b_shape=(3, 4, 24)):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((3, 4, 24)) * 2 + 0.7).astype(dtype)
    b = (rng.standard_normal(b_shape) * 1.5 - 0.2).astype(dtype)
    gamma = (1 + 0.3 * rng.standard_normal(24)).astype(dtype)
    beta = (0.3 * rng.standard_normal(24)).astype(dtype)
    return a, b, gamma, beta


@pytest.mark.parametrize("opset", (14, 17, 18, 20, 23))
@pytest.mark.parametrize("dtype,stash", [(np.float32, TensorProto.FLOAT), (np.float16, TensorProto.FLOAT),
                                         (np.float16, TensorProto.FLOAT16), (np.float64, TensorProto.DOUBLE)])
@pytest.mark.parametrize("with_beta", [True, False])
@pytest.mark.parametrize("with_sum", [True, False])
def test_add_layernorm_body_matches_reference(opset: int, dtype, stash: int, with_beta: bool, with_sum: bool) -> None:
    a, b, gamma, beta = _case(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    attrs = {"epsilon": 1e-5, "stash_type": stash}
    want = ADD_LAYER_NORM.reference([a, b, gamma] + ([beta] if with_beta else []), attrs)
    fn = add_layer_norm_body(attrs, opset, elem, has_beta=with_beta, with_sum=with_sum)
    inits = {"gamma": gamma} | ({"beta": beta} if with_beta else {})
    got = _run_fused(fn, "AddLayerNorm", opset, {"A": a, "B": b}, inits, attrs, with_sum)
    for name, gv, wv in zip(("Y", "S"), got, want):
        c = compare(name, gv, wv)
        assert c.ok, f"{name}: {c.detail}"
    # The reference is the textbook math on the sum rounded to T.
    s = (a.astype(np.float64) + b.astype(np.float64)).astype(dtype)
    np.testing.assert_array_equal(want[1], s)
    sf = s.astype(np.float64)
    plain = (sf - sf.mean(-1, keepdims=True)) / np.sqrt(sf.var(-1, keepdims=True) + 1e-5)
    tol = 5e-3 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(want[0], plain * gamma + (beta if with_beta else 0), rtol=tol, atol=tol)


@pytest.mark.parametrize("opset", (14, 17, 18, 20, 23))
@pytest.mark.parametrize("dtype,stash", [(np.float32, TensorProto.FLOAT), (np.float16, TensorProto.FLOAT),
                                         (np.float16, TensorProto.FLOAT16)])
@pytest.mark.parametrize("with_sum", [True, False])
def test_add_rmsnorm_body_matches_reference(opset: int, dtype, stash: int, with_sum: bool) -> None:
    a, b, gamma, _ = _case(dtype, 1)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    attrs = {"epsilon": 1e-6, "stash_type": stash}
    want = ADD_RMS_NORM.reference([a, b, gamma], attrs)
    fn = add_rms_norm_body(attrs, opset, elem, with_sum=with_sum)
    got = _run_fused(fn, "AddRMSNorm", opset, {"A": a, "B": b}, {"gamma": gamma}, attrs, with_sum)
    for name, gv, wv in zip(("Y", "S"), got, want):
        c = compare(name, gv, wv)
        assert c.ok, f"{name}: {c.detail}"
    sf = residual_sum(a, b).astype(np.float64)
    tol = 5e-3 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(want[0], sf / np.sqrt((sf * sf).mean(-1, keepdims=True) + 1e-6) * gamma, rtol=tol,
                               atol=tol)


def test_body_broadcasts_the_residual_like_add() -> None:
    a, b, gamma, beta = _case(np.float32, 2, b_shape=(1, 4, 24))
    attrs = {"epsilon": 1e-5, "stash_type": TensorProto.FLOAT}
    want = ADD_LAYER_NORM.reference([a, b, gamma, beta], attrs)
    assert want[1].shape == a.shape
    fn = add_layer_norm_body(attrs, 17, TensorProto.FLOAT)
    got = _run_fused(fn, "AddLayerNorm", 17, {"A": a, "B": b}, {"gamma": gamma, "beta": beta}, attrs, True)
    for name, gv, wv in zip(("Y", "S"), got, want):
        assert compare(name, gv, wv).ok


def test_overloads_differ_per_form() -> None:
    attrs = {"epsilon": 1e-5, "stash_type": TensorProto.FLOAT}
    for opset in (14, 17):
        ln = {add_layer_norm_body(attrs, opset, TensorProto.FLOAT, has_beta=hb, with_sum=ws).overload
              for hb in (True, False) for ws in (True, False)}
        assert len(ln) == 4
    rms = {add_rms_norm_body(attrs, opset, t, with_sum=ws).overload for opset in (17,)
           for t in (TensorProto.FLOAT, TensorProto.FLOAT16) for ws in (True, False)}
    assert len(rms) == 4
    # Decomposed bodies use only default-domain ops of the model's opset.
    for fn in (add_layer_norm_body(attrs, 14, TensorProto.FLOAT16), add_rms_norm_body(attrs, 20, TensorProto.FLOAT)):
        assert {n.domain for n in fn.node} <= {""}
        assert "LayerNormalization" not in {n.op_type for n in fn.node}


# ---- the cost model's view -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_cost_model_prices_the_fused_op_as_a_row_kernel(kind: str) -> None:
    from npufuse.npu_model import load_profile

    model = add_norm_model(kind, 17, sum_use="next", a_shape=[8, 128, 768], b_shape=[8, 128, 768])
    res = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend910B2"), verify=False))
    rec = next(r for r in res.records if r.match.pattern.startswith("add_"))
    assert rec.status == "applied", rec.reason
    fused = rec.decision.fused[0]
    assert fused.kind == "vector" and fused.tile is not None and fused.ub_bytes_needed > 0
    assert rec.decision.gm_bytes_saved > 0 and rec.decision.launches_saved == 1


# ---- the real exporter fixtures ------------------------------------------------------------------------------------

def _manifest() -> dict[str, dict]:
    m = json.loads((FIXTURES / "manifest.json").read_text())
    return {f["file"].removesuffix(".onnx"): f for f in m["fixtures"]}


# fixture -> (fused op, how many, how many with the sum as a second output, refusals expected)
EXPECTED = {
    # The embedding LayerNorm (word + token-type + position embeddings) stays a LayerNormalization: the position
    # embeddings are [1, S, H] against [B, S, H] (dynamo names the 1; in TorchScript shape inference leaves it
    # 'unk__0' and the canonical phase proves the 1 from the position ids' Slice), and Ascend's AddLayerNorm takes
    # x2 of x1's shape only (issue 9; these used to fuse, broadcasting).
    **{f"bert_{e}": ("AddLayerNorm", 4, 0, {"operand-broadcast": 1})
       for e in ("ts14", "ts17", "sdpa_ts17", "dynamo", "sdpa_dynamo")},
    # GPT-2's wte + wpe sum ([1, S, H] position embeddings) the same: 4 of 5, 3 with the sum as a second output.
    **{f"gpt2_{e}": ("AddLayerNorm", 4, 3, {"operand-broadcast": 1}) for e in ("ts14", "ts17", "dynamo")},
    # ViT's embeddings add a constant [1, 17, H] position table: 4 of its 5 LayerNorms, the table reported.
    **{f"vit_{e}": ("AddLayerNorm", 4, 3, {"operand-broadcast": 1}) for e in ("ts14", "ts17", "dynamo")},
    # llama's first RMSNorm reads the embedding directly: 4 of 5.
    **{f"llama_{e}": ("AddRMSNorm", 4, 3, {}) for e in ("ts14", "ts17", "dynamo", "sdpa_ts17", "sdpa_dynamo")},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_add_norm_counts(name: str) -> None:
    path = FIXTURES / f"{name}.onnx"
    op, count, with_sum, refusals = EXPECTED[name]
    layers = _manifest()[name]["config"]["num_layers"]
    res = optimize(onnx.load(path), str(FIXTURES), OptimizeOptions())
    assert res.ok and res.model_check is not None and res.model_check.ok, res.model_check
    assert res.rolled_back == []
    assert all(r.check is not None and r.check.ok for r in res.applied)
    fused = _fused_nodes(res.model, op)
    assert len(fused) == count
    assert sum(len(n.output) == 2 for n in fused) == with_sum
    mine = [r for r in res.applied if r.match.pattern in MY_PATTERNS]
    assert len(mine) == count
    assert Counter(f.reason for f in res.refusals if f.pattern in MY_PATTERNS) == Counter(refusals)
    # A norm absorbed into AddLayerNorm / AddRMSNorm still counts as a norm of the model.
    keys = Counter((n.domain, n.op_type) for n in res.model.graph.node)
    norms = sum(keys[k] for k in (RMS_KEYS if op == "AddRMSNorm" else LN_KEYS)) + keys[("npufuse", op)]
    assert norms == 2 * layers + 1
