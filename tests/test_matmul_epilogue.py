"""MatMul/Gemm -> [bias] -> norm/activation epilogue: positives, near-misses, function bodies, real exports."""

from __future__ import annotations

import json
import math
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
from npufuse.patterns.matmul_epilogue import FUSED_MATMUL, MatMulEpilogue
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

FIXTURES = Path(__file__).parent / "fixtures"
K, N, ROWS = 16, 24, 6
ACTS = ("gelu", "gelu_tanh", "relu", "silu")
NORMS = ("layernorm", "rmsnorm")


# ---- graph builders ---------------------------------------------------------------------------------

def _fused_def(op_type: str):
    return fused_op_defs().get(("npufuse", op_type))


def _std_or_fused_node(kind: str, x: str, y: str, opset: int, inits: list, functions: list, rng, *,
                       axis: int = -1, eps: float = 1e-5, with_beta: bool = True,
                       extra_outputs: tuple[str, ...] = ()) -> onnx.NodeProto:
    """A single-op GELU / LayerNorm / RMSNorm the way phase 0 leaves it at `opset` (standard op where the
    opset has it, else the npufuse op with its function body)."""
    if kind in ("gelu", "gelu_tanh"):
        approx = "none" if kind == "gelu" else "tanh"
        if opset >= 20:
            return helper.make_node("Gelu", [x], [y], name=kind, approximate=approx)
        d = _fused_def("Gelu")
        node, fn = d.make_node([x], [y], kind, {"approximate": approx}, opset, TensorProto.FLOAT)
    else:
        gamma = rng.uniform(0.5, 1.5, N).astype(np.float32)
        inits.append(numpy_helper.from_array(gamma, f"{kind}_gamma"))
        ins = [x, f"{kind}_gamma"]
        if kind == "layernorm" and with_beta:
            inits.append(numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), f"{kind}_beta"))
            ins.append(f"{kind}_beta")
        std = {"layernorm": ("LayerNormalization", 17), "rmsnorm": ("RMSNormalization", 23)}[kind]
        if opset >= std[1]:
            return helper.make_node(std[0], ins, [y, *extra_outputs], name=kind, axis=axis, epsilon=eps)
        d = _fused_def("LayerNorm" if kind == "layernorm" else "RMSNorm")
        attrs = {"epsilon": eps}
        if "axis" in d.attributes:
            attrs["axis"] = axis
        node, fn = d.make_node(ins, [y], kind, attrs, opset, TensorProto.FLOAT)
    if fn is not None and all((f.name, f.overload) != (fn.name, fn.overload) for f in functions):
        functions.append(fn)
    return node


