"""`move_scale_to_matmul`: a constant scalar Mul/Div before layout steps that end in a MatMul moves to just before it,
where the attention matcher reads a softmax scale."""

from __future__ import annotations

import onnx
from onnx import helper
from npufuse.ir.graph import Graph
from npufuse.prepare.rules.edit import (Edit, _LAYOUT_OPS, _MAX_SCALE_WALK, _Names,
                                        _has_subgraph, _perm, _private, _producer_op, _reads, _renamable)  # noqa: F401
from npufuse.prepare.rules.apply import _apply, _drop_dead, _reads_renamed, _reads_rewritten, _write_nodes  # noqa: F401
from npufuse.prepare.static_values import (MAX_FOLD_ROUNDS, _MAX_FOLDED_ELEMENTS, _tensor_type, fold_static_values)  # noqa: F401
from npufuse.prepare.rules.basic import (drop_cast_round_trip, drop_identity, fold_reshapes, fold_transposes)  # noqa: F401


def move_scale_to_matmul(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    from npufuse.algebra.layout import scale_op

    scale = scale_op(g, n)
    if scale is None or not _private(g, n.output[0]):
        return None
    x = scale[0]
    c = n.input[1] if x == n.input[0] else n.input[0]
    c_rank = g.constant(c).ndim
    if g.rank(x) is None or c_rank > g.rank(x):
        return None   # the Mul broadcasts x up: it is not a pure scale
    chain: list[onnx.NodeProto] = []
    cur = n.output[0]
    for _ in range(_MAX_SCALE_WALK):
        nxt = g.single_consumer(cur)
        if nxt is None or nxt.domain not in ("", "ai.onnx"):
            return None
        if nxt.op_type == "MatMul" and list(nxt.input).count(cur) == 1:
            break
        if nxt.op_type not in _LAYOUT_OPS or nxt.input[0] != cur or cur in nxt.input[1:] or not _private(g, cur):
            return None
        chain.append(nxt)
        cur = nxt.output[0]
    else:
        return None
    if not chain or g.rank(cur) is None or c_rank > g.rank(cur):
        return None
    if _only_head_merges(g, chain):
        return None   # the MatMul is lifted to 4-D instead (unmerge_matmul): moving the scale would undo that
    # The layout steps now carry unscaled values: new names (a name keeps its value, so activations captured on
    # the model before canonicalisation stay valid), and the scale writes `cur`, the name the MatMul reads.
    moved, types = [], {}
    prev = x
    for step in chain:
        copy = onnx.NodeProto()
        copy.CopyFrom(step)
        copy.input[0] = prev
        copy.output[0] = prev = names.value(step.output[0])
        if g.type_of(step.output[0]) is not None:
            types[prev] = g.type_of(step.output[0])
        moved.append(copy)
    operands = [prev, c] if x == n.input[0] else [c, prev]
    moved.append(helper.make_node(n.op_type, operands, [cur], name=n.name))
    return Edit("move_scale_to_matmul", [n.name] + [s.name for s in chain], add=moved, types=types)


def _algebra(g: Graph):
    from npufuse.algebra.layout import Dims, ShapeEval

    return ShapeEval(g), Dims(g)


def _merged(g: Graph, ev, dims, value: str) -> str | None:
    from npufuse.algebra.layout import merged_heads

    return merged_heads(g, ev, dims, g.producer_of(value)) if value else None


def _only_head_merges(g: Graph, chain: list[onnx.NodeProto]) -> bool:
    ev, dims = _algebra(g)
    return all(_merged(g, ev, dims, step.output[0]) is not None for step in chain)
