"""Decomposed GELU  =>  Gelu (opset >= 20) or npufuse.Gelu.

Exact (erf) form, in every association order the exporters write:
    0.5 * x * (1 + erf(x / sqrt(2)))      x / 1.4142 or x * 0.7071; the 0.5 first, last, or on (1 + erf)
Tanh approximation (GPT-2's NewGELU, `gelu_new`; onnx Gelu approximate='tanh'):
    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))      x^3 as Pow(x, 3), x*x*x or x*Pow(x, 2)
    0.5 * x * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))  the factorised form (Megatron's bias_gelu)
  tanh's argument is read as a product of scalar constants, powers of x and one two-term polynomial in x, in
  any association and operand order; it must equal sqrt(2/pi) * (x + 0.044715 x^3).
Quick GELU (CLIP, `quick_gelu`; onnxruntime's QuickGelu; Ascend's FastGelu):
    x * sigmoid(1.702 * x)                 -> npufuse.Gelu(approximate='quick') at every opset (ONNX's Gelu has
                                              no such approximation)
Constants may be initializers or Constant nodes; they must be within 1e-4 (relative) of the exact value, or
within the precision of their own type where it is narrower (float16, bfloat16: see matching.const_rtol),
else the chain is refused as "constant-mismatch". Once an Erf's argument is x / c, a Tanh's argument the
polynomial of x, or a Sigmoid's argument c * x with x * sigmoid(...) after it, the chain is a GELU candidate: it
fuses or is refused with the node where it stopped ("not-gelu"), never dropped silently.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.patterns import kernels
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph, np_dtype
from npufuse.patterns.base import ERF_OPSET, FusedOpDef, Pattern, make_body, require_opset
from npufuse.ir.matching import (
    const_rtol,
    escaping_intermediate,
    near,
    other_operand,
    reader,
    split_constant,
    std_op,
)

SQRT2 = math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TANH_CUBIC = 0.044715
SIGMOID_GELU = 1.702
APPROXIMATIONS = ("none", "tanh", "quick")
# x * sigmoid(c x) with c this close to 1.702 but not within the constant's tolerance is a quick GELU with a
# wrong constant (a near-miss); farther away it is a Swish with its own beta, not a GELU.
_QUICK_NEAR_MISS_RTOL = 5e-2


# ---- the fused op --------------------------------------------------------------------------------------

def gelu_reference(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    """GELU in float64 math, returned in x's dtype; approximate='quick' is x * sigmoid(1.702 x)."""
    if approximate == "quick":
        xf = x.astype(np.float64)
        return (xf * kernels.sigmoid(SIGMOID_GELU * xf)).astype(x.dtype)
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"Gelu: unknown approximate={approximate!r}")
    return kernels.gelu(x, approximate).astype(x.dtype)


def _gelu_ref(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    return [gelu_reference(inputs[0], str(attrs.get("approximate", "none")))]


def gelu_body(attrs: dict[str, Any], opset: int, elem_type: int) -> onnx.FunctionProto:
    """npufuse.Gelu as standard ops of `opset`; one overload per approximation and element type (the
    constants are typed like X: CastLike does not exist below opset 15)."""
    approximate = str(attrs.get("approximate", "none"))
    np_t = np_dtype(elem_type) or np.dtype(np.float32)

    def const(name: str, value: float) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np_t), name))

    if approximate == "quick":
        nodes = [const("Alpha", SIGMOID_GELU),
                 helper.make_node("Mul", ["X", "Alpha"], ["AlphaX"]),
                 helper.make_node("Sigmoid", ["AlphaX"], ["S"]),
                 helper.make_node("Mul", ["X", "S"], ["Y"])]
        return make_body(
            FUSED_DOMAIN, "Gelu", ["X"], ["Y"], nodes, [helper.make_opsetid("", opset)], attributes=["approximate"],
            overload=f"{approximate}_{np_t.name}", doc_string="Quick GELU: X * sigmoid(1.702 X).")
    nodes = [const("Half", 0.5), const("One", 1.0), helper.make_node("Mul", ["X", "Half"], ["HalfX"])]
    if approximate == "tanh":
        nodes += [const("K", SQRT_2_OVER_PI), const("C", TANH_CUBIC),
                  helper.make_node("Mul", ["X", "X"], ["X2"]),
                  helper.make_node("Mul", ["X2", "X"], ["X3"]),
                  helper.make_node("Mul", ["X3", "C"], ["CX3"]),
                  helper.make_node("Add", ["X", "CX3"], ["Inner"]),
                  helper.make_node("Mul", ["Inner", "K"], ["Arg"]),
                  helper.make_node("Tanh", ["Arg"], ["T"])]
    elif approximate == "none":
        require_opset("Gelu", opset, ERF_OPSET, "Erf")
        nodes += [const("InvSqrt2", 1.0 / SQRT2),
                  helper.make_node("Mul", ["X", "InvSqrt2"], ["Arg"]),
                  helper.make_node("Erf", ["Arg"], ["T"])]
    else:
        raise ValueError(f"Gelu: unknown approximate={approximate!r}")
    nodes += [helper.make_node("Add", ["T", "One"], ["OnePlus"]),
              helper.make_node("Mul", ["HalfX", "OnePlus"], ["Y"])]
    return make_body(
        FUSED_DOMAIN, "Gelu", ["X"], ["Y"], nodes, [helper.make_opsetid("", opset)], attributes=["approximate"],
        overload=f"{approximate}_{np_t.name}", doc_string="GELU; approximate='tanh' is GPT-2's NewGELU.")


