"""Activation forms that must fuse (issue 9): quick GELU, the factorised tanh GELU, constants rounded to fp16 /
bf16, and Tanh / Sigmoid / quick-GELU epilogues of MatMul/Gemm. Positives, near-misses that must not fuse, and
numerics against onnxruntime on the original graph."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import onnx
import pytest
from builders import random_feeds, with_output_shapes
from onnx import TensorProto, helper, numpy_helper

from npufuse.fusion.census import fusion_census
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import attributes
from npufuse.npu_model.ascend_kernels import kernel_label
from npufuse.npu_model.spec import load_profile
from npufuse.patterns import PATTERNS
from npufuse.patterns.gelu import NPU_GELU, gelu_reference
from npufuse.ir.matching import CONST_RTOL, const_rtol, near
from npufuse.patterns.matmul_epilogue import FUSED_MATMUL
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

SHAPE = [2, 5, 16]
GELU_ONLY = [p for p in PATTERNS if p.name == "gelu"]
GELU_OPS = {("", "Gelu"), ("npufuse", "Gelu")}
K_TANH = math.sqrt(2.0 / math.pi)


class _B:
    """A graph in the order nodes are added; scalar constants as initializers or Constant nodes."""

    def __init__(self, opset: int = 17, dtype=np.float32, const_nodes: bool = False) -> None:
        self.opset, self.dtype, self.const_nodes = opset, np.dtype(dtype), const_nodes
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.extra_outputs: list[str] = []
        self.k = 0

    def input(self, name: str, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(self.dtype), shape))
        return name

    def const(self, value, dtype=None) -> str:
        self.k += 1
        name = f"c{self.k}"
        arr = np.asarray(value, dtype=dtype or self.dtype)
        if self.const_nodes:
            self.nodes.append(helper.make_node("Constant", [], [name], name=name + "_node",
                                               value=numpy_helper.from_array(arr, name)))
        else:
            self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        self.k += 1
        out = f"{op_type.lower()}_{self.k}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out + "_node", **attrs))
        return out

    def model(self, y: str) -> onnx.ModelProto:
        elem = helper.np_dtype_to_tensor_dtype(self.dtype)
        outs = [helper.make_tensor_value_info(v, elem, None) for v in [y] + self.extra_outputs]
        g = helper.make_graph(self.nodes, "g", self.inputs, outs, self.inits)
        return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)],
                                                    ir_version=IR_VERSION))


def _gelu_opt(model: onnx.ModelProto):
    return optimize(model, options=OptimizeOptions(patterns=GELU_ONLY))


def _count(model: onnx.ModelProto, keys: set) -> int:
    c = Counter((n.domain, n.op_type) for n in model.graph.node)
    return sum(c[k] for k in keys)


def _assert_same_as_original(model: onnx.ModelProto, optimized: onnx.ModelProto, rtol: float = 1e-4,
                             scale: float = 3.0) -> None:
    """The optimized model against the original on onnxruntime, on inputs wide enough that the GELU forms differ
    from each other (and from SiLU) by far more than the tolerance."""
    feeds = {k: (v * scale).astype(v.dtype) for k, v in random_feeds(model, seed=11).items()}
    want, got = run(model, feeds), run(optimized, feeds)
    for name in want:
        c = compare(name, got[name], want[name])
        assert c.ok, c.detail
        assert c.min_passing_rtol <= rtol, (name, c.min_passing_rtol)


def _gelu_node(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in model.graph.node if (n.domain, n.op_type) in GELU_OPS)


# ---- dtype-aware constant tolerance --------------------------------------------------------------------

def test_near_widens_to_the_constants_dtype_only() -> None:
    inv_sqrt2 = 1 / math.sqrt(2)
    fp16 = float(np.float16(inv_sqrt2))                    # 0.70703125: off by 1.1e-4 relative
    assert not near(fp16, inv_sqrt2)                       # the fp32 rule: within 1e-4
    assert not near(fp16, inv_sqrt2, elem_type=TensorProto.FLOAT)
    assert near(fp16, inv_sqrt2, elem_type=TensorProto.FLOAT16)
    assert near(0.7071823, inv_sqrt2, elem_type=TensorProto.FLOAT16)
    bf16 = 0.70703125 - 2 ** -9                            # a bf16 neighbour
    assert near(bf16, inv_sqrt2, elem_type=TensorProto.BFLOAT16)
    assert not near(bf16, inv_sqrt2, elem_type=TensorProto.FLOAT16)
    assert not near(0.75, inv_sqrt2, elem_type=TensorProto.FLOAT16)   # 6% off is wrong in any dtype
    assert const_rtol(TensorProto.FLOAT) == CONST_RTOL and const_rtol(None) == CONST_RTOL
    assert const_rtol(TensorProto.FLOAT16) == 2 ** -10 and const_rtol(TensorProto.BFLOAT16) == 2 ** -7
    for c in (1 / math.sqrt(2), math.sqrt(2), K_TANH, 0.044715, 1.702, 0.5):
        assert near(float(np.float16(c)), c, elem_type=TensorProto.FLOAT16), c


def _erf_gelu(dtype, inv: float, scale: str = "mul") -> onnx.ModelProto:
    b = _B(17, dtype)
    x = b.op("Identity", b.input("X", SHAPE))
    arg = b.op("Mul", x, b.const(inv)) if scale == "mul" else b.op("Div", x, b.const(1 / inv))
    t = b.op("Add", b.op("Erf", arg), b.const(1.0))
    return b.model(b.op("Identity", b.op("Mul", b.op("Mul", x, b.const(0.5)), t)))


@pytest.mark.parametrize("scale", ["mul", "div"])
def test_fp16_model_with_fp16_rounded_erf_constant_fuses(scale: str) -> None:
    # the constant as an fp16 model stores it: 1/sqrt(2) -> 0.70703125, sqrt(2) -> 1.4140625
    model = _erf_gelu(np.float16, float(np.float16(1 / math.sqrt(2))) if scale == "mul" else
                      1 / float(np.float16(math.sqrt(2))), scale)
    res = _gelu_opt(model)
    assert _count(res.model, GELU_OPS) == 1, res.refusals
    assert [r.match.kind for r in res.applied] == ["npufuse.Gelu[none]"]
    _assert_same_as_original(model, res.model, rtol=2e-2)


def test_fp32_model_with_an_fp16_rounded_constant_is_still_refused() -> None:
    """The tolerance follows the constant's own dtype: an fp32 constant 1.1e-4 off is a wrong constant."""
    model = _erf_gelu(np.float32, float(np.float16(1 / math.sqrt(2))))
    res = _gelu_opt(model)
    assert _count(res.model, GELU_OPS) == 0
    assert "constant-mismatch" in {f.reason for f in res.refusals}


