"""Gated MLP (SwiGLU / GeGLU / ReGLU) => npufuse.GatedMLP: positives in every form, near-misses that must not fuse,
reference kernel vs function body, checks that fail when either is wrong, pricing, and the Llama exports."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import with_output_shapes
from onnx import TensorProto, helper, numpy_helper

import npufuse.patterns as patterns_registry
import npufuse.patterns.base as patterns_base
import npufuse.patterns.gated_mlp as gated_mlp_module
from npufuse.cost_model import FusionCandidate, OpWork, TensorInfo, decide
from npufuse.cost_model.estimate import estimate_op
from npufuse.fusion.census import fusion_census
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import attributes
from npufuse.npu_model.spec import load_profile
from npufuse.patterns import PATTERNS
from npufuse.patterns.gated_mlp import GATED_MLP, GatedMLPPattern
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

FIXTURES = Path(__file__).parent / "fixtures"
K, N = 16, 24
INT64_MAX = np.iinfo(np.int64).max
ACTS = ("silu", "gelu", "gelu_tanh", "relu")


# ---- graph builder ------------------------------------------------------------------------------------

def gated_model(*, form: str = "separate", act: str = "silu", opset: int = 17, dtype=np.float32, bias: bool = False,
                gate_first: bool = True, act_first: bool = True, symbolic: bool = False, seed: int = 0,
                partial_bias: bool = False, up_input: str | None = None, dynamic_weight: str | None = None,
                act_is_output: bool = False, up_shared: bool = False, halves: tuple | None = None,
                split_sizes: list[int] | None = None, product_with_input: bool = False, axis: int = -1,
                bounds_from_input: bool = False, shape_dim: int = -1, down: bool = True, up_width: int = N,
                gate_bias_shape: tuple[int, ...] | None = None) -> onnx.ModelProto:
    """X -> gate/up projections -> act(gate) * up -> down projection -> Y.

    form: separate (two MatMuls), split (one [K, 2N] MatMul + Split), split_equal (Split without sizes),
    slices (two Slices with constant bounds), slices_shape (bounds from Shape -> Gather -> Div -> Unsqueeze).
    act: silu (x*Sigmoid(x)), silu_rev (Sigmoid(x)*x), swish (Swish op, opset 24), gelu / gelu_tanh (the
    decomposed formulas phase 0 fuses first), gelu_op / gelu_tanh_op (Gelu-20), relu. down=False ends in Identity
    instead of the down projection (for near-misses whose product is not [.., N]). The rest are near-miss knobs."""
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    lead = ["batch", "seq"] if symbolic else [2, 3]
    inputs = [helper.make_tensor_value_info("X", elem, lead + [K])]
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    outputs = ["Y"]

    def weight(name: str, shape: tuple[int, ...], dynamic: bool = False) -> str:
        w = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype)
        if dynamic:
            inputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
        else:
            inits.append(numpy_helper.from_array(w, name))
        return name

    def const(name: str, value, np_type=None) -> str:
        inits.append(numpy_helper.from_array(np.array(value, dtype=np_type or dtype), name))
        return name

    def node(op: str, ins: list[str], out: str, **kw) -> str:
        nodes.append(helper.make_node(op, ins, [out], name=out + "_node", **kw))
        return out

    def projection(x: str, w: str, width: int, tag: str) -> str:
        out = node("MatMul", [x, w], f"{tag}_mm")
        if bias and not (partial_bias and tag == "up"):
            shape = gate_bias_shape if gate_bias_shape is not None and tag == "gate" else (width,)
            b = const(f"{tag}_b", rng.standard_normal(shape).astype(dtype))
            out = node("Add", [b, out] if tag == "up" else [out, b], f"{tag}_biased")
        return out

    if form == "separate":
        gate = projection("X", weight("W_gate", (K, N), dynamic_weight == "gate"), N, "gate")
        x_up = "X"
        if up_input is not None:
            inputs.append(helper.make_tensor_value_info(up_input, elem, lead + [K]))
            x_up = up_input
        up = projection(x_up, weight("W_up", (K, up_width), dynamic_weight == "up"), up_width, "up")
    else:
        h = projection("X", weight("W_gate_up", (K, 2 * N), dynamic_weight == "gate"), 2 * N, "gate_up")
        first, second = "half_a", "half_b"
        if form in ("split", "split_equal"):
            split_outputs = [first, second, "half_c"][:len(split_sizes or [N, N])]
            kw: dict = {"axis": axis}
            ins = [h]
            sizes = split_sizes or [N, N]
            if form == "split" or split_sizes:
                if opset < 13:
                    kw["split"] = sizes
                else:
                    ins.append(const("split_sizes", sizes, np.int64))
            elif opset >= 18:
                kw["num_outputs"] = 2
            nodes.append(helper.make_node("Split", ins, split_outputs, name="split", **kw))
        else:
            (s0, e0), (s1, e1) = halves or ((0, N), (N, INT64_MAX))
            if form == "slices_shape":
                shape = node("Shape", [h], "h_shape")
                dim = node("Gather", [shape, const("dim_index", shape_dim, np.int64)], "h_dim")
                d = node("Div", [dim, const("two", 2, np.int64)], "h_half")
                if opset < 13:
                    mid = node("Unsqueeze", [d], "h_half_1d", axes=[0])
                else:
                    mid = node("Unsqueeze", [d, const("unsq_axes", [0], np.int64)], "h_half_1d")
                bounds = [(const("s0", [s0], np.int64), mid), (mid, const("e1", [e1], np.int64))]
            elif bounds_from_input:   # h[..., :cut] and h[..., cut:2*cut]: equal widths, whatever cut is
                inputs.append(helper.make_tensor_value_info("cut", TensorProto.INT64, [1]))
                bounds = [(const("s0", [s0], np.int64), "cut"),
                          ("cut", node("Mul", ["cut", const("two", [2], np.int64)], "cut2"))]
            else:
                bounds = [(const(f"s{i}", [s], np.int64), const(f"e{i}", [e], np.int64))
                          for i, (s, e) in enumerate(((s0, e0), (s1, e1)))]
            for i, ((start, end), out) in enumerate(zip(bounds, (first, second))):
                if opset < 10:
                    arr = [numpy_helper.to_array(next(t for t in inits if t.name == v)).tolist() for v in (start, end)]
                    nodes.append(helper.make_node("Slice", [h], [out], name=f"slice{i}", starts=arr[0], ends=arr[1],
                                                  axes=[axis]))
                else:
                    nodes.append(helper.make_node("Slice", [h, start, end, const(f"axes{i}", [axis], np.int64),
                                                           const(f"steps{i}", [1], np.int64)], [out], name=f"slice{i}"))
        gate, up = (first, second) if gate_first else (second, first)
    a = activation_nodes(act, gate, node, const)
    if act_is_output:
        outputs.append(a)
    if up_shared:
        node("Neg", [up], "side")
        outputs.append("side")
    if product_with_input:
        inputs.append(helper.make_tensor_value_info("Z", elem, lead + [N]))
        up = "Z"
    prod = node("Mul", [a, up] if act_first else [up, a], "gated")
    if down:
        node("MatMul", [prod, weight("W_down", (N, K))], "Y")
    else:
        node("Identity", [prod], "Y")
    opsets = [helper.make_opsetid("", opset)]
    outs = [helper.make_tensor_value_info(v, elem, None) for v in outputs]
    g = helper.make_graph(nodes, "gated_mlp", inputs, outs, inits)
    return with_output_shapes(helper.make_model(g, opset_imports=opsets, ir_version=IR_VERSION))


def activation_nodes(act: str, x: str, node, const) -> str:
    """The activation as an exporter writes it (GELU decomposed: phase 0 makes it one op first)."""
    if act in ("silu", "silu_rev"):
        s = node("Sigmoid", [x], "act_sigmoid")
        return node("Mul", [x, s] if act == "silu" else [s, x], "act")
    if act == "swish":
        return node("Swish", [x], "act", alpha=1.0)
    if act == "relu":
        return node("Relu", [x], "act")
    if act in ("gelu_op", "gelu_tanh_op"):   # Gelu-20 as the dynamo exporter writes it
        return node("Gelu", [x], "act", approximate="none" if act == "gelu_op" else "tanh")
    if act == "gelu":
        e = node("Erf", [node("Div", [x, const("sqrt2", math.sqrt(2.0))], "gelu_div")], "gelu_erf")
        inner = node("Add", [e, const("one", 1.0)], "gelu_add")
        return node("Mul", [node("Mul", [x, inner], "gelu_mul"), const("half", 0.5)], "act")
    if act == "gelu_tanh":
        cube = node("Pow", [x, const("three", 3.0)], "gelu_cube")
        poly = node("Add", [x, node("Mul", [cube, const("c", 0.044715)], "gelu_cmul")], "gelu_poly")
        t = node("Tanh", [node("Mul", [poly, const("k", math.sqrt(2.0 / math.pi))], "gelu_kmul")], "gelu_tanh")
        inner = node("Add", [t, const("one", 1.0)], "gelu_add")
        return node("Mul", [node("Mul", [x, const("half", 0.5)], "gelu_half"), inner], "act")
    raise ValueError(act)


def _optimize(model: onnx.ModelProto, **kw):
    return optimize(model, options=OptimizeOptions(**kw))


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _gated_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "GatedMLP" and n.domain == "npufuse"]


def _reasons(res) -> set[str]:
    return {f.reason for f in res.refusals if f.pattern == "gated_mlp"}


def _assert_same_outputs(original: onnx.ModelProto, optimized: onnx.ModelProto) -> None:
    rng = np.random.default_rng(3)
    feeds = {}
    for i in original.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else 2 for d in i.type.tensor_type.shape.dim]
        dt = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        feeds[i.name] = np.full(dims, 2, dt) if np.issubdtype(dt, np.integer) else rng.standard_normal(dims).astype(dt)
    want, got = run(original, feeds), run(optimized, feeds)
    for name in want:
        c = compare(name, got[name], want[name])
        assert c.ok, c.detail


def _assert_fused(model: onnx.ModelProto, res, *, act: str, merged: int, gate_first: int | None = None,
                  has_bias: int = 0) -> onnx.NodeProto:
    """One GatedMLP with these attributes, the down projection left as it was, every check passed."""
    gated = _gated_nodes(res.model)
    assert len(gated) == 1, (_ops(res.model), res.refusals)
    a = attributes(gated[0])
    assert (a["activation"], a["merged"], a["has_bias"]) == (act, merged, has_bias)
    assert a.get("gate_first") == gate_first
    assert sorted(_ops(res.model)) == ["GatedMLP", "MatMul"]
    kinds = [r.match.kind for r in res.applied if r.match.pattern == "gated_mlp"]
    assert len(kinds) == 1 and kinds[0].startswith(f"GatedMLP[{act}")
    assert not [r for r in res.applied if r.match.pattern == "matmul_epilogue"]
    assert all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok, res.model_check
    _assert_same_outputs(model, res.model)
    onnx.checker.check_model(res.model, full_check=True)
    return gated[0]


# ---- positives ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("opset", [14, 17, 20])
@pytest.mark.parametrize("act", ["silu", "silu_rev", "gelu", "gelu_tanh", "relu"])
def test_separate_projections_fuse(act: str, opset: int) -> None:
    model = gated_model(act=act, opset=opset)
    res = _optimize(model)
    node = _assert_fused(model, res, act="silu" if act == "silu_rev" else act, merged=0)
    assert list(node.input) == ["X", "W_gate", "W_up"]
    assert list(node.output) == ["gated"]
    meta = {m.key: m.value for m in node.metadata_props}
    assert meta["npufuse.pattern"] == "gated_mlp"


@pytest.mark.parametrize("case", [
    {"bias": True}, {"bias": True, "partial_bias": True}, {"act_first": False}, {"symbolic": True},
    {"dtype": np.float16}, {"dtype": np.float16, "symbolic": True, "act": "gelu_op", "bias": True, "opset": 20},
    {"act": "gelu_tanh_op", "opset": 20},
    {"act": "relu", "act_first": False, "bias": True, "opset": 20},
], ids=lambda c: "-".join(f"{k}={getattr(v, '__name__', v)}" for k, v in c.items()))
def test_separate_projection_variants(case: dict) -> None:
    model = gated_model(**case)
    res = _optimize(model)
    act = case.get("act", "silu").replace("_op", "")
    node = _assert_fused(model, res, act=act, merged=0, has_bias=int(case.get("bias", False)))
    if case.get("partial_bias"):   # the up projection had no bias: a zero vector stands in for it
        inits = {t.name: numpy_helper.to_array(t) for t in res.model.graph.initializer}
        assert list(node.input[:4]) == ["X", "W_gate", "W_up", "gate_b"]
        assert not np.any(inits[node.input[4]]) and inits[node.input[4]].shape == (N,)


def test_swish_op_is_silu() -> None:
    model = gated_model(act="swish", opset=24)
    _assert_fused(model, _optimize(model), act="silu", merged=0)


MERGED_FORMS = ["split", "split_equal", "slices", "slices_shape"]


@pytest.mark.parametrize("opset", [11, 17, 18, 20])
@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("form", MERGED_FORMS)
def test_merged_projection_fuses(form: str, gate_first: bool, opset: int) -> None:
    model = gated_model(form=form, gate_first=gate_first, opset=opset, symbolic=True)
    res = _optimize(model)
    node = _assert_fused(model, res, act="silu", merged=1, gate_first=int(gate_first))
    assert list(node.input) == ["X", "W_gate_up"]
    # the Shape -> Gather -> Div -> Unsqueeze arithmetic of the slice bounds went with the fusion
    assert not {"Shape", "Gather", "Div", "Unsqueeze", "Split", "Slice"} & set(_ops(res.model))


@pytest.mark.parametrize("case", [
    {"form": "split", "act": "gelu_op", "bias": True, "dtype": np.float16, "opset": 20},
    {"form": "split", "act": "relu", "bias": True, "dtype": np.float16, "opset": 17},
    {"form": "slices", "act": "gelu_tanh", "gate_first": False, "opset": 20},
    {"form": "slices", "act": "relu", "opset": 9},                      # Slice bounds as attributes
    {"form": "slices", "act": "relu", "axis": 2, "bias": True},         # the last axis by its positive index
    {"form": "slices_shape", "act": "silu_rev", "symbolic": False},     # Shape of a fixed shape: a constant
    {"form": "slices_shape", "shape_dim": 2, "dtype": np.float16, "symbolic": True, "act_first": False},
    {"form": "slices", "halves": ((-2 * N, N), (-N, 2 * N))},           # negative starts, exact ends
    {"form": "split_equal", "act": "gelu", "opset": 20, "gate_first": False, "bias": True},
], ids=lambda c: "-".join(f"{k}={getattr(v, '__name__', v)}" for k, v in c.items()))
def test_merged_projection_variants(case: dict) -> None:
    model = gated_model(**case)
    res = _optimize(model)
    act = case.get("act", "silu").replace("silu_rev", "silu").replace("_op", "")
    node = _assert_fused(model, res, act=act, merged=1, gate_first=int(case.get("gate_first", True)),
                         has_bias=int(case.get("bias", False)))
    assert len(node.input) == (4 if case.get("bias") else 2) and node.input[0] == "X"
    assert all(not v for v in node.input[2:3])   # W_up absent: W_gate holds the [K, 2N] gate_up weight


def _gemm_model(*, merged: bool, opset: int = 17) -> onnx.ModelProto:
    """Linear layers on a 2-D input as TorchScript writes them: Gemm(transB=1) with C; alpha and beta set on one."""
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array((rng.standard_normal(shape) / 4).astype(np.float32), name) for name, shape in
             (("Wg", (2 * N if merged else N, K)), ("Wu", (N, K)), ("Cg", (2 * N if merged else N,)), ("Cu", (1, N)),
              ("Wd", (N, K)))]
    nodes = [helper.make_node("Gemm", ["X", "Wg", "Cg"], ["g"], name="gate_gemm", transB=1)]
    if merged:
        nodes += [helper.make_node("Split", ["g"], ["g0", "g1"], name="split", axis=1),
                  helper.make_node("Relu", ["g1"], ["a"], name="act"),
                  helper.make_node("Mul", ["g0", "a"], ["p"], name="prod")]
    else:
        nodes += [helper.make_node("Gemm", ["X", "Wu", "Cu"], ["u"], name="up_gemm", transB=1, alpha=0.5, beta=2.0),
                  helper.make_node("Relu", ["g"], ["a"], name="act"),
                  helper.make_node("Mul", ["a", "u"], ["p"], name="prod")]
    nodes.append(helper.make_node("Gemm", ["p", "Wd"], ["Y"], name="down"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [6, K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                                                ir_version=IR_VERSION))


@pytest.mark.parametrize("merged", [False, True])
def test_gemm_projections_fuse_with_transb_alpha_beta_folded(merged: bool) -> None:
    model = _gemm_model(merged=merged)
    res = _optimize(model)
    gated = _gated_nodes(res.model)
    assert len(gated) == 1 and sorted(_ops(res.model)) == ["GatedMLP", "Gemm"], _ops(res.model)
    a = attributes(gated[0])
    assert (a["activation"], a["merged"], a["has_bias"], a.get("gate_first")) == \
        ("relu", int(merged), 1, 0 if merged else None)
    inits = {t.name: numpy_helper.to_array(t) for t in res.model.graph.initializer}
    orig = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(inits[gated[0].input[1]], orig["Wg"].T)       # transB folded
    if not merged:
        np.testing.assert_allclose(inits[gated[0].input[2]], 0.5 * orig["Wu"].T, rtol=1e-6)   # alpha folded
        np.testing.assert_allclose(inits[gated[0].input[4]], 2.0 * orig["Cu"].reshape(-1), rtol=1e-6)  # beta
    assert all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok
    _assert_same_outputs(model, res.model)


def test_fused_node_records_what_it_replaced() -> None:
    res = _optimize(gated_model(form="slices_shape", symbolic=True))
    meta = {m.key: m.value for m in _gated_nodes(res.model)[0].metadata_props}
    replaced = set(meta["npufuse.replaced"].split(","))
    # the Slice bounds' shape arithmetic (Shape -> Gather -> Div -> Unsqueeze of a static dim) is folded to a
    # constant by the canonical phase (fold_static_value) before matching: nothing of it is left to replace
    assert {"gate_up_mm_node", "slice0", "slice1", "act_sigmoid_node", "act_node", "gated_node"} == replaced
    assert res.canonical.get("fold_static_value") == 1


def test_gated_pattern_wins_over_fusedmatmul_and_fusedmatmul_takes_it_when_disabled() -> None:
    """Phase 1 runs before matmul_epilogue (phase 2), which would take the gate's SiLU as FusedMatMul[silu]."""
    by_name = {p.name: p for p in PATTERNS}
    assert by_name["gated_mlp"].phase < by_name["matmul_epilogue"].phase
    assert by_name["gated_mlp"].phase > max(by_name[n].phase for n in ("gelu", "layernorm", "rmsnorm"))
    model = gated_model(act="gelu", opset=17, bias=True)
    assert Counter(_ops(_optimize(model).model)) == Counter({"GatedMLP": 1, "MatMul": 1})
    res = _optimize(model, patterns=[p for p in PATTERNS if p.name != "gated_mlp"])
    assert Counter(_ops(res.model)) == Counter({"FusedMatMul": 2, "Mul": 1, "MatMul": 1})
    assert sorted(r.match.kind for r in res.applied if r.match.pattern == "matmul_epilogue") == \
        ["FusedMatMul[bias,gelu]", "FusedMatMul[bias]"]


