"""Coverage accounting: every node that looks like the start of a fusion ends fused or with a stated reason.

A fusion start ("anchor") is a node a fusion family is built around:

- `softmax`: every Softmax (attention; a router's Softmax -> TopK is moe_gating's: fused, or named by its near-miss);
- `norm`: a ReduceMean over the last axis that starts a decomposed norm: its input squared first (Pow(x, 2) or
  x·x: RMSNorm) or its output subtracted from its input (LayerNorm); and every BatchNormalization (`batchnorm`);
- `activation`: every Erf, Tanh and Sigmoid (GELU, tanh-GELU, quick-GELU, SiLU, epilogues);
- `groupnorm`: every InstanceNormalization and GroupNormalization (GroupNorm: the exporters write it as an
  InstanceNormalization over x viewed (N, G, -1); a true instance norm is named by the group_norm near-miss).

An anchor is accounted for when it is gone from the optimized graph (fused), or when a near-miss (a pattern's
refusal naming it in its chain) or a decision (skipped by the cost model, rolled back, dropped for an overlap)
says why it stayed, or when the run turned off a pattern built around its kind (--disable, --only,
--fusion-switch). Anything else is a silent refusal: `unaccounted` lists them, the reports show them, and
the coverage test fails on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import onnx

from npufuse.ir.graph import attributes

if TYPE_CHECKING:
    from npufuse.fusion.engine import OptimizeResult

_ACTIVATIONS = frozenset({"Erf", "Tanh", "Sigmoid"})
# The patterns built around each kind of start: where the user turned one of them off (--disable, --only,
# --fusion-switch), a start of that kind left in the graph is their choice, not a silent refusal.
_KIND_PATTERNS = {"softmax": ("attention",), "norm": ("layernorm", "rmsnorm"),
                  "batchnorm": ("conv_bn_act", "gemm_bn", "matmul_bn"),
                  "groupnorm": ("group_norm",),
                  "activation": ("gelu", "matmul_epilogue", "gated_mlp", "conv_bn_act", "silu")}


@dataclass(frozen=True)
class Anchor:
    node: str
    op_type: str
    kind: str            # softmax | norm | batchnorm | activation | groupnorm

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "op_type": self.op_type, "kind": self.kind}


def fusion_anchors(graph: onnx.GraphProto) -> list[Anchor]:
    """The fusion starts among `graph`'s nodes (main graph only; subgraph bodies are reported with their own)."""
    producer = {o: n for n in graph.node for o in n.output if o}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for v in n.input:
            readers.setdefault(v, []).append(n)
    out = []
    for n in graph.node:
        if n.domain not in ("", "ai.onnx"):
            continue
        kind = None
        if n.op_type == "Softmax":
            kind = "softmax"
        elif n.op_type == "BatchNormalization":
            kind = "batchnorm"
        elif n.op_type in _ACTIVATIONS:
            kind = "activation"
        elif n.op_type in ("InstanceNormalization", "GroupNormalization"):
            kind = "groupnorm"
        elif n.op_type == "ReduceMean" and _starts_norm(n, producer, readers):
            kind = "norm"
        if kind:
            out.append(Anchor(n.name, n.op_type, kind))
    return out


def _starts_norm(n: onnx.NodeProto, producer: dict, readers: dict) -> bool:
    if not _reduces_last_axis(n):
        return False
    x = n.input[0]
    p = producer.get(x)
    if p is not None and p.domain in ("", "ai.onnx") and (
            p.op_type == "Pow" or (p.op_type == "Mul" and len(p.input) == 2 and p.input[0] == p.input[1])):
        return True   # mean of squares: RMSNorm, or a LayerNorm's variance
    # x - mean(x): a LayerNorm's centring
    return any(r.op_type == "Sub" and list(r.input) == [x, n.output[0]] for r in readers.get(n.output[0], []))


def _reduces_last_axis(n: onnx.NodeProto) -> bool:
    axes = attributes(n).get("axes")
    if axes is None:
        # opset 18 moved axes to an input; an initializer or Constant we cannot see here counts as unknown:
        # treat as a candidate (a false anchor only asks for a reason, it never hides one)
        return True
    return any(a == -1 for a in axes) or len(axes) == 1


def unaccounted(result: OptimizeResult) -> list[Anchor]:
    """Anchors left in `result`'s graph with neither a fusion nor a near-miss or decision naming them."""
    named: set[str] = set()
    for r in result.refusals:
        if not r.graph:
            named.add(r.node)
            named.update(r.nodes)
    for rec in result.records:
        if getattr(rec, "graph", "") == "" and rec.status != "applied":
            named.update(rec.match.nodes)
    off = set(getattr(result, "patterns_off", ()))
    return [a for a in fusion_anchors(result.model.graph)
            if a.node not in named and not off & set(_KIND_PATTERNS[a.kind])]
