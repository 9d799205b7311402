"""Applying selected replacements: one new model, built from the old one, all at once or not at all."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from npufuse.errors import InputError
from npufuse.ir.candidates import Match, Replacement
from npufuse.ir.graph import Graph
from npufuse.prepare.normalize import set_nodes, topological_order
from npufuse.ir.runtime import IR_VERSION


def apply(g: Graph, rewrites: Sequence[tuple[Match, Replacement]]) -> onnx.ModelProto:
    """Replace each match's nodes by its replacement (placed where its last node was), in `g.model` itself:
    the engine owns that model, and its view `g` is rebuilt afterwards. Returns the model."""
    model = g.model
    graph = model.graph
    last_of = {}
    removed: set[str] = set()
    for m, rep in rewrites:
        last_of[max(m.nodes, key=lambda n: g.topo_index[n])] = (m, rep)
        removed.update(m.nodes)
    new_nodes: list[onnx.NodeProto] = []
    for node in g.nodes:
        if node.name in last_of:
            m, rep = last_of[node.name]
            replaced = _original_names(g, m.nodes)
            for r in rep.nodes:
                _record_provenance(r, m.pattern, replaced)
            new_nodes.extend(rep.nodes)
        elif node.name not in removed:
            new_nodes.append(node)
    # A fused node with several outputs (AddLayerNorm's sum) may feed a node that came before the
    # match's last node; restore topological order (a no-op when it already holds).
    set_nodes(graph, topological_order(new_nodes) or new_nodes)   # counts what subgraphs read, too
    for _, rep in rewrites:
        graph.initializer.extend(rep.initializers)
    _add_functions_and_opsets(model, [rep for _, rep in rewrites])
    _remove_dead(model, g)
    return model


def _original_names(g: Graph, names: Sequence[str]) -> list[str]:
    """Names of the input model's nodes behind `names`: a node fused in an earlier round stands for the
    nodes it replaced (a FusedMatMul whose epilogue absorbed a Gelu lists the Gelu's Div, Erf, ...)."""
    out: list[str] = []
    for n in names:
        meta = {p.key: p.value for p in g.node(n).metadata_props}
        out.extend(meta["npufuse.replaced"].split(",") if "npufuse.replaced" in meta else [n])
    return list(dict.fromkeys(out))


def _record_provenance(node: onnx.NodeProto, pattern: str, replaced: Sequence[str]) -> None:
    """The fused node records which nodes it replaced and which pattern made it (IR >= 10 node metadata)."""
    del node.metadata_props[:]
    node.metadata_props.add(key="npufuse.pattern", value=pattern)
    node.metadata_props.add(key="npufuse.replaced", value=",".join(replaced))


def _add_functions_and_opsets(model: onnx.ModelProto, reps: Sequence[Replacement]) -> None:
    have = {(f.domain, f.name, f.overload): f for f in model.functions}
    for rep in reps:
        for fn in rep.functions:
            key = (fn.domain, fn.name, fn.overload)
            if key not in have:
                model.functions.append(fn)
                have[key] = fn
            elif have[key] != fn:
                # Only a body npufuse wrote gets this far (fusion.admit), so one of another npufuse version:
                # the new node would run it, not the body it was built and checked with.
                raise InputError(f"the model already holds a different body of {fn.domain}.{fn.name} (overload "
                                 f"{fn.overload!r}), written by another npufuse version; optimize the original model")
        for domain, version in rep.opsets.items():
            if not any(o.domain == domain for o in model.opset_import):
                model.opset_import.append(helper.make_opsetid(domain, version))
    if model.ir_version < 4:
        # IR 3 listed every initializer as an input; from IR 4 that would make them overridable inputs.
        inits = {t.name for t in model.graph.initializer}
        keep = [i for i in model.graph.input if i.name not in inits]
        del model.graph.input[:]
        model.graph.input.extend(keep)
    model.ir_version = max(model.ir_version, IR_VERSION)


def _remove_dead(model: onnx.ModelProto, before: Graph) -> None:
    """Drop what the rewrites left unused: nodes (e.g. ConstantOfShape feeding a folded BN), initializers
    and value_info. Anything that was already unused before stays, so nothing else changes."""
    graph = model.graph
    # A value read only inside an If/Loop/Scan body is used: what the view's subgraph holders read counts (no
    # rewrite replaces such a node, so that is what the new graph's holders read).
    outputs = {o.name for o in graph.output} | before.holder_reads
    while True:
        used = {v for n in graph.node for v in n.input if v} | outputs
        dead = [n for n in graph.node
                if not any(o in used for o in n.output if o)
                and any(before.consumers_of(o) or o in before.graph_outputs for o in n.output if o)]
        if not dead:
            break
        dead_names = {id(n) for n in dead}
        set_nodes(graph, [n for n in graph.node if id(n) not in dead_names])
    used = {v for n in graph.node for v in n.input if v} | outputs
    inits = [t for t in graph.initializer if t.name in used or not before.consumers_of(t.name)]
    dropped = {t.name for t in graph.initializer} - {t.name for t in inits}
    del graph.initializer[:]
    graph.initializer.extend(inits)
    if dropped:
        keep_inputs = [i for i in graph.input if i.name not in dropped]
        del graph.input[:]
        graph.input.extend(keep_inputs)
    produced = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | \
        {t.name for t in graph.initializer}
    vi = [v for v in graph.value_info if v.name in produced]
    del graph.value_info[:]
    graph.value_info.extend(vi)
