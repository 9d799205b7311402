"""Normalise a loaded model before matching: unique node names, topological order, inferred shapes.

Nothing here changes what the model computes. The last step brings the graph to canonical form
(`canonicalize`: small exact rewrite rules run to a fixed point) so patterns match semantics, not syntax. Constant folding of weight-only subgraphs
(ConstantOfShape, Identity of initializers, Cast/Reshape of weights, ...) is lazy: `Graph.constant`
evaluates such values when a pattern asks, so a BatchNorm whose statistics come from ConstantOfShape
counts as constant, while weights that no rewrite touches stay compact in the file.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import NamedTuple

import networkx as nx
import numpy as np
import onnx

from npufuse.prepare.canonicalize import canonicalize
from npufuse.errors import InputError
from npufuse.ir.graph import _FLAT_DOMAINS, _SUBGRAPH_OPS, Graph, _node_value_inputs, np_dtype
from npufuse.prepare.infer import infer_value_types  # noqa: F401  (normalize's callers import it from here too)

log = logging.getLogger(__name__)


# Constant values that feed the computation (shapes, pads, scalar bounds, biases) are materialised as
# initializers when at most this big; larger ones (weights) stay lazy, folded only when a rewrite needs them.
_MAX_MATERIALISED_ELEMENTS = 1 << 16
# ... except a weight computed from weights the model embeds, of at least its size (NFNet's scaled weight
# standardisation: BatchNorm and ReduceMean over the conv weights; a Transpose of a weight left by an export without
# constant folding): computed once here instead of on every inference, within a budget of bytes per model. Weights in
# external data stay lazy (a 7B model's are not read to fold a Transpose), and so do tensors a ConstantOfShape
# generates (materialising them would only grow the file).
_MAX_MATERIALISED_WEIGHT_BYTES = 256 << 20


def normalize(model: onnx.ModelProto, base_dir: str | None = None, canonical: Counter | None = None
              ) -> tuple[onnx.ModelProto, dict[str, onnx.TypeProto]]:
    """Return a normalised copy of `model` and the value types found by shape inference (`base_dir`: the folder
    its stored weights are relative to), brought to canonical form (see `canonicalize`; `canonical`, when
    given, counts the rules applied)."""
    n = normalize_with_view(model, base_dir, canonical)
    return n.model, n.types


class Normalized(NamedTuple):
    model: onnx.ModelProto                       # normalised and canonical
    types: dict[str, onnx.TypeProto]
    view: Graph                                  # the view of `model`
    before_canonical: onnx.ModelProto | None     # normalised, before the canonical rules changed it (None: unchanged)


def normalize_with_view(model: onnx.ModelProto, base_dir: str | None = None, canonical: Counter | None = None
                        ) -> Normalized:
    """`normalize`, with the view of the result (built once: on a 100k-node graph that is seconds) and the model
    as it was before canonicalisation, which verification runs as the reference (so the canonical rules are
    checked with every rewrite)."""
    copied = onnx.ModelProto()
    copied.CopyFrom(model)  # the structure: weights are references (see weights.load_skeleton)
    model = copied
    named, ordered = _named_and_ordered(model.graph)
    if not named:
        _name_nodes(model.graph)
    if not ordered:
        sort_topologically(model.graph)   # neither changes what a node reads: the view below sees the input's reads
    types = infer_value_types(model)
    g = Graph(model, base_dir, value_types=types)   # the one index of the run (see Graph.patch)
    g.in_topological_order = True   # sorted just above
    unread_in_input = _unread_initializers(model.graph, g)
    view = _materialise_small_constants(model, g, types)
    before = onnx.ModelProto()
    before.CopyFrom(model)
    applied, view = canonicalize(model, types, base_dir, view)
    # What folding and the rules left unread goes (see _drop_initializers); from IR 4 an initializer that is also a
    # graph input is part of the model's interface (overridable) and stays.
    inputs = {i.name for i in model.graph.input} if model.ir_version >= 4 else set()
    _drop_initializers(model.graph, _unread_initializers(model.graph, view) - unread_in_input - inputs, view)
    if canonical is not None:
        canonical.update(applied)
    return Normalized(model, types, view if view is not None else Graph(model, base_dir, value_types=types),
                      before if applied else None)


def _materialise_small_constants(model: onnx.ModelProto, g: Graph, types: dict[str, onnx.TypeProto] | None = None
                                 ) -> Graph | None:
    """Fold small constant subgraphs into initializers where they meet the computation (and weights computed from
    embedded weights, within `_MAX_MATERIALISED_WEIGHT_BYTES`), and drop the constant nodes that leaves unused.

    Two kinds of node are constant without reading only constants, and both must go for fusion to see
    through them: CastLike(6.0, x) (the dynamo exporter's Clip bounds, constant but reading x for its
    type) and Shape(x) of a value whose shape is fixed (TorchScript's padding arithmetic). Their edges
    from x would otherwise make x look used outside any fusion. Nothing else about the model changes.
    """
    from onnx import helper, numpy_helper

    replaced: dict[str, onnx.TensorProto] = {}
    weight_bytes = 0
    constant = g._constant_values | {""}   # `g.is_constant` of a name: in here (the empty name, an absent value, too)
    for n in g.nodes:
        if not constant.issuperset(n.output):   # the common case, a node of the computation: one set test
            continue
        outs = [o for o in n.output if o]
        if not outs or not all(g.is_constant(o) for o in outs):
            continue
        reads_dynamic = any(v and not g.is_constant(v) for v in n.input)
        feeds_computation = any(not all(g.is_constant(o) for o in c.output if o)
                                for o in outs for c in g.consumers_of(o))
        if not (reads_dynamic or feeds_computation) or any(o in g.graph_outputs for o in outs):
            continue
        weight = not reads_dynamic and any(_elements(g, o) > _MAX_MATERIALISED_ELEMENTS for o in outs)
        if weight:
            # a big constant: a weight computed from embedded weights of at least its size (not a tensor a
            # ConstantOfShape generates, whose expansion would only grow the file), within the budget
            source = _weight_source(g, outs)
            size = sum(_nbytes(g, o) for o in outs)
            if source is None or source < size or weight_bytes + size > _MAX_MATERIALISED_WEIGHT_BYTES:
                continue
            weight_bytes += size
        arrays = [g.constant(o) for o in outs]
        if any(a is None or (a.size > _MAX_MATERIALISED_ELEMENTS and not weight) for a in arrays):
            continue
        for o, a in zip(outs, arrays):
            replaced[o] = numpy_helper.from_array(np.asarray(a), o)
    if not replaced:
        return g   # the model is unchanged: its view (`g`, of the model as given) is still good
    if types is not None:
        # A folded value's type is its tensor's now. Shape inference may have left its dims unknown (an Expand or
        # ConstantOfShape whose shape it could not evaluate: a class token expanded to the batch), and a dim left
        # unknown here stays unknown in everything that reads it.
        for o, t in replaced.items():
            known = types.get(o)
            if known is None or not _fully_known(known):
                types[o] = helper.make_tensor_type_proto(t.data_type, list(t.dims))
    nodes = [n for n in model.graph.node if not any(o in replaced for o in n.output)]
    # Constant nodes whose every output is now unread go too (repeat: they may feed each other).
    while True:
        read = {v for n in nodes for v in _node_value_inputs(n)} | {o.name for o in model.graph.output}
        dead = [n for n in nodes if all(g.is_constant(o) for o in n.output if o) and not any(o in read for o in n.output)]
        if not dead:
            break
        nodes = [n for n in nodes if n not in dead]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(replaced.values())
    if model.ir_version < 4:  # IR 3 lists every initializer among the inputs
        model.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                 for t in replaced.values())
    return None


def _in_data_file(t: onnx.TensorProto) -> bool:
    """Whether `t` lies in an external data file. A weight embedded in the .onnx file is a reference to that file
    once loaded (`ir.weights.load_skeleton`): it counts as embedded."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return False
    location = next((e.value for e in t.external_data if e.key == "location"), "")
    return not location.endswith(".onnx")


def _weight_source(g: Graph, values: list[str]) -> int | None:
    """The bytes of the initializers the constant `values` are computed from; None where any lies in an external
    data file (it is not read to fold)."""
    todo, seen, total = list(values), set(), 0
    while todo:
        v = todo.pop()
        if not v or v in seen:
            continue
        seen.add(v)
        if v in g.initializers:
            t = g.initializers[v]
            if _in_data_file(t):
                return None
            total += int(np.prod(t.dims, dtype=np.int64)) * max(1, _itemsize(t.data_type))
        else:
            p = g.producer_of(v)
            todo.extend(p.input if p is not None else ())
    return total


def _itemsize(elem_type: int) -> int:
    """Bytes per element of an ONNX element type (4 where numpy has no such type)."""
    dt = np_dtype(elem_type) if elem_type else None
    return int(dt.itemsize) if dt is not None else 4


def _fully_known(t: onnx.TypeProto) -> bool:
    tt = t.tensor_type
    return tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim)


