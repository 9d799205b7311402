"""LayerNorm, RMSNorm and GELU decompositions: positives per exporter form and opset, near-misses,
fused-op function bodies vs reference kernels, and the real exporter fixtures."""

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
from npufuse.patterns import PATTERNS
from npufuse.patterns.gelu import GELU, NPU_GELU
from npufuse.patterns.norms import LAYER_NORMALIZATION, NPU_LAYER_NORM, NPU_RMS_NORM, RMS_NORMALIZATION
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

FIXTURES = Path(__file__).parent / "fixtures"
MY_PATTERNS = [p for p in PATTERNS if p.name in ("layernorm", "rmsnorm", "gelu")]
LN_OPS = {("", "LayerNormalization"), ("npufuse", "LayerNorm")}
RMS_OPS = {("", "RMSNormalization"), ("npufuse", "RMSNorm")}
GELU_OPS = {("", "Gelu"), ("npufuse", "Gelu")}
SHAPE = [2, 5, 16]
H = SHAPE[-1]


# ---- a tiny graph builder ------------------------------------------------------------------------------

class GraphBuilder:
    """Nodes in the order they are added; constants as initializers or Constant nodes."""

    def __init__(self, opset: int, dtype=np.float32, const_nodes: bool = False, seed: int = 0) -> None:
        self.opset, self.dtype, self.const_nodes = opset, np.dtype(dtype), const_nodes
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.extra_outputs: list[str] = []
        self.rng = np.random.default_rng(seed)
        self.k = 0

    def _name(self, base: str) -> str:
        self.k += 1
        return f"{base}_{self.k}"

    def input(self, name: str, shape, dtype=None) -> str:
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype or self.dtype))
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def const(self, value, dtype=None) -> str:
        arr = np.asarray(value, dtype=dtype or self.dtype)
        name = self._name("c")
        if self.const_nodes:
            self.nodes.append(helper.make_node("Constant", [], [name], name=name + "_node",
                                               value=numpy_helper.from_array(arr, name)))
        else:
            self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        out = self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out + "_node", **attrs))
        return out

    def reduce_mean(self, x: str, axes=(-1,)) -> str:
        if self.opset < 18:
            return self.op("ReduceMean", x, axes=list(axes), keepdims=1)
        return self.op("ReduceMean", x, self.const(np.array(axes, np.int64), np.int64), keepdims=1)

    def vector(self, shape=(H,), center: float = 1.0) -> str:
        return self.const(center + 0.3 * self.rng.standard_normal(shape))

    def model(self, y: str) -> onnx.ModelProto:
        elem = helper.np_dtype_to_tensor_dtype(self.dtype)
        outs = [helper.make_tensor_value_info(v, elem, None) for v in [y] + self.extra_outputs]
        g = helper.make_graph(self.nodes, "g", self.inputs, outs, self.inits)
        return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)],
                                                    ir_version=IR_VERSION))


