"""Fusion inside control-flow subgraphs: the branches of `If`, the bodies of `Loop` and `Scan`, nested too.

The main graph is fused first; then each subgraph, depth first, becomes a *standalone model* that the engine's
phase loop fuses exactly like the main graph (same patterns, cost model, selection, rewrite and per-rewrite
checks), and the result is written back into the subgraph:

- inputs: the subgraph's own (a Loop's iteration number, condition and carried values, a Scan's state and
  slices), then the values of enclosing graphs it reads (outer-scope references) that are not constant;
- initializers: its own, then the constants of enclosing graphs it reads (stored weights stay references);
- outputs: its own.

So an outer value is an input of the standalone model: no rewrite can remove or rename it, and a pattern sees it
as dynamic unless an enclosing graph fixes it (a BatchNorm whose statistics are initializers of the main graph
still folds). Writing back keeps the subgraph's inputs and outputs, drops the outer constants again (they stay
where they are) and adds the fused ops' function bodies and opsets to the model.

Verification, for each subgraph on its own:

- inputs are the real activations of the main graph where the subgraph reads them directly (captured when the
  original model ran), else values generated from the types (`verify.inputs`); the standalone model runs on
  onnxruntime on them to capture each rewrite's boundary values, and each rewrite is checked as in the main
  graph (onnxruntime on the matched nodes vs the reference kernels), a failing one rolled back;
- then the whole standalone model, before vs after (nested subgraphs' rewrites included): if it drifts, every
  rewrite in that subgraph is rolled back (the subgraph is left as it was) and reported so;
- the whole model is compared with the original at the end, as always.

A subgraph that cannot run standalone (a type that no input can be made for) gets its rewrites checked on
synthetic boundary values only, and a note says so.

Node names inside subgraphs are made unique across the model first: reports, provenance and the names of the
values a rewrite creates are derived from them. A rewrite may not define a value name used in another scope.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npufuse.errors import first_line
from npufuse.ir.candidates import APPLIED, ROLLED_BACK
from npufuse.ir.graph import Graph, outer_scope_reads, subgraphs_of
from npufuse.prepare.infer import infer_value_types
from npufuse.ir.runtime import IR_VERSION
from npufuse.verify.inputs import synthetic_value
from npufuse.verify.whole import capture, compare_outputs, run_model

# fuse(standalone model, its value types, where, activations, reserved names) -> the fused standalone model
FuseFn = Callable[[onnx.ModelProto, dict, str, Any, set], onnx.ModelProto]


def has_subgraphs(g: Graph) -> bool:
    """True if a node of the view holds a graph."""
    return any(subgraphs_of(n) for n in g.holders)


def subgraph_value_names(model: onnx.ModelProto) -> set[str]:
    """Every value name defined inside a subgraph of `model` (inputs, initializers, node outputs), nested too."""
    names: set[str] = set()

    def visit(graph: onnx.GraphProto) -> None:
        for n in graph.node:
            for _, sub in subgraphs_of(n):
                names.update(i.name for i in sub.input)
                names.update(t.name for t in sub.initializer)
                names.update(o for m in sub.node for o in m.output if o)
                visit(sub)

    visit(model.graph)
    return names


def fuse_subgraphs(model: onnx.ModelProto, g: Graph, fuse: FuseFn, run: Any) -> None:
    """Fuse every subgraph of `model` (whose view is `g`) in place, depth first. `run` is the engine's shared state
    (options, result, verifier, progress); `fuse` its phase loop."""
    _name_subgraph_nodes(model, g)
    reserved = set(g.producer) | set(g.initializers) | set(g.graph_inputs) | set(g.consumers) | \
        subgraph_value_names(model)
    for node in g.nodes:
        for label, sub in subgraphs_of(node):
            _fuse_site(g, sub, f"{node.name}.{label}", fuse, run, reserved, top=True)


def _fuse_site(parent: Graph, sub: onnx.GraphProto, where: str, fuse: FuseFn, run: Any, reserved: set[str],
               top: bool) -> None:
    """Fuse one subgraph (and those nested in it) of the graph `parent` views; write it back if anything was
    fused and it still computes what it did."""
    standalone, outer_consts = standalone_model(parent, sub, where)
    before = onnx.ModelProto()
    before.CopyFrom(standalone)
    types = infer_value_types(standalone)
    view = Graph(standalone, parent.base_dir, types)
    feeds = _feeds(view, run, top) if run.verifier is not None else {}
    notes: list[str] = []
    start = len(run.result.records)
    fused = fuse(standalone, types, where, _Activations(feeds, run, where, notes), reserved)
    inner = Graph(fused, parent.base_dir, types)
    for node in inner.nodes:
        for label, nested in subgraphs_of(node):
            _fuse_site(inner, nested, f"{where}/{node.name}.{label}", fuse, run, reserved, top=False)
    records = [r for r in run.result.records[start:] if r.status == APPLIED]
    if not records:
        run.result.notes.extend(notes)
        return
    if run.verifier is not None:
        verdict = _check_standalone(before, fused, feeds, parent.base_dir, run)
        if verdict is None:
            notes.append(f"subgraph {where} could not run on its own on generated inputs; its rewrites were each "
                         "checked on their boundary values only")
        elif not verdict.ok:
            for r in records:
                r.status = ROLLED_BACK
                r.reason = f"the subgraph {where} drifts after fusion, run on its own: {verdict.reason}"
            run.result.notes.extend(notes)
            return
    run.result.notes.extend(notes)
    _write_back(sub, fused, outer_consts)
    _merge_functions(parent.model, fused)


def standalone_model(parent: Graph, sub: onnx.GraphProto, where: str) -> tuple[onnx.ModelProto, set[str]]:
    """The subgraph as a model of its own (see the module doc) and the names of the outer constants it holds."""
    inputs = list(sub.input)
    inits = list(sub.initializer)
    outer_consts: set[str] = set()
    for v in outer_scope_reads(sub):
        if parent.is_constant(v):
            t = parent.initializers.get(v)
            arr = None if t is not None else parent.constant(v)
            if t is not None or arr is not None:
                inits.append(t if t is not None else numpy_helper.from_array(np.asarray(arr), v))
                outer_consts.add(v)
                continue
        inputs.append(parent.value_info(v))
    graph = helper.make_graph(list(sub.node), sub.name or where, inputs, list(sub.output), inits,
                              value_info=list(sub.value_info))
    model = helper.make_model(graph, opset_imports=list(parent.model.opset_import),
                              ir_version=max(parent.model.ir_version, IR_VERSION),
                              functions=list(parent.model.functions))
    return model, outer_consts


def _feeds(view: Graph, run: Any, top: bool) -> dict[str, np.ndarray]:
    """Inputs of a standalone subgraph: the main graph's real activations for the outer values a first-level
    subgraph reads, values made from the types for the rest (left out where the type is unknown)."""
    verifier, opts = run.verifier, run.opts
    rng = np.random.default_rng(opts.seed + 2)
    feeds: dict[str, np.ndarray] = {}
    for name in view.graph_inputs:
        arr = None
        if top:
            arr = verifier.feeds.get(name)
            if arr is None and name not in verifier.rewritten:
                arr = verifier.store.get(name)
        if arr is None:
            arr = synthetic_value(view, name, rng, opts.input_dims)
        if arr is not None:
            feeds[name] = arr
    return feeds


class _Activations:
    """The values at rewrite boundaries inside a standalone subgraph: the standalone model run on onnxruntime on
    its inputs, and values made from the types where that cannot run (with a note)."""

    def __init__(self, feeds: Mapping[str, np.ndarray], run: Any, where: str, notes: list[str]) -> None:
        self.feeds, self.run, self.where, self.notes = feeds, run, where, notes

    def __call__(self, g: Graph, names: list[str], rnd: int) -> dict[str, np.ndarray]:
        values = {v: self.feeds[v] for v in names if v in self.feeds}
        missing = [v for v in names if v not in values]
        if missing:
            try:
                values.update(capture(g, self.feeds, missing, self.run.opts.verify_memory_bytes))
            except Exception as exc:
                self.notes.append(f"subgraph {self.where}, round {rnd + 1}: could not run it on its own "
                                  f"({first_line(exc, 160)}); rewrites were checked on synthetic inputs")
        rng = np.random.default_rng(self.run.opts.seed + 1)
        for v in names:
            if v not in values:
                arr = synthetic_value(g, v, rng, self.run.opts.input_dims)
                if arr is not None:
                    values[v] = arr
        return values


def _check_standalone(before: onnx.ModelProto, after: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                      base_dir: str | None, run: Any) -> Any:
    """The fused standalone subgraph against the original on the same inputs (None where the original cannot
    run: no verdict)."""
    budget = run.opts.verify_memory_bytes
    if any(i.name not in feeds for i in before.graph.input):
        return None
    try:
        want = run_model(before, feeds, base_dir, budget)
    except Exception:
        return None
    from npufuse.verify.whole import ModelCheck

    try:
        got = run_model(after, feeds, base_dir, budget)
    except Exception as exc:
        return ModelCheck(False, reason=f"onnxruntime could not run it: {first_line(exc)}")
    return compare_outputs(got, want)


def _write_back(sub: onnx.GraphProto, fused: onnx.ModelProto, outer_consts: set[str]) -> None:
    """Put the fused standalone model's nodes, own initializers and value types back into the subgraph; its
    inputs and outputs stay as they were."""
    g = fused.graph
    outer = outer_consts | {i.name for i in g.input[len(sub.input):]}
    nodes, inits = list(g.node), [t for t in g.initializer if t.name not in outer_consts]
    infos = [v for v in g.value_info if v.name not in outer]
    for field, items in (("node", nodes), ("initializer", inits), ("value_info", infos)):
        sub.ClearField(field)
        getattr(sub, field).extend(items)


def _merge_functions(into: onnx.ModelProto, fused: onnx.ModelProto) -> None:
    """The function bodies and opsets the fused subgraph needs, added to the model that holds it."""
    have = {(f.domain, f.name, f.overload) for f in into.functions}
    into.functions.extend(f for f in fused.functions if (f.domain, f.name, f.overload) not in have)
    domains = {o.domain for o in into.opset_import}
    into.opset_import.extend(o for o in fused.opset_import if o.domain not in domains)
    into.ir_version = max(into.ir_version, fused.ir_version)


def _name_subgraph_nodes(model: onnx.ModelProto, g: Graph) -> None:
    """Give every node inside a subgraph a name unique across the model (unnamed or repeated ones get
    `OWNER.ATTR/OP_i`)."""
    used = set(g.node_by_name)

    def visit(graph: onnx.GraphProto) -> None:
        for n in graph.node:
            for label, sub in subgraphs_of(n):
                for i, m in enumerate(sub.node):
                    if not m.name or m.name in used:
                        base = name = f"{n.name}.{label}/{m.name or f'{m.op_type}_{i}'}"
                        k = 1
                        while name in used:
                            name, k = f"{base}__{k}", k + 1
                        m.name = name
                    used.add(m.name)
                visit(sub)

    visit(model.graph)
