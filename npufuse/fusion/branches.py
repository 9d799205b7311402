"""Whole-model pricing through an If: the node runs one of its branches, so it costs what its costlier branch costs.

`model_ops` prices the main graph's nodes, and an If among them would be one generic kernel: optimum's merged
decoders (Whisper, T5, the LLMs exported with a past) hold their whole decoder in an If's two branches (`use_cache`),
and were priced at a few microseconds. Here each If is replaced by the ops of the branch that costs more on the
target (each branch priced as a model of its own, as the engine fuses it: `fusion.subgraphs.standalone_model`),
and the report says which branch it priced (`summary.if_branches`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import onnx

from npufuse.cost_model import OpWork, estimate_ops
from npufuse.fusion.costing import CostShapes, model_ops
from npufuse.fusion.subgraphs import standalone_model
from npufuse.ir.graph import Graph
from npufuse.prepare.infer import infer_value_types

_MAX_DEPTH = 4   # If inside If inside ...: deeper ones stay one generic kernel


@dataclass(frozen=True)
class BranchChoice:
    node: str          # the If
    priced: str        # the branch whose ops stand for it: then_branch / else_branch
    time_us: float     # that branch, priced
    other_us: float    # the other branch, priced

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "priced": self.priced, "time_us": round(self.time_us, 3),
                "other_us": round(self.other_us, 3)}


def ops_through_branches(g: Graph, shapes: CostShapes, spec: Any, base_dir: str | None,
                         dims: Mapping[str, int] | None, choices: list[BranchChoice],
                         depth: int = 0) -> list[OpWork]:
    """`model_ops(g, shapes)` with each If's op replaced by the ops of its costlier branch on `spec` (appended to
    `choices`); a graph without an If gets `model_ops` unchanged."""
    ops = list(model_ops(g, shapes))
    ifs = {n.name: n for n in g.nodes if n.op_type == "If" and n.domain in ("", "ai.onnx")}
    if not ifs or depth >= _MAX_DEPTH:
        return ops
    out: list[OpWork] = []
    for op in ops:
        node = ifs.get(op.name) if op.op_type == "If" else None
        branches = _branches(g, node, spec, base_dir, dims, depth) if node is not None else []
        if len(branches) != 2:
            out.append(op)
            continue
        (t_hi, name, hi_ops, sub), (t_lo, _, _, _) = sorted(branches, key=lambda b: -b[0])
        out.extend(hi_ops)
        choices.append(BranchChoice(node.name, name, t_hi, t_lo))
        choices.extend(sub)
    return out


def _branches(g: Graph, node: onnx.NodeProto, spec: Any, base_dir: str | None, dims: Mapping[str, int] | None,
              depth: int) -> list[tuple[float, str, list[OpWork], list[BranchChoice]]]:
    out = []
    for a in node.attribute:
        if a.type != onnx.AttributeProto.GRAPH or a.name not in ("then_branch", "else_branch"):
            continue
        try:
            model, _ = standalone_model(g, a.g, f"{node.name}/{a.name}")
            types = infer_value_types(model)
            view = Graph(model, base_dir, types)
            sub: list[BranchChoice] = []
            ops = ops_through_branches(view, CostShapes(model, dims, types=types), spec, base_dir, dims, sub,
                                       depth + 1)
        except Exception:   # noqa: BLE001 - a branch that cannot be priced leaves the If one generic kernel
            return []
        out.append((estimate_ops(ops, spec).time_us, a.name, ops, sub))
    return out
