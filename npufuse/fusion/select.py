"""Choosing which candidates to apply: legal (convex, no shared intermediates), disjoint, by gain."""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from npufuse.fusion.types import Match
from npufuse.graph import Graph
from npufuse.patterns.matching import escaping_intermediate


def boundary_violation(g: Graph, m: Match) -> str | None:
    """Why `m` cannot be fused as one node (an intermediate escapes, or a path leaves and re-enters), or None."""
    escape = escaping_intermediate(g, m.nodes, m.outputs)
    if escape is not None:
        return escape[2]
    return _path_reenters(g, set(m.nodes))


def _path_reenters(g: Graph, members: set[str]) -> str | None:
    """A path that leaves `members` and comes back makes the fused node a cycle: find one, bounded by
    topological order (nothing after the set's last node can lead back into it)."""
    last = max(g.topo_index[n] for n in members)
    dg = g.nx
    frontier = [s for n in members for s in dg.successors(n) if s not in members]
    seen = set(frontier)
    while frontier:
        cur = frontier.pop()
        for s in dg.successors(cur):
            if s in members:
                return f"a path from the set through {cur!r} re-enters it at {s!r} (not convex)"
            if s not in seen and g.topo_index[s] < last:
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
    if len(matches) < 2:
        return True
    group = {n: i for i, m in enumerate(matches) for n in m.nodes}
    q = nx.DiGraph()
    for u, v in g.nx.edges:
        gu, gv = group.get(u, u), group.get(v, v)
        if gu != gv:
            q.add_edge(gu, gv)
    return nx.is_directed_acyclic_graph(q)
