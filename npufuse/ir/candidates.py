"""Plain records passed between the engine's stages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx

# What became of a candidate (FusionRecord.status in fusion.engine).
APPLIED, SKIPPED_COST, ROLLED_BACK, DROPPED = "applied", "skipped-by-cost", "rolled-back", "dropped"


@dataclass(frozen=True)
class Match:
    """A fusible chain a pattern found: its nodes and the values crossing its boundary."""

    pattern: str
    nodes: tuple[str, ...]          # names of the matched nodes, in topological order
    inputs: tuple[str, ...]         # values read from outside the set (dynamic and constant)
    outputs: tuple[str, ...]        # values the set produces for the rest of the graph
    kind: str                       # what it becomes, for summaries: "FusedConv[Relu]", "Conv(BN folded)"
    info: dict[str, Any] = field(default_factory=dict, compare=False)  # pattern-private details


@dataclass(frozen=True)
class Refusal:
    """A near-miss: a chain that looked fusible but is not, with the reason and the offending node."""

    pattern: str
    node: str                       # the node that made it refuse
    reason: str                     # short key, e.g. "bn-training-mode"; stable for reports and tests
    detail: str                     # one sentence a person reads
    nodes: tuple[str, ...] = ()     # the chain as far as it was matched
    graph: str = ""                 # the subgraph it lies in (see fusion.subgraphs); "" for the main graph

    def to_dict(self) -> dict[str, Any]:
        d = {"pattern": self.pattern, "node": self.node, "reason": self.reason,
             "detail": self.detail, "nodes": list(self.nodes)}
        if self.graph:
            d["graph"] = self.graph
        return d


@dataclass
class Replacement:
    """What a match becomes: built completely before anything in the graph changes."""

    nodes: list[onnx.NodeProto]
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    functions: list[onnx.FunctionProto] = field(default_factory=list)
    opsets: dict[str, int] = field(default_factory=dict)   # extra opset imports the nodes need
