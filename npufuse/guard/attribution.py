"""Which rewrite made OPTIMIZED drift: per-node evidence, confirmed by undoing rewrites.

npufuse records on every node it puts in the pattern that made it (`npufuse.pattern`) and the original
nodes it replaced (`npufuse.replaced`); nodes sharing one record form one rewrite, whose outputs keep the
names the replaced subgraph gave them. So:

1. Evidence. One run of each model captures every rewrite's outputs and dynamic inputs (same names in
   both models). A rewrite is a suspect when its own output drifts while all its inputs match.
2. Confirmation. A model is built from OPTIMIZED with the suspects undone: their nodes are replaced by
   ORIGINAL's computation of their outputs (a backward slice from the outputs to values OPTIMIZED still
   has, with the constants it reads). If the outputs then pass, the suspects are shrunk to a minimal set
   whose undoing still removes the drift (bisection); those are the confirmed culprits.
3. When the evidence is inconclusive (no suspect, or undoing the suspects does not help), the same
   bisection runs over every rewrite: undo half, keep the half that still removes the drift, and split
   further, so k culprits among n rewrites cost about 2k·log2(n) runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from npufuse.ir.graph import Graph
from npufuse.guard.stats import OutputCheck, OutputTolerance, measure
from npufuse.verify.whole import capture, run_model

PATTERN_KEY, REPLACED_KEY = "npufuse.pattern", "npufuse.replaced"


@dataclass(frozen=True)
class FusedNode:
    """One rewrite in OPTIMIZED: the node(s) npufuse put in (all carrying the same provenance), and what
    they replaced. `name` is the main node's (the first one in a fused-op domain, else the first)."""

    name: str
    op_type: str
    pattern: str
    replaced: tuple[str, ...]
    inputs: tuple[str, ...]          # values the rewrite's nodes read from outside them
    outputs: tuple[str, ...]         # values they produce for the rest of the graph (or as graph outputs)
    nodes: tuple[str, ...] = ()      # every node of the rewrite in OPTIMIZED


@dataclass
class Culprit:
    """A rewrite blamed for drift."""

    node: str                        # the fused node's name in OPTIMIZED
    op_type: str
    pattern: str
    replaced: list[str]              # the ORIGINAL nodes it replaced (its npufuse.replaced record)
    confirmed: bool                  # undoing it (with the other culprits) removes the drift
    evidence: str                    # one sentence a person reads
    output_error: dict[str, Any] | None = None   # its own output vs ORIGINAL's value of the same name
    inputs_match: bool | None = None
    nodes: list[str] = field(default_factory=list)      # all nodes of the rewrite in OPTIMIZED
    restored: list[str] = field(default_factory=list)   # the ORIGINAL nodes undoing it puts back

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "op_type": self.op_type, "pattern": self.pattern, "replaced": list(self.replaced),
                "confirmed": self.confirmed, "evidence": self.evidence, "output_error": self.output_error,
                "inputs_match": self.inputs_match, "nodes": list(self.nodes), "restored": list(self.restored)}


@dataclass
class Attribution:
    culprits: list[Culprit] = field(default_factory=list)
    method: str = ""                 # how the culprits were found, for the report
    runs: int = 0                    # onnxruntime runs spent on undo checks


class UndoError(Exception):
    """A rewrite cannot be replaced by original nodes (they or their inputs are gone)."""