def layernorm_model(opset: int = 17, *, square: str = "pow", inv: str = "sqrt_div", affine: str = "both",
                    form: str = "plain", casts: str = "none", const_nodes: bool = False, axes=(-1,),
                    dtype=np.float32, gamma_shape=(H,), pow_exponent: float = 2.0, eps_input: bool = False,
                    output_intermediate: bool = False) -> onnx.ModelProto:
    """A LayerNorm written out the way an exporter (or a hand-written TF/PyTorch model) does."""
    b = GraphBuilder(opset, np.float16 if casts in ("fp16_x", "fp16_d") else dtype, const_nodes)
    x = b.input("X", SHAPE)
    f32 = TensorProto.FLOAT
    if casts == "noop":                 # HF-style x.float() on a float32 model: a no-op Cast
        x = b.op("Cast", x, to=f32)
    if casts == "fp16_x":               # x16 -> float32 -> LayerNorm core -> fp16 -> affine in fp16
        x = b.op("Cast", x, to=f32)
    mean = b.reduce_mean(x, axes)
    d = b.op("Sub", x, mean)
    if casts == "fp16_d":               # TorchScript's fp16 LayerNorm: the centred value goes to float32
        d = b.op("Cast", d, to=f32)
    cdt = np.float32 if casts in ("fp16_x", "fp16_d") else None
    sq = b.op("Pow", d, b.const(pow_exponent, cdt)) if square == "pow" else b.op("Mul", d, d)
    var = b.reduce_mean(sq)
    if eps_input:
        eps = b.input("eps", [], cdt)
    else:
        eps = b.const(1e-5, cdt)
    ve = b.op("Add", var, eps)
    if output_intermediate:
        b.extra_outputs.append(ve)
    if inv == "sqrt_div":
        norm_kind, s = "std", b.op("Sqrt", ve)
    elif inv == "reciprocal":
        norm_kind, s = "inv", b.op("Reciprocal", b.op("Sqrt", ve))
    elif inv == "one_div":
        norm_kind, s = "inv", b.op("Div", b.const(1.0, cdt), b.op("Sqrt", ve))
    else:  # "pow": Pow(var + eps, -0.5)
        norm_kind, s = "inv", b.op("Pow", ve, b.const(-0.5, cdt))
    if form == "plain":
        n = b.op("Div", d, s) if norm_kind == "std" else b.op("Mul", s, d)
        if casts in ("fp16_x", "fp16_d"):
            n = b.op("Cast", n, to=TensorProto.FLOAT16)
        if casts == "noop":
            n = b.op("Cast", n, to=f32)
        if affine in ("both", "gamma"):
            n = b.op("Mul", n, b.vector(gamma_shape))
        elif affine == "gamma_left":
            n = b.op("Mul", b.vector(gamma_shape), n)
        if affine in ("both", "gamma_left"):
            n = b.op("Add", b.vector(center=0.0), n)
        return b.model(n)
    assert norm_kind == "inv"
    ginv = b.op("Mul", s, b.vector())           # gamma folded into the inverse std
    if form == "folded":                         # d * (gamma * rsqrt) + beta
        return b.model(b.op("Add", b.op("Mul", d, ginv), b.vector(center=0.0)))
    xg, mg = b.op("Mul", x, ginv), b.op("Mul", ginv, mean)
    if form == "xg_minus_mg":                    # x*g - m*g + beta
        return b.model(b.op("Add", b.op("Sub", xg, mg), b.vector(center=0.0)))
    assert form == "beta_minus_mg"               # x*g + (beta - m*g)
    return b.model(b.op("Add", xg, b.op("Sub", b.vector(center=0.0), mg)))


def rmsnorm_model(opset: int = 17, *, square: str = "pow", inv: str = "one_div", gamma: str = "left",
                  casts: str = "none", const_nodes: bool = False, shared_input_cast: bool = False,
                  axes=(-1,)) -> onnx.ModelProto:
    """An RMSNorm as HF Llama / T5 / hand-written code exports it."""
    b = GraphBuilder(opset, np.float16 if casts == "fp16" else np.float32, const_nodes)
    x = b.input("X", SHAPE)
    f32 = TensorProto.FLOAT
    if casts in ("noop", "fp16"):
        x = b.op("Cast", x, to=f32)
    cdt = np.float32 if casts == "fp16" else None
    sq = b.op("Pow", x, b.const(2.0, cdt)) if square == "pow" else b.op("Mul", x, x)
    ve = b.op("Add", b.reduce_mean(sq, axes), b.const(1e-6, cdt))
    s = b.op("Sqrt", ve)
    if inv == "x_div":
        n = b.op("Div", x, s)
    elif inv == "reciprocal":
        n = b.op("Mul", x, b.op("Reciprocal", s))
    elif inv == "one_div":
        n = b.op("Mul", x, b.op("Div", b.const(1.0, cdt), s))
    else:  # "folded": x * (rsqrt * gamma)
        n = b.op("Mul", x, b.op("Mul", b.op("Reciprocal", s), b.vector()))
    if casts in ("noop", "fp16"):
        n = b.op("Cast", n, to=TensorProto.FLOAT16 if casts == "fp16" else f32)
    if inv != "folded":
        if gamma == "left":
            n = b.op("Mul", b.vector(), n)
        elif gamma == "right":
            n = b.op("Mul", n, b.vector())
    if shared_input_cast:               # the residual reads the (no-op) Cast too, as in the TorchScript export
        n = b.op("Add", n, x)
    return b.model(n)