NPU_GELU = FusedOpDef(
    op_type="Gelu",
    doc="Y = 0.5 * X * (1 + erf(X / sqrt(2))); approximate='tanh': 0.5 X (1 + tanh(sqrt(2/pi) (X + 0.044715 X^3))); "
        "approximate='quick': X * sigmoid(1.702 X).",
    inputs=("X",), outputs=("Y",), attributes=("approximate",), reference=_gelu_ref, body=gelu_body,
)
GELU = FusedOpDef(
    op_type="Gelu", doc="ONNX Gelu-20.", inputs=("X",), outputs=("Y",), attributes=("approximate",),
    reference=_gelu_ref, body=None, domain="",
)


# ---- matching ------------------------------------------------------------------------------------------

class _Mismatch(Exception):
    """A GELU-shaped chain with a constant that is off."""

    def __init__(self, node: onnx.NodeProto, what: str, got: float | None, want: float,
                 elem_type: int | None = None) -> None:
        super().__init__(what)
        self.node, self.what, self.got, self.want, self.elem_type = node, what, got, want, elem_type


def _rank_raising_constant(g: Graph, x: str, nodes: list[str]) -> tuple[str, str, int] | None:
    """(node, constant, its rank) for a size-1 constant of the chain whose rank exceeds x's (a [1, 1, 1] 0.5 on a
    2-D x makes the output 3-D), else None. x's rank unknown: constants up to rank 1 broadcast harmlessly."""
    limit = g.rank(x)
    limit = 1 if limit is None else max(limit, 1)
    for name in nodes:
        n = g.node(name)
        for v in n.input:
            if v and g.is_constant(v):
                arr = g.constant(v)
                if arr is not None and arr.ndim > limit:
                    return name, v, arr.ndim
    return None


class _NotGelu(Exception):
    """A GELU candidate (its anchor's argument is GELU's) whose chain stops short of a GELU."""

    def __init__(self, node: onnx.NodeProto, detail: str) -> None:
        super().__init__(detail)
        self.node, self.detail = node, detail


def _scale(g: Graph, node: onnx.NodeProto, x: str | None = None) -> tuple[str, float | None, int] | None:
    """(operand, factor, the constant's element type) if `node` is Mul(v, c) / Mul(c, v) / Div(v, c) with c
    constant (and v == x if given)."""
    if std_op(node, "Mul"):
        sc = split_constant(g, node)
        if sc is None or (x is not None and sc[0] != x):
            return None
        return sc[0], g.scalar(sc[1]), g.elem_type(sc[1])
    if std_op(node, "Div") and g.is_constant(node.input[1]) and not g.is_constant(node.input[0]):
        if x is not None and node.input[0] != x:
            return None
        c = g.scalar(node.input[1])
        return node.input[0], (1.0 / c if c else None), g.elem_type(node.input[1])
    return None


def _check(node: onnx.NodeProto, what: str, got: float | None, want: float, elem_type: int | None = None) -> None:
    if not near(got, want, elem_type=elem_type):
        raise _Mismatch(node, what, got, want, elem_type)


