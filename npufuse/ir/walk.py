"""Walking a model's graphs: the main graph and every subgraph below it, with no index built (the Graph view
indexes one graph; these walks serve the passes that touch every graph once)."""

from __future__ import annotations

from collections.abc import Iterator

import onnx


def graphs_below(*graphs: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graphs` and every subgraph below them (If branches, Loop/Scan bodies, nested ones too)."""
    stack = list(graphs)
    while stack:
        g = stack.pop()
        yield g
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    stack.append(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    stack.extend(a.graphs)