# ---- near-misses -------------------------------------------------------------------------------------

NEAR_MISSES = {
    # name: (builder kwargs, reason, does the gate projection still become FusedMatMul[silu])
    "different_inputs": ({"up_input": "X2"}, "different-inputs", True),
    "activation_is_graph_output": ({"act_is_output": True}, "intermediate-is-output", True),
    "up_projection_used_elsewhere": ({"up_shared": True}, "shared-intermediate", True),
    "up_weight_of_another_width": ({"up_width": 1}, "weight-shape-mismatch", True),
    "gate_bias_along_rows": ({"bias": True, "gate_bias_shape": (3, N)}, "bias-not-last-axis", False),
    "dynamic_gate_weight": ({"dynamic_weight": "gate"}, "dynamic-weight", False),
    "dynamic_up_weight": ({"dynamic_weight": "up"}, "dynamic-weight", True),
    "merged_dynamic_weight": ({"form": "split", "dynamic_weight": "gate"}, "dynamic-weight", False),
    "product_with_another_tensor": ({"product_with_input": True}, "product-not-gated", True),
    "merged_product_with_another_tensor": ({"form": "split", "product_with_input": True}, "product-not-gated",
                                           False),
    "slices_with_a_gap": ({"form": "slices", "halves": ((0, 20), (28, 2 * N)), "down": False}, "uneven-split",
                          False),
    "slices_overlap": ({"form": "slices", "halves": ((0, N), (N - 4, 2 * N - 4))}, "uneven-split", False),
    "split_in_three": ({"form": "split", "split_sizes": [16, 16, 16], "down": False}, "uneven-split", False),
    "split_not_last_axis": ({"form": "split", "axis": 1, "split_sizes": [1, 2], "down": False},
                            "split-not-last-axis", False),
    "slice_bounds_from_an_input": ({"form": "slices", "bounds_from_input": True, "down": False},
                                   "slice-bounds-unknown", False),
    "slice_bounds_from_a_symbolic_dim": ({"form": "slices_shape", "symbolic": True, "shape_dim": 0, "down": False},
                                         "slice-bounds-unknown", False),
}