# ---- quick GELU: x * sigmoid(1.702 x) -------------------------------------------------------------------

def quick_gelu_model(opset: int = 17, *, order: str = "clip", dtype=np.float32, alpha: float = 1.702,
                     const_nodes: bool = False, shared_sigmoid: bool = False) -> onnx.ModelProto:
    b = _B(opset, dtype, const_nodes)
    x = b.op("Identity", b.input("X", SHAPE))
    if order == "clip":                       # CLIP's exporters: x * sigmoid(x * 1.702)
        y = b.op("Mul", x, b.op("Sigmoid", b.op("Mul", x, b.const(alpha))))
    elif order == "const_first":              # sigmoid(1.702 * x) * x
        y = b.op("Mul", b.op("Sigmoid", b.op("Mul", b.const(alpha), x)), x)
    else:                                     # x * sigmoid(x / (1 / 1.702))
        y = b.op("Mul", x, b.op("Sigmoid", b.op("Div", x, b.const(1 / alpha))))
    if shared_sigmoid:
        b.extra_outputs.append(b.nodes[-2].output[0] if order != "const_first" else b.nodes[-2].output[0])
    return b.model(b.op("Identity", y))


@pytest.mark.parametrize("opset", [14, 17, 20])
@pytest.mark.parametrize("order", ["clip", "const_first", "div"])
@pytest.mark.parametrize("const_nodes", [False, True])
def test_quick_gelu_fuses(opset: int, order: str, const_nodes: bool) -> None:
    model = quick_gelu_model(opset, order=order, const_nodes=const_nodes)
    res = _gelu_opt(model)
    assert _count(res.model, GELU_OPS) == 1
    node = _gelu_node(res.model)
    assert (node.domain, attributes(node)["approximate"]) == ("npufuse", "quick")   # ONNX Gelu has no such form
    assert [r.match.kind for r in res.applied] == ["npufuse.Gelu[quick]"]
    assert {"Sigmoid", "Mul", "Div"}.isdisjoint({n.op_type for n in res.model.graph.node})
    assert res.model_check is not None and res.model_check.ok
    onnx.checker.check_model(res.model, full_check=True)
    _assert_same_as_original(model, res.model)
    assert fusion_census(res.model)["gelu"] == 1


