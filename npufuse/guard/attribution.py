"""Which rewrite made OPTIMIZED drift: per-node evidence, confirmed by undoing rewrites.

npufuse records on every fused node the pattern that made it (`npufuse.pattern`) and the original nodes it
replaced (`npufuse.replaced`); the fused node keeps the output names of the subgraph it replaced. So:

1. Evidence. One run of each model captures every fused node's outputs and dynamic inputs (same names in
   both models). A fused node is a suspect when its own output drifts while all its inputs match.
2. Confirmation. A model is built from OPTIMIZED with suspect fused nodes replaced by the original nodes
   they replaced (copied from ORIGINAL with the constants they read). If the outputs then pass, the
   suspects are shrunk to a minimal set whose undoing still removes the drift (bisection); those are the
   confirmed culprits.
3. When the evidence is inconclusive (no suspect, or undoing the suspects does not help), the same
   bisection runs over every fused node: undo half, keep the half that still removes the drift, and
   split further, so k culprits among n rewrites cost about 2k·log2(n) runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from npufuse.graph import Graph
from npufuse.guard.stats import OutputCheck, OutputTolerance, measure
from npufuse.runtime import run
from npufuse.verify.whole import capture

PATTERN_KEY, REPLACED_KEY = "npufuse.pattern", "npufuse.replaced"


@dataclass(frozen=True)
class FusedNode:
    """A node of OPTIMIZED that npufuse made, and what it replaced."""

    name: str
    op_type: str
    pattern: str
    replaced: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass
class Culprit:
    """A rewrite blamed for drift."""

    node: str                        # the fused node's name in OPTIMIZED
    op_type: str
    pattern: str
    replaced: list[str]              # the ORIGINAL nodes it replaced
    confirmed: bool                  # undoing it (with the other culprits) removes the drift
    evidence: str                    # one sentence a person reads
    output_error: dict[str, Any] | None = None   # its own output vs ORIGINAL's value of the same name
    inputs_match: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "op_type": self.op_type, "pattern": self.pattern, "replaced": list(self.replaced),
                "confirmed": self.confirmed, "evidence": self.evidence, "output_error": self.output_error,
                "inputs_match": self.inputs_match}


@dataclass
class Attribution:
    culprits: list[Culprit] = field(default_factory=list)
    method: str = ""                 # how the culprits were found, for the report
    runs: int = 0                    # onnxruntime runs spent on undo checks


class UndoError(Exception):
    """A fused node cannot be replaced by its original nodes (they or their inputs are gone)."""


def fused_nodes(model: onnx.ModelProto) -> list[FusedNode]:
    """The nodes of `model` that carry npufuse provenance, in graph order."""
    out = []
    for n in model.graph.node:
        meta = {p.key: p.value for p in n.metadata_props}
        if REPLACED_KEY in meta:
            replaced = tuple(r for r in meta[REPLACED_KEY].split(",") if r)
            out.append(FusedNode(n.name, n.op_type, meta.get(PATTERN_KEY, "?"), replaced,
                                 tuple(v for v in n.input if v), tuple(v for v in n.output if v)))
    return out


def undo(optimized: onnx.ModelProto, original: Graph, nodes: Sequence[FusedNode]) -> onnx.ModelProto:
    """A copy of OPTIMIZED in which each of `nodes` is replaced by the ORIGINAL nodes it replaced."""
    model = copy.deepcopy(optimized)
    graph = model.graph
    by_name = {f.name: f for f in nodes}
    opt_inits = {t.name: t for t in graph.initializer}
    available = {i.name for i in graph.input} | set(opt_inits) | {o for n in graph.node for o in n.output if o}
    taken = set(available)
    new_inits: list[onnx.TensorProto] = []
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        f = by_name.get(node.name) if _is_fused(node) else None
        if f is None:
            new_nodes.append(node)
            continue
        missing = [r for r in f.replaced if r not in original.node_by_name]
        if missing:
            raise UndoError(f"ORIGINAL has no node {missing[0]!r} that {f.name!r} replaced")
        originals = [original.node(r) for r in f.replaced]
        internal = {o for n in originals for o in n.output if o}
        lost = [o for o in f.outputs if o not in internal]
        if lost:
            raise UndoError(f"the nodes {f.name!r} replaced do not produce its output {lost[0]!r}")
        rename: dict[str, str] = {}
        for v in original.boundary_inputs(f.replaced):
            if original.is_constant(v):
                init = original.initializers.get(v)
                if init is not None and v in opt_inits and opt_inits[v].SerializeToString() == init.SerializeToString():
                    continue  # the same weight is still there
                arr = original.constant(v)
                if arr is None:
                    raise UndoError(f"cannot evaluate the constant {v!r} that {f.name!r}'s original nodes read")
                name = _fresh(v, taken)
                rename[v] = name
                new_inits.append(numpy_helper.from_array(arr, name))
            elif v not in available:
                raise UndoError(f"value {v!r} that {f.name!r}'s original nodes read is gone from OPTIMIZED")
        for v in internal - set(f.outputs):
            if v in taken:  # an internal value whose name OPTIMIZED now uses for something else
                rename[v] = _fresh(v, taken)
        for n in originals:
            c = copy.deepcopy(n)
            c.input[:] = [rename.get(v, v) for v in c.input]
            c.output[:] = [rename.get(v, v) for v in c.output]
            new_nodes.append(c)
    del graph.node[:]
    graph.node.extend(_topological(new_nodes, available | {t.name for t in new_inits}))
    graph.initializer.extend(new_inits)
    have = {o.domain for o in model.opset_import}
    for o in original.model.opset_import:
        if o.domain not in have:
            model.opset_import.append(copy.deepcopy(o))
    return model


def _is_fused(node: onnx.NodeProto) -> bool:
    return any(p.key == REPLACED_KEY for p in node.metadata_props)


def _fresh(base: str, taken: set[str]) -> str:
    name, k = f"{base}__undo", 1
    while name in taken:
        name, k = f"{base}__undo{k}", k + 1
    taken.add(name)
    return name


def _topological(nodes: list[onnx.NodeProto], sources: set[str]) -> list[onnx.NodeProto]:
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
    undoable, not_undoable = [], {}
    for f in fused:
        try:
            undo(optimized, original, [f])
            undoable.append(f)
        except UndoError as exc:
            not_undoable[f.name] = str(exc)
    evidence = _node_evidence(original, optimized, fused, feeds, base_dir)
    suspects = [f for f in undoable if evidence.get(f.name, (None, None))[0] is not None
                and not evidence[f.name][0].ok and evidence[f.name][1]]

    cache: dict[frozenset[str], bool] = {frozenset(): False}
    runs = 0

    def passes(names: frozenset[str]) -> bool:
        nonlocal runs
        if names not in cache:
            runs += 1
            model = undo(optimized, original, [f for f in undoable if f.name in names])
            try:
                cache[names] = bool(judge(run(model, feeds, base_dir=base_dir)))
            except Exception:
                cache[names] = False
        return cache[names]

    suspect_names = frozenset(f.name for f in suspects)
    all_names = frozenset(f.name for f in undoable)
    if suspect_names and passes(suspect_names):
        start, method = suspect_names, "per-node evidence, confirmed by undoing"
    elif all_names and passes(all_names):
        start, method = all_names, "bisection by undoing rewrites"
    else:
        why = ("undoing every rewrite does not remove the drift, so it does not come (only) from npufuse's "
               "rewrites" if all_names else "no fused node could be undone")
        if not_undoable:
            why += f"; {len(not_undoable)} fused node(s) could not be undone (e.g. {next(iter(not_undoable.values()))})"
        culprits = [_culprit(f, evidence, False, "suspect only: its output drifts while its inputs match, "
                             "but undoing it did not remove the drift") for f in suspects]
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
        culprits.append(_culprit(by_name[name], evidence, True, local + joint))
    return Attribution(culprits, method, runs)


def _culprit(f: FusedNode, evidence: dict, confirmed: bool, text: str) -> Culprit:
    out_err, inputs_ok = evidence.get(f.name, (None, None))
    err = None
    if out_err is not None:
        err = {"value": out_err.name, "max_abs_err": out_err.max_abs_err, "max_rel_err": out_err.max_rel_err,
               "worst_index": list(out_err.worst_index)}
    return Culprit(f.name, f.op_type, f.pattern, list(f.replaced), confirmed, text, err, inputs_ok)


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
