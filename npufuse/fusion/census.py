"""What a model's fused structure amounts to, counted the same way for npufuse's output and the peers'.

A LayerNorm counts once whether it is a standard LayerNormalization, an `npufuse.LayerNorm`, part of an
`npufuse.AddLayerNorm`, or a step of a `FusedMatMul` epilogue; likewise RMSNorm and GELU (a GeGLU's GELU inside
an `npufuse.GatedMLP` counts as a GELU, and so does a FusedConv's GELU epilogue, also counted as
`conv_gelu`). Each `npufuse.GatedMLP` counts as a `gated_mlp`, each `npufuse.MlaProlog` as
an `mla_prolog` and its two RMSNorms as `rmsnorm`. `rotary` counts rotated tensors: one per RotaryEmbedding
(npufuse's, onnx's or com.microsoft's), two per `npufuse.RotaryEmbeddingPair` and per `npufuse.MlaProlog` (q_pe and
k_pe). Peers' fused
ops (onnxruntime's com.microsoft Attention, SkipLayerNormalization, BiasGelu, ...) count in their kind.
"""

from __future__ import annotations

from collections import Counter

import onnx
from onnx import helper

KINDS: dict[str, tuple[str, ...]] = {
    "attention": ("FusedAttention", "Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention",
                  "PackedMultiHeadAttention", "DecoderMaskedMultiHeadAttention", "SDPA"),
    "layernorm": ("LayerNormalization", "LayerNorm", "AddLayerNorm", "SkipLayerNormalization",
                  "EmbedLayerNormalization"),
    "rmsnorm": ("RMSNormalization", "RMSNorm", "AddRMSNorm", "SimplifiedLayerNormalization",
                "SkipSimplifiedLayerNormalization"),
    "gelu": ("Gelu", "FastGelu", "BiasGelu", "BiasFastGelu", "QuickGelu", "GeluNew"),
    "conv_epilogue": ("FusedConv",),
    "gated_mlp": ("GatedMLP",),
    "mla_prolog": ("MlaProlog",),
    "group_norm": ("GroupNorm", "GroupNormSilu", "GroupNormalization"),
    "moe_gating": ("MoeGatingTopKSoftmax",),
    "rotary": ("RotaryEmbedding",),
}
_EPILOGUE_KIND = {"layernorm": "layernorm", "rmsnorm": "rmsnorm", "gelu": "gelu", "gelu_tanh": "gelu",
                  "quick_gelu": "gelu"}


def fusion_census(model: onnx.ModelProto) -> Counter:
    """Counts per kind (attention, layernorm, rmsnorm, gelu, conv_epilogue, gated_mlp, mla_prolog, rotary, group_norm
    and, of those, group_norm_silu; moe_gating) in `model`'s main graph."""
    kind_of = {op: kind for kind, ops in KINDS.items() for op in ops}
    c: Counter = Counter()
    for n in model.graph.node:
        if n.op_type in kind_of:
            c[kind_of[n.op_type]] += 1
        if n.op_type == "FusedMatMul":
            for a in n.attribute:
                if a.name == "epilogue":
                    for step in helper.get_attribute_value(a):
                        step = step.decode() if isinstance(step, bytes) else step
                        if step in _EPILOGUE_KIND:
                            c[_EPILOGUE_KIND[step]] += 1
        if n.op_type == "MlaProlog":   # its q_a_layernorm and kv_a_layernorm; q_pe and k_pe rotated
            c["rmsnorm"] += 2
            c["rotary"] += 2
        if n.op_type == "RotaryEmbeddingPair":   # q and k, one kernel
            c["rotary"] += 2
        if n.op_type == "GroupNormSilu" or (n.op_type == "GroupNorm" and n.domain == "com.microsoft" and any(
                a.name == "activation" and a.i == 1 for a in n.attribute)):   # onnxruntime's GroupNorm with SiLU
            c["group_norm_silu"] += 1
        if n.op_type == "GatedMLP":
            for a in n.attribute:
                if a.name == "activation":
                    act = helper.get_attribute_value(a)
                    act = act.decode() if isinstance(act, bytes) else act
                    if act in _EPILOGUE_KIND:
                        c[_EPILOGUE_KIND[act]] += 1
        if n.op_type == "FusedConv" and _fused_conv_gelu(n):   # a GELU epilogue is a GELU too (`conv_gelu`)
            c["gelu"] += 1
            c["conv_gelu"] += 1
    return c


def _fused_conv_gelu(n: onnx.NodeProto) -> bool:
    act = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "activation"), None)
    return (act.decode() if isinstance(act, bytes) else act) == "Gelu"


def result_counts(res) -> dict[str, int]:
    """What an optimize run (an `OptimizeResult`) fused, per kind the census fixtures' manifest counts on the torch
    model: `fusion_census` of the output, with a FusedConv that took a residual Add counted as `conv_residual` and one
    with a GELU epilogue as `conv_gelu`, rotary as the per-tensor `rotary` rewrites applied, `batchnorm` as the
    BatchNormalizations the rewrites folded and `linear_bn` as those folded into a Gemm or MatMul."""
    c = fusion_census(res.model)
    out = {k: int(c.get(k, 0)) for k in ("attention", "layernorm", "rmsnorm", "gelu", "gated_mlp", "conv_epilogue",
                                          "conv_residual", "group_norm", "group_norm_silu", "moe_gating")}
    # a FusedConv with residual=1 took the residual Add (-> activation) of a residual block: counted as
    # conv_residual, not conv_epilogue (fusion_census counts every FusedConv as conv_epilogue)
    residual = sum(1 for n in res.model.graph.node if n.op_type == "FusedConv"
                   and any(a.name == "residual" and helper.get_attribute_value(a) for a in n.attribute))
    out["conv_epilogue"] -= residual
    out["conv_residual"] += residual
    # a FusedConv whose epilogue is a GELU (and no residual): `conv_gelu`, the census's Conv [-> BN] -> GELU chains,
    # not conv_epilogue (the census counts the other activations there); its GELU stays counted in `gelu`
    out["conv_gelu"] = sum(1 for n in res.model.graph.node if n.op_type == "FusedConv" and _fused_conv_gelu(n)
                           and not any(a.name == "residual" and helper.get_attribute_value(a) for a in n.attribute))
    out["conv_epilogue"] -= out["conv_gelu"]
    out["rotary"] = sum(1 for r in res.applied if r.match.pattern == "rotary")
    out["batchnorm"] = sum(r.node_ops.count("BatchNormalization") for r in res.applied)
    # Linear -> BatchNorm1d: the BNs folded into a Gemm's or a MatMul's weights
    out["linear_bn"] = sum(r.node_ops.count("BatchNormalization") for r in res.applied
                           if r.match.pattern in ("gemm_bn", "matmul_bn"))
    return out