def test_quick_gelu_is_not_the_erf_gelu() -> None:
    """The numeric check has teeth: the quick form differs from the erf GELU by far more than the tolerance, so
    a rewrite to the wrong approximation would fail verification."""
    x = np.linspace(-4, 4, 101)
    quick, erf = gelu_reference(x, "quick"), gelu_reference(x, "none")
    assert np.abs(quick - erf).max() > 1e-2
    np.testing.assert_allclose(quick, x / (1 + np.exp(-1.702 * x)), rtol=1e-12)


def test_fp16_quick_gelu_with_fp16_rounded_constant_fuses() -> None:
    model = quick_gelu_model(17, dtype=np.float16, alpha=float(np.float16(1.702)))
    res = _gelu_opt(model)
    assert _count(res.model, GELU_OPS) == 1
    _assert_same_as_original(model, res.model, rtol=2e-2)


@pytest.mark.parametrize("alpha", [1.75, 1.66])
def test_quick_gelu_with_a_wrong_constant_is_a_near_miss(alpha: float) -> None:
    res = _gelu_opt(quick_gelu_model(17, alpha=alpha))
    assert _count(res.model, GELU_OPS) == 0
    refusal = next(f for f in res.refusals if f.reason == "constant-mismatch")
    assert "1.702" in refusal.detail and refusal.node in refusal.detail


@pytest.mark.parametrize("alpha", [1.0, 2.5])
def test_swish_with_another_beta_is_not_a_gelu(alpha: float) -> None:
    res = _gelu_opt(quick_gelu_model(17, alpha=alpha))
    assert _count(res.model, GELU_OPS) == 0 and not res.refusals


def test_quick_gelu_with_a_shared_sigmoid_is_refused() -> None:
    model = quick_gelu_model(17)
    sig = next(n.output[0] for n in model.graph.node if n.op_type == "Sigmoid")
    model.graph.output.append(helper.make_tensor_value_info(sig, TensorProto.FLOAT, SHAPE))
    res = _gelu_opt(model)
    assert _count(res.model, GELU_OPS) == 0
    assert "intermediate-is-output" in {f.reason for f in res.refusals}


def test_sigmoid_gate_is_left_alone_silently() -> None:
    b = _B(17)
    x, h = b.input("X", SHAPE), b.input("H", SHAPE)
    model = b.model(b.op("Mul", b.op("Sigmoid", b.op("Mul", x, b.const(1.702))), h))   # sigmoid(1.702 x) * h
    res = _gelu_opt(model)
    assert _count(res.model, GELU_OPS) == 0 and not res.refusals


# ---- the factorised tanh GELU ---------------------------------------------------------------------------

def tanh_gelu_model(form: str, *, dtype=np.float32, k: float = 0.79788456, c: float = 0.044715,
                    const_nodes: bool = False, opset: int = 17, tail: bool = True) -> onnx.ModelProto:
    b = _B(opset, dtype, const_nodes)
    x = b.op("Identity", b.input("X", SHAPE))
    if form == "megatron":       # 0.79788456 * x * (1 + 0.044715 * x * x)
        sq = b.op("Mul", b.op("Mul", b.const(c), x), x)
        arg = b.op("Mul", b.op("Mul", b.const(k), x), b.op("Add", b.const(1.0), sq))
    elif form == "x_times_poly":  # k * (x * (1 + c * x^2)), x^2 as Pow
        poly = b.op("Add", b.op("Mul", b.op("Pow", x, b.const(2.0)), b.const(c)), b.const(1.0))
        arg = b.op("Mul", b.const(k), b.op("Mul", x, poly))
    elif form == "poly_first":   # ((c * x * x + 1) * x) * k
        poly = b.op("Add", b.op("Mul", b.const(c), b.op("Mul", x, x)), b.const(1.0))
        arg = b.op("Mul", b.op("Mul", poly, x), b.const(k))
    elif form == "kx_first":     # (x * k) * (1 + x * (x * c))
        poly = b.op("Add", b.const(1.0), b.op("Mul", x, b.op("Mul", x, b.const(c))))
        arg = b.op("Mul", b.op("Mul", x, b.const(k)), poly)
    elif form == "cube_x_pow2":  # k * (x + c * (x * Pow(x, 2)))
        arg = b.op("Mul", b.const(k), b.op("Add", x, b.op("Mul", b.const(c), b.op("Mul", x, b.op("Pow", x, b.const(2.0))))))
    elif form == "div_scale":    # (x + x^3 * c) / (1 / k)
        arg = b.op("Div", b.op("Add", x, b.op("Mul", b.op("Pow", x, b.const(3.0)), b.const(c))), b.const(1 / k))
    else:
        raise ValueError(form)
    t = b.op("Tanh", arg)
    if not tail:
        return b.model(b.op("Identity", t))
    y = b.op("Mul", b.op("Mul", x, b.const(0.5)), b.op("Add", t, b.const(1.0)))
    return b.model(b.op("Identity", y))


