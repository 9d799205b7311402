"""A SiLU no larger fusion took, x * Sigmoid(x)  =>  npufuse.Silu: one elementwise kernel instead of two.

Runs last (phase 4), after every family that takes a SiLU as its epilogue or gate (FusedConv, FusedMatMul,
GatedMLP, GroupNormSilu): what is left is a SiLU after an op no kernel fuses it with (Flux's SiLU of a summed time
embedding, an expert's SiLU in an MoE's batched form), which would otherwise stay two kernels and an unnamed
Sigmoid. On Ascend it is the Swish kernel (scale 1) where the chip has one; elsewhere the region is refused with that
reason, which still names the Sigmoid.

Not a SiLU (left alone, the Sigmoid is some other family's business): x * Sigmoid(y) with y another value (a gate),
Sigmoid(c * x) * x (a Swish with its own beta, or the gelu pattern's quick GELU), a Sigmoid read elsewhere.
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
            return None
        nodes = (node.name, mul.name)
        esc = escaping_intermediate(g, nodes, [mul.output[0]])
        if esc is not None:
            return Refusal(self.name, esc[1], esc[0], f"SiLU at {node.name!r}: {esc[2]}", nodes)
        ordered = tuple(sorted(nodes, key=lambda n: g.topo_index[n]))
        return Match(self.name, ordered, (x,), (mul.output[0],), "npufuse.Silu",
                     info={"x": x, "out": mul.output[0], "anchor": node.name})

    def build(self, g: Graph, m: Match) -> Replacement:
        node, fn = SILU.make_node([m.info["x"]], [m.info["out"]], m.info["anchor"], {}, g.opset.get("", 1),
                                  g.elem_type(m.info["x"]))
        return Replacement([node], [], [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})