@pytest.mark.parametrize("case", list(NEAR_MISSES))
def test_near_miss_does_not_fuse(case: str) -> None:
    kw, reason, gate_fusedmatmul = NEAR_MISSES[case]
    model = gated_model(**kw)
    res = _optimize(model)
    assert not _gated_nodes(res.model), _ops(res.model)
    assert reason in _reasons(res), res.refusals
    refusal = next(f for f in res.refusals if f.pattern == "gated_mlp" and f.reason == reason)
    assert refusal.node and refusal.detail and refusal.nodes
    # FusedMatMul still takes what it can: the gate projection and its SiLU where the gate is a projection
    kinds = [r.match.kind for r in res.applied if r.match.pattern == "matmul_epilogue"]
    assert ("FusedMatMul[silu]" in kinds) == gate_fusedmatmul, kinds
    assert res.model_check is None or res.model_check.ok
    _assert_same_outputs(model, res.model)


def test_a_scaled_activation_is_not_a_near_miss() -> None:
    """act(x·W) * 0.5 is not gating anything: no refusal noise, FusedMatMul takes the gate projection."""
    model = gated_model(product_with_input=True)
    graph = model.graph
    mul = next(n for n in graph.node if n.output[0] == "gated")
    graph.input.remove(next(i for i in graph.input if i.name == "Z"))
    graph.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "Z"))
    res = _optimize(model)
    assert mul.input[1] == "Z" and not _reasons(res)
    assert "FusedMatMul" in _ops(res.model)