def _one_plus(g: Graph, t: str, nodes: list[str]) -> str | None:
    """The output of Add(t, 1) (either order), the only reader of t."""
    add = reader(g, t, "Add")
    if add is None:
        return None
    one = other_operand(add, t)
    if one is None or one == t or not g.is_constant(one):
        return None
    _check(add, "the 1 in (1 + ...)", g.scalar(one), 1.0, g.elem_type(one))
    nodes.append(add.name)
    return add.output[0]


def _half_product(g: Graph, x: str, a: str, nodes: list[str]) -> str | None:
    """The output of 0.5 * x * a in any association: (x*a)*0.5, (a*0.5)*x, (x*0.5)*a, x/2 and /2 too."""
    m1 = reader(g, a, "Mul")
    if m1 is None:
        return None
    y = other_operand(m1, a)
    if y is None or y == a:
        return None
    if y == x:                                             # (x * a) * 0.5
        m2 = reader(g, m1.output[0], "Mul", "Div")
        sc = _scale(g, m2) if m2 is not None else None
        if sc is None:
            return None
        _check(m2, "the 0.5 factor", sc[1], 0.5, sc[2])
        nodes += [m1.name, m2.name]
        return m2.output[0]
    if g.is_constant(y):                                   # (a * 0.5) * x
        m2 = reader(g, m1.output[0], "Mul")
        if m2 is None or other_operand(m2, m1.output[0]) != x:
            return None
        _check(m1, "the 0.5 factor", g.scalar(y), 0.5, g.elem_type(y))
        nodes += [m1.name, m2.name]
        return m2.output[0]
    half = g.producer_of(y)                                # (x * 0.5) * a
    sc = _scale(g, half, x) if half is not None else None
    if sc is None:
        return None
    _check(half, "the 0.5 factor", sc[1], 0.5, sc[2])
    nodes += [half.name, m1.name]
    return m1.output[0]


class _Product:
    """A value read as c * prod(leaf ** power): scalar constants multiplied out, Mul/Div-by-constant/Pow nodes
    walked through (only where nobody else reads their output), every other value a leaf."""

    def __init__(self) -> None:
        self.factor = 1.0
        self.rtol_type: int | None = None     # the element type of the least precise constant seen
        self.powers: dict[str, int] = {}
        self.nodes: list[str] = []

    def constant(self, g: Graph, v: str, invert: bool = False) -> bool:
        c = g.scalar(v)
        if c is None or not math.isfinite(c) or (invert and c == 0.0):
            return False
        self.factor *= (1.0 / c) if invert else c
        t = g.elem_type(v)
        if self.rtol_type is None or const_rtol(t) > const_rtol(self.rtol_type):
            self.rtol_type = t
        return True


def _product(g: Graph, v: str, top: bool = True, prod: _Product | None = None) -> _Product | None:
    """`v` as a `_Product`, or None where a constant factor is not a scalar."""
    prod = prod if prod is not None else _Product()
    if g.is_constant(v):
        return prod if prod.constant(g, v) else None
    p = g.producer_of(v)
    private = top or (g.single_consumer(v) is not None and v not in g.graph_outputs)
    if private and std_op(p, "Mul") and len(p.input) == 2:
        prod.nodes.append(p.name)
        for i in p.input:
            if _product(g, i, False, prod) is None:
                return None
        return prod
    if private and std_op(p, "Div") and g.is_constant(p.input[1]) and not g.is_constant(p.input[0]):
        prod.nodes.append(p.name)
        if not prod.constant(g, p.input[1], invert=True):
            return None
        return _product(g, p.input[0], False, prod)
    if private and std_op(p, "Pow") and g.is_constant(p.input[1]) and not g.is_constant(p.input[0]):
        e = g.scalar(p.input[1])
        if e is not None and e == int(e) and 1 <= e <= 4:
            prod.nodes.append(p.name)
            prod.powers[p.input[0]] = prod.powers.get(p.input[0], 0) + int(e)
            return prod
    prod.powers[v] = prod.powers.get(v, 0) + 1
    return prod


