"""Normalise a loaded model before matching: unique node names, topological order, inferred shapes.

Nothing here changes what the model computes. Constant folding of weight-only subgraphs
(ConstantOfShape, Identity of initializers, Cast/Reshape of weights, ...) is lazy: `Graph.constant`
evaluates such values when a pattern asks, so a BatchNorm whose statistics come from ConstantOfShape
counts as constant, while weights that no rewrite touches stay compact in the file.
"""

from __future__ import annotations

import copy
import logging

import networkx as nx
import onnx

from npufuse.errors import InputError

log = logging.getLogger(__name__)


def normalize(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, onnx.TypeProto]]:
    """Return a normalised copy of `model` and the value types found by shape inference."""
    model = copy.deepcopy(model)
    _name_nodes(model.graph)
    sort_topologically(model.graph)
    return model, infer_value_types(model)


def infer_value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Types and shapes (symbolic dims kept) of every value onnx's shape inference can reach."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as exc:  # inference is advice, not a requirement: patterns that need shapes refuse
        log.warning("shape inference failed (%s); continuing with the shapes the model declares", exc)
        inferred = model
    g = inferred.graph
    return {vi.name: vi.type for vi in list(g.value_info) + list(g.input) + list(g.output)
            if vi.type.HasField("tensor_type")}


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
    produced_at = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    if all(produced_at.get(v, -1) < i for i, n in enumerate(graph.node) for v in n.input if v):
        return
    dg = nx.DiGraph()
    dg.add_nodes_from(range(len(graph.node)))
    for i, n in enumerate(graph.node):
        for v in n.input:
            j = produced_at.get(v)
            if j is not None and j != i:
                dg.add_edge(j, i)
    try:
        order = list(nx.lexicographical_topological_sort(dg))
    except nx.NetworkXUnfeasible:
        raise InputError("the graph has a cycle; it is not a valid ONNX model, re-export it") from None
    nodes = [copy.deepcopy(graph.node[i]) for i in order]
    del graph.node[:]
    graph.node.extend(nodes)
