"""Decomposed GELU  =>  Gelu (opset >= 20) or npufuse.Gelu.

Exact (erf) form, in every association order the exporters write:
    0.5 * x * (1 + erf(x / sqrt(2)))      x / 1.4142 or x * 0.7071; the 0.5 first, last, or on (1 + erf)
Tanh approximation (GPT-2's NewGELU, `gelu_new`; onnx Gelu approximate='tanh'):
    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))      x^3 as Pow(x, 3) or x*x*x
Constants may be initializers or Constant nodes; they must be within 1e-4 (relative) of the exact value,
else the chain is refused as "constant-mismatch". The sigmoid approximation x * sigmoid(1.702 x) is a
different function and is only reported as a near-miss ("sigmoid-approximation").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION, kernels
from npufuse.fusion.types import Match, Refusal, Replacement
from npufuse.graph import Graph, np_dtype
from npufuse.patterns.base import FusedOpDef, Pattern
from npufuse.patterns.matching import (
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


# ---- the fused op --------------------------------------------------------------------------------------

def gelu_reference(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    """GELU in float64 math, returned in x's dtype."""
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
        nodes += [const("InvSqrt2", 1.0 / SQRT2),
                  helper.make_node("Mul", ["X", "InvSqrt2"], ["Arg"]),
                  helper.make_node("Erf", ["Arg"], ["T"])]
    else:
        raise ValueError(f"Gelu: unknown approximate={approximate!r}")
    nodes += [helper.make_node("Add", ["T", "One"], ["OnePlus"]),
              helper.make_node("Mul", ["HalfX", "OnePlus"], ["Y"])]
    return helper.make_function(
        FUSED_DOMAIN, "Gelu", ["X"], ["Y"], nodes, [helper.make_opsetid("", opset)], attributes=["approximate"],
        overload=f"{approximate}_{np_t.name}", doc_string="GELU; approximate='tanh' is GPT-2's NewGELU.")


NPU_GELU = FusedOpDef(
    op_type="Gelu",
    doc="Y = 0.5 * X * (1 + erf(X / sqrt(2))); approximate='tanh': 0.5 X (1 + tanh(sqrt(2/pi) (X + 0.044715 X^3))).",
    inputs=("X",), outputs=("Y",), attributes=("approximate",), reference=_gelu_ref, body=gelu_body,
)
GELU = FusedOpDef(
    op_type="Gelu", doc="ONNX Gelu-20.", inputs=("X",), outputs=("Y",), attributes=("approximate",),
    reference=_gelu_ref, body=None, domain="",
)


# ---- matching ------------------------------------------------------------------------------------------

class _Mismatch(Exception):
    """A GELU-shaped chain with a constant that is off."""

    def __init__(self, node: onnx.NodeProto, what: str, got: float | None, want: float) -> None:
        super().__init__(what)
        self.node, self.what, self.got, self.want = node, what, got, want


def _scale(g: Graph, node: onnx.NodeProto, x: str | None = None) -> tuple[str, float | None] | None:
    """(operand, factor) if `node` is Mul(v, c) / Mul(c, v) / Div(v, c) with c constant (and v == x if given)."""
    if std_op(node, "Mul"):
        sc = split_constant(g, node)
        if sc is None or (x is not None and sc[0] != x):
            return None
        return sc[0], g.scalar(sc[1])
    if std_op(node, "Div") and g.is_constant(node.input[1]) and not g.is_constant(node.input[0]):
        if x is not None and node.input[0] != x:
            return None
        c = g.scalar(node.input[1])
        return node.input[0], (1.0 / c if c else None)
    return None


def _check(node: onnx.NodeProto, what: str, got: float | None, want: float) -> None:
    if not near(got, want):
        raise _Mismatch(node, what, got, want)


def _one_plus(g: Graph, t: str, nodes: list[str]) -> str | None:
    """The output of Add(t, 1) (either order), the only reader of t."""
    add = reader(g, t, "Add")
    if add is None:
        return None
    one = other_operand(add, t)
    if one is None or one == t or not g.is_constant(one):
        return None
    _check(add, "the 1 in (1 + ...)", g.scalar(one), 1.0)
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
        _check(m2, "the 0.5 factor", sc[1], 0.5)
        nodes += [m1.name, m2.name]
        return m2.output[0]
    if g.is_constant(y):                                   # (a * 0.5) * x
        m2 = reader(g, m1.output[0], "Mul")
        if m2 is None or other_operand(m2, m1.output[0]) != x:
            return None
        _check(m1, "the 0.5 factor", g.scalar(y), 0.5)
        nodes += [m1.name, m2.name]
        return m2.output[0]
    half = g.producer_of(y)                                # (x * 0.5) * a
    sc = _scale(g, half, x) if half is not None else None
    if sc is None:
        return None
    _check(half, "the 0.5 factor", sc[1], 0.5)
    nodes += [half.name, m1.name]
    return m1.output[0]


def _is_cube_of(g: Graph, v: str, nodes: list[str]) -> str | None:
    """x if `v` is Pow(x, 3), x*(x*x), (x*x)*x or x*Pow(x, 2), recording the nodes."""
    p = g.producer_of(v)
    if std_op(p, "Pow") and g.is_constant(p.input[1]) and not g.is_constant(p.input[0]):
        _check(p, "the exponent of x^3", g.scalar(p.input[1]), 3.0)
        nodes.append(p.name)
        return p.input[0]
    if not std_op(p, "Mul") or g.is_constant(p.input[0]) or g.is_constant(p.input[1]):
        return None
    for x, sq in (p.input[0], p.input[1]), (p.input[1], p.input[0]):
        q = g.producer_of(sq)
        if std_op(q, "Mul") and list(q.input) == [x, x] or \
                std_op(q, "Pow") and q.input[0] == x and g.is_constant(q.input[1]) and g.scalar(q.input[1]) == 2.0:
            nodes += [q.name, p.name]
            return x
    return None


