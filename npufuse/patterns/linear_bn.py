"""Linear -> BatchNorm1d: a BatchNormalization over a Gemm's or a MatMul's output columns, folded into its weights.

    Gemm -> BatchNormalization [-> per-column Mul/Add]                         =>  Gemm(A, B', C')      (gemm_bn)
    MatMul(A, W) [-> Add(bias)] -> [layout ops] -> BatchNormalization [-> ...]  =>  FusedMatMul(A, W', t)[bias]
                                                                                     -> the same layout ops (matmul_bn)

The BN is y = x * s + t per column (batchnorm.py), so x @ W * s + t = x @ (W * s) + t: the scale goes into the
weight's columns, the shift (with a bias Add's constant c: c * s + t) becomes the bias.

matmul_bn is LeViT's `MLPLayerWithBN` (a bias-free Linear, then `batch_norm(x.flatten(0, 1)).reshape_as(x)`):
TorchScript writes MatMul -> Flatten(axis=2) -> BatchNormalization -> Reshape(.., Shape(MatMul output)), dynamo
MatMul -> Reshape([-1, C]) -> BatchNormalization -> Reshape. A BatchNorm1d over a 3-D [B, C, L] view of the
tokens (MatMul -> Transpose(0, 2, 1) -> BN) folds the same way. The layout ops between the MatMul and the BN are
followed only where they keep the MatMul's columns on the BN's channel axis (axis 1): a Transpose moves that axis,
a Reshape or Flatten must keep a last axis of exactly N columns (row-major order keeps each element's column), and
the BN must end with the columns on axis 1 (`batchnorm.matmul_behind`). A BN over any other axis (the tokens of
a [B, N, C] MatMul output) is a per-row affine: the near-miss `bn-axis`. A Shape of a value of the chain (the
TorchScript Reshape back reads Shape(MatMul output)) reads only its shape, which the fold keeps: it is rebuilt on
the new value. The replacement is `npufuse.FusedMatMul` with the `bias` epilogue (the shift added by FixPipe on the
way out of L0C, as matmul_epilogue emits for a MatMul + bias), then the same layout ops, the last of them writing
the BN's output. fp16/bf16 models are refused (`bn-low-precision`): W * s rounded to the weight's type can exceed
the model's own error (conv_bn_act keeps such a BN as a float32 epilogue; FusedMatMul has none).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph, attributes
from npufuse.patterns.base import Pattern, unique_name
from npufuse.patterns.batchnorm import (
    ChainRefusal,
    apply_affine,
    batchnorm_affine,
    batchnorm_problem,
    bn_scale_shift,
    matmul_behind,
    per_channel_affine_chain,
)
from npufuse.patterns.matmul_epilogue import FUSED_MATMUL


class GemmBatchNorm(Pattern):
    """Gemm -> BatchNormalization (-> per-channel Mul/Add) => a Gemm with the BN folded into B and C.

    What a Linear followed by BatchNorm1d exports to. The activation after it, if any, is left for the
    MatMul-epilogue family (phase 2), which fuses Gemm + bias + activation.
    """

    name = "gemm_bn"
    description = "Gemm -> BatchNormalization into a Gemm with folded weights (Linear + BatchNorm1d)"
    anchor_ops = frozenset({"Gemm"})
    phase = 1

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            return None
        y = node.output[0]
        cons = g.consumers_of(y)
        if not any(c.op_type == "BatchNormalization" for c in cons):
            return None
        nodes = [node.name]
        if len(cons) != 1 or y in g.graph_outputs:
            return Refusal(self.name, node.name, "shared-intermediate", f"Gemm output {y!r} is also used outside "
                           "the BatchNormalization; folding would change what that reads", tuple(nodes))
        bn = cons[0]
        nodes.append(bn.name)
        a = attributes(node)
        b = g.constant(node.input[1]) if g.is_constant(node.input[1]) else None
        if b is None or b.ndim != 2:
            return Refusal(self.name, node.name, "dynamic-weight", f"Gemm weight {node.input[1]!r} is not a constant "
                           "matrix", tuple(nodes))
        n_out = b.shape[0] if a.get("transB", 0) else b.shape[1]
        if len(node.input) > 2 and node.input[2]:
            c = g.constant(node.input[2]) if g.is_constant(node.input[2]) else None
            if c is None or c.size not in (1, n_out) or (c.ndim == 2 and c.shape[0] != 1):
                return Refusal(self.name, node.name, "bias-shape", f"Gemm bias {node.input[2]!r} is not a constant "
                               f"of shape [{n_out}] (or a scalar)", tuple(nodes))
        problem = batchnorm_problem(g, bn, n_out)
        if problem is not None:
            return Refusal(self.name, bn.name, *problem, tuple(nodes))
        affine, z = per_channel_affine_chain(g, bn.output[0], 2)
        nodes.extend(name for name, _ in affine)
        return Match(self.name, tuple(nodes), g.boundary_inputs(nodes), (z,), "Gemm(BN folded)",
                     info={"gemm": node.name, "bn": bn.name, "affine": tuple(affine), "n_out": n_out})

    def build(self, g: Graph, m: Match) -> Replacement:
        gemm, bn = g.node(m.info["gemm"]), g.node(m.info["bn"])
        a = attributes(gemm)
        alpha, beta, trans_b = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0)), int(a.get("transB", 0))
        b = g.constant(gemm.input[1])
        n_out = m.info["n_out"]
        c = np.zeros(n_out) if len(gemm.input) < 3 or not gemm.input[2] else \
            np.broadcast_to(g.constant(gemm.input[2]).astype(np.float64).reshape(-1), (n_out,))
        # Y = alpha * A @ B + beta * C, then per column y * scale + shift.
        gamma, bn_beta, mean, var = (g.constant(v).astype(np.float64) for v in bn.input[1:5])
        s, t = batchnorm_affine(gamma, bn_beta, mean, var, float(attributes(bn).get("epsilon", 1e-5)))
        scale, shift = alpha * s, beta * c * s + t
        for name, const in m.info["affine"]:
            scale, shift = apply_affine(g, g.node(name).op_type, const, scale, shift)
        work = np.promote_types(b.dtype, np.float32)
        col = scale.astype(work)
        b_folded = (b.astype(work) * (col[:, None] if trans_b else col[None, :])).astype(b.dtype)
        taken: set[str] = set()
        b_name = unique_name(g, f"{gemm.name}.weight_folded", taken)
        c_name = unique_name(g, f"{gemm.name}.bias_folded", taken)
        attrs = {k: v for k, v in a.items() if k in ("transA", "transB")}
        node = helper.make_node("Gemm", [gemm.input[0], b_name, c_name], [m.outputs[0]], name=gemm.name, **attrs)
        return Replacement([node], [numpy_helper.from_array(b_folded, b_name),
                                    numpy_helper.from_array(shift.astype(b.dtype), c_name)])


class MatMulBatchNorm(Pattern):
    """MatMul [-> bias Add] -> layout ops -> BatchNormalization over the MatMul's columns => FusedMatMul[bias] with
    the BN folded into its weight and bias, then the same layout ops (see the module doc)."""

    name = "matmul_bn"
    description = ("MatMul [+ bias] -> [Reshape/Flatten/Transpose] -> BatchNormalization over its output columns "
                   "into FusedMatMul[bias] with folded weights (LeViT's Linear + BatchNorm1d)")
    anchor_ops = frozenset({"BatchNormalization"})
    phase = 1
    fused_ops = (FUSED_MATMUL,)

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if node.domain not in ("", "ai.onnx") or not node.output:
            return None
        chain = matmul_behind(g, node)
        if chain is None:
            return None
        if isinstance(chain, ChainRefusal):
            return Refusal(self.name, chain.node, chain.reason, chain.detail, chain.nodes)
        rank = g.rank(node.input[0])
        affine, z = per_channel_affine_chain(g, node.output[0], rank)
        members = [chain.matmul] + ([chain.bias_add] if chain.bias_add is not None else []) + list(chain.layout)
        nodes = [n.name for n in members + list(chain.shape_readers) + [node]] + [name for name, _ in affine]
        ordered = tuple(sorted(nodes, key=lambda n: g.topo_index[n]))
        inside = set(ordered)
        # a Shape of the chain read outside the match is one of its outputs (its value does not change)
        shapes_out = tuple(r.output[0] for r in chain.shape_readers
                           if r.output[0] in g.graph_outputs or any(c.name not in inside
                                                                    for c in g.consumers_of(r.output[0])))
        return Match(self.name, ordered, g.boundary_inputs(ordered), (z,) + shapes_out, "FusedMatMul[bias,folded BN]",
                     info={"matmul": chain.matmul.name, "bias": chain.bias, "bn": node.name,
                           "bias_add": chain.bias_add.name if chain.bias_add is not None else None,
                           "layout": tuple(n.name for n in chain.layout),
                           "shape_readers": tuple(r.name for r in chain.shape_readers), "affine": tuple(affine),
                           "n_cols": chain.n_cols})

    def build(self, g: Graph, m: Match) -> Replacement:
        mm, bn = g.node(m.info["matmul"]), g.node(m.info["bn"])
        n_cols = m.info["n_cols"]
        w = g.constant(mm.input[1])
        bias = m.info["bias"]
        c = np.zeros(n_cols) if bias is None else \
            np.broadcast_to(g.constant(bias).astype(np.float64).reshape(-1), (n_cols,))
        # (A @ W + c) * s + t per column, then the per-channel ops after the BN
        s, t = bn_scale_shift(g, bn)
        scale, shift = s, c * s + t
        for name, const in m.info["affine"]:
            scale, shift = apply_affine(g, g.node(name).op_type, const, scale, shift)
        work = np.promote_types(w.dtype, np.float32)
        w_folded = (w.astype(work) * scale.astype(work)[None, :]).astype(w.dtype)
        taken: set[str] = set()
        w_name = unique_name(g, f"{mm.name}.weight_folded", taken)
        b_name = unique_name(g, f"{mm.name}.bias_folded", taken)
        layout = [g.node(n) for n in m.info["layout"]]
        readers: dict[str, list[onnx.NodeProto]] = {}
        for r in (g.node(n) for n in m.info["shape_readers"]):
            readers.setdefault(r.input[0], []).append(r)
        # The MatMul's (and its bias Add's) output becomes the FusedMatMul's; each layout op is rebuilt on the folded
        # value under a new output name, the last writing the match's output (the BN's, or its affine chain's).
        head = [mm.output[0]] + ([g.node(m.info["bias_add"]).output[0]] if m.info["bias_add"] else [])
        fused_out = m.outputs[0] if not layout else unique_name(g, f"{head[-1]}.bn_folded", taken)
        fused, fn = FUSED_MATMUL.make_node([mm.input[0], w_name, b_name], [fused_out], mm.name, {"epilogue": ["bias"]},
                                           g.opset.get("", 1), g.elem_type(mm.input[0]) or g.elem_type(mm.output[0]))
        nodes = [fused]
        new_value = {v: fused_out for v in head}
        for v in head:
            nodes.extend(_copy(r, {v: fused_out}) for r in readers.get(v, []))
        for i, n in enumerate(layout):
            out = m.outputs[0] if i == len(layout) - 1 else unique_name(g, f"{n.output[0]}.bn_folded", taken)
            nodes.append(_copy(n, {n.input[0]: new_value[n.input[0]]}, {n.output[0]: out}))
            new_value[n.output[0]] = out
            nodes.extend(_copy(r, {n.output[0]: out}) for r in readers.get(n.output[0], []))
        inits = [numpy_helper.from_array(w_folded, w_name), numpy_helper.from_array(shift.astype(w.dtype), b_name)]
        return Replacement(nodes, inits, [fn] if fn is not None else [], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})


def _copy(node: onnx.NodeProto, inputs: dict[str, str], outputs: dict[str, str] | None = None) -> onnx.NodeProto:
    """`node` with some inputs and outputs renamed (its name, op, domain and attributes kept)."""
    out = onnx.NodeProto()
    out.CopyFrom(node)
    del out.input[:], out.output[:]
    out.input.extend(inputs.get(v, v) for v in node.input)
    out.output.extend((outputs or {}).get(v, v) for v in node.output)
    return out