def fused_nodes(model: onnx.ModelProto) -> list[FusedNode]:
    """The rewrites recorded in `model` (nodes with npufuse provenance, grouped by it), in graph order."""
    groups: dict[tuple[str, str], list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        meta = {p.key: p.value for p in n.metadata_props}
        if REPLACED_KEY in meta:
            groups.setdefault((meta.get(PATTERN_KEY, "?"), meta[REPLACED_KEY]), []).append(n)
    g = Graph(model)  # its consumer index counts reads from inside subgraphs too
    out = []
    for (pattern, replaced), nodes in groups.items():
        names = {n.name for n in nodes}
        produced = [o for n in nodes for o in n.output if o]
        outputs = tuple(o for o in produced
                        if o in g.graph_outputs or any(c.name not in names for c in g.consumers_of(o)))
        inputs = tuple(dict.fromkeys(v for n in nodes for v in n.input if v and v not in produced))
        main = next((n for n in nodes if n.domain not in ("", "ai.onnx")), nodes[0])
        out.append(FusedNode(main.name, main.op_type, pattern, tuple(r for r in replaced.split(",") if r),
                             inputs, outputs, tuple(n.name for n in nodes)))
    return out


@dataclass
class _UndoPlan:
    """What undoing one rewrite takes: the original nodes and the constants to bring back."""

    fused: FusedNode
    originals: list[onnx.NodeProto]
    constants: dict[str, str]            # original constant value -> name it gets in the undone model
    renamed_internal: dict[str, str]     # internal values whose names OPTIMIZED now uses elsewhere


def _plan(f: FusedNode, original: Graph, available: set[str], opt_inits: Mapping[str, onnx.TensorProto],
          taken: set[str]) -> _UndoPlan:
    """The ORIGINAL nodes that compute `f`'s outputs from what OPTIMIZED still has (a backward slice from
    the outputs, so it does not rely on `npufuse.replaced` being complete); raises UndoError."""
    if not f.outputs:
        raise UndoError(f"{f.name!r} has no outputs anything reads")
    chosen: dict[str, onnx.NodeProto] = {}
    constants: dict[str, str] = {}
    todo = list(f.outputs)
    seen: set[str] = set()
    while todo:
        v = todo.pop()
        if v in seen or not v:
            continue
        seen.add(v)
        if original.is_constant(v) and v not in f.outputs:
            init = original.initializers.get(v)
            if init is not None and v in opt_inits and opt_inits[v].SerializeToString() == init.SerializeToString():
                continue  # the same weight is still there
            if init is not None or original.constant(v) is not None:
                constants[v] = _fresh(v, taken) if v in taken else v
                taken.add(constants[v])
                continue
        if v in available and v not in f.outputs:
            continue  # computed outside the rewrite in OPTIMIZED too
        producer = original.producer_of(v)
        if producer is None:
            raise UndoError(f"ORIGINAL does not compute {v!r}, which {f.name!r} produces or reads")
        if producer.name not in chosen:
            if len(chosen) > 4 * max(len(f.replaced), 4) + 64:
                raise UndoError(f"undoing {f.name!r} would pull in too much of ORIGINAL (values it reads are gone)")
            chosen[producer.name] = producer
            todo.extend(x for x in producer.input if x)
    originals = sorted(chosen.values(), key=lambda n: original.topo_index[n.name])
    internal = {o for n in originals for o in n.output if o} - set(f.outputs)
    renamed = {v: _fresh(v, taken) for v in sorted(internal) if v in taken}
    return _UndoPlan(f, originals, constants, renamed)


def _available(graph: onnx.GraphProto, dropping: Sequence[FusedNode]) -> set[str]:
    """Values OPTIMIZED still has once the nodes of `dropping` are gone (their outputs are put back)."""
    gone = {n for f in dropping for n in f.nodes}
    have = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    have |= {o for n in graph.node if n.name not in gone for o in n.output if o}
    return have | {o for f in dropping for o in f.outputs}


def undoable(optimized: onnx.ModelProto, original: Graph, nodes: Sequence[FusedNode]) -> dict[str, str]:
    """{rewrite name: why it cannot be undone} for those of `nodes` that cannot; copies nothing big."""
    graph = optimized.graph
    opt_inits = {t.name: t for t in graph.initializer}
    why = {}
    for f in nodes:
        available = _available(graph, [f])
        try:
            _plan(f, original, available, opt_inits, set(available))
        except UndoError as exc:
            why[f.name] = str(exc)
    return why


def restored_nodes(optimized: onnx.ModelProto, original: Graph, f: FusedNode) -> list[str]:
    """The ORIGINAL nodes that undoing `f` alone puts back."""
    available = _available(optimized.graph, [f])
    opt_inits = {t.name: t for t in optimized.graph.initializer}
    try:
        return [n.name for n in _plan(f, original, available, opt_inits, set(available)).originals]
    except UndoError:
        return []


def undo(optimized: onnx.ModelProto, original: Graph, nodes: Sequence[FusedNode]) -> onnx.ModelProto:
    """A copy of OPTIMIZED in which each rewrite of `nodes` is replaced by the ORIGINAL nodes it replaced."""
    model = copy.deepcopy(optimized)
    graph = model.graph
    opt_inits = {t.name: t for t in graph.initializer}
    available = _available(graph, nodes)
    taken = set(available) | {o for n in graph.node for o in n.output if o}
    first_of = {f.nodes[0]: f for f in nodes}
    gone = {n for f in nodes for n in f.nodes}
    new_inits: list[onnx.TensorProto] = []
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        f = first_of.get(node.name)
        if f is not None:
            plan = _plan(f, original, available, opt_inits, taken)
            for v, name in plan.constants.items():
                init = original.initializers.get(v)
                if init is not None and not external_data_helper.uses_external_data(init):
                    new_inits.append(_renamed(init, name))
                else:  # a folded constant, or weights on disk: bring the values in
                    new_inits.append(numpy_helper.from_array(original.constant(v), name))
            rename = plan.constants | plan.renamed_internal
            for n in plan.originals:
                c = copy.deepcopy(n)
                c.input[:] = [rename.get(v, v) for v in c.input]
                c.output[:] = [rename.get(v, v) for v in c.output]
                new_nodes.append(c)
        elif node.name not in gone:
            new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(_topological(new_nodes))
    graph.initializer.extend(new_inits)
    have = {o.domain for o in model.opset_import}
    for o in original.model.opset_import:
        if o.domain not in have:
            model.opset_import.append(copy.deepcopy(o))
    return model


def _renamed(t: onnx.TensorProto, name: str) -> onnx.TensorProto:
    c = copy.deepcopy(t)
    c.name = name
    return c


def _fresh(base: str, taken: set[str]) -> str:
    name, k = f"{base}__undo", 1
    while name in taken:
        name, k = f"{base}__undo{k}", k + 1
    taken.add(name)
    return name


def _topological(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """Stable order in which each node comes after the producers of what it reads."""
    produced_by = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    if all(produced_by.get(v, -1) < i for i, n in enumerate(nodes) for v in n.input if v):
        return nodes
    done: set[int] = set()
    out: list[onnx.NodeProto] = []

    def visit(i: int, stack: set[int]) -> None:
        if i in done or i in stack:
            return
        stack.add(i)
        for v in nodes[i].input:
            j = produced_by.get(v)
            if j is not None and j != i:
                visit(j, stack)
        stack.discard(i)
        done.add(i)
        out.append(nodes[i])

    for i in range(len(nodes)):
        visit(i, set())
    return out


# ---- finding the culprits ------------------------------------------------------------------------

def attribute(original: Graph, optimized: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
              judge: Callable[[Mapping[str, np.ndarray]], bool], base_dir: str | None = None) -> Attribution:
    """Blame the rewrites of OPTIMIZED that make it drift from ORIGINAL.

    `judge(outputs)` says whether a model's outputs pass (the caller's tolerances and statistic).
    """
    fused = fused_nodes(optimized)
    if not fused:
        return Attribution([], "OPTIMIZED has no node with npufuse provenance (npufuse.replaced); nothing to blame")
    not_undoable = undoable(optimized, original, fused)
    can_undo = [f for f in fused if f.name not in not_undoable]
    evidence = _node_evidence(original, optimized, fused, feeds, base_dir)
    local_drift = [f for f in fused if evidence.get(f.name, (None, None))[0] is not None
                   and not evidence[f.name][0].ok and evidence[f.name][1]]
    suspects = [f for f in local_drift if f.name not in not_undoable]

    cache: dict[frozenset[str], bool] = {frozenset(): False}
    runs = 0

    def passes(names: frozenset[str]) -> bool:
        nonlocal runs
        if names not in cache:
            runs += 1
            try:
                model = undo(optimized, original, [f for f in can_undo if f.name in names])
                cache[names] = bool(judge(run_model(model, feeds, base_dir)))
            except Exception:  # an undo onnxruntime cannot run proves nothing
                cache[names] = False
        return cache[names]

    suspect_names = frozenset(f.name for f in suspects)
    all_names = frozenset(f.name for f in can_undo)
    if suspect_names and passes(suspect_names):
        start, method = suspect_names, "per-node evidence, confirmed by undoing"
    elif all_names and passes(all_names):
        start, method = all_names, "bisection by undoing rewrites"
    else:
        why = ("undoing every rewrite does not remove the drift, so it does not come (only) from npufuse's "
               "rewrites" if all_names else "no fused node could be undone")
        if not_undoable:
            why += f"; {len(not_undoable)} fused node(s) could not be undone (e.g. {next(iter(not_undoable.values()))})"
        culprits = [_culprit(f, evidence, False, "suspect only: its output drifts while its inputs match, but "
                             + (f"it cannot be undone ({not_undoable[f.name]})" if f.name in not_undoable
                                else "undoing it did not remove the drift"), []) for f in local_drift]
        return Attribution(culprits, why, runs)
    order = [f.name for f in fused if f.name in start]
    blamed = _minimize(order, [], lambda names: passes(frozenset(names)))
    joint = f"undoing {'it' if len(blamed) == 1 else f'these {len(blamed)} together'} removes the drift"
    by_name = {f.name: f for f in fused}
    culprits = []
    for name in blamed:
        out_err, inputs_ok = evidence.get(name, (None, None))
        if out_err is not None and not out_err.ok and inputs_ok:
            local = (f"its output {out_err.name!r} drifts (worst abs {out_err.max_abs_err:.3g}, rel "
                     f"{out_err.max_rel_err:.3g} at {out_err.worst_index}) while its inputs match; ")
        elif out_err is not None:
            local = f"its output {out_err.name!r} {'matches' if out_err.ok else 'drifts'} locally; "
        else:
            local = ""
        culprits.append(_culprit(by_name[name], evidence, True, local + joint,
                                 restored_nodes(optimized, original, by_name[name])))
    return Attribution(culprits, method, runs)


def _culprit(f: FusedNode, evidence: dict, confirmed: bool, text: str, restored: list[str]) -> Culprit:
    out_err, inputs_ok = evidence.get(f.name, (None, None))
    err = None
    if out_err is not None:
        err = {"value": out_err.name, "max_abs_err": out_err.max_abs_err, "max_rel_err": out_err.max_rel_err,
               "worst_index": list(out_err.worst_index)}
    return Culprit(f.name, f.op_type, f.pattern, list(f.replaced), confirmed, text, err, inputs_ok,
                   list(f.nodes), restored)


def _minimize(candidates: list[str], fixed: list[str], passes: Callable[[list[str]], bool]) -> list[str]:
    """A minimal subset C of `candidates` with passes(C + fixed), given passes(candidates + fixed)."""
    if not candidates:
        return []
    if len(candidates) == 1:
        return [] if passes(fixed) else list(candidates)
    half = len(candidates) // 2
    a, b = candidates[:half], candidates[half:]
    if passes(a + fixed):
        return _minimize(a, fixed, passes)
    if passes(b + fixed):
        return _minimize(b, fixed, passes)
    # Culprits in both halves (or ones that only matter together): shrink one half with the other undone.
    in_a = _minimize(a, b + fixed, passes)
    in_b = _minimize(b, in_a + fixed, passes)
    return in_a + in_b


def _node_evidence(original: Graph, optimized: onnx.ModelProto, fused: list[FusedNode],
                   feeds: Mapping[str, np.ndarray], base_dir: str | None
                   ) -> dict[str, tuple[OutputCheck | None, bool | None]]:
    """Per fused node: the worst of its outputs vs ORIGINAL, and whether all its dynamic inputs match."""
    opt_g = Graph(optimized, base_dir, original.value_types)
    names: list[str] = []
    for f in fused:
        names += [v for v in f.outputs if v in original.producer or v in original.graph_inputs]
        names += [v for v in f.inputs if not opt_g.is_constant(v) and v not in feeds
                  and (v in original.producer or v in original.graph_inputs)]
    names = list(dict.fromkeys(names))
    try:
        want = dict(feeds) | capture(original, feeds, names)
        got = dict(feeds) | capture(opt_g, feeds, names)
    except Exception:
        return {}  # no evidence: the bisection over all rewrites still works
    checks = {v: measure(v, got[v], want[v], OutputTolerance()) for v in names if v in got and v in want}
    out: dict[str, tuple[OutputCheck | None, bool | None]] = {}
    for f in fused:
        outs = [checks[v] for v in f.outputs if v in checks]
        worst = max(outs, key=lambda c: (not c.ok, c.min_passing_rtol), default=None)
        # Graph inputs are identical by construction; a value ORIGINAL does not have counts as not matching.
        dyn = [v for v in f.inputs if not opt_g.is_constant(v)]
        inputs_ok = all(v in feeds or (v in checks and checks[v].ok) for v in dyn)
        out[f.name] = (worst, inputs_ok)
    return out
