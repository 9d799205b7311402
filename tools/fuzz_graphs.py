"""Random graphs of every npufuse fusion family, for the differential fuzzer (tools/fuzz.py).

Each generator writes one family's subgraph the way exporters do, with random shapes, attributes and exporter
forms, only with ops that exist at the case's opset, and optionally one near-miss perturbation: a change that
makes the chain something the fused op does not compute (a wrong constant, an intermediate read elsewhere, a
wrong axis or perm, a broadcast that changes the shape). A perturbed graph must not be fused by the family's
pattern; `Perturbation.forbidden` says which applied fusions would break that promise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IR_VERSION = 10
INT64_MAX = int(np.iinfo(np.int64).max)
FLOAT_DTYPES = {"fp32": np.float32, "fp16": np.float16}


class Unbuildable(Exception):
    """The drawn combination cannot be expressed at this opset/dtype: the case is drawn again."""


# ---- the graph builder ------------------------------------------------------------------------------------------

class Builder:
    """Nodes in the order they are added; inputs remember how to feed them (`feed_kind`)."""

    def __init__(self, opset: int, dtype: str, rng: np.random.Generator) -> None:
        self.opset, self.dtype_name, self.rng = opset, dtype, rng
        self.np_dtype = np.dtype(FLOAT_DTYPES.get(dtype, np.float32))
        self.elem = TensorProto.BFLOAT16 if dtype == "bf16" else helper.np_dtype_to_tensor_dtype(self.np_dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[str] = []
        self.feed_kind: dict[str, str] = {}
        self.const_nodes = bool(rng.random() < 0.2)   # constants as Constant nodes (some exporters) or initializers
        self.n = 0

    # names and values
    def fresh(self, base: str) -> str:
        self.n += 1
        return f"{base}_{self.n}"

    def input(self, name: str, shape, elem: int | None = None, kind: str = "normal") -> str:
        self.inputs.append(helper.make_tensor_value_info(name, self.elem if elem is None else elem, list(shape)))
        self.feed_kind[name] = kind
        return name

    def tensor(self, value, elem_or_np=None, name: str | None = None) -> str:
        """A constant; float values take the model's dtype unless `elem_or_np` says otherwise."""
        name = name or self.fresh("c")
        arr = np.asarray(value)
        if elem_or_np is None and arr.dtype.kind == "f":
            elem_or_np = self.elem
        if isinstance(elem_or_np, int):     # a TensorProto element type
            if elem_or_np == TensorProto.BFLOAT16:
                t = helper.make_tensor(name, TensorProto.BFLOAT16, arr.shape,
                                       arr.astype(np.float32).flatten().tolist())
            else:
                t = numpy_helper.from_array(arr.astype(helper.tensor_dtype_to_np_dtype(elem_or_np)), name)
        else:
            t = numpy_helper.from_array(arr.astype(elem_or_np) if elem_or_np is not None else arr, name)
        if self.const_nodes:
            self.nodes.append(helper.make_node("Constant", [], [name], name=name + "_const", value=t))
        else:
            self.inits.append(t)
        return name

    def f(self, v: float) -> str:
        return self.tensor(np.array(v, np.float32))

    def f32(self, v) -> str:
        return self.tensor(np.asarray(v, np.float32), np.float32)

    def ints(self, *v: int) -> str:
        return self.tensor(np.array(v, np.int64), np.int64)

    def weight(self, shape, scale: float | None = None) -> str:
        s = scale if scale is not None else 1.0 / math.sqrt(max(shape[0], 1))
        return self.tensor((self.rng.standard_normal(shape) * s).astype(np.float32))

    def op(self, op_type: str, *inputs: str, n_out: int = 1, **attrs):
        name = self.fresh(op_type.lower())
        outs = [name] if n_out == 1 else [f"{name}_o{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name + "_n", **attrs))
        return outs[0] if n_out == 1 else outs

    # opset-aware forms
    def reduce(self, op_type: str, x: str, axes=(-1,), keepdims: int = 1) -> str:
        axes_as_input = self.opset >= 18 or (op_type == "ReduceSum" and self.opset >= 13)
        if axes_as_input:
            return self.op(op_type, x, self.ints(*axes), keepdims=keepdims)
        return self.op(op_type, x, axes=list(axes), keepdims=keepdims)

    def unsqueeze(self, x: str, axes) -> str:
        if self.opset >= 13:
            return self.op("Unsqueeze", x, self.ints(*axes))
        return self.op("Unsqueeze", x, axes=list(axes))

    def split(self, x: str, sizes: list[int], axis: int = -1) -> list[str]:
        if self.opset >= 13:
            return self.op("Split", x, self.ints(*sizes), n_out=len(sizes), axis=axis)
        return self.op("Split", x, n_out=len(sizes), axis=axis, split=list(sizes))

    def slice(self, x: str, start: int, end: int, axis: int = -1, step: int = 1) -> str:
        ins = [x, self.ints(start), self.ints(end), self.ints(axis)]
        if step != 1 or self.rng.random() < 0.5:
            ins.append(self.ints(step))
        return self.op("Slice", *ins)

    def output(self, *names: str) -> None:
        self.outputs.extend(names)

    def model(self) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, "fuzz", self.inputs,
                              [helper.make_empty_tensor_value_info(o) for o in self.outputs], self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)], ir_version=IR_VERSION)
        try:
            inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
        except Exception as exc:
            raise Unbuildable(f"shape inference: {str(exc).splitlines()[0][:200]}") from None
        known = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
        for o in m.graph.output:
            if o.name not in known or not known[o.name].type.tensor_type.elem_type:
                raise Unbuildable(f"output {o.name} has no inferred type")
            o.type.CopyFrom(known[o.name].type)
        try:    # only valid originals: an op the opset lacks, or a type an op refuses (bf16 Conv), is redrawn
            onnx.checker.check_model(m, full_check=True)
        except Exception as exc:
            raise Unbuildable(f"checker: {str(exc).splitlines()[0][:200]}") from None
        return m