def _elements(g: Graph, v: str) -> int:
    """Elements of `v` by its inferred shape (0 where not known: then the small-constant rule decides)."""
    shape = g.shape(v)
    if not shape or not all(isinstance(d, int) for d in shape):
        return 0
    return int(np.prod(shape, dtype=np.int64))


def _nbytes(g: Graph, v: str) -> int:
    return _elements(g, v) * _itemsize(g.elem_type(v) or 1)


def _unread_initializers(graph: onnx.GraphProto, view: Graph | None = None) -> set[str]:
    """Initializers no node reads (subgraphs' outer-scope reads included) and no graph output is; `view`, when
    given, is an up-to-date view of the graph, whose reader index answers without a pass over the nodes."""
    if view is not None:
        return {t.name for t in graph.initializer
                if not view.consumers.get(t.name) and t.name not in view.graph_outputs}
    read = {v for n in graph.node for v in _node_value_inputs(n)} | {o.name for o in graph.output}
    return {t.name for t in graph.initializer if t.name not in read}


def _drop_initializers(graph: onnx.GraphProto, names: set[str], view: Graph | None) -> None:
    """Remove `names`: initializers constant folding or the canonical rules left unread (a Shape(x) value whose
    Gather -> Unsqueeze readers folded into a later Concat's value, the targets of a cancelled Reshape pair, ...),
    which the optimized model would otherwise carry unread (onnxruntime warns of each at load). Initializers the
    input itself left unread stay: not ours to judge."""
    if not names:
        return
    keep = [t for t in graph.initializer if t.name not in names]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    inputs = [i for i in graph.input if i.name not in names]   # IR < 4 lists initializers among the inputs
    del graph.input[:]
    graph.input.extend(inputs)
    if view is not None:
        for name in names:
            view.initializers.pop(name, None)