def mm_model(steps: list[str], *, opset: int = 17, form: str = "matmul", rank: int = 3, seed: int = 0,
             bias_shape: tuple[int, ...] | None = None, bias_first: bool = False, weight_as_input: bool = False,
             trans_b: int = 0, alpha: float = 1.0, beta: float = 1.0, trans_a: int = 0,
             reshape_to: tuple[int, ...] | None = None, norm_axis: int = -1, graph_outputs: tuple[str, ...] = (),
             extra_consumer_of: str | None = None, llama_up: bool = False, ln_mean_output: bool = False,
             gemm_c_shape: tuple[int, ...] | None = None) -> onnx.ModelProto:
    """X -> MatMul/Gemm(W) -> steps -> Y. Steps: bias, residual, relu, silu, gelu, gelu_tanh, layernorm,
    rmsnorm. Intermediate values are named after the step that produced them (mm, bias, relu, ...)."""
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    functions: list[onnx.FunctionProto] = []
    lead = {2: [ROWS], 3: [2, ROWS // 2], 4: [2, 3, ROWS // 3]}[rank] if form == "matmul" else [ROWS]
    x_shape = lead + [K] if not trans_a else [K, ROWS]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    if trans_b:
        w = np.ascontiguousarray(w.T)
    if weight_as_input:
        inputs.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, list(w.shape)))
    else:
        inits.append(numpy_helper.from_array(w, "W"))
    nodes: list[onnx.NodeProto] = []
    outputs: list[str] = list(graph_outputs)
    remaining = list(steps)
    if form == "gemm":
        gemm_in = ["X", "W"]
        if remaining and remaining[0] == "bias":
            remaining.pop(0)
            c = rng.standard_normal(gemm_c_shape or (N,)).astype(np.float32)
            inits.append(numpy_helper.from_array(c, "C"))
            gemm_in.append("C")
        nodes.append(helper.make_node("Gemm", gemm_in, ["mm"], name="gemm", transB=trans_b, transA=trans_a,
                                      alpha=alpha, beta=beta))
    else:
        nodes.append(helper.make_node("MatMul", ["X", "W"], ["mm"], name="matmul"))
    cur = "mm"
    if reshape_to is not None:
        inits.append(numpy_helper.from_array(np.array(reshape_to, dtype=np.int64), "reshape_shape"))
        nodes.append(helper.make_node("Reshape", [cur, "reshape_shape"], ["reshaped"], name="reshape"))
        cur = "reshaped"
    for step in remaining:
        out = step
        if step == "bias":
            b = rng.standard_normal(bias_shape or (N,)).astype(np.float32)
            inits.append(numpy_helper.from_array(b, "B"))
            nodes.append(helper.make_node("Add", ["B", cur] if bias_first else [cur, "B"], [out], name="bias_add"))
        elif step == "residual":
            res_shape = [d.dim_value for d in inputs[0].type.tensor_type.shape.dim][:-1] + [N]
            inputs.append(helper.make_tensor_value_info("R", TensorProto.FLOAT, res_shape))
            nodes.append(helper.make_node("Add", ["R", cur], [out], name="residual_add"))
        elif step == "relu":
            nodes.append(helper.make_node("Relu", [cur], [out], name="relu"))
        elif step == "silu":
            nodes.append(helper.make_node("Sigmoid", [cur], ["sig"], name="sigmoid"))
            nodes.append(helper.make_node("Mul", ["sig", cur] if bias_first else [cur, "sig"], [out], name="silu_mul"))
        elif step in ACTS + NORMS:
            extra = ("ln_mean",) if (ln_mean_output and step == "layernorm") else ()
            nodes.append(_std_or_fused_node(step, cur, out, opset, inits, functions, rng, axis=norm_axis,
                                            extra_outputs=extra))
            if extra:
                outputs.append("ln_mean")
        else:
            raise ValueError(step)
        cur = out
    if llama_up:  # act(gate(x)) * up(x): only the gate's activation is an epilogue
        inits.append(numpy_helper.from_array((rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32), "W_up"))
        nodes.append(helper.make_node("MatMul", ["X", "W_up"], ["up"], name="up_proj"))
        nodes.append(helper.make_node("Mul", [cur, "up"], ["gated"], name="gate_mul"))
        cur = "gated"
    if extra_consumer_of is not None:
        nodes.append(helper.make_node("Neg", [extra_consumer_of], ["side"], name="side"))
        outputs.append("side")
    nodes.append(helper.make_node("Identity", [cur], ["Y"], name="out"))
    outs = [helper.make_tensor_value_info(v, TensorProto.FLOAT, None) for v in ["Y"] + outputs]
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("npufuse", 1)] if functions else [])
    g = helper.make_graph(nodes, "mm_chain", inputs, outs, inits)
    return with_output_shapes(helper.make_model(g, opset_imports=opsets, functions=functions, ir_version=IR_VERSION))


def _optimize(model: onnx.ModelProto, **kw):
    return optimize(model, options=OptimizeOptions(**kw))


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _epilogues(model: onnx.ModelProto) -> list[tuple[str, ...]]:
    return [tuple(attributes(n)["epilogue"]) for n in model.graph.node if n.op_type == "FusedMatMul"]


def _assert_same_outputs(original: onnx.ModelProto, optimized: onnx.ModelProto) -> None:
    feeds = random_feeds(original, seed=3)
    want, got = run(original, feeds), run(optimized, feeds)
    assert set(want) == set(got)
    for name in want:
        c = compare(name, got[name], want[name])
        assert c.ok, c.detail


# ---- positives --------------------------------------------------------------------------------------

