"""Matching helpers the fusion families share: operands of commutative ops, constants, readers, escapes.

Matchers walk the graph through `Graph`'s indices only; these helpers keep that walk short and uniform.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import onnx
from onnx import TensorProto

from npufuse.ir.graph import Graph, attributes

STD_DOMAINS = ("", "ai.onnx")
CONST_RTOL = 1e-4   # how far an exporter's rounded constant (1.4142, 0.7071) may be from the exact value
# A constant stored in a narrow float type is the exact value rounded to that type: it may be off by half a unit
# in the last place (relative 2^-11 for float16, 2^-8 for bfloat16). Its machine epsilon is the tolerance (twice
# that, room for a constant the exporter computed in that type), and never less than CONST_RTOL.
_DTYPE_RTOL = {
    TensorProto.FLOAT16: 2.0 ** -10,
    TensorProto.BFLOAT16: 2.0 ** -7,
    TensorProto.FLOAT8E4M3FN: 2.0 ** -3, TensorProto.FLOAT8E4M3FNUZ: 2.0 ** -3,
    TensorProto.FLOAT8E5M2: 2.0 ** -2, TensorProto.FLOAT8E5M2FNUZ: 2.0 ** -2,
}


class MatchRefused(Exception):
    """Raised deep inside a matcher to refuse with a reason key and the offending node; the pattern's `match`
    turns it into a Refusal (a near-miss in the report)."""

    def __init__(self, node: str, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.node, self.reason, self.detail = node, reason, detail


def other_operand(node: onnx.NodeProto, v: str) -> str | None:
    """The other input of a binary commutative node that reads `v` (v itself for v*v); None if it does not."""
    if len(node.input) != 2:
        return None
    a, b = node.input
    if a == v:
        return b
    if b == v:
        return a
    return None


def split_constant(g: Graph, node: onnx.NodeProto) -> tuple[str, str] | None:
    """(dynamic input, constant input) of a binary node with exactly one constant input, in either order."""
    if len(node.input) != 2:
        return None
    a, b = node.input
    ca, cb = g.is_constant(a), g.is_constant(b)
    if ca == cb:
        return None
    return (b, a) if ca else (a, b)


def const_rtol(elem_type: int | None, rtol: float = CONST_RTOL) -> float:
    """The relative tolerance for a constant of ONNX element type `elem_type`: `rtol`, widened to the type's
    machine epsilon for float16 / bfloat16 / float8 (an fp16 model stores 1/sqrt(2) as 0.70703125)."""
    return max(rtol, _DTYPE_RTOL.get(int(elem_type), 0.0)) if elem_type is not None else rtol


def near(value: float | None, target: float, rtol: float = CONST_RTOL, elem_type: int | None = None) -> bool:
    """True if `value` is `target` within `rtol` (relative), widened to the precision of `elem_type`, the
    ONNX element type the value was stored in (see `const_rtol`), where it is given."""
    tol = const_rtol(elem_type, rtol)
    return value is not None and math.isfinite(value) and abs(value - target) <= tol * abs(target)


def near_constant(g: Graph, v: str, target: float, rtol: float = CONST_RTOL) -> bool:
    """True if `v` is a one-element constant equal to `target` within the tolerance of its own dtype."""
    return near(g.scalar(v), target, rtol, g.elem_type(v))


def std_op(node: onnx.NodeProto | None, *op_types: str) -> bool:
    return node is not None and node.domain in STD_DOMAINS and node.op_type in op_types


def is_last_axis(g: Graph, node: onnx.NodeProto, value: str) -> bool:
    """`node`'s `axis` attribute (default 0) is the last axis of `value`."""
    axis = int(attributes(node).get("axis", 0))
    rank = g.rank(value)
    return axis == -1 or (rank is not None and axis == rank - 1)


def sole_consumer(g: Graph, v: str, *op_types: str) -> onnx.NodeProto | None:
    """The single consumer of `v` if it is one of `op_types` (None if shared, a graph output, or other)."""
    c = g.single_consumer(v)
    return c if std_op(c, *op_types) else None


def reader(g: Graph, v: str, *op_types: str) -> onnx.NodeProto | None:
    """The first consumer of `v` that is one of `op_types`, however many others there are (a core step of a
    pattern: if `v` escapes, the escape check refuses the whole chain with its reason)."""
    return next((c for c in g.consumers_of(v) if std_op(c, *op_types)), None)


def escaping_intermediate(g: Graph, nodes: Sequence[str], outputs: Sequence[str]) -> tuple[str, str, str] | None:
    """(reason, node, detail) if a value inside `nodes` other than `outputs` is used outside or is a graph output."""
    members = set(nodes)
    by_name, consumers, graph_outputs = g.node_by_name, g.consumers, g.graph_outputs
    member_nodes = [by_name[name] for name in nodes]
    member_ids = {id(n) for n in member_nodes}   # a reader that is one of them needs no name read
    for name, node in zip(nodes, member_nodes):
        for v in node.output:
            if not v or v in outputs:
                continue
            if v in graph_outputs:
                return "intermediate-is-output", name, f"{v!r} (output of {name!r}) is also a graph output"
            outside = [c.name for c in consumers.get(v, ()) if id(c) not in member_ids and c.name not in members]
            if outside:
                return ("shared-intermediate", name,
                        f"{v!r} (output of {name!r}) is also used by {outside[0]!r} outside the pattern")
    return None


def last_axis_vector_problem(g: Graph, v: str, n: int | str | None) -> str | None:
    """Why `v` is not a vector along the last axis of length `n` ([n], or a constant [1,..,1,n]), or None.

    A symbolic `n` accepts any fixed length: the op that reads it (a norm, say) already required it to be n."""
    shape = g.shape_or_constant(v)
    if shape is None:
        return "has an unknown shape"
    if not shape or (shape[-1] != n and (not isinstance(n, str) or not isinstance(shape[-1], int))):
        return f"has shape {list(shape)}, not [N] with N={n}"
    if len(shape) > 1 and (any(d != 1 for d in shape[:-1]) or not g.is_constant(v)):
        return f"has shape {list(shape)}, not [N] or a constant [1,..,1,N] with N={n}"
    return None
