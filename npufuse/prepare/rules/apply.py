"""Applying a round's edits to the graph view in place: removals, additions, renames, and the dead nodes they leave."""

from __future__ import annotations

from collections import Counter
import onnx
from npufuse.ir.graph import Graph
from npufuse.prepare.rules.edit import (Edit, _has_subgraph, _perm, _private, _producer_op, _reads, _renamable)  # noqa: F401


def _write_nodes(model: onnx.ModelProto, g: Graph) -> None:
    """Write the view's node list into the model (`g.model`), the view then referring to the model's nodes."""
    assert g.model is model
    g.write_nodes()


def _reads_renamed(g: Graph, value: str, touched: set[str]) -> bool:
    return any(c.name in touched for c in g.consumers_of(value))


def _reads_rewritten(g: Graph, e: Edit, touched: set[str]) -> bool:
    """Whether the edit's new nodes read a value whose producer another edit of this round rewrites (which may
    rename it away): such an edit waits for the next round."""
    for node in e.add:
        for v in node.input:
            p = g.producer_of(v) if v else None
            if p is not None and p.name in touched:
                return True
    return False


def _apply(g: Graph, edits: list[Edit], types: dict[str, onnx.TypeProto]) -> set[str]:
    """Apply `edits` to the view `g` (patched, not rebuilt; the model's node list is written by the caller) and
    record the new values' types. Returns the names of the nodes whose neighbourhood changed: the nodes a rule's
    precondition must judge again."""
    removed = {name for e in edits for name in e.remove}
    placed = {g.topo_index[e.remove[-1]]: e.add for e in edits}
    rename = {old: new for e in edits for old, new in e.rename.items()}
    gone = [g.node(name) for name in removed]
    for e in edits:   # the types first: the patched view judges the new nodes' constness by them
        types.update(e.types)
    old_nodes, nodes = g.nodes, []
    cut = sorted({g.topo_index[name] for name in removed} | set(placed))
    prev = 0
    for i in cut:
        nodes.extend(old_nodes[prev:i])
        nodes.extend(placed.get(i, ()))
        if old_nodes[i].name not in removed:
            nodes.append(old_nodes[i])
        prev = i + 1
    nodes.extend(old_nodes[prev:])
    added = [n for e in edits for n in e.add]
    readers = {c.name for v in rename for c in g.consumers_of(v) if c.name not in removed}
    candidates = {v for n in gone for v in n.input if v}
    g.patch(nodes, gone, added, rename, [t for e in edits for t in e.initializers])
    dead = _drop_dead(g, candidates)
    if dead:
        dead_nodes = [g.node(name) for name in dead]
        candidates |= {v for n in dead_nodes for v in _reads(n)}
        g.patch([n for n in g.nodes if n.name not in dead], dead_nodes, [])
    # what a precondition reads: the node, its inputs' producers, its outputs' consumers
    changed = [g.node_by_name[x] for x in readers if x in g.node_by_name] + \
        [n for n in added if g.node_by_name.get(n.name) is n]
    values = {v for n in changed for v in _reads(n)} | candidates | set(rename) | set(rename.values()) | \
        {o for n in changed for o in n.output if o}
    recheck = {n.name for n in changed}
    for v in values:
        p = g.producer_of(v)
        if p is not None:
            recheck.add(p.name)
        recheck.update(c.name for c in g.consumers_of(v))
    return recheck


def _drop_dead(g: Graph, candidates: set[str]) -> set[str]:
    """The nodes an edit left unread (the first Transpose of a folded pair, say), found transitively from the
    values the removed nodes read; nodes that were dead in the input stay (not ours to judge)."""
    outputs = g.graph_outputs
    read: Counter = Counter()
    dead: set[str] = set()
    frontier = [v for v in candidates if v not in outputs]
    while frontier:
        v = frontier.pop()
        p = g.producer_of(v)
        if p is None or p.name in dead or _has_subgraph(p) or \
                any(len(g.consumers_of(o)) - read[o] > 0 or o in outputs for o in p.output if o):
            continue
        dead.add(p.name)
        for x in set(_reads(p)):
            read[x] += 1     # one reader of x fewer (the view lists a node once per value it reads)
            frontier.append(x)
    return dead