POSITIVE_CASES = {
    # name: (steps, builder kwargs, expected epilogue, ops left beside FusedMatMul)
    "mla_prolog_ln_gelu": (["layernorm", "gelu"], {}, ("layernorm", "gelu"), []),
    "bert_head_bias_gelu_ln": (["bias", "gelu", "layernorm"], {}, ("bias", "gelu", "layernorm"), []),
    "rmsnorm": (["rmsnorm"], {}, ("rmsnorm",), []),
    "bias_rmsnorm_2d": (["bias", "rmsnorm"], {"rank": 2}, ("bias", "rmsnorm"), []),
    "ffn_bias_gelu": (["bias", "gelu"], {"bias_first": True}, ("bias", "gelu"), []),
    "ffn_bias_gelu_tanh_4d": (["bias", "gelu_tanh"], {"rank": 4}, ("bias", "gelu_tanh"), []),
    "bias_relu": (["bias", "relu"], {}, ("bias", "relu"), []),
    "bias_silu_commuted": (["bias", "silu"], {"bias_first": True}, ("bias", "silu"), []),
    # act(gate(x)) * up(x) is a gated MLP (npufuse.GatedMLP, phase 1); with that pattern disabled
    # (`--disable gated_mlp`), FusedMatMul still takes the gate projection and its SiLU
    "llama_gate_silu": (["silu"], {"llama_up": True}, ("silu",), ["MatMul", "Mul"]),
    "relu_layernorm": (["relu", "layernorm"], {}, ("relu", "layernorm"), []),
    "bias_only": (["bias"], {"bias_shape": (1, 1, N)}, ("bias",), []),
    "gemm_bias_gelu": (["bias", "gelu"], {"form": "gemm"}, ("bias", "gelu"), []),
    "gemm_transb_alpha_beta_relu": (["bias", "relu"], {"form": "gemm", "trans_b": 1, "alpha": 0.5, "beta": 2.0},
                                    ("bias", "relu"), []),
    "gemm_scalar_c_layernorm": (["bias", "layernorm"], {"form": "gemm", "gemm_c_shape": (1,)},
                                ("bias", "layernorm"), []),
    "gpt2_gemm_reshape_gelu_tanh": (["bias", "gelu_tanh"], {"form": "gemm", "reshape_to": (2, -1, N)},
                                    ("bias", "gelu_tanh"), ["Reshape"]),
    "gemm_reshape_layernorm": (["bias", "layernorm"], {"form": "gemm", "reshape_to": (3, 2, N)},
                               ("bias", "layernorm"), ["Reshape"]),
    "gemm_no_c_reshape_bias_silu": ([], {}, ("bias", "silu"), ["Reshape"]),  # built by its own helper
}


@pytest.mark.parametrize("opset", [14, 17, 20])
@pytest.mark.parametrize("case", list(POSITIVE_CASES))
def test_epilogue_fuses_into_fusedmatmul(case: str, opset: int) -> None:
    steps, kw, want_epilogue, others = POSITIVE_CASES[case]
    if case == "gemm_no_c_reshape_bias_silu":
        # the bias is an Add after the Reshape, not Gemm's C
        model = _gemm_then_reshape_add_bias(opset)
    else:
        model = mm_model(steps, opset=opset, **kw)
    if case == "llama_gate_silu":
        assert _ops(_optimize(model).model) == ["GatedMLP", "Identity"]
        res = _optimize(model, patterns=[p for p in PATTERNS if p.name != "gated_mlp"])
    else:
        res = _optimize(model)
    assert _epilogues(res.model) == [want_epilogue], (res.refusals, _ops(res.model))
    assert sorted(_ops(res.model)) == sorted(["FusedMatMul", "Identity", *others])
    assert [r.match.kind for r in res.applied if r.match.pattern == "matmul_epilogue"] == \
        [f"FusedMatMul[{','.join(want_epilogue)}]"]
    assert all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok
    node = next(n for n in res.model.graph.node if n.op_type == "FusedMatMul")
    assert node.domain == "npufuse"
    if any(s in want_epilogue for s in NORMS):
        assert attributes(node)["epsilon"] == pytest.approx(1e-5)
    _assert_same_outputs(model, res.model)
    onnx.checker.check_model(res.model, full_check=True)