# ---- the fused op: reference kernel vs function body -------------------------------------------------

def _run_op(attrs: dict, opset: int, dtype=np.float32, seed: int = 7):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 5, K)) * 2).astype(dtype)
    merged = attrs["merged"]
    tensors = {"w": (rng.standard_normal((K, 2 * N if merged else N)) / np.sqrt(K)).astype(dtype)}
    if not merged:
        tensors["w_up"] = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(dtype)
    if attrs["has_bias"]:
        tensors["b"] = rng.standard_normal(2 * N if merged else N).astype(dtype)
        if not merged:
            tensors["b_up"] = rng.standard_normal(N).astype(dtype)
    names = ["x"] + [k if k in tensors else "" for k in ("w", "w_up", "b", "b_up")]
    while not names[-1]:
        names.pop()
    want = GATED_MLP.reference([x] + [tensors.get(k) for k in ("w", "w_up", "b", "b_up")], attrs)[0]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node, fn = GATED_MLP.make_node(names, ["y"], "gm", attrs, opset, elem)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, x.shape)],
                          [helper.make_tensor_value_info("y", elem, want.shape)],
                          [numpy_helper.from_array(v, k) for k, v in tensors.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("npufuse", 1)],
                          functions=[fn], ir_version=IR_VERSION)
    onnx.checker.check_model(m, full_check=True)
    return x, tensors, want, run(m, {"x": x})["y"], fn