TANH_FORMS = ["megatron", "x_times_poly", "poly_first", "kx_first", "cube_x_pow2", "div_scale"]


@pytest.mark.parametrize("form", TANH_FORMS)
@pytest.mark.parametrize("opset,const_nodes", [(14, False), (17, True), (20, False)])
def test_factorised_tanh_gelu_fuses(form: str, opset: int, const_nodes: bool) -> None:
    model = tanh_gelu_model(form, opset=opset, const_nodes=const_nodes)
    res = _gelu_opt(model)
    assert _count(res.model, GELU_OPS) == 1, [(f.reason, f.detail) for f in res.refusals]
    node = _gelu_node(res.model)
    assert node.domain == ("" if opset >= 20 else "npufuse")
    assert attributes(node)["approximate"] == "tanh"
    assert {n.op_type for n in res.model.graph.node} == {"Identity", "Gelu"}
    assert res.model_check is not None and res.model_check.ok
    _assert_same_as_original(model, res.model)


@pytest.mark.parametrize("form", ["megatron", "cube_x_pow2"])
def test_fp16_tanh_gelu_with_fp16_rounded_constants_fuses(form: str) -> None:
    model = tanh_gelu_model(form, dtype=np.float16, k=float(np.float16(K_TANH)), c=float(np.float16(0.044715)))
    res = _gelu_opt(model)
    assert _count(res.model, GELU_OPS) == 1, [(f.reason, f.detail) for f in res.refusals]
    _assert_same_as_original(model, res.model, rtol=2e-2)


@pytest.mark.parametrize("kwargs,what", [({"k": 0.85}, "sqrt(2/pi)"), ({"c": 0.05}, "0.044715")])
@pytest.mark.parametrize("form", ["megatron", "poly_first"])
def test_factorised_tanh_gelu_with_a_wrong_constant_is_refused(form: str, kwargs: dict, what: str) -> None:
    res = _gelu_opt(tanh_gelu_model(form, **kwargs))
    assert _count(res.model, GELU_OPS) == 0
    refusal = next(f for f in res.refusals if f.reason == "constant-mismatch")
    assert what in refusal.detail


def test_tanh_gelu_polynomial_without_the_gelu_tail_is_a_near_miss() -> None:
    res = _gelu_opt(tanh_gelu_model("megatron", tail=False))
    assert _count(res.model, GELU_OPS) == 0
    refusal = next(f for f in res.refusals if f.reason == "not-gelu")
    assert "Tanh" in refusal.detail and refusal.node.startswith("tanh")


def test_erf_of_a_scaled_x_without_the_gelu_tail_is_a_near_miss() -> None:
    b = _B(17)
    x = b.op("Identity", b.input("X", SHAPE))
    t = b.op("Add", b.op("Erf", b.op("Div", x, b.const(math.sqrt(2)))), b.const(1.0))
    model = b.model(b.op("Mul", t, b.const(0.5)))          # 0.5 * (1 + erf(x / sqrt 2)): the CDF, not GELU
    res = _gelu_opt(model)
    assert _count(res.model, GELU_OPS) == 0
    refusal = next(f for f in res.refusals if f.reason == "not-gelu")
    assert "multiplied by 0.5" in refusal.detail