def _gemm_then_reshape_add_bias(opset: int) -> onnx.ModelProto:
    """Gemm without C -> Reshape -> Add(bias) -> SiLU: the bias comes after the Reshape."""
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array((rng.standard_normal((K, N)) / 4).astype(np.float32), "W"),
             numpy_helper.from_array(np.array([2, 3, N], dtype=np.int64), "shape"),
             numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), "B")]
    nodes = [helper.make_node("Gemm", ["X", "W"], ["mm"], name="gemm"),
             helper.make_node("Reshape", ["mm", "shape"], ["r"], name="reshape"),
             helper.make_node("Add", ["r", "B"], ["b"], name="bias_add"),
             helper.make_node("Sigmoid", ["b"], ["s"], name="sig"),
             helper.make_node("Mul", ["s", "b"], ["y"], name="silu_mul"),
             helper.make_node("Identity", ["y"], ["Y"], name="out")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [ROWS, K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                                                ir_version=IR_VERSION))


def test_fused_node_keeps_the_last_output_name_and_records_provenance() -> None:
    model = mm_model(["bias", "gelu", "layernorm"], opset=20)
    res = _optimize(model)
    node = next(n for n in res.model.graph.node if n.op_type == "FusedMatMul")
    assert list(node.output) == ["layernorm"]
    meta = {m.key: m.value for m in node.metadata_props}
    assert meta["npufuse.replaced"] == "matmul,bias_add,gelu,layernorm"


def test_gemm_reshape_keeps_reshape_after_fused_op_with_final_shape() -> None:
    model = mm_model(["bias", "gelu_tanh"], opset=20, form="gemm", reshape_to=(2, -1, N))
    res = _optimize(model)
    assert _ops(res.model) == ["FusedMatMul", "Reshape", "Identity"]
    fused, reshape = res.model.graph.node[0], res.model.graph.node[1]
    assert list(fused.input[:1]) == ["X"] and reshape.input[0] == fused.output[0]
    assert list(reshape.output) == ["gelu_tanh"]
    out = run(res.model, random_feeds(model))["Y"]
    assert out.shape == (2, ROWS // 2, N)


def test_gemm_transb_and_alpha_are_folded_into_a_new_weight() -> None:
    model = mm_model(["bias", "relu"], form="gemm", trans_b=1, alpha=0.5, beta=2.0)
    res = _optimize(model)
    node = res.model.graph.node[0]
    inits = {t.name: numpy_helper.to_array(t) for t in res.model.graph.initializer}
    w_orig = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "W"))
    c_orig = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "C"))
    np.testing.assert_allclose(inits[node.input[1]], 0.5 * w_orig.T, rtol=1e-6)
    np.testing.assert_allclose(inits[node.input[2]], 2.0 * c_orig, rtol=1e-6)
    assert "W" not in inits and "C" not in inits  # the originals are no longer used


# ---- near-misses ------------------------------------------------------------------------------------

def _reasons(res) -> set[str]:
    return {f.reason for f in res.refusals if f.pattern == "matmul_epilogue"}


def test_norm_over_a_non_last_axis_is_refused() -> None:
    res = _optimize(mm_model(["layernorm"], opset=17, norm_axis=-2, rank=3))
    assert "FusedMatMul" not in _ops(res.model)
    assert "norm-not-last-axis" in _reasons(res)


def test_norm_over_a_non_last_axis_after_bias_leaves_the_norm_outside() -> None:
    model = mm_model(["bias", "layernorm"], opset=17, norm_axis=1, rank=3)
    res = _optimize(model)
    assert _epilogues(res.model) == [("bias",)]
    assert "LayerNormalization" in _ops(res.model)
    _assert_same_outputs(model, res.model)


