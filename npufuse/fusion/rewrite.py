"""Applying selected replacements: every replacement swapped in at once, the engine's graph view patched in step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx
from onnx import helper

from npufuse.errors import InputError
from npufuse.ir.candidates import Match, Replacement
from npufuse.ir.graph import Graph, _node_value_inputs
from npufuse.prepare.normalize import topological_order
from npufuse.ir.runtime import IR_VERSION


def apply(g: Graph, rewrites: Sequence[tuple[Match, Replacement]]) -> onnx.ModelProto:
    """Replace each match's nodes by its replacement (placed where its last node was) in the view `g`, patched,
    not rebuilt (on a 100k-node graph a rebuild costs more than the round's matching), and in `g.model`: its
    initializers, functions, opsets and value_info now; its node list when the caller asks `g.write_nodes()`.
    Returns the model."""
    model = g.model
    graph = model.graph
    last_of = {}
    removed: set[str] = set()
    topo = g.topo_index
    for m, rep in rewrites:
        last_of[max(m.nodes, key=topo.__getitem__)] = (m, rep)
        removed.update(m.nodes)
    by_name = g.node_by_name
    gone = [by_name[n] for n in removed]
    added: list[onnx.NodeProto] = []
    new_nodes: list[onnx.NodeProto] = []
    old_nodes = g.nodes
    prev = 0
    for i, name in sorted((topo[n], n) for n in removed):   # the untouched runs between matched nodes: slices
        new_nodes.extend(old_nodes[prev:i])
        prev = i + 1
        if name in last_of:
            m, rep = last_of[name]
            replaced = _original_names(g, m.nodes)
            for r in rep.nodes:
                _record_provenance(r, m.pattern, replaced)
            new_nodes.extend(rep.nodes)
            added.extend(rep.nodes)
    new_nodes.extend(old_nodes[prev:])
    start = len(graph.initializer)
    for _, rep in rewrites:
        graph.initializer.extend(rep.initializers)
    lost = g.patch(new_nodes, gone, added, initializers=graph.initializer[start:])   # values that lost a reader
    # A fused node with several outputs (AddLayerNorm's sum) may feed a node that came before the
    # match's last node; restore topological order (a no-op when it already holds: the view knows when it does).
    if not g.in_topological_order:
        ordered = topological_order(g.nodes)   # counts what subgraphs read, too
        if ordered is not None:
            g.reorder(ordered)
    _add_functions_and_opsets(model, [rep for _, rep in rewrites], g)
    added_ids = {id(n) for n in added}

    def read_before(v: str) -> bool:
        """Whether some node read `v` before these rewrites (the replaced nodes, or any reader not new)."""
        return v in lost or any(id(c) not in added_ids for c in g.consumers.get(v, ()))

    _remove_dead(g, lost, read_before)
    return model


def _original_names(g: Graph, names: Sequence[str]) -> list[str]:
    """Names of the input model's nodes behind `names`: a node fused in an earlier round stands for the
    nodes it replaced (a FusedMatMul whose epilogue absorbed a Gelu lists the Gelu's Div, Erf, ...)."""
    out: list[str] = []
    for n in names:
        props = g.node(n).metadata_props
        if not props:   # a node of the input model
            out.append(n)
            continue
        meta = {p.key: p.value for p in props}
        out.extend(meta["npufuse.replaced"].split(",") if "npufuse.replaced" in meta else [n])
    return list(dict.fromkeys(out))


def _record_provenance(node: onnx.NodeProto, pattern: str, replaced: Sequence[str]) -> None:
    """The fused node records which nodes it replaced and which pattern made it (IR >= 10 node metadata)."""
    del node.metadata_props[:]
    node.metadata_props.add(key="npufuse.pattern", value=pattern)
    node.metadata_props.add(key="npufuse.replaced", value=",".join(replaced))


def _add_functions_and_opsets(model: onnx.ModelProto, reps: Sequence[Replacement], g: Graph) -> None:
    have = {(f.domain, f.name, f.overload): f for f in model.functions}
    for rep in reps:
        for fn in rep.functions:
            key = (fn.domain, fn.name, fn.overload)
            if key not in have:
                model.functions.append(fn)
                have[key] = fn
            elif have[key] is not fn and have[key] != fn:
                # Only a body npufuse wrote gets this far (fusion.admit), so one of another npufuse version:
                # the new node would run it, not the body it was built and checked with.
                raise InputError(f"the model already holds a different body of {fn.domain}.{fn.name} (overload "
                                 f"{fn.overload!r}), written by another npufuse version; optimize the original model")
        for domain, version in rep.opsets.items():
            if not any(o.domain == domain for o in model.opset_import):
                model.opset_import.append(helper.make_opsetid(domain, version))
                g.opset[domain or ""] = version
    if model.ir_version < 4:
        # IR 3 listed every initializer as an input; from IR 4 that would make them overridable inputs.
        inits = {t.name for t in model.graph.initializer}
        keep = [i for i in model.graph.input if i.name not in inits]
        del model.graph.input[:]
        model.graph.input.extend(keep)
        g.graph_inputs = [i.name for i in model.graph.input]
    model.ir_version = max(model.ir_version, IR_VERSION)


def _remove_dead(g: Graph, lost: set[str], read_before: Callable[[str], bool]) -> None:
    """Drop what the rewrites left unused: nodes (e.g. ConstantOfShape feeding a folded BN), initializers
    and value_info. Anything that was already unused before stays, so nothing else changes.

    Only a value that lost a reader can have become unused: the walk starts at the values the replaced nodes
    read and climbs through the producers it finds dead (`read_before`: whether some node read a value before,
    asked while the dead nodes are still in the view)."""
    graph = g.model.graph
    # A value read only inside an If/Loop/Scan body is used: what the view's subgraph holders read counts (no
    # rewrite replaces such a node, so that is what the new graph's holders read).
    outputs = g.graph_outputs | g.holder_reads
    dead: dict[str, onnx.NodeProto] = {}
    lost = set(lost)

    consumers = g.consumers

    def unused(v: str) -> bool:
        if v in outputs:
            return False
        readers = consumers.get(v, ())
        # while nothing is dead (most of the walk) a reader is a use: no name to read
        return all(c.name in dead for c in readers) if dead else not readers

    frontier = sorted(lost)
    while frontier:
        p = g.producer.get(frontier.pop())
        if p is None or p.name in dead:
            continue
        outs = [o for o in p.output if o]
        if all(unused(o) for o in outs) and any(read_before(o) or o in g.graph_outputs for o in outs):
            dead[p.name] = p
            lost.update(_node_value_inputs(p))
            frontier.extend(_node_value_inputs(p))
    gone_values = {o for n in dead.values() for o in n.output if o}
    were_read = {v for v in lost if v in g.initializers and read_before(v)}
    if dead:
        dead_ids = {id(n) for n in dead.values()}
        g.patch([n for n in g.nodes if id(n) not in dead_ids], list(dead.values()), [])
    dropped = {v for v in were_read if unused(v)}
    if dropped:
        inits = [t for t in graph.initializer if t.name not in dropped]
        del graph.initializer[:]
        graph.initializer.extend(inits)
        keep_inputs = [i for i in graph.input if i.name not in dropped]
        if len(keep_inputs) != len(graph.input):
            del graph.input[:]
            graph.input.extend(keep_inputs)
        g.drop_initializers(dropped, [i.name for i in graph.input])
    inputs = set(g.graph_inputs)
    vi = [v for v in graph.value_info
          if v.name in g.producer or v.name in inputs or v.name in g.initializers]
    if len(vi) != len(graph.value_info):
        removed_vi = {v.name for v in graph.value_info} - {v.name for v in vi}
        del graph.value_info[:]
        graph.value_info.extend(vi)
        g.forget_declared(removed_vi)
    g.forget(gone_values | dropped)