def test_tanh_of_something_else_is_left_alone_silently() -> None:
    b = _B(17)
    x = b.op("Identity", b.input("X", SHAPE))
    model = b.model(b.op("Tanh", b.op("Mul", b.op("Add", x, b.const(0.5)), b.const(K_TANH))))   # tanh(k (x + .5))
    res = _gelu_opt(model)
    assert res.applied == [] and not res.refusals


# ---- Tanh / Sigmoid / quick-GELU epilogues of MatMul and Gemm -------------------------------------------

def matmul_act_model(act: str, *, gemm: bool = False, bias: bool = True, shared: bool = False,
                     dtype=np.float32, m: int = 6, k: int = 32, n: int = 24) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    b = _B(17, dtype)
    x = b.input("X", [m, k] if gemm else [2, m, k])
    w = b.const(rng.standard_normal((n, k) if gemm else (k, n)) / np.sqrt(k))
    bvec = b.const(rng.standard_normal(n) * 0.5)
    if gemm:   # BERT's pooler: Gemm(transB=1, C=bias) -> Tanh
        y = b.op("Gemm", x, w, bvec, transB=1) if bias else b.op("Gemm", x, w, transB=1)
    else:
        y = b.op("MatMul", x, w)
        if bias:
            y = b.op("Add", y, bvec)
    if shared:
        b.extra_outputs.append(b.op("Neg", y))
    if act == "quick_gelu":
        out = b.op("Mul", y, b.op("Sigmoid", b.op("Mul", y, b.const(1.702))))
    else:
        out = b.op(act, y)
    return b.model(out)


@pytest.mark.parametrize("act,step", [("Tanh", "tanh"), ("Sigmoid", "sigmoid"), ("quick_gelu", "quick_gelu")])
@pytest.mark.parametrize("gemm", [False, True])
def test_matmul_activation_epilogues_fuse(act: str, step: str, gemm: bool) -> None:
    model = matmul_act_model(act, gemm=gemm)
    res = optimize(model, options=OptimizeOptions())
    kinds = [r.match.kind for r in res.applied]
    assert f"FusedMatMul[bias,{step}]" in kinds, kinds
    assert [n.op_type for n in res.model.graph.node] == ["FusedMatMul"]
    assert res.model_check is not None and res.model_check.ok
    _assert_same_as_original(model, res.model)
    if step == "quick_gelu":
        assert fusion_census(res.model)["gelu"] == 1


@pytest.mark.parametrize("act", ["Tanh", "Sigmoid"])
def test_matmul_output_shared_with_another_reader_is_a_near_miss(act: str) -> None:
    res = optimize(matmul_act_model(act, bias=False, shared=True), options=OptimizeOptions())
    assert not any(n.op_type == "FusedMatMul" for n in res.model.graph.node)
    assert "shared-intermediate" in {f.reason for f in res.refusals if f.pattern == "matmul_epilogue"}


@pytest.mark.parametrize("step", ["tanh", "sigmoid", "quick_gelu"])
@pytest.mark.parametrize("dtype,opset", [(np.float32, 14), (np.float32, 20), (np.float16, 17)])
def test_new_epilogue_bodies_match_the_reference(step: str, dtype, opset: int) -> None:
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((3, 8)) * 2).astype(dtype)
    w = (rng.standard_normal((8, 5)) / 2).astype(dtype)
    bias = rng.standard_normal(5).astype(dtype)
    attrs = {"epilogue": ["bias", step]}
    want = FUSED_MATMUL.reference([a, w, bias], attrs)[0]
    y = a.astype(np.float64) @ w.astype(np.float64) + bias
    textbook = {"tanh": np.tanh(y), "sigmoid": 1 / (1 + np.exp(-y)), "quick_gelu": y / (1 + np.exp(-1.702 * y))}[step]
    np.testing.assert_allclose(want.astype(np.float64), textbook, rtol=2e-3 if dtype == np.float16 else 1e-6,
                               atol=2e-3 if dtype == np.float16 else 1e-6)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node, fn = FUSED_MATMUL.make_node(["a", "w", "bias"], ["y"], "fm", attrs, opset, elem)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", elem, a.shape)],
                          [helper.make_tensor_value_info("y", elem, want.shape)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "bias")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("npufuse", 1)],
                          functions=[fn], ir_version=IR_VERSION)
    onnx.checker.check_model(m, full_check=True)
    c = compare("y", run(m, {"a": a})["y"], want)
    assert c.ok, c.detail


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("opset", [14, 20])
def test_quick_gelu_body_matches_reference(dtype, opset: int) -> None:
    x = (np.random.default_rng(2).standard_normal((4, 33)) * 3).astype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node, fn = NPU_GELU.make_node(["x"], ["y"], "gelu", {"approximate": "quick"}, opset, elem)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, x.shape)],
                          [helper.make_tensor_value_info("y", elem, x.shape)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("npufuse", 1)],
                          functions=[fn], ir_version=IR_VERSION)
    c = compare("y", run(m, {"x": x})["y"], NPU_GELU.reference([x], {"approximate": "quick"})[0])
    assert c.ok, c.detail