def _all_attrs() -> list[dict]:
    out = []
    for act in ACTS:
        for has_bias in (0, 1):
            out.append({"activation": act, "merged": 0, "has_bias": has_bias})
            out += [{"activation": act, "merged": 1, "gate_first": gf, "has_bias": has_bias} for gf in (1, 0)]
    return out


def _attrs_id(a: dict) -> str:
    return f"{a['activation']}-{'merged' + str(a['gate_first']) if a['merged'] else 'separate'}-bias{a['has_bias']}"


@pytest.mark.parametrize("opset", [11, 14, 17, 18, 20])
@pytest.mark.parametrize("attrs", _all_attrs(), ids=_attrs_id)
def test_function_body_matches_reference_kernel(attrs: dict, opset: int) -> None:
    x, tensors, want, got, fn = _run_op(attrs, opset)
    assert got.dtype == want.dtype == np.float32 and got.shape == (2, 5, N)
    c = compare("y", got, want)
    assert c.ok, c.detail
    ops = [n.op_type for n in fn.node]
    assert ("Gelu" in ops) == (attrs["activation"].startswith("gelu") and opset >= 20)
    split = next((n for n in fn.node if n.op_type == "Split"), None)
    assert (split is not None) == bool(attrs["merged"])
    if split is not None:
        assert ("num_outputs" in attributes(split)) == (opset >= 18)


