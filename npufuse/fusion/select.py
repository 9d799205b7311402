"""Choosing which candidates to apply: legal (convex, no shared intermediates), disjoint, by gain."""

from __future__ import annotations

from collections.abc import Sequence

from npufuse.ir.candidates import Match
from npufuse.ir.graph import Graph
from npufuse.ir.matching import escaping_intermediate


def boundary_violation(g: Graph, m: Match) -> str | None:
    """Why `m` cannot be fused as one node (an intermediate escapes, or a path leaves and re-enters), or None."""
    escape = escaping_intermediate(g, m.nodes, m.outputs)
    if escape is not None:
        return escape[2]
    topo = g.topo_index
    return _path_reenters(g, {topo[n] for n in m.nodes})


def _path_reenters(g: Graph, inside: set[int]) -> str | None:
    """A path that leaves the members (at positions `inside`) and comes back makes the fused node a cycle: find
    one, bounded by topological order (nothing after the set's last node can lead back into it). The successor
    lists it reads are the view's (`Graph.successors_at`), kept for the selection's placed-last test."""
    succ = g.successors_at
    last = max(inside)
    frontier = [s for n in inside for s in succ(n) if s not in inside]
    seen = set(frontier)
    while frontier:
        cur = frontier.pop()
        for s in succ(cur):
            if s in inside:
                return (f"a path from the set through {g.nodes[cur].name!r} re-enters it at {g.nodes[s].name!r} "
                        "(not convex)")
            if s not in seen and s < last:
                seen.add(s)
                frontier.append(s)
    return None


def select(g: Graph, ranked: Sequence[Match]) -> tuple[list[Match], list[tuple[Match, str]]]:
    """Greedily take candidates in `ranked` order (best first) that do not overlap a taken one.

    Returns (selected, [(dropped, why)]). Each selected set is convex on its own, and contracting all of
    them together leaves the graph acyclic (two convex sets can still form a cycle between them). That
    last check is done once for the whole selection; only if it fails is it repeated candidate by
    candidate to find which ones to drop.
    """
    taken, dropped = _disjoint(ranked)
    if _acyclic_when_contracted(g, taken):
        return taken, dropped
    safe: list[Match] = []
    for m in taken:
        if _acyclic_when_contracted(g, safe + [m]):
            safe.append(m)
        else:
            dropped.append((m, "fusing it together with the selected candidates would create a cycle"))
    return safe, dropped


def _disjoint(ranked: Sequence[Match]) -> tuple[list[Match], list[tuple[Match, str]]]:
    taken: list[Match] = []
    dropped: list[tuple[Match, str]] = []
    used: set[str] = set()
    for m in ranked:
        overlap = used.intersection(m.nodes)
        if overlap:
            dropped.append((m, f"overlaps a better candidate at {sorted(overlap)[0]!r}"))
            continue
        taken.append(m)
        used.update(m.nodes)
    return taken, dropped


def _acyclic_when_contracted(g: Graph, matches: Sequence[Match]) -> bool:
    """True if the graph with each match contracted to one vertex has no cycle: Kahn's algorithm over node
    positions (linear; the view's successor lists are built once per round)."""
    if len(matches) < 2:
        return True
    if _forward_when_placed_last(g, matches):
        return True
    n_nodes = len(g.nodes)
    vertex = list(range(n_nodes))          # node position -> its vertex (a match's vertex: n_nodes + i)
    for i, m in enumerate(matches):
        for name in m.nodes:
            vertex[g.topo_index[name]] = n_nodes + i
    succ: list[list[int]] = [[] for _ in range(n_nodes + len(matches))]
    indegree = [0] * (n_nodes + len(matches))
    for u, targets in enumerate(g.successor_positions):
        vu = vertex[u]
        for t in targets:
            vt = vertex[t]
            if vt != vu:
                succ[vu].append(vt)
                indegree[vt] += 1
    ready = [v for v, d in enumerate(indegree) if d == 0]
    done = 0
    while ready:
        v = ready.pop()
        done += 1
        for t in succ[v]:
            indegree[t] -= 1
            if indegree[t] == 0:
                ready.append(t)
    return done == len(indegree)


def _forward_when_placed_last(g: Graph, matches: Sequence[Match]) -> bool:
    """A sufficient test for `_acyclic_when_contracted` that reads only the matches' own edges: with each match
    placed at its last node (where the rewrite puts it), every edge out of a match goes forward. Edges between
    other nodes keep the graph's order and an edge into a match lands at or before its last node, so then the
    contracted graph has a topological order and no cycle."""
    topo = g.topo_index
    last_of: dict[int, int] = {}          # node position -> position of its match's last node
    for m in matches:
        positions = [topo[n] for n in m.nodes]
        last = max(positions)
        for p in positions:
            last_of[p] = last
    succ = g.successors_at
    for p, last in last_of.items():
        for s in succ(p):
            if last_of.get(s, s) <= last and last_of.get(s) != last:
                return False
    return True
