"""Quantized (QDQ) regions: kept exactly as they are, each refused candidate a named near-miss.

A QDQ model says where the device computes in int8: DequantizeLinear(int8 weight) -> Conv/MatMul/Gemm ->
QuantizeLinear. A float fusion of that compute node (a FusedConv, a BN folded into its weight, a FusedMatMul)
would hide the group from the deployment toolchain that lowers it to an int8 kernel, so npufuse does not fuse
it: there is no QDQ-aware fusion yet (Ascend's QuantBatchMatmulV3 / WeightQuantBatchMatmulV2 would be one).
The quantization steps themselves are never folded into float constants (`graph.QUANTIZATION_OPS`).

`quantized_refusal` is asked once per pattern and anchor node by the engine: it turns a match that touches a
quantized compute node, or a pattern's silence or other refusal at an anchor that reads a DequantizeLinear or
feeds a QuantizeLinear, into one near-miss with reason `quantized` naming the DequantizeLinear (or
QuantizeLinear) responsible.
"""

from __future__ import annotations

import onnx

from npufuse.ir.candidates import Match, Refusal
from npufuse.ir.graph import QUANTIZATION_OPS, Graph
from npufuse.ir.matching import std_op

QUANTIZED = "quantized"

# The compute a QDQ group is built around (the int8 kernels), and the anchors whose silence in a quantized
# model deserves a reason (the coverage anchors, see fusion.coverage, and BatchNormalization after a Conv).
_COMPUTE_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
_REPORTED_ANCHORS = _COMPUTE_OPS | {"BatchNormalization", "Softmax", "Erf", "Tanh", "Sigmoid", "ReduceMean",
                                    "LayerNormalization", "RMSNormalization"}
# Steps that move or reinterpret a dequantized weight without computing on it (DQ(W) -> Transpose -> MatMul).
_LAYOUT_OPS = frozenset({"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


# onnxruntime's quantizer writes its QDQ pairs in com.microsoft for int16/int4 and with UseQDQContribOps: the
# same steps, the same meaning for the device.
_QDQ_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft"})


def _qdq_op(node: onnx.NodeProto | None, *op_types: str) -> bool:
    return node is not None and node.domain in _QDQ_DOMAINS and node.op_type in op_types


def _dequantize_source(g: Graph, v: str) -> onnx.NodeProto | None:
    """The DequantizeLinear (or DynamicQuantizeLinear) `v` comes from, through layout-only steps."""
    for _ in range(8):
        p = g.producer_of(v)
        if p is None:
            return None
        if _qdq_op(p, "DequantizeLinear", "DynamicQuantizeLinear"):
            return p
        if not std_op(p, *_LAYOUT_OPS) or not p.input:
            return None
        v = p.input[0]
    return None


def quantization_of(g: Graph, node: onnx.NodeProto) -> tuple[onnx.NodeProto, list[str]] | None:
    """(the quantization node to name, the group's nodes) when `node` reads a dequantized value or feeds a
    QuantizeLinear; None otherwise. The DequantizeLinear of a stored (int8) weight is named first."""
    dqs = [p for p in (_dequantize_source(g, v) for v in node.input if v) if p is not None]
    qs = [c for o in node.output if o for c in g.consumers_of(o) if _qdq_op(c, "QuantizeLinear")]
    if not dqs and not qs:
        return None
    weight_dq = [p for p in dqs if p.input and p.input[0] in g.initializers]
    named = (weight_dq or dqs or qs)[0]
    group = list(dict.fromkeys([p.name for p in dqs] + [node.name] + [q.name for q in qs]))
    return named, group


def quantized_refusal(g: Graph, pattern: str, node: onnx.NodeProto, found: Match | Refusal | None
                      ) -> Refusal | None:
    """A `quantized` near-miss replacing what `pattern` found at anchor `node`, or None to keep it.

    A match is refused when one of its nodes is a quantization step, or a compute node of a quantized group; a
    refusal or silence at a reported anchor of a quantized group becomes that group's near-miss."""
    if isinstance(found, Match):
        for name in found.nodes:
            n = g.node(name)
            if _qdq_op(n, *QUANTIZATION_OPS):
                return Refusal(pattern, n.name, QUANTIZED, f"{n.op_type} {n.name!r} lies inside the chain; npufuse "
                               "keeps quantization steps where the model puts them", found.nodes)
            if std_op(n, *_COMPUTE_OPS):
                q = quantization_of(g, n)
                if q is not None:
                    return _refusal(pattern, n, *q)
        return None
    if not std_op(node, *_REPORTED_ANCHORS):
        return None
    q = quantization_of(g, node)
    if q is None:
        return None
    return _refusal(pattern, node, *q)


def _refusal(pattern: str, node: onnx.NodeProto, named: onnx.NodeProto, group: list[str]) -> Refusal:
    role = "reads" if named.op_type != "QuantizeLinear" else "is requantized by"
    return Refusal(pattern, named.name, QUANTIZED,
                   f"{node.op_type} {node.name!r} {role} {named.op_type} {named.name!r}: a quantized (QDQ) group, "
                   "kept as it is for the int8 kernels it lowers to (npufuse has no QDQ-aware fusion)", tuple(group))