# ---- shapes ---------------------------------------------------------------------------------------------------

def lead_dims(b: Builder, symbolic: bool, rank: int = 2) -> tuple[list, list[int]]:
    """Leading dims [batch, seq] (declared and one fixed instance): symbolic names or small fixed sizes."""
    fixed = [int(b.rng.integers(1, 4)), int(b.rng.integers(1, 7))][:rank]
    if rank == 1:
        fixed = [int(b.rng.integers(1, 7))]
    if symbolic:
        names = ["batch", "seq"][:rank] if rank == 2 else ["seq"]
        return names, fixed
    return fixed, fixed


def choice(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


# ---- perturbations --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Perturbation:
    """A near-miss: `forbidden(pattern, kind)` is true for an applied fusion the perturbed graph must not get."""

    name: str
    forbidden: Callable[[str, str], bool]


def no_pattern(*patterns: str) -> Callable[[str, str], bool]:
    return lambda pattern, kind: pattern in patterns


def no_kind(pattern_name: str, fragment: str) -> Callable[[str, str], bool]:
    return lambda pattern, kind: pattern == pattern_name and fragment in kind


@dataclass
class Family:
    name: str
    build: Callable[[Builder, str | None], None]
    perturbations: dict[str, Perturbation] = field(default_factory=dict)
    min_opset: int = 11
    dtypes: tuple[str, ...] = ("fp32", "fp16", "bf16")


FAMILIES: dict[str, Family] = {}


def family(name: str, perturbations: dict[str, Callable[[str, str], bool]] | None = None, min_opset: int = 11,
           dtypes: tuple[str, ...] = ("fp32", "fp16", "bf16")):
    def register(fn):
        FAMILIES[name] = Family(name, fn, {k: Perturbation(k, v) for k, v in (perturbations or {}).items()},
                                min_opset, dtypes)
        return fn
    return register


# ---- activations as exporters write them ------------------------------------------------------------------------

def activation(b: Builder, act: str, x: str) -> str:
    if act == "silu":
        return b.op("Mul", x, b.op("Sigmoid", x))
    if act == "silu_rev":
        return b.op("Mul", b.op("Sigmoid", x), x)
    if act == "quick_gelu":
        return b.op("Mul", x, b.op("Sigmoid", b.op("Mul", x, b.f(1.702))))
    if act == "gelu":
        return gelu_erf(b, x, {})
    if act == "gelu_tanh":
        return gelu_tanh(b, x, {})
    if act == "gelu_op":
        return b.op("Gelu", x, approximate="none")
    if act == "gelu_tanh_op":
        return b.op("Gelu", x, approximate="tanh")
    if act == "clip":
        if b.opset < 12 and b.elem != TensorProto.FLOAT:
            raise Unbuildable("Clip-11 is float only in onnxruntime")
        return b.op("Clip", x, b.f(0.0), b.f(6.0))
    if act == "leaky_relu":
        return b.op("LeakyRelu", x, alpha=float(b.rng.choice([0.01, 0.1, 0.2])))
    if act == "hard_sigmoid":
        return b.op("HardSigmoid", x, alpha=0.2, beta=0.5)
    if act == "hard_swish":
        return b.op("HardSwish", x)
    return b.op({"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh"}[act], x)


def gelu_erf(b: Builder, x: str, c: dict) -> str:
    sqrt2 = c.get("sqrt2", math.sqrt(2.0))
    arg = b.op("Div", x, b.f(sqrt2)) if b.rng.random() < 0.5 else b.op("Mul", b.f(1.0 / sqrt2), x)
    e = b.op("Erf", arg)
    if "erf_consumer" in c:
        b.output(b.op("Neg", e))
    one = b.f(1.0)
    a = b.op("Add", one, e) if b.rng.random() < 0.5 else b.op("Add", e, one)
    return _half(b, x, a, c.get("half", 0.5))


def gelu_tanh(b: Builder, x: str, c: dict) -> str:
    form = choice(b.rng, ["pow", "mul_left", "mul_right"])
    x3 = (b.op("Pow", x, b.f(3.0)) if form == "pow" else b.op("Mul", b.op("Mul", x, x), x) if form == "mul_left"
          else b.op("Mul", x, b.op("Mul", x, x)))
    inner = b.op("Add", x, b.op("Mul", x3, b.f(c.get("cubic", 0.044715))))
    t = b.op("Tanh", b.op("Mul", inner, b.f(c.get("k", math.sqrt(2.0 / math.pi)))))
    a = b.op("Add", t, b.f(1.0))
    return _half(b, x, a, c.get("half", 0.5))


def _half(b: Builder, x: str, a: str, half: float) -> str:
    form = choice(b.rng, ["last", "div2", "first", "inner"])
    if form == "last":
        return b.op("Mul", b.op("Mul", x, a), b.f(half))
    if form == "div2":
        return b.op("Div", b.op("Mul", a, x), b.f(1.0 / half))
    if form == "first":
        return b.op("Mul", b.op("Mul", b.f(half), x), a)
    return b.op("Mul", x, b.op("Mul", a, b.f(half)))


# ---- Conv + BN + activation, Conv residual, Gemm + BN --------------------------------------------------------------

CONV_ACTS = [None, "relu", "sigmoid", "tanh", "silu", "clip", "leaky_relu", "hard_sigmoid", "hard_swish"]


def _bn(b: Builder, x: str, c: int, mean_input: bool = False) -> str:
    rng = b.rng
    mean = b.input(b.fresh("bn_mean"), [c]) if mean_input else b.tensor(rng.standard_normal(c) * 0.5)
    return b.op("BatchNormalization", x, b.tensor(rng.uniform(0.5, 1.5, c)), b.tensor(rng.standard_normal(c)),
                mean, b.tensor(rng.uniform(0.2, 2.0, c)), epsilon=float(choice(rng, [1e-5, 1e-3])))


@family("conv_bn_act", {"conv_extra_consumer": no_pattern("conv_bn_act"),
                        "bn_mean_is_input": no_kind("conv_bn_act", "BN folded")})
def conv_bn_act(b: Builder, perturb: str | None) -> None:
    rng = b.rng
    rank = int(rng.integers(1, 3))
    cin = int(choice(rng, [2, 3, 4]))
    depthwise = rng.random() < 0.25
    cout = cin if depthwise else int(choice(rng, [2, 4, 5]))
    group = cin if depthwise else 1
    k = int(choice(rng, [1, 3]))
    spatial = int(rng.integers(3, 7))
    x = b.input("X", ["batch" if rng.random() < 0.5 else 1, cin] + [spatial] * rank)
    ins = [x, b.weight((cout, cin // group) + (k,) * rank, 0.3)]
    if rng.random() < 0.7:
        ins.append(b.tensor(rng.standard_normal(cout)))
    attrs = {"group": group, "kernel_shape": [k] * rank}
    if k == 3 and rng.random() < 0.7:
        attrs["pads"] = [1] * (2 * rank)
    if rng.random() < 0.2:
        attrs["strides"] = [2] * rank
    c = b.op("Conv", *ins, **attrs)
    cur = c
    bn = rng.random() < 0.75 or perturb == "bn_mean_is_input"
    if bn:
        cur = _bn(b, cur, cout, mean_input=perturb == "bn_mean_is_input")
    acts = [a for a in CONV_ACTS if a != "hard_swish" or b.opset >= 14]
    act = choice(rng, acts)
    if act is None and not bn:
        act = "relu"
    if act is not None:
        cur = activation(b, act, cur)
    b.output(b.op("Identity", cur))
    if perturb == "conv_extra_consumer":
        b.output(b.op("Neg", c))


@family("conv_residual", {"broadcast_residual": no_kind("conv_bn_act", "Add"),
                          "sum_is_output": no_kind("conv_bn_act", "Add,")})
def conv_residual(b: Builder, perturb: str | None) -> None:
    rng = b.rng
    cch = int(choice(rng, [2, 3, 4]))
    s = int(rng.integers(3, 6))
    x = b.input("X", [1, cch, s, s])
    ins = [x, b.weight((cch, cch, 3, 3), 0.2)]
    if rng.random() < 0.6:
        ins.append(b.tensor(rng.standard_normal(cch)))
    cur = b.op("Conv", *ins, kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    if rng.random() < 0.7:
        cur = _bn(b, cur, cch)
    form = choice(rng, ["input", "tensor", "down"])
    if perturb == "broadcast_residual":
        z = b.input("Z", [1, cch, 1, 1])
    elif form == "input":
        z = x
    elif form == "tensor":
        z = b.input("Z", [1, cch, s, s])
    else:
        z = _bn(b, b.op("Conv", x, b.weight((cch, cch, 1, 1), 0.3), kernel_shape=[1, 1]), cch)
    op = "Sum" if rng.random() < 0.2 else "Add"
    ssum = b.op(op, *([z, cur] if rng.random() < 0.5 else [cur, z]))
    act = choice(rng, [None, "relu", "relu", "silu", "leaky_relu"])
    if perturb == "sum_is_output":
        act = act or "relu"
        b.output(ssum)
    y = activation(b, act, ssum) if act else ssum
    b.output(b.op("Identity", y))


@family("gemm_bn", {"gemm_extra_consumer": no_pattern("gemm_bn")}, dtypes=("fp32", "fp16"))
def gemm_bn(b: Builder, perturb: str | None) -> None:
    rng = b.rng
    k, n = int(choice(rng, [4, 8, 12])), int(choice(rng, [4, 6, 8]))
    x = b.input("X", ["batch" if rng.random() < 0.5 else 3, k])
    trans_b = int(rng.integers(0, 2))
    w = b.weight((n, k) if trans_b else (k, n))
    ins = [x, w] + ([b.tensor(rng.standard_normal(n))] if rng.random() < 0.6 else [])
    g = b.op("Gemm", *ins, transB=trans_b)
    y = _bn(b, g, n)
    if rng.random() < 0.5:
        y = b.op("Relu", y)
    b.output(b.op("Identity", y))
    if perturb == "gemm_extra_consumer":
        b.output(b.op("Neg", g))


# ---- MatMul / Gemm epilogues --------------------------------------------------------------------------------------

MM_ACTS = [None, "relu", "tanh", "sigmoid", "gelu", "gelu_tanh", "quick_gelu", "silu"]


@family("matmul_epilogue", {"mm_extra_consumer": no_pattern("matmul_epilogue"),
                            "bias_full_shape": no_kind("matmul_epilogue", "bias")})
def matmul_epilogue(b: Builder, perturb: str | None) -> None:
    rng = b.rng
    k, n = int(choice(rng, [4, 8, 16])), int(choice(rng, [4, 8, 12]))
    gemm = rng.random() < 0.25 and perturb != "bias_full_shape"
    if gemm:
        rows = int(rng.integers(1, 6))
        x = b.input("X", ["rows" if rng.random() < 0.5 else rows, k])
        trans_b = int(rng.integers(0, 2))
        w = b.weight((n, k) if trans_b else (k, n))
        ins = [x, w] + ([b.tensor(rng.standard_normal(n))] if rng.random() < 0.6 else [])
        mm = b.op("Gemm", *ins, transB=trans_b)
        cur = mm
    else:
        symbolic = rng.random() < 0.5 and perturb != "bias_full_shape"
        lead, fixed = lead_dims(b, symbolic, int(rng.integers(1, 3)))
        if perturb == "bias_full_shape":    # a [rows.., N] bias is per element only where rows > 1
            lead = fixed = [int(rng.integers(2, 4)) for _ in fixed]
        x = b.input("X", lead + [k])
        mm = b.op("MatMul", x, b.weight((k, n)))
        cur = mm
        if rng.random() < 0.7 or perturb == "bias_full_shape":
            if perturb == "bias_full_shape":
                bias = b.tensor(rng.standard_normal(fixed + [n]))
            else:
                bias = b.tensor(rng.standard_normal(n))
            cur = b.op("Add", *([bias, cur] if rng.random() < 0.5 else [cur, bias]))
    act = choice(rng, MM_ACTS)
    if act is None and cur == mm:
        act = "relu"
    if act is not None:
        cur = activation(b, act, cur)
    b.output(b.op("Identity", cur))
    if perturb == "mm_extra_consumer":
        b.output(b.op("Neg", mm))


# ---- LayerNorm / RMSNorm / GELU -------------------------------------------------------------------------------

def _norm_input(b: Builder) -> tuple[str, int]:
    lead, _ = lead_dims(b, b.rng.random() < 0.5)
    hidden = int(choice(b.rng, [4, 8, 16, 32]))
    return b.input("X", lead + [hidden]), hidden


def layernorm_body(b: Builder, x: str, hidden: int, perturb: str | None) -> str:
    rng = b.rng
    mean = b.reduce("ReduceMean", x)
    d = b.op("Sub", x, mean)
    if perturb == "ln_extra_consumer":
        b.output(b.op("Neg", d))
    exponent = 3.0 if perturb == "ln_wrong_exponent" else 2.0
    sq = b.op("Pow", d, b.f(exponent)) if rng.random() < 0.6 or exponent != 2.0 else b.op("Mul", d, d)
    var = b.reduce("ReduceMean", sq, axes=(-2,) if perturb == "ln_wrong_axis" else (-1,))
    ve = b.op("Add", var, b.f(float(choice(rng, [1e-5, 1e-6, 1e-12]))))
    inv = choice(rng, ["sqrt_div", "reciprocal", "one_div", "pow"])
    if inv == "sqrt_div":
        n = b.op("Div", d, b.op("Sqrt", ve))
    else:
        s = (b.op("Reciprocal", b.op("Sqrt", ve)) if inv == "reciprocal" else
             b.op("Div", b.f(1.0), b.op("Sqrt", ve)) if inv == "one_div" else b.op("Pow", ve, b.f(-0.5)))
        n = b.op("Mul", s, d) if rng.random() < 0.5 else b.op("Mul", d, s)
    affine = choice(rng, ["both", "gamma", "none", "gamma_left"])
    gshape = (2, hidden) if perturb == "ln_gamma_broadcast" else (hidden,)
    if perturb == "ln_gamma_broadcast":
        affine = "both"
    if affine in ("both", "gamma"):
        n = b.op("Mul", n, b.tensor(1 + 0.3 * rng.standard_normal(gshape)))
    elif affine == "gamma_left":
        n = b.op("Mul", b.tensor(1 + 0.3 * rng.standard_normal(gshape)), n)
    if affine in ("both", "gamma_left"):
        n = b.op("Add", b.tensor(0.3 * rng.standard_normal(hidden)), n)
    return n


def rmsnorm_body(b: Builder, x: str, hidden: int, perturb: str | None) -> str:
    rng = b.rng
    exponent = 3.0 if perturb == "rms_wrong_exponent" else 2.0
    sq = b.op("Pow", x, b.f(exponent)) if rng.random() < 0.6 or exponent != 2.0 else b.op("Mul", x, x)
    if perturb == "rms_extra_consumer":
        b.output(b.op("Neg", sq))
    red = "ReduceSum" if perturb == "rms_sum_not_mean" else "ReduceMean"
    ve = b.op("Add", b.reduce(red, sq), b.f(float(choice(rng, [1e-5, 1e-6]))))
    s = b.op("Sqrt", ve)
    inv = choice(rng, ["x_div", "reciprocal", "one_div", "folded"])
    gamma = b.tensor(1 + 0.3 * rng.standard_normal(hidden))
    if inv == "x_div":
        n = b.op("Div", x, s)
    elif inv == "reciprocal":
        n = b.op("Mul", x, b.op("Reciprocal", s))
    elif inv == "one_div":
        n = b.op("Mul", x, b.op("Div", b.f(1.0), s))
    else:
        return b.op("Mul", x, b.op("Mul", b.op("Reciprocal", s), gamma))
    return b.op("Mul", gamma, n) if rng.random() < 0.5 else b.op("Mul", n, gamma)


@family("layernorm", {"ln_extra_consumer": no_pattern("layernorm", "add_layernorm"),
                      "ln_wrong_exponent": no_pattern("layernorm", "add_layernorm"),
                      "ln_wrong_axis": no_pattern("layernorm", "add_layernorm"),
                      # the output is NaN (Sqrt of a negative): fusing is fine, the verdict must not be drift
                      "nan_reference": lambda pattern, kind: False,
                      # the core may fuse with the per-position affine left outside: numerics judge it
                      "ln_gamma_broadcast": lambda pattern, kind: False})
def layernorm(b: Builder, perturb: str | None) -> None:
    x, hidden = _norm_input(b)
    if perturb == "ln_gamma_broadcast":     # X [n, 2, H], gamma [2, H]: an affine per position, not per channel
        if b.inputs[0].type.tensor_type.shape.dim[1].dim_param:
            raise Unbuildable("a [2, H] gamma needs a fixed seq of 2")
        del b.inputs[:]
        x = b.input("X", [int(b.rng.integers(1, 3)), 2, hidden])
    if b.rng.random() < 0.2 and b.elem == TensorProto.FLOAT:
        x = b.op("Cast", x, to=TensorProto.FLOAT)       # HF-style x.float() on a float32 model: a no-op Cast
    b.output(b.op("Identity", nan_tail(b, layernorm_body(b, x, hidden, perturb), perturb)))


def nan_tail(b: Builder, y: str, perturb: str | None) -> str:
    """With "nan_reference": Sqrt(y - 100), NaN wherever the fused part is right (npufuse must not call it drift)."""
    return b.op("Sqrt", b.op("Sub", y, b.f(100.0))) if perturb == "nan_reference" else y


@family("rmsnorm", {"rms_extra_consumer": no_pattern("rmsnorm", "add_rmsnorm"),
                    "rms_wrong_exponent": no_pattern("rmsnorm", "add_rmsnorm"),
                    "rms_sum_not_mean": no_pattern("rmsnorm", "add_rmsnorm"),
                    "nan_reference": lambda pattern, kind: False})
def rmsnorm(b: Builder, perturb: str | None) -> None:
    x, hidden = _norm_input(b)
    if b.rng.random() < 0.3 and b.elem == TensorProto.FLOAT16:   # llama: fp16 -> float32 norm -> fp16
        xf = b.op("Cast", x, to=TensorProto.FLOAT)
        saved = b.elem
        b.elem = TensorProto.FLOAT
        y = rmsnorm_body(b, xf, hidden, perturb)
        b.elem = saved
        y = b.op("Cast", y, to=TensorProto.FLOAT16)
    else:
        y = rmsnorm_body(b, x, hidden, perturb)
    b.output(b.op("Identity", nan_tail(b, y, perturb)))


@family("gelu", {"gelu_wrong_sqrt2": no_pattern("gelu"), "gelu_wrong_half": no_pattern("gelu"),
                 "gelu_wrong_cubic": no_pattern("gelu"), "gelu_erf_consumer": no_pattern("gelu")})
def gelu(b: Builder, perturb: str | None) -> None:
    x, _ = _norm_input(b)
    x = b.op("Identity", x)
    approx = "tanh" if perturb == "gelu_wrong_cubic" else "none" if perturb in (
        "gelu_wrong_sqrt2", "gelu_erf_consumer") else choice(b.rng, ["none", "tanh"])
    c = {"sqrt2": 1.5} if perturb == "gelu_wrong_sqrt2" else {"half": 0.6} if perturb == "gelu_wrong_half" else \
        {"cubic": 0.05} if perturb == "gelu_wrong_cubic" else {"erf_consumer": True} if perturb else {}
    y = gelu_erf(b, x, c) if approx == "none" else gelu_tanh(b, x, c)
    b.output(b.op("Identity", y))


@family("add_norm", {"residual_broadcast": no_pattern("add_layernorm", "add_rmsnorm"),
                     "same_operand": no_pattern("add_layernorm", "add_rmsnorm")})
def add_norm(b: Builder, perturb: str | None) -> None:
    rng = b.rng
    lead, fixed = lead_dims(b, rng.random() < 0.5 and perturb != "residual_broadcast")
    if perturb == "residual_broadcast":
        lead[0] = int(rng.integers(2, 4))     # B [1, seq, H] must really broadcast over the batch
    hidden = int(choice(rng, [8, 16, 32]))
    a = b.input("A", lead + [hidden])
    if perturb == "residual_broadcast":
        other = b.input("B", [1] + lead[1:] + [hidden])
    elif perturb == "same_operand":
        other = a
    else:
        other = b.input("B", lead + [hidden])
    s = b.op("Add", a, other)
    kind = choice(rng, ["layernorm", "rmsnorm"])
    n = layernorm_body(b, s, hidden, None) if kind == "layernorm" else rmsnorm_body(b, s, hidden, None)
    y = b.op("Identity", n)
    b.output(y)
    use = choice(rng, ["none", "next", "output"])
    if use == "next":
        b.output(b.op("Add", s, y))
    elif use == "output":
        b.output(s)


# ---- attention ---------------------------------------------------------------------------------------------------

@family("attention", {"softmax_wrong_axis": no_pattern("attention"), "probs_consumer": no_pattern("attention"),
                      # q @ k is attention with the key k^T (seq == head dim here): fusing it is right, and
                      # the numerics judge whether the key was taken transposed
                      "k_wrong_perm": lambda pattern, kind: False}, dtypes=("fp32", "fp16"))
def attention(b: Builder, perturb: str | None) -> None:
    rng = b.rng
    heads = int(choice(rng, [1, 2, 4]))
    gqa = heads > 1 and rng.random() < 0.3
    kvh = heads // 2 if gqa else heads
    d = int(choice(rng, [4, 8, 16]))
    symbolic = rng.random() < 0.5
    bsz, seq = ("batch", "seq") if symbolic else (int(rng.integers(1, 3)), int(rng.integers(2, 6)))
    layout = choice(rng, ["bsh", "bnsd"])
    kv_cache = rng.random() < 0.25 and perturb != "k_wrong_perm"
    if layout == "bsh":
        xq = b.input("xq", [bsz, seq, heads * d])
        xk = b.input("xk", [bsz, seq, kvh * d])
        xv = b.input("xv", [bsz, seq, kvh * d])
        q = b.op("Transpose", b.op("Reshape", xq, b.ints(0, 0, heads, d)), perm=[0, 2, 1, 3])
        k = b.op("Transpose", b.op("Reshape", xk, b.ints(0, 0, kvh, d)), perm=[0, 2, 1, 3])
        v = b.op("Transpose", b.op("Reshape", xv, b.ints(0, 0, kvh, d)), perm=[0, 2, 1, 3])
    else:
        q = b.input("q", [bsz, heads, seq, d])
        k = b.input("k", [bsz, kvh, seq, d])
        v = b.input("v", [bsz, kvh, seq, d])
    kv_len, total = seq, seq
    if kv_cache:   # decode/prefill with a cache: keys and values are the past concatenated with the new
        past = "past" if symbolic else int(rng.integers(1, 4))
        k = b.op("Concat", b.input("past_key", [bsz, kvh, past, d]), k, axis=2)
        v = b.op("Concat", b.input("past_value", [bsz, kvh, past, d]), v, axis=2)
        b.output(k, v)
        kv_len, total = None, "total" if symbolic else past + seq
    if gqa:
        n = heads // kvh
        if symbolic or kv_len is None:
            form = choice(rng, ["tile4", "concat4"])
        else:
            form = choice(rng, ["tile4", "concat4", "expand"])
        if form == "tile4":
            k, v = (b.op("Tile", t, b.ints(1, n, 1, 1)) for t in (k, v))
        elif form == "concat4":
            k, v = (b.op("Concat", *([t] * n), axis=1) for t in (k, v))
        else:
            k, v = (b.op("Reshape", b.op("Expand", b.unsqueeze(t, [2]), b.ints(bsz, kvh, n, seq, d)),
                         b.ints(bsz, heads, seq, d)) for t in (k, v))
    kt = b.op("Transpose", k, perm=[0, 1, 2, 3] if perturb == "k_wrong_perm" else [0, 1, 3, 2])
    if perturb == "k_wrong_perm" and (symbolic or seq != d):
        raise Unbuildable("a wrong K perm needs seq == head dim to stay well-typed")
    scale = choice(rng, ["div", "mul", "mul_commuted", "qk_sqrt", "q_only", "none"])
    if scale == "qk_sqrt":
        q, kt = b.op("Mul", q, b.f(d ** -0.25)), b.op("Mul", kt, b.f(d ** -0.25))
    elif scale == "q_only":
        q = b.op("Div", q, b.f(d ** 0.5))
    s = b.op("MatMul", q, kt)
    if scale == "div":
        s = b.op("Div", s, b.f(d ** 0.5))
    elif scale == "mul":
        s = b.op("Mul", s, b.f(d ** -0.5))
    elif scale == "mul_commuted":
        s = b.op("Mul", b.f(d ** -0.5), s)
    if rng.random() < 0.2 and not symbolic and kv_len is not None:     # a relative-position bias
        s = b.op("Add", s, b.input("position_bias", [1, heads, seq, seq]))
    mask = choice(rng, [None, "additive", "additive_input", "bool_keep", "causal_const"])
    if mask == "causal_const" and (symbolic or kv_len is None):
        mask = "additive"
    if mask == "additive":          # HF: (1 - attention_mask) * finfo.min
        am = b.input("attention_mask", [bsz, total], TensorProto.INT64, kind="mask01")
        inv = b.op("Sub", b.f(1.0), b.op("Cast", am, to=b.elem))
        fmin = float(np.finfo(np.float16 if b.elem == TensorProto.FLOAT16 else np.float32).min)
        s = b.op("Add", s, b.unsqueeze(b.op("Mul", inv, b.f(fmin)), [1, 2]))
    elif mask == "additive_input":
        s = b.op("Add", s, b.input("float_mask", [bsz, 1, 1, total], kind="mask_add"))
    elif mask == "bool_keep":
        m = b.input("bool_mask", [bsz, 1, 1, total], TensorProto.BOOL, kind="bool")
        s = b.op("Where", m, s, b.f(-np.inf))
    elif mask == "causal_const":
        keep = np.tril(np.ones((seq, seq), dtype=bool)).reshape(1, 1, seq, seq)
        s = b.op("Where", b.tensor(keep, np.bool_), s, b.f(float(np.finfo(np.float16).min)))
    upcast = b.elem == TensorProto.FLOAT16 and rng.random() < 0.5
    if upcast:
        s = b.op("Cast", s, to=TensorProto.FLOAT)
    p = b.op("Softmax", s, axis=2 if perturb == "softmax_wrong_axis" else -1)
    if upcast:
        p = b.op("Cast", p, to=b.elem)
    if perturb == "probs_consumer":
        b.output(b.op("Neg", p))
    o = b.op("MatMul", p, v)
    if layout == "bsh" and rng.random() < 0.7:
        o = b.op("Reshape", b.op("Transpose", o, perm=[0, 2, 1, 3]), b.ints(0, 0, heads * d))
    b.output(b.op("Identity", o))


# ---- rotary -------------------------------------------------------------------------------------------------

def rotate(b: Builder, x: str, form: str, width: int, cos: str, sin: str, perturb: str | None) -> str:
    h = width // 2
    if form == "half":
        if perturb == "rope_uneven_halves":
            x1, x2 = b.slice(x, 0, h - 1), b.slice(x, h - 1, width - 2)
        else:
            x1, x2 = b.slice(x, 0, h), b.slice(x, h, INT64_MAX if b.rng.random() < 0.5 else width)
        if perturb == "rope_neg_wrong_half":
            rot = b.op("Concat", x2, b.op("Neg", x1), axis=-1)
        else:
            rot = b.op("Concat", b.op("Neg", x2), x1, axis=-1)
    else:
        even, odd = b.slice(x, 0, INT64_MAX, step=2), b.slice(x, 1, INT64_MAX, step=2)
        a, c = (even, odd) if perturb == "rope_neg_wrong_half" else (odd, even)
        st = b.op("Concat", b.unsqueeze(b.op("Neg", a), [-1]), b.unsqueeze(c, [-1]), axis=-1)
        rot = b.op("Reshape", st, b.ints(0, 0, 0, -1))
    if perturb == "rope_rot_consumer":
        b.output(b.op("Neg", rot))
    mc, ms = b.op("Mul", x, cos), (b.op("Mul", sin, rot) if b.rng.random() < 0.5 else b.op("Mul", rot, sin))
    return b.op("Add", mc, ms) if b.rng.random() < 0.5 else b.op("Add", ms, mc)


def rope_tables(b: Builder, width: int, form: str, seq, from_positions: bool) -> tuple[str, str]:
    inv = 1.0 / (10000 ** (np.arange(0, width, 2) / width))
    if from_positions:   # inv_freq x positions -> Cos/Sin at run time
        pos = b.op("Cast", b.input("pos", [seq], TensorProto.INT64, kind="positions"), to=TensorProto.FLOAT)
        freqs = b.op("Mul", b.unsqueeze(pos, [1]), b.tensor(inv[None, :].astype(np.float32), np.float32))
        if form == "interleaved":
            emb = b.op("Reshape", b.op("Concat", b.unsqueeze(freqs, [-1]), b.unsqueeze(freqs, [-1]), axis=-1),
                       b.ints(-1, width))
        else:
            emb = b.op("Concat", freqs, freqs, axis=-1)
        out = []
        for fn in ("Cos", "Sin"):
            t = b.op(fn, emb)
            if b.elem != TensorProto.FLOAT:
                t = b.op("Cast", t, to=b.elem)
            out.append(b.unsqueeze(t, [0, 1]))
        return out[0], out[1]
    freqs = np.arange(3, 3 + seq)[:, None] * inv[None, :]
    emb = np.repeat(freqs, 2, axis=-1) if form == "interleaved" else np.concatenate([freqs, freqs], -1)
    return b.tensor(np.cos(emb).reshape(1, 1, seq, width)), b.tensor(np.sin(emb).reshape(1, 1, seq, width))


@family("rotary", {"rope_uneven_halves": no_pattern("rotary", "rotary_pair"),
                   "rope_neg_wrong_half": no_pattern("rotary", "rotary_pair"),
                   "rope_rot_consumer": no_pattern("rotary", "rotary_pair")}, dtypes=("fp32", "fp16"))
def rotary(b: Builder, perturb: str | None) -> None:
    rng = b.rng
    heads, d = int(choice(rng, [1, 2, 3])), int(choice(rng, [4, 8, 16]))
    form = "half" if perturb == "rope_uneven_halves" else choice(rng, ["half", "interleaved"])
    partial = rng.random() < 0.3 and d >= 8
    r = d // 2 if partial else d
    from_positions = rng.random() < 0.6
    seq = "seq" if from_positions and rng.random() < 0.5 else int(rng.integers(1, 6))
    x = b.input("X", [int(rng.integers(1, 3)), heads, seq, d])
    cos, sin = rope_tables(b, r, form, seq, from_positions)
    if partial:
        y = rotate(b, b.slice(x, 0, r), form, r, cos, sin, perturb)
        y = b.op("Concat", y, b.slice(x, r, INT64_MAX), axis=-1)
    else:
        y = rotate(b, x, form, r, cos, sin, perturb)
    b.output(b.op("Identity", y))


@family("rotary_pair", {"rope_pair_other_tables": no_pattern("rotary_pair")}, dtypes=("fp32", "fp16"))
def rotary_pair(b: Builder, perturb: str | None) -> None:
    rng = b.rng
    kvh = int(choice(rng, [1, 2]))
    heads = kvh * int(choice(rng, [1, 2]))
    d = int(choice(rng, [8, 16]))
    seq = int(rng.integers(2, 6))
    form = choice(rng, ["half", "interleaved"])
    bnsd = rng.random() < 0.6
    qs, ks = ([1, heads, seq, d], [1, kvh, seq, d]) if bnsd else ([1, seq, heads, d], [1, seq, kvh, d])
    q, k, v = b.input("Q", qs), b.input("K", ks), b.input("V", [1, kvh, seq, d])
    cos, sin = rope_tables(b, d, form, seq, False)
    if not bnsd:
        cos, sin = (b.op("Transpose", t, perm=[0, 2, 1, 3]) for t in (cos, sin))
    if perturb == "rope_pair_other_tables":
        kcos, ksin = b.tensor(rng.standard_normal((1, 1, seq, d))), b.tensor(rng.standard_normal((1, 1, seq, d)))
        if not bnsd:
            kcos, ksin = (b.op("Transpose", t, perm=[0, 2, 1, 3]) for t in (kcos, ksin))
    else:
        kcos, ksin = cos, sin
    qr, kr = rotate(b, q, form, d, cos, sin, None), rotate(b, k, form, d, kcos, ksin, None)
    if not bnsd:
        qr, kr = (b.op("Transpose", t, perm=[0, 2, 1, 3]) for t in (qr, kr))
    if heads != kvh:
        n = heads // kvh
        kr, v = (b.op("Tile", t, b.ints(1, n, 1, 1)) for t in (kr, v))
    sc = b.op("Div", b.op("MatMul", qr, b.op("Transpose", kr, perm=[0, 1, 3, 2])), b.f(math.sqrt(d)))
    b.output(b.op("MatMul", b.op("Softmax", sc, axis=-1), v))


# ---- gated MLP --------------------------------------------------------------------------------------------------

@family("gated_mlp", {"gate_up_different_inputs": no_pattern("gated_mlp"),
                      "act_is_output": no_pattern("gated_mlp"),
                      "up_extra_consumer": no_pattern("gated_mlp"),
                      "product_with_input": no_pattern("gated_mlp"),
                      "uneven_slices": no_pattern("gated_mlp")})
def gated_mlp(b: Builder, perturb: str | None) -> None:
    rng = b.rng
    k, n = int(choice(rng, [8, 16])), int(choice(rng, [8, 12, 24]))
    lead, _ = lead_dims(b, rng.random() < 0.5)
    x = b.input("X", lead + [k])
    bias = rng.random() < 0.3
    form = "slices" if perturb == "uneven_slices" else choice(rng, ["separate", "split", "slices"])
    if perturb == "gate_up_different_inputs":
        form = "separate"

    def proj(inp: str, width: int) -> str:
        y = b.op("MatMul", inp, b.weight((k, width)))
        return b.op("Add", y, b.tensor(rng.standard_normal(width))) if bias else y

    if form == "separate":
        gate = proj(x, n)
        up = proj(b.input("X2", lead + [k]) if perturb == "gate_up_different_inputs" else x, n)
    else:
        h = proj(x, 2 * n)
        if form == "split":
            first, second = b.split(h, [n, n])
        elif perturb == "uneven_slices":
            first, second = b.slice(h, 0, n), b.slice(h, n - 2, 2 * n - 2)
        else:
            first, second = b.slice(h, 0, n), b.slice(h, n, INT64_MAX if rng.random() < 0.5 else 2 * n)
        gate, up = (first, second) if rng.random() < 0.7 else (second, first)
    acts = ["silu", "silu_rev", "gelu", "gelu_tanh", "relu"] + (["gelu_op", "gelu_tanh_op"] if b.opset >= 20 else [])
    a = activation(b, choice(rng, acts), gate)
    if perturb == "act_is_output":
        b.output(a)
    if perturb == "up_extra_consumer":
        b.output(b.op("Neg", up))
    if perturb == "product_with_input":
        up = b.input("Z", lead + [n])
    prod = b.op("Mul", a, up) if rng.random() < 0.5 else b.op("Mul", up, a)
    b.output(b.op("MatMul", prod, b.weight((n, k))))


# ---- MLA prolog (DeepSeek) ------------------------------------------------------------------------------------

@family("mla_prolog", {"mla_q_extra_consumer": no_pattern("mla_prolog")}, dtypes=("fp32",))
def mla_prolog(b: Builder, perturb: str | None) -> None:
    rng = b.rng
    bsz, seq = int(rng.integers(1, 3)), int(rng.integers(2, 5))
    hid, heads = int(choice(rng, [16, 32])), int(choice(rng, [2, 4]))
    dn, dr, rq, rkv = int(choice(rng, [4, 8])), 4, int(choice(rng, [8, 16])), int(choice(rng, [8, 12]))
    x = b.input("x", [bsz, seq, hid])

    def rms(v: str, width: int) -> str:
        var = b.op("Add", b.reduce("ReduceMean", b.op("Pow", v, b.f(2.0))), b.f(1e-6))
        return b.op("Mul", b.tensor(1 + 0.1 * rng.standard_normal(width)),
                    b.op("Mul", v, b.op("Reciprocal", b.op("Sqrt", var))))

    inv = 1.0 / (10000 ** (np.arange(0, dr, 2) / dr))
    freqs = np.arange(seq)[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], -1)[None, None]
    cos, sin = b.tensor(np.cos(emb)), b.tensor(np.sin(emb))
    cq = rms(b.op("MatMul", x, b.weight((hid, rq))), rq)
    qb = b.op("MatMul", cq, b.weight((rq, heads * (dn + dr))))
    if perturb == "mla_q_extra_consumer":
        b.output(b.op("Neg", qb))
    q = b.op("Transpose", b.op("Reshape", qb, b.ints(bsz, seq, heads, dn + dr)), perm=[0, 2, 1, 3])
    q_nope, q_pe = b.split(q, [dn, dr])
    kv = b.op("MatMul", x, b.weight((hid, rkv + dr)))
    c, k_pe = b.split(kv, [rkv, dr])
    ckv = rms(c, rkv)
    k_pe = b.op("Reshape", k_pe, b.ints(bsz, 1, seq, dr))
    b.output(b.op("Identity", q_nope), b.op("Identity", rotate(b, q_pe, "half", dr, cos, sin, None)),
             b.op("Identity", ckv), b.op("Identity", rotate(b, k_pe, "half", dr, cos, sin, None)))