@pytest.mark.parametrize("attrs", [a for a in _all_attrs() if a["has_bias"]], ids=_attrs_id)
@pytest.mark.parametrize("opset", [14, 20])
def test_fp16_function_body_matches_reference(attrs: dict, opset: int) -> None:
    _, _, want, got, _ = _run_op(attrs, opset, dtype=np.float16)
    assert got.dtype == np.float16
    c = compare("y", got, want)
    assert c.ok, c.detail


def test_overloads_differ_per_signature() -> None:
    seen: dict[str, tuple] = {}
    for attrs in _all_attrs():
        for opset in (14, 17, 18, 20):
            for elem in (TensorProto.FLOAT, TensorProto.FLOAT16):
                fn = GATED_MLP.body(attrs, opset, elem)
                body = tuple(n.SerializeToString() for n in fn.node)
                assert seen.setdefault(fn.overload, body) == body, fn.overload


def test_reference_kernel_is_the_textbook_math() -> None:
    rng = np.random.default_rng(0)
    x, wg, wu = rng.standard_normal((3, 4)), rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    bg, bu = rng.standard_normal(5), rng.standard_normal(5)
    g, u = x @ wg + bg, x @ wu + bu
    erf = np.vectorize(math.erf)
    want = {"silu": g / (1 + np.exp(-g)) * u, "relu": np.maximum(g, 0) * u,
            "gelu": 0.5 * g * (1 + erf(g / np.sqrt(2))) * u,
            "gelu_tanh": 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u}
    for act, expected in want.items():
        got = GATED_MLP.reference([x, wg, wu, bg, bu], {"activation": act, "merged": 0, "has_bias": 1})[0]
        np.testing.assert_allclose(got, expected, rtol=1e-12)
        merged_w, merged_b = np.concatenate([wu, wg], 1), np.concatenate([bu, bg])
        got = GATED_MLP.reference([x, merged_w, None, merged_b], {"activation": act, "merged": 1, "gate_first": 0,
                                                                  "has_bias": 1})[0]
        np.testing.assert_allclose(got, expected, rtol=1e-12)