class GeluPattern(Pattern):
    name = "gelu"
    description = "0.5*x*(1+erf(x/sqrt2)) and 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715x^3))) into Gelu / npufuse.Gelu"
    anchor_ops = frozenset({"Erf", "Tanh", "Sigmoid"})
    phase = 0
    fused_ops = (NPU_GELU, GELU)

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if node.domain not in ("", "ai.onnx") or not node.input or not node.output:
            return None
        if node.op_type == "Sigmoid":
            return self._sigmoid_near_miss(g, node)
        nodes: list[str] = []
        try:
            found = self._erf_form(g, node, nodes) if node.op_type == "Erf" else self._tanh_form(g, node, nodes)
        except _Mismatch as mm:
            got = "a non-scalar" if mm.got is None else f"{mm.got:.7g}"
            return Refusal(self.name, mm.node.name, "constant-mismatch",
                           f"GELU at {node.name!r}: {mm.what} is {got} in {mm.node.name!r}, not {mm.want:.7g}",
                           tuple(nodes))
        if found is None:
            return None
        x, out, approximate = found
        esc = escaping_intermediate(g, nodes, [out])
        if esc is not None:
            return Refusal(self.name, esc[1], esc[0], f"GELU at {node.name!r}: {esc[2]}", tuple(nodes))
        ordered = tuple(sorted(nodes, key=lambda n: g.topo_index[n]))
        op = GELU if g.opset.get("", 1) >= 20 else NPU_GELU
        kind = f"{op.op_type}[{approximate}]" if op is GELU else f"npufuse.Gelu[{approximate}]"
        return Match(self.name, ordered, g.boundary_inputs(ordered), (out,), kind,
                     info={"x": x, "approximate": approximate, "anchor": node.name})

    def _erf_form(self, g: Graph, erf: onnx.NodeProto, nodes: list[str]) -> tuple[str, str, str] | None:
        p = g.producer_of(erf.input[0])
        sc = _scale(g, p) if p is not None else None
        if sc is None:
            return None
        x = sc[0]
        nodes += [p.name, erf.name]
        a = _one_plus(g, erf.output[0], nodes)
        if a is None:
            return None
        out = _half_product(g, x, a, nodes)
        if out is None:
            return None
        _check(p, "the 1/sqrt(2) scale of erf's argument", sc[1], 1.0 / SQRT2)
        return x, out, "none"

    def _tanh_form(self, g: Graph, tanh: onnx.NodeProto, nodes: list[str]) -> tuple[str, str, str] | None:
        p = g.producer_of(tanh.input[0])
        sc = _scale(g, p) if p is not None else None
        if sc is None:
            return None
        inner, k = sc
        add = g.producer_of(inner)
        if not std_op(add, "Add"):
            return None
        found = None
        for x, cubic in (add.input[0], add.input[1]), (add.input[1], add.input[0]):
            cm = g.producer_of(cubic)
            cs = _scale(g, cm) if cm is not None else None
            if cs is None:
                continue
            sub: list[str] = []
            if _is_cube_of(g, cs[0], sub) == x:
                found = (x, cm, cs[1], sub)
                break
        if found is None:
            return None
        x, cm, c, cube_nodes = found
        nodes += cube_nodes + [cm.name, add.name, p.name, tanh.name]
        a = _one_plus(g, tanh.output[0], nodes)
        if a is None:
            return None
        out = _half_product(g, x, a, nodes)
        if out is None:
            return None
        _check(cm, "the 0.044715 cubic coefficient", c, TANH_CUBIC)
        _check(p, "the sqrt(2/pi) scale of tanh's argument", k, SQRT_2_OVER_PI)
        return x, out, "tanh"

    def _sigmoid_near_miss(self, g: Graph, sig: onnx.NodeProto) -> Refusal | None:
        p = g.producer_of(sig.input[0])
        sc = _scale(g, p) if p is not None else None
        if sc is None or not near(sc[1], SIGMOID_GELU, 1e-2):
            return None
        if not any(std_op(c, "Mul") and other_operand(c, sig.output[0]) == sc[0]
                   for c in g.consumers_of(sig.output[0])):
            return None
        return Refusal(self.name, sig.name, "sigmoid-approximation",
                       f"x * sigmoid({sc[1]:.4g} x) at {sig.name!r} approximates GELU to about 2e-2, it is not "
                       "GELU; left as it is", (p.name, sig.name))

    def build(self, g: Graph, m: Match) -> Replacement:
        opset = g.opset.get("", 1)
        op = GELU if opset >= 20 else NPU_GELU
        x = m.info["x"]
        elem_type = g.elem_type(x)
        if elem_type == TensorProto.UNDEFINED:
            elem_type = g.elem_type(m.outputs[0])
        node, fn = op.make_node([x], list(m.outputs), m.info["anchor"], {"approximate": m.info["approximate"]},
                                opset, elem_type)
        if fn is None:
            return Replacement([node])
        return Replacement([node], [], [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})