def _named_and_ordered(graph: onnx.GraphProto) -> tuple[bool, bool]:
    """Whether `_name_nodes` and `sort_topologically` would leave the graph as it is, in one pass over the nodes
    (an exporter's graph is named and sorted already): every node has a name no other node has, and every value a
    node reads is produced before it or by no node (`_in_order`'s test; a value written twice answers False, which
    sends the graph to `sort_topologically` to judge)."""
    names: set[str] = set()
    produced: set[str] = set()
    unseen: list[str] = []   # values read before any node wrote them: graph inputs, initializers, or a later node's
    named = ordered = True
    for n in graph.node:
        name = n.name
        if named and (not name or name in names):
            named = False
        names.add(name)
        if n.op_type not in _SUBGRAPH_OPS and n.domain in _FLAT_DOMAINS:
            reads = n.input
        else:
            reads = _node_value_inputs(n)
        for v in reads:
            if v and v not in produced:
                unseen.append(v)
        for o in n.output:
            if o:
                if o in produced:
                    ordered = False
                produced.add(o)
    return named, ordered and produced.isdisjoint(unseen)


def _name_nodes(graph: onnx.GraphProto) -> None:
    """Give every node a unique, stable name: reports and fused nodes refer to nodes by name."""
    used: set[str] = set()
    for i, node in enumerate(graph.node):
        base = node.name or f"{node.op_type}_{i}"
        name = base
        k = 1
        while name in used:
            name = f"{base}__{k}"
            k += 1
        node.name = name
        used.add(name)


def sort_topologically(graph: onnx.GraphProto) -> None:
    """Put nodes in topological order (stable: already-sorted graphs keep their order)."""
    nodes = list(graph.node)
    ordered = topological_order(nodes)
    if ordered is not None:
        set_nodes(graph, ordered)


def topological_order(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto] | None:
    """`nodes` in a topological order, or None when they are in one already (a stable sort)."""
    produced_at = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    # what a node reads includes the outer-scope values its subgraphs use: they must be computed before it
    if _in_order(nodes, produced_at):
        return None
    reads = [_node_value_inputs(n) for n in nodes]
    dg = nx.DiGraph()
    dg.add_nodes_from(range(len(nodes)))
    for i, n in enumerate(nodes):
        for v in reads[i]:
            j = produced_at.get(v)
            if j is not None and j != i:
                dg.add_edge(j, i)
    try:
        order = list(nx.lexicographical_topological_sort(dg))
    except nx.NetworkXUnfeasible:
        raise InputError("the graph has a cycle; it is not a valid ONNX model, re-export it") from None
    return [nodes[i] for i in order]


def _in_order(nodes: list[onnx.NodeProto], produced_at: dict[str, int]) -> bool:
    """Whether every value a node reads is produced before it (or by no node): `topological_order`'s test, with
    a plain node's inputs read straight from the proto (a 100k-node graph is sorted once per run)."""
    for i, n in enumerate(nodes):
        if n.op_type not in _SUBGRAPH_OPS and n.domain in _FLAT_DOMAINS:
            reads = n.input
        else:
            reads = _node_value_inputs(n)
        for v in reads:
            if v and produced_at.get(v, -1) >= i:
                return False
    return True


def set_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    """Replace the graph's nodes by `nodes` (which may be the graph's own): copied out first, because clearing
    a repeated field invalidates the messages it held."""
    staged = onnx.GraphProto()
    staged.node.extend(nodes)
    graph.ClearField("node")
    graph.node.extend(staged.node)