def _tanh_polynomial(g: Graph, arg: str) -> tuple[str, float, float, onnx.NodeProto, int | None, list[str]] | None:
    """(x, k, c, the polynomial's Add, constants' type, nodes) if `arg` is k * (x + c x^3), written as
    k * x_or_1 * (a x^p + b x^q) in any association (x + c x^3, x * (1 + c x^2), ...); None otherwise.
    k and c are what the model computes; the exponents are checked here, the constants by the caller."""
    outer = _product(g, arg)
    if outer is None:
        return None
    adds = [v for v, e in outer.powers.items() if e == 1 and std_op(g.producer_of(v), "Add")
            and g.single_consumer(v) is not None and v not in g.graph_outputs]
    if len(adds) != 1:
        return None
    add = g.producer_of(adds[0])
    rest = {v: e for v, e in outer.powers.items() if v != adds[0]}
    terms = [_product(g, i, False) for i in add.input]
    if any(t is None for t in terms) or len(rest) > 1:
        return None
    leaves = set(rest) | {v for t in terms for v in t.powers}
    if len(leaves) != 1:
        return None
    x = next(iter(leaves))
    shift = rest.get(x, 0)
    by_power = {}
    for t in terms:
        p = t.powers.get(x, 0) + shift
        if p in by_power:
            return None
        by_power[p] = t.factor
    if set(by_power) != {1, 3}:
        return None     # tanh of some other polynomial (tanh(x + b), ...): not a GELU candidate
    elem = max([outer.rtol_type] + [t.rtol_type for t in terms], key=lambda t: const_rtol(t))
    nodes = outer.nodes + [add.name] + [n for t in terms for n in t.nodes]
    a1 = by_power[1]
    if a1 == 0.0:
        raise _Mismatch(add, "the coefficient of x", 0.0, 1.0, elem)
    return x, outer.factor * a1, by_power[3] / a1, add, elem, nodes


