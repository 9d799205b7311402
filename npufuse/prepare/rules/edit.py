"""What every canonicalisation rule returns (an Edit) and the helpers rules share: fresh names, what a node reads,
which values may be renamed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
import onnx
from onnx import TensorProto
from npufuse.ir.graph import Graph


_LAYOUT_OPS = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Expand"})


_MAX_SCALE_WALK = 6


# Casts that represent every value of the source type exactly, so casting back restores it bit for bit.
_EXACT_WIDENING: dict[int, frozenset[int]] = {
    TensorProto.FLOAT16: frozenset({TensorProto.FLOAT, TensorProto.DOUBLE}),
    TensorProto.BFLOAT16: frozenset({TensorProto.FLOAT, TensorProto.DOUBLE}),
    TensorProto.FLOAT: frozenset({TensorProto.DOUBLE}),
    TensorProto.INT8: frozenset({TensorProto.INT16, TensorProto.INT32, TensorProto.INT64}),
    TensorProto.UINT8: frozenset({TensorProto.INT16, TensorProto.INT32, TensorProto.INT64}),
    TensorProto.INT16: frozenset({TensorProto.INT32, TensorProto.INT64}),
    TensorProto.INT32: frozenset({TensorProto.INT64}),
    TensorProto.BOOL: frozenset({TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
                                 TensorProto.UINT8}),
}


@dataclass
class Edit:
    """One application of a rule: drop `remove`, put `add` where the last of them was, make every reader of a
    value in `rename` read its replacement, and record the types of the new intermediate values."""

    rule: str
    remove: list[str]
    add: list[onnx.NodeProto] = field(default_factory=list)
    rename: dict[str, str] = field(default_factory=dict)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    types: dict[str, onnx.TypeProto] = field(default_factory=dict)


class _Names:
    """Fresh node and value names for one round."""

    def __init__(self, g: Graph) -> None:
        self.g = g
        self.taken: set[str] = set()

    def value(self, base: str) -> str:
        name, k = f"{base}_canon", 1
        while name in self.taken or name in self.g.producer or name in self.g.consumers or name in self.g.initializers:
            name, k = f"{base}_canon{k}", k + 1
        self.taken.add(name)
        return name

    def node(self, base: str) -> str:
        name, k = f"{base}_canon", 1
        while name in self.taken or name in self.g.node_by_name:
            name, k = f"{base}_canon{k}", k + 1
        self.taken.add(name)
        return name


Rule = Callable[[Graph, onnx.NodeProto, _Names], Edit | None]


def _producer_op(g: Graph, n: onnx.NodeProto, i: int = 0) -> str | None:
    inputs = n.input
    p = g.producer.get(inputs[i]) if len(inputs) > i else None
    return p.op_type if p is not None else None


def _perm(n: onnx.NodeProto) -> tuple[int, ...]:
    return next((tuple(a.ints) for a in n.attribute if a.name == "perm"), ())


def _reads(n: onnx.NodeProto) -> list[str]:
    from npufuse.ir.graph import _node_value_inputs  # the one definition of what a node reads (subgraphs included)

    return [v for v in _node_value_inputs(n) if v]


def _has_subgraph(n: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)


def _renamable(g: Graph, value: str) -> bool:
    """A value whose readers can be pointed elsewhere: not a graph output, and read only as a node input (a
    subgraph reading it from the outer scope would need its body edited)."""
    return value not in g.graph_outputs and all(value in c.input and not _has_subgraph(c)
                                                for c in g.consumers_of(value))   # an If may read it in a branch too


def _private(g: Graph, value: str) -> bool:
    """Read by exactly one node, as an input, and not a graph output."""
    return g.single_consumer(value) is not None and _renamable(g, value)