@pytest.mark.parametrize("act,step,kernel", [("Tanh", "tanh", "MatMulV3+Tanh"), ("Sigmoid", "sigmoid", "MatMulV3+Sigmoid"),
                                             ("quick_gelu", "quick_gelu", "MatMulV3+FastGelu")])
def test_new_epilogues_are_priced_and_name_their_kernel(act: str, step: str, kernel: str) -> None:
    """BERT's pooler at deployment size: the Tanh's round trip through GM is what the fusion saves."""
    model = matmul_act_model(act, gemm=True, m=64, k=768, n=768)
    res = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend910B2"), verify=False))
    rec = next(r for r in res.records if r.match.kind == f"FusedMatMul[bias,{step}]")
    assert rec.status == "applied"
    dec = rec.decision
    assert dec.fuse and dec.gain_us > 0 and dec.gm_bytes_saved > 0 and dec.launches_saved >= 1
    fused = dec.fused[0]
    assert fused.kind == "cube+vector" and fused.vector_cycles > 0, "the epilogue's Vector work is priced"
    assert kernel_label(rec.ascend_kernel) == kernel
    assert rec.ascend_kernel["available"] is True


def test_quick_gelu_standalone_names_fastgelu() -> None:
    res = optimize(quick_gelu_model(17), options=OptimizeOptions(spec=load_profile("Ascend910B2"), verify=False,
                                                                 force_fuse=True))
    rec = next(r for r in res.records if r.match.kind == "npufuse.Gelu[quick]")
    assert rec.ascend_kernel["op"] == "FastGelu" and rec.ascend_kernel["builtin"]


@pytest.mark.parametrize("form", ["erf", "quick"])
@pytest.mark.parametrize("verify", [True, False])
def test_a_size_one_constant_of_higher_rank_is_a_near_miss(form: str, verify: bool) -> None:
    """A [1, 1, 1] 1/sqrt(2) (or 1.702) on a [4, 8] x broadcasts the output to [1, 4, 8]: a fused Gelu would return
    [4, 8]. Refused with the reason, with or without verification, and the model's output shape is kept."""
    f = TensorProto.FLOAT
    k = numpy_helper.from_array(np.full((1, 1, 1), 1 / math.sqrt(2) if form == "erf" else 1.702, np.float32), "k")
    if form == "erf":
        inits = [k, numpy_helper.from_array(np.array(1.0, np.float32), "one"),
                 numpy_helper.from_array(np.array(0.5, np.float32), "half")]
        nodes = [helper.make_node("Mul", ["x", "k"], ["a"], name="scale"), helper.make_node("Erf", ["a"], ["e"]),
                 helper.make_node("Add", ["e", "one"], ["p"]), helper.make_node("Mul", ["x", "half"], ["hx"]),
                 helper.make_node("Mul", ["hx", "p"], ["y"])]
    else:
        inits = [k]
        nodes = [helper.make_node("Mul", ["x", "k"], ["a"], name="scale"), helper.make_node("Sigmoid", ["a"], ["s"]),
                 helper.make_node("Mul", ["x", "s"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [4, 8])],
                          [helper.make_tensor_value_info("y", f, [1, 4, 8])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    res = optimize(model, options=OptimizeOptions(verify=verify))
    assert not res.applied
    assert {(r.node, r.reason) for r in res.refusals if r.pattern == "gelu"} == {("scale", "constant-shape")}
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    assert run(res.model, feeds)["y"].shape == (1, 4, 8)