class GeluPattern(Pattern):
    name = "gelu"
    description = ("0.5*x*(1+erf(x/sqrt2)), 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715x^3))) in its factorised forms too, "
                   "and x*sigmoid(1.702x) into Gelu / npufuse.Gelu")
    anchor_ops = frozenset({"Erf", "Tanh", "Sigmoid"})
    phase = 0
    fused_ops = (NPU_GELU, GELU)

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if node.domain not in ("", "ai.onnx") or not node.input or not node.output:
            return None
        nodes: list[str] = []
        try:
            if node.op_type == "Erf":
                found = self._erf_form(g, node, nodes)
            elif node.op_type == "Tanh":
                found = self._tanh_form(g, node, nodes)
            else:
                found = self._quick_form(g, node, nodes)
        except _Mismatch as mm:
            got = "a non-scalar" if mm.got is None else f"{mm.got:.7g}"
            tol = const_rtol(mm.elem_type)
            return Refusal(self.name, mm.node.name, "constant-mismatch",
                           f"GELU at {node.name!r}: {mm.what} is {got} in {mm.node.name!r}, not {mm.want:.7g} "
                           f"(within {tol:.2g} relative)", tuple(nodes))
        except _NotGelu as ng:
            return Refusal(self.name, ng.node.name, "not-gelu", f"GELU at {node.name!r}: {ng.detail}", tuple(nodes))
        if found is None:
            return None
        x, out, approximate = found
        widened = _rank_raising_constant(g, x, nodes)
        if widened is not None:
            return Refusal(self.name, widened[0], "constant-shape",
                           f"GELU at {node.name!r}: the constant {widened[1]!r} of {widened[0]!r} has rank "
                           f"{widened[2]}, more than {x!r}'s: it broadcasts the result to a higher rank, which the "
                           "fused op would not", tuple(nodes))
        esc = escaping_intermediate(g, nodes, [out])
        if esc is not None:
            return Refusal(self.name, esc[1], esc[0], f"GELU at {node.name!r}: {esc[2]}", tuple(nodes))
        nodes = list(dict.fromkeys(nodes))
        ordered = tuple(sorted(nodes, key=lambda n: g.topo_index[n]))
        op = self._op(g, approximate)
        kind = f"{op.op_type}[{approximate}]" if op is GELU else f"npufuse.Gelu[{approximate}]"
        return Match(self.name, ordered, g.boundary_inputs(ordered), (out,), kind,
                     info={"x": x, "approximate": approximate, "anchor": node.name})

    @staticmethod
    def _op(g: Graph, approximate: str) -> FusedOpDef:
        """ONNX's Gelu where the opset has it and it has the approximation; npufuse.Gelu otherwise."""
        return GELU if g.opset.get("", 1) >= 20 and approximate in ("none", "tanh") else NPU_GELU

    @staticmethod
    def _tail(g: Graph, anchor: onnx.NodeProto, x: str, nodes: list[str]) -> str:
        """The output of 0.5 * x * (1 + anchor(...)), or _NotGelu naming where the chain stops."""
        t = anchor.output[0]
        a = _one_plus(g, t, nodes)
        if a is None:
            readers = ", ".join(repr(c.name) for c in g.consumers_of(t)) or "nothing (a graph output)"
            raise _NotGelu(anchor, f"the argument of {anchor.op_type} {anchor.name!r} is GELU's, but its output is "
                                   f"read by {readers}, not by an Add of 1")
        out = _half_product(g, x, a, nodes)
        if out is None:
            add = g.producer_of(a)
            readers = ", ".join(repr(c.name) for c in g.consumers_of(a)) or "nothing (a graph output)"
            raise _NotGelu(add, f"(1 + {anchor.op_type.lower()}(...)) from {add.name!r} is read by {readers}, "
                                f"not multiplied by 0.5 * {x!r}")
        return out

    def _erf_form(self, g: Graph, erf: onnx.NodeProto, nodes: list[str]) -> tuple[str, str, str] | None:
        p = g.producer_of(erf.input[0])
        sc = _scale(g, p) if p is not None else None
        if sc is None:
            return None
        x = sc[0]
        nodes += [p.name, erf.name]
        out = self._tail(g, erf, x, nodes)
        _check(p, "the 1/sqrt(2) scale of erf's argument", sc[1], 1.0 / SQRT2, sc[2])
        return x, out, "none"

    def _tanh_form(self, g: Graph, tanh: onnx.NodeProto, nodes: list[str]) -> tuple[str, str, str] | None:
        poly = _tanh_polynomial(g, tanh.input[0])
        if poly is None:
            return None
        x, k, c, add, elem, poly_nodes = poly
        nodes += poly_nodes + [tanh.name]
        out = self._tail(g, tanh, x, nodes)
        _check(add, "the 0.044715 cubic coefficient", c, TANH_CUBIC, elem)
        scale_node = g.producer_of(tanh.input[0])
        _check(scale_node if scale_node is not None else tanh, "the sqrt(2/pi) scale of tanh's argument", k,
               SQRT_2_OVER_PI, elem)
        return x, out, "tanh"

    def _quick_form(self, g: Graph, sig: onnx.NodeProto, nodes: list[str]) -> tuple[str, str, str] | None:
        """x * Sigmoid(1.702 * x), every operand order (CLIP's quick_gelu)."""
        p = g.producer_of(sig.input[0])
        sc = _scale(g, p) if p is not None else None
        if sc is None:
            return None
        x, alpha, elem = sc
        mul = next((c for c in g.consumers_of(sig.output[0])
                    if std_op(c, "Mul") and other_operand(c, sig.output[0]) == x), None)
        if mul is None:
            return None   # a gate sigmoid(c * x) * h: not a GELU
        if not near(alpha, SIGMOID_GELU, elem_type=elem):
            if near(alpha, SIGMOID_GELU, _QUICK_NEAR_MISS_RTOL):
                nodes += [p.name, sig.name, mul.name]
                raise _Mismatch(p, "the 1.702 of x * sigmoid(1.702 x) (quick GELU)", alpha, SIGMOID_GELU, elem)
            return None   # x * sigmoid(beta * x): a Swish with its own beta, not a GELU
        nodes += [p.name, sig.name, mul.name]
        return x, mul.output[0], "quick"

    def build(self, g: Graph, m: Match) -> Replacement:
        opset = g.opset.get("", 1)
        op = self._op(g, m.info["approximate"])
        x = m.info["x"]
        elem_type = g.elem_type(x)
        if elem_type == TensorProto.UNDEFINED:
            elem_type = g.elem_type(m.outputs[0])
        node, fn = op.make_node([x], list(m.outputs), m.info["anchor"], {"approximate": m.info["approximate"]},
                                opset, elem_type)
        if fn is None:
            return Replacement([node])
        return Replacement([node], [], [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})