@pytest.mark.parametrize("bias_shape", [(ROWS // 2, 1), (ROWS // 2, N), (2, 1, 1, N)])
def test_bias_broadcasting_along_another_axis_does_not_fuse(bias_shape: tuple[int, ...]) -> None:
    res = _optimize(mm_model(["bias", "gelu"], opset=20, bias_shape=bias_shape))
    assert "FusedMatMul" not in _ops(res.model)
    assert "bias-not-last-axis" in _reasons(res)


def test_gemm_c_broadcasting_along_rows_does_not_fuse() -> None:
    res = _optimize(mm_model(["bias", "relu"], form="gemm", gemm_c_shape=(ROWS, N)))
    assert "FusedMatMul" not in _ops(res.model)
    assert "bias-not-last-axis" in _reasons(res)


def test_gemm_with_trans_a_is_refused() -> None:
    res = _optimize(mm_model(["bias", "relu"], form="gemm", trans_a=1))
    assert "FusedMatMul" not in _ops(res.model)
    assert "gemm-transA" in _reasons(res)


def test_gemm_with_only_its_own_bias_is_left_alone() -> None:
    res = _optimize(mm_model(["bias"], form="gemm"))
    assert _ops(res.model) == ["Gemm", "Identity"]
    assert not _reasons(res)


def test_dynamic_weight_with_epilogue_is_refused() -> None:
    res = _optimize(mm_model(["bias", "relu"], weight_as_input=True))
    assert "FusedMatMul" not in _ops(res.model)
    assert "dynamic-weight" in _reasons(res)


def test_dynamic_weight_without_epilogue_is_ignored_silently() -> None:
    """Q·Kᵀ -> Softmax: not this pattern, and not a near-miss either."""
    nodes = [helper.make_node("Transpose", ["K"], ["kt"], perm=[0, 2, 1], name="kt"),
             helper.make_node("MatMul", ["Q", "kt"], ["s"], name="qk"),
             helper.make_node("Softmax", ["s"], ["Y"], axis=-1, name="softmax")]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, 8]) for n in ("Q", "K")]
    g = helper.make_graph(nodes, "g", vi, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION))
    res = _optimize(model)
    assert _ops(res.model) == _ops(model)
    assert not _reasons(res)


def test_matmul_output_as_graph_output_is_refused() -> None:
    res = _optimize(mm_model(["bias", "relu"], graph_outputs=("mm",)))
    assert "FusedMatMul" not in _ops(res.model)
    assert "intermediate-is-output" in _reasons(res)


def test_matmul_output_with_another_reader_is_refused() -> None:
    res = _optimize(mm_model(["relu"], extra_consumer_of="mm"))
    assert "FusedMatMul" not in _ops(res.model)
    assert "shared-intermediate" in _reasons(res)


def test_intermediate_graph_output_stops_the_epilogue_there() -> None:
    model = mm_model(["bias", "gelu", "layernorm"], opset=20, graph_outputs=("gelu",))
    res = _optimize(model)
    assert _epilogues(res.model) == [("bias", "gelu")]
    assert "LayerNormalization" in _ops(res.model)
    _assert_same_outputs(model, res.model)


def test_residual_add_between_bias_and_norm_keeps_the_norm_outside() -> None:
    """BERT's dense -> +bias -> +residual -> LayerNorm: the epilogue has no residual step, so only the
    bias is absorbed; the residual Add and the LayerNorm become an AddLayerNorm of their own (phase 3)."""
    model = mm_model(["bias", "residual", "layernorm"], opset=17)
    res = _optimize(model)
    assert _epilogues(res.model) == [("bias",)]
    assert _ops(res.model) == ["FusedMatMul", "AddLayerNorm", "Identity"]
    _assert_same_outputs(model, res.model)


def test_residual_add_without_bias_is_not_an_epilogue() -> None:
    res = _optimize(mm_model(["residual", "layernorm"], opset=17))
    assert "FusedMatMul" not in _ops(res.model)


def test_layernorm_with_used_mean_output_is_not_absorbed() -> None:
    model = mm_model(["layernorm"], opset=17, ln_mean_output=True)
    res = _optimize(model)
    assert "FusedMatMul" not in _ops(res.model)
    assert "norm-extra-outputs" in _reasons(res)


def test_two_activations_are_not_chained() -> None:
    model = mm_model(["bias", "relu", "gelu"], opset=20)
    res = _optimize(model)
    assert _epilogues(res.model) == [("bias", "relu")]
    assert "Gelu" in _ops(res.model)


def test_pattern_is_registered_in_phase_two() -> None:
    p = next(p for p in PATTERNS if p.name == "matmul_epilogue")
    assert isinstance(p, MatMulEpilogue) and p.phase == 2


# ---- the fused op: reference kernel vs function body ------------------------------------------------