# ---- the checks can fail ------------------------------------------------------------------------------

def _corrupted(op: patterns_base.FusedOpDef, **changes) -> patterns_base.FusedOpDef:
    return dataclasses.replace(op, **changes)


def test_a_wrong_reference_kernel_fails_the_rewrite_check(monkeypatch) -> None:
    real = GATED_MLP.reference

    def off_by_one_percent(inputs, attrs):
        return [(y.astype(np.float64) * 1.01).astype(y.dtype) for y in real(inputs, attrs)]

    defs = dict(patterns_registry.fused_op_defs())
    defs[("npufuse", "GatedMLP")] = _corrupted(GATED_MLP, reference=off_by_one_percent)
    monkeypatch.setattr(patterns_registry, "fused_op_defs", lambda: defs)
    model = gated_model(form="split", act="gelu")
    res = _optimize(model)
    rolled = [r for r in res.rolled_back if r.match.pattern == "gated_mlp"]
    assert len(rolled) == 1 and rolled[0].check is not None and not rolled[0].check.ok
    assert rolled[0].reason and rolled[0].match.kind == "GatedMLP[gelu,merged]"
    assert not _gated_nodes(res.model)
    assert res.model_check is None or res.model_check.ok   # nothing wrong was written


def test_a_wrong_function_body_fails_the_whole_model_check(monkeypatch) -> None:
    """The body onnxruntime runs must compute what the reference kernel says: here it forgets the activation."""
    real_body = GATED_MLP.body

    def relu_instead(attrs, opset, elem_type):
        fn = real_body({**attrs, "activation": "relu"}, opset, elem_type)
        fn.overload = fn.overload + "__corrupt"
        return fn

    monkeypatch.setattr(gated_mlp_module, "GATED_MLP", _corrupted(GATED_MLP, body=relu_instead))
    monkeypatch.setattr(patterns_base, "_BODIES", {})
    model = gated_model(act="silu", bias=True)
    res = _optimize(model)
    assert _gated_nodes(res.model)                      # the rewrite itself passed its (reference) check ...
    assert res.model_check is not None and not res.model_check.ok and not res.ok   # ... the whole model did not