def gelu_model(opset: int = 17, *, approximate: str = "none", scale: str = "div", half: str = "last",
               cube: str = "pow", const_nodes: bool = False, one_first: bool = False,
               half_value: float = 0.5, sqrt2: float = 1.4142135, k: float = 0.7978846) -> onnx.ModelProto:
    """GELU the way bert/vit (erf) and GPT-2 (tanh) exporters write it, in any association order."""
    b = GraphBuilder(opset, np.float32, const_nodes)
    x = b.op("Identity", b.input("X", SHAPE))
    if approximate == "none":
        arg = b.op("Div", x, b.const(sqrt2)) if scale == "div" else b.op("Mul", b.const(1.0 / sqrt2), x)
        t = b.op("Erf", arg)
    elif approximate == "tanh":
        x3 = (b.op("Pow", x, b.const(3.0)) if cube == "pow" else
              b.op("Mul", b.op("Mul", x, x), x) if cube == "mul_left" else b.op("Mul", x, b.op("Mul", x, x)))
        inner = b.op("Add", x, b.op("Mul", x3, b.const(0.044715)))
        t = b.op("Tanh", b.op("Mul", inner, b.const(k)))
    else:  # the sigmoid approximation: not GELU
        return b.model(b.op("Mul", x, b.op("Sigmoid", b.op("Mul", x, b.const(1.702)))))
    a = b.op("Add", b.const(1.0), t) if one_first else b.op("Add", t, b.const(1.0))
    if half == "last":          # (x * a) * 0.5
        y = b.op("Mul", b.op("Mul", x, a), b.const(half_value))
    elif half == "div2":        # (x * a) / 2
        y = b.op("Div", b.op("Mul", a, x), b.const(1.0 / half_value))
    elif half == "first":       # (x * 0.5) * a
        y = b.op("Mul", b.op("Mul", b.const(half_value), x), a)
    else:                       # (a * 0.5) * x
        y = b.op("Mul", x, b.op("Mul", a, b.const(half_value)))
    return b.model(b.op("Identity", y))


# ---- helpers -------------------------------------------------------------------------------------------

def _optimize(model: onnx.ModelProto):
    return optimize(model, options=OptimizeOptions(patterns=MY_PATTERNS))


def _op_keys(model: onnx.ModelProto) -> Counter:
    return Counter((n.domain, n.op_type) for n in model.graph.node)


def _count(model: onnx.ModelProto, keys: set) -> int:
    c = _op_keys(model)
    return sum(c[k] for k in keys)


def _assert_fused_and_exact(model: onnx.ModelProto, res, keys: set, *, rtol: float = 1e-4) -> None:
    assert _count(res.model, keys) == 1, [n.op_type for n in res.model.graph.node]
    assert res.applied and all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok
    onnx.checker.check_model(res.model, full_check=True)
    feeds = random_feeds(model, seed=5)
    want, got = run(model, feeds), run(res.model, feeds)
    for name in want:
        c = compare(name, got[name], want[name])
        assert c.ok, c.detail
        assert c.min_passing_rtol <= rtol


def _leftover(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node}


# ---- LayerNorm positives --------------------------------------------------------------------------------

OPSETS = [14, 17, 18, 20]


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("variant", [
    {}, {"square": "mul"}, {"inv": "reciprocal"}, {"inv": "one_div"}, {"inv": "pow"},
    {"affine": "none"}, {"affine": "gamma"}, {"affine": "gamma_left"}, {"const_nodes": True},
    {"axes": (2,)}, {"gamma_shape": (1, 1, H)}, {"gamma_shape": (1,)}, {"casts": "noop"},
    {"inv": "reciprocal", "form": "folded"}, {"inv": "reciprocal", "form": "xg_minus_mg"},
    {"inv": "pow", "form": "beta_minus_mg"},
], ids=lambda v: "-".join(f"{k}={v}" for k, v in v.items()) or "torchscript")
def test_layernorm_forms_fuse(opset: int, variant: dict) -> None:
    model = layernorm_model(opset, **variant)
    res = _optimize(model)
    _assert_fused_and_exact(model, res, LN_OPS)
    node = next(n for n in res.model.graph.node if (n.domain, n.op_type) in LN_OPS)
    if opset >= 17:
        assert (node.domain, node.op_type) == ("", "LayerNormalization")
        assert len(node.input) == 3      # gamma/beta materialised for the standard op
    else:
        assert (node.domain, node.op_type) == ("npufuse", "LayerNorm")
        assert len(node.input) == (3 if variant.get("affine", "both") in ("both", "gamma_left") else 2)
    assert {"ReduceMean", "Sqrt", "Sub"}.isdisjoint(_leftover(res.model))
    eps = next(a.f for a in node.attribute if a.name == "epsilon")
    assert eps == pytest.approx(1e-5, rel=1e-6)