def _all_epilogues() -> list[tuple[str, ...]]:
    tails: list[tuple[str, ...]] = [()]
    tails += [(a,) for a in ACTS] + [(n,) for n in NORMS]
    tails += [(a, n) for a in ACTS for n in NORMS] + [(n, a) for a in ACTS for n in NORMS]
    return [pre + t for pre in ((), ("bias",)) for t in tails if pre + t]


def _run_fused(epilogue: tuple[str, ...], opset: int, dtype=np.float32, seed: int = 7):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((2, 5, K)) * 2).astype(dtype)
    b = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(dtype)
    vec = {"bias": rng.standard_normal(N), "gamma": rng.uniform(0.5, 1.5, N), "beta": rng.standard_normal(N)}
    has = {"bias": "bias" in epilogue, "gamma": any(s in NORMS for s in epilogue), "beta": "layernorm" in epilogue}
    names = ["a", "b"] + [k if has[k] else "" for k in ("bias", "gamma", "beta")]
    while not names[-1]:
        names.pop()
    attrs = {"epilogue": list(epilogue), "epsilon": 1e-3}
    ins = [a, b] + [vec[k].astype(dtype) if has[k] else None for k in ("bias", "gamma", "beta")]
    want = FUSED_MATMUL.reference(ins, attrs)[0]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node, fn = FUSED_MATMUL.make_node(names, ["y"], "fm", attrs, opset, elem)
    inits = [numpy_helper.from_array(b, "b")]
    inits += [numpy_helper.from_array(vec[k].astype(dtype), k) for k in vec if has[k]]
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", elem, a.shape)],
                          [helper.make_tensor_value_info("y", elem, want.shape)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("npufuse", 1)],
                          functions=[fn], ir_version=IR_VERSION)
    onnx.checker.check_model(m, full_check=True)
    return a, b, want, run(m, {"a": a})["y"], fn


@pytest.mark.parametrize("opset", [14, 17, 18, 20, 23])
@pytest.mark.parametrize("epilogue", _all_epilogues(), ids=lambda e: "+".join(e))
def test_fusedmatmul_function_body_matches_reference_kernel(epilogue: tuple[str, ...], opset: int) -> None:
    a, b, want, got, fn = _run_fused(epilogue, opset)
    assert got.dtype == want.dtype == np.float32
    c = compare("y", got, want)
    assert c.ok, c.detail
    assert not np.allclose(want, a @ b, atol=1e-2)  # the epilogue really ran
    # the body uses only ops of the model's opset
    std_ops = {n.op_type for n in fn.node}
    assert ("LayerNormalization" in std_ops) == ("layernorm" in epilogue and opset >= 17)
    assert ("Gelu" in std_ops) == (any(s.startswith("gelu") for s in epilogue) and opset >= 20)
    assert ("RMSNormalization" in std_ops) == ("rmsnorm" in epilogue and opset >= 23)


@pytest.mark.parametrize("epilogue", [("bias", "gelu", "layernorm"), ("rmsnorm", "silu"), ("layernorm", "gelu_tanh")])
@pytest.mark.parametrize("opset", [14, 20])
def test_fusedmatmul_fp16_body_matches_reference(epilogue: tuple[str, ...], opset: int) -> None:
    _, _, want, got, _ = _run_fused(epilogue, opset, dtype=np.float16)
    assert got.dtype == np.float16
    c = compare("y", got, want)
    assert c.ok, c.detail


def test_overloads_differ_per_epilogue_and_opset_choice() -> None:
    overloads = {}
    for e in _all_epilogues():
        for opset in (14, 17, 20, 23):
            fn = FUSED_MATMUL.body({"epilogue": list(e)}, opset, TensorProto.FLOAT)
            overloads.setdefault(fn.overload, set()).add(tuple(e))
    assert all(len(v) == 1 for v in overloads.values())  # one overload never names two epilogues
    assert FUSED_MATMUL.body({"epilogue": ["layernorm"]}, 14, 1).overload != \
        FUSED_MATMUL.body({"epilogue": ["layernorm"]}, 17, 1).overload