# ---- pricing -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile", ["Ascend910B2", "Ascend910A", "Ascend310P3"])
def test_priced_as_one_cube_vector_kernel_that_pays(profile: str) -> None:
    spec = load_profile(profile)
    x, y = TensorInfo((1, 512, 4096), "float16"), TensorInfo((1, 512, 11008), "float16")
    w = TensorInfo((4096, 11008), "float16", True)
    unfused = (OpWork("gate", "MatMul", "", (x, w), (y,)), OpWork("sig", "Sigmoid", "", (y,), (y,)),
               OpWork("silu", "Mul", "", (y, y), (y,)), OpWork("up", "MatMul", "", (x, w), (y,)),
               OpWork("prod", "Mul", "", (y, y), (y,)))
    separate = OpWork("gm", "GatedMLP", "npufuse", (x, w, w), (y,), {"activation": "silu", "merged": 0})
    merged = OpWork("gm", "GatedMLP", "npufuse", (x, TensorInfo((4096, 2 * 11008), "float16", True)), (y,),
                    {"activation": "silu", "merged": 1, "gate_first": 1})
    est, est_merged = estimate_op(separate, spec), estimate_op(merged, spec)
    assert est.kind == "cube+vector" and est.launches == 1
    assert est.t_total_us == pytest.approx(est_merged.t_total_us)
    assert est.gm_bytes_written == y.nbytes
    d = decide(FusionCandidate("gated_mlp", unfused, (separate,)), spec)
    assert d.fuse and d.gain_us > 0
    # a wider gate costs more: the estimate is monotone in N
    w_wide = TensorInfo((4096, 14336), "float16", True)
    wider = OpWork("gm", "GatedMLP", "npufuse", (x, w_wide, w_wide), (TensorInfo((1, 512, 14336), "float16"),),
                   {"activation": "silu", "merged": 0})
    assert estimate_op(wider, spec).t_total_us > est.t_total_us


# ---- real exporter output ----------------------------------------------------------------------------

_MANIFEST = {f["file"]: f for f in json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]}
LLAMA_FIXTURES = sorted(f for f, e in _MANIFEST.items() if e["base_family"] == "llama")


def test_the_llama_fixtures_are_all_here() -> None:
    assert LLAMA_FIXTURES == ["llama_dynamo.onnx", "llama_sdpa_dynamo.onnx", "llama_sdpa_ts17.onnx",
                              "llama_ts14.onnx", "llama_ts17.onnx"]


@pytest.mark.parametrize("fixture", LLAMA_FIXTURES)
def test_every_llama_mlp_fuses(fixture: str) -> None:
    entry = _MANIFEST[fixture]
    n_layers = entry["config"]["num_layers"]
    assert entry["config"]["hidden_act"] == "silu" and entry["expected"]["silu"] == n_layers
    model = onnx.load(str(FIXTURES / fixture), load_external_data=False)
    res = optimize(model, str(FIXTURES), OptimizeOptions())
    gated = [r for r in res.records if r.match.pattern == "gated_mlp"]
    assert [r.status for r in gated] == ["applied"] * n_layers, [(r.status, r.reason) for r in gated]
    assert all(r.check is not None and r.check.ok for r in gated)
    assert [r.match.kind for r in gated] == ["GatedMLP[silu]"] * n_layers
    nodes = _gated_nodes(res.model)
    assert len(nodes) == n_layers == fusion_census(res.model)["gated_mlp"]
    assert all(attributes(n) == {"activation": "silu", "merged": 0, "has_bias": 0} for n in nodes)
    # the gate's SiLU went into the GatedMLP, not into a FusedMatMul; the down projections stay MatMuls
    assert "Sigmoid" not in _ops(res.model)
    assert not [n for n in res.model.graph.node if n.op_type == "FusedMatMul" and "silu" in attributes(n)["epilogue"]]
    downs = [c for n in nodes for c in res.model.graph.node if n.output[0] in c.input]
    assert [c.op_type for c in downs] == ["MatMul"] * n_layers
    assert not _reasons(res)
    assert res.model_check is not None and res.model_check.ok, res.model_check


def test_pattern_is_registered_in_phase_one() -> None:
    p = next(p for p in PATTERNS if p.name == "gated_mlp")
    assert isinstance(p, GatedMLPPattern) and p.phase == 1 and p.anchor_ops == {"Mul"}
    assert ("npufuse", "GatedMLP") in patterns_registry.fused_op_defs()