@pytest.mark.parametrize("opset", [14, 17])
@pytest.mark.parametrize("casts", ["fp16_x", "fp16_d"])
def test_mixed_precision_layernorm_absorbs_the_cast_pair_as_stash_type(opset: int, casts: str) -> None:
    model = layernorm_model(opset, casts=casts)
    res = _optimize(model)
    _assert_fused_and_exact(model, res, LN_OPS, rtol=1e-2)
    assert "Cast" not in _leftover(res.model)
    node = next(n for n in res.model.graph.node if (n.domain, n.op_type) in LN_OPS)
    # fp16 in and out; statistics in float32 (stash_type default 1)
    assert all(a.name != "stash_type" or a.i == TensorProto.FLOAT for a in node.attribute)
    assert res.model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16


def test_fp16_layernorm_without_casts_keeps_fp16_statistics() -> None:
    model = layernorm_model(17, dtype=np.float16)
    res = _optimize(model)
    _assert_fused_and_exact(model, res, LN_OPS, rtol=1e-2)
    node = next(n for n in res.model.graph.node if n.op_type == "LayerNormalization")
    assert {a.name: a.i for a in node.attribute if a.name == "stash_type"} == {"stash_type": TensorProto.FLOAT16}


# ---- RMSNorm positives ----------------------------------------------------------------------------------

@pytest.mark.parametrize("opset", OPSETS + [23])
@pytest.mark.parametrize("variant", [
    {}, {"inv": "reciprocal"}, {"inv": "x_div"}, {"square": "mul"}, {"gamma": "right"}, {"gamma": "none"},
    {"inv": "folded"}, {"const_nodes": True}, {"axes": (2,)}, {"casts": "noop"},
    {"casts": "noop", "shared_input_cast": True},
], ids=lambda v: "-".join(f"{k}={v}" for k, v in v.items()) or "llama")
def test_rmsnorm_forms_fuse(opset: int, variant: dict) -> None:
    model = rmsnorm_model(opset, **variant)
    res = _optimize(model)
    _assert_fused_and_exact(model, res, RMS_OPS)
    node = next(n for n in res.model.graph.node if (n.domain, n.op_type) in RMS_OPS)
    want = ("", "RMSNormalization") if opset >= 23 else ("npufuse", "RMSNorm")
    assert (node.domain, node.op_type) == want
    assert {"ReduceMean", "Sqrt", "Pow"}.isdisjoint(_leftover(res.model))
    if variant.get("shared_input_cast"):
        # the no-op Cast the residual reads too is dropped by the canonicaliser: norm and residual read X
        assert node.input[0] == "X" and "Cast" not in _leftover(res.model)


@pytest.mark.parametrize("opset", [17, 23])
def test_mixed_precision_rmsnorm_is_stash_type_exact(opset: int) -> None:
    model = rmsnorm_model(opset, casts="fp16")
    res = _optimize(model)
    _assert_fused_and_exact(model, res, RMS_OPS, rtol=1e-2)
    assert "Cast" not in _leftover(res.model)
    node = next(n for n in res.model.graph.node if (n.domain, n.op_type) in RMS_OPS)
    assert node.input[0] == "X"


def test_rmsnorm_with_an_outside_reader_of_the_upcast_fuses_only_the_float32_core() -> None:
    # x16 -> Cast(f32) is also read outside, so it cannot be absorbed: the fused node reads the float32 value,
    # and the Cast back to fp16 and the fp16 gamma stay outside, exactly as the original computes them.
    b = GraphBuilder(17, np.float16)
    x = b.op("Cast", b.input("X", SHAPE), to=TensorProto.FLOAT)
    ve = b.op("Add", b.reduce_mean(b.op("Pow", x, b.const(2.0, np.float32))), b.const(1e-6, np.float32))
    n = b.op("Cast", b.op("Mul", x, b.op("Reciprocal", b.op("Sqrt", ve))), to=TensorProto.FLOAT16)
    y = b.op("Mul", b.vector(), n)
    b.extra_outputs.append(b.op("Cast", b.op("Neg", x), to=TensorProto.FLOAT16))
    model = b.model(y)
    res = _optimize(model)
    _assert_fused_and_exact(model, res, RMS_OPS, rtol=1e-2)
    assert Counter(n.op_type for n in res.model.graph.node)["Cast"] == 3


