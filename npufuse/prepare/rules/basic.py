"""Rules that drop what computes nothing: Identity, Cast round trips, Transpose and Reshape chains folded into one."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper
from npufuse.ir.graph import Graph, attributes
from npufuse.prepare.rules.edit import (Edit, _EXACT_WIDENING, _Names,
                                        _has_subgraph, _perm, _private, _producer_op, _reads, _renamable)  # noqa: F401
from npufuse.prepare.rules.apply import _apply, _drop_dead, _reads_renamed, _reads_rewritten, _write_nodes  # noqa: F401
from npufuse.prepare.static_values import (MAX_FOLD_ROUNDS, _MAX_FOLDED_ELEMENTS, _tensor_type, fold_static_values)  # noqa: F401


def drop_identity(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    if not n.input or not n.input[0] or not _renamable(g, n.output[0]):
        return None
    return Edit("drop_identity", [n.name], rename={n.output[0]: n.input[0]})


def drop_cast_round_trip(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    to = attributes(n).get("to")
    x, y = n.input[0], n.output[0]
    if not _renamable(g, y):
        return None
    src = g.elem_type(x)
    if src and src == to:
        return Edit("drop_cast_round_trip", [n.name], rename={y: x})
    p = g.producer_of(x)
    if p is None or p.op_type != "Cast" or p.domain not in ("", "ai.onnx"):
        return None
    origin = p.input[0]
    t0 = g.elem_type(origin)
    if t0 and t0 == to and attributes(p).get("to") in _EXACT_WIDENING.get(t0, ()):
        return Edit("drop_cast_round_trip", [n.name], rename={y: origin})
    return None


def fold_transposes(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    p = g.producer_of(n.input[0])
    if p is None or p.op_type != "Transpose" or p.domain not in ("", "ai.onnx"):
        return None
    rank = g.rank(p.input[0])
    p_perm = attributes(p).get("perm") or (list(range(rank))[::-1] if rank is not None else None)
    q_perm = attributes(n).get("perm") or (p_perm and list(range(len(p_perm)))[::-1])
    if not p_perm or not q_perm or len(p_perm) != len(q_perm):
        return None
    perm = [p_perm[i] for i in q_perm]
    y = n.output[0]
    if perm == list(range(len(perm))) and _renamable(g, y):
        return Edit("fold_transposes", [n.name], rename={y: p.input[0]})
    node = helper.make_node("Transpose", [p.input[0]], [y], name=n.name, perm=perm)
    return Edit("fold_transposes", [n.name], add=[node])


def fold_reshapes(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    p = g.producer_of(n.input[0])
    if p is None or p.op_type != "Reshape" or p.domain not in ("", "ai.onnx") or len(n.input) < 2:
        return None
    # A 0 in the target copies that dim of the reshaped value, which the fold would change; a constant target
    # shows it has none (or allowzero says 0 means 0).
    target = g.constant(n.input[1]) if g.is_constant(n.input[1]) else None
    if not attributes(n).get("allowzero", 0) and (target is None or np.any(target == 0)):
        return None
    node = onnx.NodeProto()
    node.CopyFrom(n)
    node.input[0] = p.input[0]
    return Edit("fold_reshapes", [n.name], add=[node])