def test_reference_kernel_is_the_textbook_math() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 5))
    bias, gamma, beta = rng.standard_normal(5), rng.standard_normal(5), rng.standard_normal(5)
    y = a @ b + bias
    gelu = 0.5 * y * (1 + np.vectorize(math.erf)(y / np.sqrt(2)))
    mu, var = gelu.mean(-1, keepdims=True), gelu.var(-1, keepdims=True)
    want = (gelu - mu) / np.sqrt(var + 1e-6) * gamma + beta
    attrs = {"epilogue": ["bias", "gelu", "layernorm"], "epsilon": 1e-6}
    got = FUSED_MATMUL.reference([a, b, bias, gamma, beta], attrs)
    np.testing.assert_allclose(got[0], want, rtol=1e-12)
    rms = FUSED_MATMUL.reference([a, b, None, gamma], {"epilogue": ["rmsnorm"], "epsilon": 1e-6})[0]
    np.testing.assert_allclose(rms, (a @ b) / np.sqrt(((a @ b) ** 2).mean(-1, keepdims=True) + 1e-6) * gamma,
                               rtol=1e-12)


# ---- real exporter output ---------------------------------------------------------------------------

_MANIFEST = {f["file"]: f for f in json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]}
TRANSFORMER_FIXTURES = sorted(f for f, e in _MANIFEST.items() if e["base_family"] in ("bert", "gpt2", "vit", "llama"))
_GELU_KEYS = {("", "Gelu"), ("npufuse", "Gelu")}
_LN_KEYS = {("", "LayerNormalization"), ("npufuse", "LayerNorm"), ("npufuse", "AddLayerNorm")}
_RMS_KEYS = {("", "RMSNormalization"), ("npufuse", "RMSNorm"), ("npufuse", "AddRMSNorm")}


def fusion_counts(model: onnx.ModelProto) -> dict[str, Counter]:
    """Standalone GELU/LayerNorm/RMSNorm ops and those inside FusedMatMul epilogues."""
    standalone, in_epilogue, epilogues = Counter(), Counter(), Counter()
    for n in model.graph.node:
        key = ("" if n.domain == "ai.onnx" else n.domain, n.op_type)
        for name, keys in (("gelu", _GELU_KEYS), ("layernorm", _LN_KEYS), ("rmsnorm", _RMS_KEYS)):
            if key in keys:
                standalone[name] += 1
        if key == ("npufuse", "FusedMatMul"):
            ep = attributes(n)["epilogue"]
            epilogues[",".join(ep)] += 1
            for s in ep:
                in_epilogue["gelu" if s.startswith("gelu") else s] += 1
    return {"standalone": standalone, "epilogue": in_epilogue, "fused": epilogues}


@pytest.mark.parametrize("fixture", TRANSFORMER_FIXTURES)
def test_real_transformers(fixture: str) -> None:
    entry = _MANIFEST[fixture]
    n_layers = entry["config"]["num_layers"]
    model = onnx.load(str(FIXTURES / fixture), load_external_data=False)
    res = optimize(model, str(FIXTURES), OptimizeOptions())
    assert not [r for r in res.rolled_back if r.match.pattern == "matmul_epilogue"], \
        [(r.match.kind, r.reason) for r in res.rolled_back]
    assert res.ok, res.model_check
    counts = fusion_counts(res.model)
    fused = counts["fused"]
    family = entry["base_family"]
    assert res.model_check is not None and res.model_check.ok, res.model_check
    if family == "llama":
        # the gate projection's SiLU and the product with up(x) are each layer's npufuse.GatedMLP ...
        assert fused["silu"] == 0
        assert sum(n.op_type == "GatedMLP" for n in res.model.graph.node) == n_layers
        # ... and with that pattern disabled, FusedMatMul takes the gate projection's SiLU (the Mul stays)
        res = optimize(model, str(FIXTURES), OptimizeOptions(patterns=[p for p in PATTERNS if p.name != "gated_mlp"]))
        assert res.ok and not res.rolled_back
        fused = fusion_counts(res.model)["fused"]
        assert fused["silu"] == n_layers
    assert sum(fused.values()) > 0
    total = counts["standalone"] + counts["epilogue"]
    if family == "llama":
        assert total["rmsnorm"] == 2 * n_layers + 1
    else:
        assert total["gelu"] == n_layers
        assert total["layernorm"] == 2 * n_layers + 1
        act = "gelu_tanh" if family == "gpt2" else "gelu"
        assert fused[f"bias,{act}"] == n_layers  # the FFN's intermediate dense