# ---- GELU positives -------------------------------------------------------------------------------------

@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("variant", [
    {}, {"scale": "mul"}, {"half": "first"}, {"half": "on_sum"}, {"one_first": True}, {"const_nodes": True},
    {"sqrt2": 1.4142}, {"scale": "mul", "half": "first", "const_nodes": True}, {"half": "div2"},
    {"approximate": "tanh"}, {"approximate": "tanh", "cube": "mul_left"}, {"approximate": "tanh", "cube": "mul_right"},
    {"approximate": "tanh", "half": "first", "const_nodes": True},
], ids=lambda v: "-".join(f"{k}={v}" for k, v in v.items()) or "erf-torchscript")
def test_gelu_forms_fuse(opset: int, variant: dict) -> None:
    model = gelu_model(opset, **variant)
    res = _optimize(model)
    _assert_fused_and_exact(model, res, GELU_OPS)
    node = next(n for n in res.model.graph.node if (n.domain, n.op_type) in GELU_OPS)
    assert node.domain == ("" if opset >= 20 else "npufuse")
    approx = {a.name: helper.get_attribute_value(a) for a in node.attribute}["approximate"]
    assert approx == variant.get("approximate", "none").encode()
    assert {"Erf", "Tanh", "Pow"}.isdisjoint(_leftover(res.model))
    assert _leftover(res.model) == {"Identity", "Gelu"}


def test_existing_gelu_op_is_left_alone() -> None:
    b = GraphBuilder(20)
    model = b.model(b.op("Gelu", b.input("X", SHAPE), approximate="tanh"))
    res = _optimize(model)
    assert res.applied == [] and _leftover(res.model) == {"Gelu"}


# ---- near-misses: must not fuse -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,reason", [
    ({"axes": (1,)}, "wrong-axis"),
    ({"axes": (1, 2)}, "wrong-axis"),
    ({"eps_input": True}, "nonconstant-epsilon"),
    ({"gamma_shape": (5, H)}, "weight-shape"),
    ({"gamma_shape": (2, 1, H)}, "weight-shape"),
    ({"output_intermediate": True}, "intermediate-is-output"),
    ({"pow_exponent": 3.0}, "pow-exponent"),
])
@pytest.mark.parametrize("opset", [14, 18])
def test_layernorm_near_misses(kwargs: dict, reason: str, opset: int) -> None:
    model = layernorm_model(opset, **kwargs)
    res = _optimize(model)
    assert _count(res.model, LN_OPS) == 0 and _count(res.model, RMS_OPS) == 0
    assert reason in {f.reason for f in res.refusals}, [f.reason for f in res.refusals]
    refusal = next(f for f in res.refusals if f.reason == reason)
    assert refusal.node in refusal.detail and refusal.pattern == "layernorm"


def test_layernorm_with_shared_centred_value_is_refused() -> None:
    b = GraphBuilder(17)
    x = b.input("X", SHAPE)
    d = b.op("Sub", x, b.reduce_mean(x))
    s = b.op("Sqrt", b.op("Add", b.reduce_mean(b.op("Pow", d, b.const(2.0))), b.const(1e-5)))
    b.extra_outputs.append(b.op("Neg", d))
    model = b.model(b.op("Div", d, s))
    res = _optimize(model)
    assert _count(res.model, LN_OPS) == 0
    assert "shared-intermediate" in {f.reason for f in res.refusals}


@pytest.mark.parametrize("kwargs,reason", [
    ({"axes": (1,)}, "wrong-axis"),
])
def test_rmsnorm_near_misses(kwargs: dict, reason: str) -> None:
    res = _optimize(rmsnorm_model(18, **kwargs))
    assert _count(res.model, RMS_OPS) == 0
    assert reason in {f.reason for f in res.refusals}


@pytest.mark.parametrize("kwargs", [
    {"half_value": 0.6}, {"half_value": 0.6, "half": "first"}, {"half_value": 0.6, "half": "on_sum"},
    {"sqrt2": 1.5}, {"approximate": "tanh", "k": 0.8}, {"approximate": "tanh", "half_value": 0.25},
])
def test_gelu_with_a_wrong_constant_is_refused(kwargs: dict) -> None:
    model = gelu_model(17, **kwargs)
    res = _optimize(model)
    assert _count(res.model, GELU_OPS) == 0
    refusals = [f for f in res.refusals if f.reason == "constant-mismatch"]
    assert refusals and refusals[0].node in refusals[0].detail


