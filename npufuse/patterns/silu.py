"""A SiLU no larger fusion took, x * Sigmoid(x)  =>  npufuse.Silu: one elementwise kernel instead of two.

Runs last (phase 4), after every family that takes a SiLU as its epilogue or gate (FusedConv, FusedMatMul,
GatedMLP, GroupNormSilu): what is left is a SiLU after an op no kernel fuses it with (Flux's SiLU of a summed time
embedding, an expert's SiLU in an MoE's batched form), which would otherwise stay two kernels and an unnamed
Sigmoid. On Ascend it is the Swish kernel (scale 1) where the chip has one; elsewhere the region is refused with that
reason, which still names the Sigmoid.

Not a SiLU (left alone, the Sigmoid is some other family's business): x * Sigmoid(y) with y another value (a gate),
Sigmoid(c * x) * x (a Swish with its own beta, or the gelu pattern's quick GELU), a Sigmoid read elsewhere.

A plain Sigmoid that no family can take (near-miss `lone-sigmoid`): one whose input comes from data movement
(ultralytics' Detect head: Sigmoid over the Concat of the three levels' class scores), from a sum of two computed
values (RT-DETR's sigmoid(bbox_head(x) + inverse_sigmoid(ref))), or from the graph's input, and that is no SiLU.
No Conv, MatMul or norm writes its input, so no epilogue can take it: it stays one elementwise kernel, and the
report says so instead of leaving the Sigmoid unaccounted. A Sigmoid after a Conv, MatMul or norm is left to those
families (fused as their epilogue, or named by their own near-miss).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph
from npufuse.ir.matching import STD_DOMAINS, escaping_intermediate, other_operand, sole_consumer
from npufuse.patterns import kernels
from npufuse.patterns.base import FusedOpDef, Pattern, make_body

# ops that only move or select elements: no kernel computing them takes an activation epilogue
_DATA_MOVEMENT = frozenset({"Concat", "Reshape", "Transpose", "Split", "Slice", "Gather", "GatherElements", "Squeeze",
                            "Unsqueeze", "Flatten", "Expand", "Tile", "Pad", "Resize"})
_FLOAT = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                    onnx.TensorProto.DOUBLE})


def _silu_ref(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    x = inputs[0]
    xf = x.astype(np.float64)
    return [(xf * kernels.sigmoid(xf)).astype(x.dtype)]


def silu_body(attrs: dict[str, Any], opset: int, elem_type: int) -> onnx.FunctionProto:
    """npufuse.Silu as Sigmoid and Mul (valid at every opset npufuse accepts)."""
    nodes = [helper.make_node("Sigmoid", ["X"], ["S"]), helper.make_node("Mul", ["X", "S"], ["Y"])]
    return make_body(FUSED_DOMAIN, "Silu", ["X"], ["Y"], nodes, [helper.make_opsetid("", opset)], attributes=[],
                     overload="silu", doc_string="SiLU: X * Sigmoid(X).")


SILU = FusedOpDef(op_type="Silu", doc="Y = X * sigmoid(X) (SiLU, Swish with beta 1), elementwise.",
                  inputs=("X",), outputs=("Y",), attributes=(), reference=_silu_ref, body=silu_body)


class SiluPattern(Pattern):
    name = "silu"
    description = "Sigmoid/Mul (x * sigmoid(x)) that no larger fusion took into npufuse.Silu"
    anchor_ops = frozenset({"Sigmoid"})
    phase = 4
    fused_ops = (SILU,)

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if node.domain not in STD_DOMAINS or not node.input or not node.output:
            return None
        x, s = node.input[0], node.output[0]
        mul = sole_consumer(g, s, "Mul")
        if mul is None or other_operand(mul, s) != x or g.elem_type(x) not in _FLOAT:
            return self._lone(g, node)
        nodes = (node.name, mul.name)
        esc = escaping_intermediate(g, nodes, [mul.output[0]])
        if esc is not None:
            return Refusal(self.name, esc[1], esc[0], f"SiLU at {node.name!r}: {esc[2]}", nodes)
        ordered = tuple(sorted(nodes, key=lambda n: g.topo_index[n]))
        return Match(self.name, ordered, (x,), (mul.output[0],), "npufuse.Silu",
                     info={"x": x, "out": mul.output[0], "anchor": node.name})

    def _lone(self, g: Graph, node: onnx.NodeProto) -> Refusal | None:
        """The `lone-sigmoid` near-miss for a Sigmoid whose input no epilogue-taking op writes (see the module
        docstring); None where some other family may still take it or name it."""
        x = node.input[0]
        p = g.producer_of(x)
        if p is None:
            if g.is_constant(x):
                return None
            why = "the graph input"
        elif p.domain in STD_DOMAINS and p.op_type in _DATA_MOVEMENT:
            why = f"{p.op_type} {p.name!r}, data movement that no kernel takes an epilogue after"
        elif p.domain in STD_DOMAINS and p.op_type in ("Add", "Sub") and len(p.input) == 2 and \
                not any(g.is_constant(v) for v in p.input):
            why = (f"{p.op_type} {p.name!r} of two computed values: no Conv or MatMul epilogue reaches the Sigmoid "
                   "through a sum of activations")
        else:
            return None
        return Refusal(self.name, node.name, "lone-sigmoid",
                       f"Sigmoid {node.name!r} is no SiLU (no Mul reads both it and its input) and reads {why}; it "
                       "stays one elementwise kernel", (node.name,))

    def build(self, g: Graph, m: Match) -> Replacement:
        node, fn = SILU.make_node([m.info["x"]], [m.info["out"]], m.info["anchor"], {}, g.opset.get("", 1),
                                  g.elem_type(m.info["x"]))
        return Replacement([node], [], [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})