def test_sigmoid_gelu_approximation_is_a_quick_gelu() -> None:
    """x * sigmoid(1.702 x) was a near-miss; it is now npufuse.Gelu(approximate='quick') (issue 9; the forms are
    tested in test_activation_forms.py)."""
    model = gelu_model(17, approximate="sigmoid")
    res = _optimize(model)
    assert _count(res.model, GELU_OPS) == 1 and "Sigmoid" not in _leftover(res.model)
    assert [r.match.kind for r in res.applied] == ["npufuse.Gelu[quick]"]


def test_gelu_with_intermediate_graph_output_is_refused() -> None:
    model = gelu_model(17)
    erf_out = next(n.output[0] for n in model.graph.node if n.op_type == "Erf")
    model.graph.output.append(helper.make_tensor_value_info(erf_out, TensorProto.FLOAT, SHAPE))
    res = _optimize(model)
    assert _count(res.model, GELU_OPS) == 0
    assert "intermediate-is-output" in {f.reason for f in res.refusals}


# ---- reference kernels vs function bodies and vs onnxruntime's standard ops -------------------------------

def _run_single(node: onnx.NodeProto, fn, opset: int, feeds: dict, inits: dict, elem: int, domain_opset: bool):
    g = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, elem, v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info(node.output[0], elem, next(iter(feeds.values())).shape)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("npufuse", 1)] if domain_opset else [])
    m = helper.make_model(g, opset_imports=imports, functions=[fn] if fn is not None else [], ir_version=IR_VERSION)
    onnx.checker.check_model(m, full_check=True)
    return run(m, feeds)[node.output[0]]


def _norm_case(dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((3, 4, 24)) * 2 + 0.7).astype(dtype)
    gamma = (1 + 0.3 * rng.standard_normal(24)).astype(dtype)
    beta = (0.3 * rng.standard_normal(24)).astype(dtype)
    return x, gamma, beta


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("dtype,stash", [(np.float32, None), (np.float16, None), (np.float16, TensorProto.FLOAT16),
                                         (np.float64, TensorProto.DOUBLE)])
@pytest.mark.parametrize("with_beta", [True, False])
def test_layernorm_body_matches_reference(opset: int, dtype, stash, with_beta: bool) -> None:
    x, gamma, beta = _norm_case(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    attrs = {"epsilon": 1e-5, "stash_type": stash}
    inputs = ["x", "gamma"] + (["beta"] if with_beta else [])
    want = NPU_LAYER_NORM.reference([x, gamma] + ([beta] if with_beta else []), attrs)[0]
    node, fn = NPU_LAYER_NORM.make_node(inputs, ["y"], "ln", attrs, opset, elem)
    if not with_beta:
        from npufuse.patterns.norms import layer_norm_body
        fn = layer_norm_body(attrs, opset, elem, has_beta=False)
        node.overload = fn.overload
    inits = {"gamma": gamma} | ({"beta": beta} if with_beta else {})
    got = _run_single(node, fn, opset, {"x": x}, inits, elem, True)
    c = compare("y", got, want)
    assert c.ok, c.detail
    assert want.dtype == x.dtype
    xf = x.astype(np.float64)
    plain = (xf - xf.mean(-1, keepdims=True)) / np.sqrt(xf.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(want, plain * gamma + (beta if with_beta else 0), rtol=5e-3 if dtype == np.float16
                               else 1e-6, atol=5e-3 if dtype == np.float16 else 1e-6)


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("dtype,stash", [(np.float32, None), (np.float16, None), (np.float16, TensorProto.FLOAT16)])
def test_rmsnorm_body_matches_reference(opset: int, dtype, stash) -> None:
    x, gamma, _ = _norm_case(dtype, 1)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    attrs = {"epsilon": 1e-6, "stash_type": stash}
    want = NPU_RMS_NORM.reference([x, gamma], attrs)[0]
    node, fn = NPU_RMS_NORM.make_node(["x", "gamma"], ["y"], "rms", attrs, opset, elem)
    got = _run_single(node, fn, opset, {"x": x}, {"gamma": gamma}, elem, True)
    c = compare("y", got, want)
    assert c.ok, c.detail
    xf = x.astype(np.float64)
    np.testing.assert_allclose(want, xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-6) * gamma,
                               rtol=5e-3 if dtype == np.float16 else 1e-6)


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gelu_body_matches_reference(opset: int, approximate: str, dtype) -> None:
    x = (np.random.default_rng(2).standard_normal((4, 33)) * 3).astype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    attrs = {"approximate": approximate}
    want = NPU_GELU.reference([x], attrs)[0]
    node, fn = NPU_GELU.make_node(["x"], ["y"], "gelu", attrs, opset, elem)
    got = _run_single(node, fn, opset, {"x": x}, {}, elem, True)
    c = compare("y", got, want)
    assert c.ok, c.detail
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64).ravel()])
    tol = 1e-3 if approximate == "tanh" or dtype == np.float16 else 1e-6
    np.testing.assert_allclose(want.astype(np.float64).ravel(), exact, rtol=tol, atol=tol * 3)


@pytest.mark.parametrize("op,opset,inputs,attrs", [
    (LAYER_NORMALIZATION, 17, 3, {"axis": -1, "epsilon": 1e-5}),
    (LAYER_NORMALIZATION, 17, 2, {"axis": 1, "epsilon": 1e-3}),
    (RMS_NORMALIZATION, 23, 2, {"axis": -1, "epsilon": 1e-6}),
    (GELU, 20, 1, {"approximate": "none"}),
    (GELU, 20, 1, {"approximate": "tanh"}),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_standard_op_reference_kernels_agree_with_onnxruntime(op, opset: int, inputs: int, attrs: dict, dtype) -> None:
    x, gamma, beta = _norm_case(dtype, 3)
    if attrs.get("axis") == 1:
        gamma, beta = np.ones((4, 24), dtype), None
    vals = [x, gamma, beta][:inputs]
    names = ["x", "gamma", "beta"][:inputs]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node, _ = op.make_node(names, ["y"], "n", attrs, opset, elem)
    got = _run_single(node, None, opset, {"x": x}, dict(zip(names[1:], vals[1:])), elem, False)
    want = op.reference(vals, attrs)[0]
    c = compare("y", got, want)
    assert c.ok, c.detail


# ---- the real exporter fixtures ---------------------------------------------------------------------------

def _manifest() -> dict[str, dict]:
    m = json.loads((FIXTURES / "manifest.json").read_text())
    return {f["file"].removesuffix(".onnx"): f for f in m["fixtures"]}


TRANSFORMERS = [f"{fam}_{exp}" for fam in ("bert", "gpt2", "vit") for exp in ("ts14", "ts17", "dynamo")] + \
    ["bert_sdpa_ts17", "bert_sdpa_dynamo"]
LLAMAS = [f"llama_{exp}" for exp in ("ts14", "ts17", "dynamo", "sdpa_ts17", "sdpa_dynamo")]


@pytest.mark.parametrize("name", TRANSFORMERS + LLAMAS)
def test_fixture_norm_and_gelu_counts(name: str) -> None:
    path = FIXTURES / f"{name}.onnx"
    layers = _manifest()[name]["config"]["num_layers"]
    model = onnx.load(path)
    res = optimize(model, str(FIXTURES), OptimizeOptions(patterns=MY_PATTERNS))
    if name.startswith("llama"):
        assert _count(res.model, RMS_OPS) == 2 * layers + 1
        assert _count(res.model, LN_OPS) == 0 and _count(res.model, GELU_OPS) == 0
        assert {"Sqrt", "ReduceMean"}.isdisjoint(_leftover(res.model))
    else:
        assert _count(res.model, LN_OPS) == 2 * layers + 1
        assert _count(res.model, GELU_OPS) == layers
        assert {"Erf", "Tanh", "Sqrt", "ReduceMean"}.isdisjoint(_leftover(res.model))
    assert res.rolled_back == []
    assert all(r.check is not None and r.check.ok for r in res.applied)
    if res.applied:
        assert res.model_check is not None and res.model_check.ok
    else:  # the dynamo bert/vit exports already use LayerNormalization and Gelu
        assert name.endswith("dynamo") and not name.startswith(("gpt2", "llama"))
    assert not [f for f in res.refusals if f.pattern in ("layernorm", "rmsnorm", "gelu")]
