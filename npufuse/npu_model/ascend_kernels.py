"""The Ascend kernel a fused region becomes, and whether the target's chip has it.

The catalogue (`ascend_kernels.tsv`, shipped with the package) lists the public CANN kernels of Huawei's
Ascend/ops-transformer and Ascend/ops-nn repositories: inputs, outputs and attributes as each kernel's
`op_host/*_def.cpp` declares them, and the chips that ship a kernel for it. `region_kernel` maps the replacement
node of a fusion to its kernel record:

    {"op": "PromptFlashAttention", "source": "Ascend/ops-transformer", "builtin": False, "node": "...",
     "attrs": {"num_heads": 12, ...}, "inputs": [{"name": "query", "value": "q"}, ...], "outputs": [...],
     "notes": [...], "chip": "ascend910b", "available": True, "problem": None}

`builtin` marks what ATC (the model converter) runs with its own built-in operators and fusion passes (Conv2D
with an activation fused by UB fusion, GELU), which the catalogue does not cover for these chips: no chip
restriction. `folded` marks a
region that stays the op it was (BatchNormalization folded into a Conv or Gemm): it needs no new kernel, so the
chip cannot refuse it. `problem` says, in one sentence, why the target cannot run the region as that kernel: no
kernel for its chip, or an attribute outside what the kernel documents (heads, head dim, masks or grouped-query
attention a chip does not take, logit soft-capping, which none takes). Where it is set, the cost model prices the
region as unfused.

Limits are the kernels' own documentation (aclnnPromptFlashAttentionV3 / aclnnIncreFlashAttentionV3 in
Ascend/ops-transformer): N <= 256 heads and a head dim D <= 512 on every chip; on Atlas A2/A3 N*D < 65535 in the
BSH/BSND layouts; on Atlas inference cards (ascend310p) no pse_shift, num_key_value_heads 0 only and sparse_mode 0
only (an atten_mask only where query and key lengths are equal), and a batch of at most 128 (300 in BSH; the
kernel's tiling, ops-transformer prompt_flash_attention_tiling.cpp). Data types are not checked: ATC's precision
modes (force_fp16, allow_fp32_to_fp16) run a float32 model in the float16 the kernels take.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import onnx

from npufuse.ir.graph import attributes
from npufuse.npu_model.user_kernels import UserKernel, find_kernel

Shape = tuple  # ints for fixed dims, str for symbolic ones, None for unknown
ShapeOf = Callable[[str], "Shape | None"]

FUSED_DOMAIN = "npufuse"
ATC_BUILTIN = "ATC built-in"
MAX_HEADS = 256
MAX_HEAD_DIM = 512
MAX_ND_BSH = 65535          # N * D in the BSH / BSND layouts, Atlas A2 / A3
A2_CHIPS = frozenset({"ascend910b", "ascend910_93"})
INFERENCE_CARD = "ascend310p"
# PromptFlashAttention's tiling refuses a larger batch on ascend310p (ops-transformer prompt_flash_attention_tiling.cpp,
# BATCH_LIMIT_300 in BSH, BATCH_LIMIT_128 in every other layout)
CARD_PFA_MAX_BATCH, CARD_PFA_MAX_BATCH_BSH = 128, 300


@dataclass(frozen=True)
class CatalogueKernel:
    """One row of the catalogue."""

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: tuple[str, ...]
    chips: tuple[str, ...]          # empty: no chip has a kernel of this name in the public repositories
    source: str


@functools.lru_cache(maxsize=1)
def catalogue() -> dict[str, CatalogueKernel]:
    """Every kernel of the shipped catalogue, by op name."""
    text = resources.files("npufuse.npu_model").joinpath("ascend_kernels.tsv").read_text("utf-8")
    out: dict[str, CatalogueKernel] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        cells = line.split("\t")
        cells += [""] * (6 - len(cells))

        def split(cell: str) -> tuple[str, ...]:
            return tuple(c for c in cell.split(",") if c)

        op, ins, outs, attrs, chips, source = cells[:6]
        out[op] = CatalogueKernel(op, split(ins), split(outs), split(attrs), split(chips), source.strip())
    return out


@functools.lru_cache(maxsize=1)
def known_chips() -> tuple[str, ...]:
    """Every chip name the catalogue knows (a profile's `chip` must be one of them)."""
    return tuple(sorted({c for k in catalogue().values() for c in k.chips}))


def chip_label(chip: str, profile: str | None = None) -> str:
    return f"{chip} ({profile})" if profile else chip


def no_kernel(op: str, chip: str | None, profile: str | None = None) -> str | None:
    """Why `chip` cannot run catalogue kernel `op` ("X has no kernel for chip (profile)"), or None if it can.
    None too where no chip is set or `op` is not in the catalogue (ATC's built-ins)."""
    k = catalogue().get(op)
    if chip is None or k is None or chip in k.chips:
        return None
    return f"{op} has no kernel for {chip_label(chip, profile)}"


def kernel_label(rec: dict[str, Any] | None) -> str:
    """A short name for reports: `PromptFlashAttention`, `MatMulV3+Gelu`, `Conv2D+Relu6 (ATC)`,
    `BatchMatMulV3 → SwiGlu` (two kernels)."""
    if not rec:
        return "–"
    ops = [rec["op"]] + [e["op"] for e in rec.get("epilogue") or []]
    if rec.get("prologue"):
        return " → ".join([p["op"] for p in rec["prologue"]] + ["+".join(ops)])
    text = "+".join(ops)
    if rec.get("builtin"):
        text += " (ATC)"
    return text


# ---- the mapping ---------------------------------------------------------------------------------------------

@dataclass
class _Ctx:
    shape_of: ShapeOf
    chip: str | None
    profile: str | None
    ub_bytes: int | None = None     # the target's UB per core, for kernels whose documentation bounds it

    def shape(self, value: str) -> Shape | None:
        if not value:
            return None
        try:
            return self.shape_of(value)
        except Exception:  # a shape the view cannot give is simply unknown
            return None

    @property
    def where(self) -> str:
        return chip_label(self.chip, self.profile) if self.chip else ""


def bind(names: Sequence[str], values: Sequence[str]) -> list[dict[str, Any]]:
    """Kernel input/output names bound to the fused node's values, pairwise, where both are given."""
    return [{"name": n, "value": v} for n, v in zip(names, values) if n and v]


def kernel_record(op: str, node: onnx.NodeProto, attrs: dict[str, Any], inputs: list[dict[str, Any]],
                  outputs: list[dict[str, Any]], notes: list[str] | None = None, builtin: bool = False,
                  **extra: Any) -> dict[str, Any]:
    """A kernel record (see the module docstring) without its chip fields, which `region_kernel` adds."""
    k = catalogue().get(op)
    # float attributes come from float32 model attributes: 7 significant digits say all they hold
    attrs = {n: float(f"{v:.7g}") if isinstance(v, float) else v for n, v in attrs.items()}
    rec: dict[str, Any] = {"op": op, "source": ATC_BUILTIN if builtin or k is None else k.source,
                           "builtin": builtin, "node": node.name, "attrs": attrs, "inputs": inputs,
                           "outputs": outputs}
    rec.update(extra)
    rec["notes"] = list(notes or [])
    return rec


def _int(d: Any) -> int | None:
    return int(d) if isinstance(d, int) and not isinstance(d, bool) else None


def _same_memory(a: str, b: str) -> bool:
    """BSH and BSND are the same bytes ([B,S,N*D] vs [B,S,N,D]); a reshape between them is a view."""
    return a == b or {a, b} == {"BSH", "BSND"}


def _heads_from_shape(shape: Shape | None, layout: str) -> int | None:
    if shape is None or len(shape) != 4:
        return None
    return _int(shape[1] if layout == "BNSD" else shape[2])


def _seq_len(shape: Shape | None, layout: str) -> Any:
    if shape is None or len(shape) < 3:
        return None
    return shape[2] if layout == "BNSD" else shape[1]


def _head_dim(shape: Shape | None, layout: str, heads: int | None) -> int | None:
    if shape is None or not shape:
        return None
    last = _int(shape[-1])
    if layout == "BSH":
        return last // heads if last is not None and heads else None
    return last


def _attention(node: onnx.NodeProto, ctx: _Ctx) -> dict[str, Any]:
    """npufuse.FusedAttention -> PromptFlashAttention (prefill), IncreFlashAttention (a query of length 1)."""
    a = attributes(node)
    q, k, v, mask, bool_mask = (list(node.input) + [""] * 5)[:5]
    ql, kl, vl, ol = (str(a.get(f"{r}_layout", "BNSD")) for r in ("q", "k", "v", "out"))
    q_shape, k_shape = ctx.shape(q), ctx.shape(k)
    heads = int(a.get("num_heads", 0)) or _heads_from_shape(q_shape, ql)
    kv_heads = int(a.get("kv_num_heads", 0)) or _heads_from_shape(k_shape, kl) or heads
    head_dim = _head_dim(q_shape, ql, heads)
    sq, sk = _seq_len(q_shape, ql), _seq_len(k_shape, kl)
    if _int(sq) is None:   # shape inference may have lost the query length on Q (after a rotary) but not on Y
        sq = _int(_seq_len(ctx.shape(node.output[0]), ol)) or sq
    decode = sq == 1 and sk != 1
    lengths_differ = _int(sq) is not None and _int(sk) is not None and sq != sk   # only where both are known
    op = "IncreFlashAttention" if decode else "PromptFlashAttention"
    causal = bool(int(a.get("causal", 0)))
    card = ctx.chip == INFERENCE_CARD
    notes: list[str] = []
    problems: list[str] = []

    layout = ql
    for role, lay in (("key", kl), ("value", vl)):
        if not _same_memory(lay, ql):
            notes.append(f"{role} arrives {lay}: the kernel's one input_layout ({ql}) needs it transposed first")
    if not _same_memory(ol, ql):
        if not decode and ql == "BNSD" and ol in ("BSND", "BSH"):
            layout = "BNSD_BSND"   # BNSD in, BSND out; BSND -> BSH is a view
        else:
            notes.append(f"the kernel writes {ql}; the region's output is {ol}: a transpose follows it")
    attrs: dict[str, Any] = {
        "num_heads": heads, "num_key_value_heads": kv_heads if kv_heads and kv_heads != heads else 0,
        "scale_value": float(a.get("scale", 1.0)), "input_layout": layout}
    inputs = bind(("query", "key", "value"), (q, k, v))
    if mask:
        inputs.append({"name": "pse_shift", "value": mask})
        notes.append("the region's bias (its additive mask and position biases: relative position bias, ALiBi, "
                     "DeBERTa's c2p/p2c, summed outside the fused op where the model adds several) is the kernel's "
                     "pse_shift, added to the scaled scores; pse_shift is [B or 1, N, Sq, Sk], so a bias that "
                     "broadcasts is expanded to it")
        if card and not decode:
            problems.append(f"{op} on {ctx.where} takes no pse_shift, which carries this region's additive mask")
    if kv_heads and heads and kv_heads != heads:
        if a.get("kv_repeat", "interleave") == "tile":
            notes.append("KV heads are repeated by tile (query head h reads KV head h mod G); the kernel groups "
                         "consecutive query heads on one KV head, so the KV heads must be permuted for it")
        if card:
            problems.append(f"{op} on {ctx.where} takes num_key_value_heads 0 only, no grouped-query attention "
                            f"(this region: {heads} query heads on {kv_heads} KV heads)")
    if int(a.get("out_dtype", 0)):
        notes.append("the region multiplies the probabilities by V cast up and writes Y in a wider type than its "
                     "inputs: the kernel computes softmax and P·V in fp32 internally and a Cast of its output follows")
    if bool(int(a.get("nan_guard", 0))):
        notes.append("fully masked rows give zeros (the export's NaN guard): the kernel's invalid-row correction")
    if not decode:
        sparse, pre, nxt, precise = 0, 2147483647, 2147483647, 0
        if causal and card:
            # Atlas inference cards take sparse_mode 0 only: causal as a full lower-triangular mask with
            # next_tokens 0 (aligned to the first key), the region's causal (aligned to the last key) when Sq == Sk.
            nxt, precise = 0, 2
            inputs.append({"name": "atten_mask", "value": None, "const": "causal"})
            notes.append("causal: a full Sq x Sk lower-triangular atten_mask with next_tokens 0 (equal query and "
                         "key lengths)")
            if lengths_differ:
                problems.append(f"{op} on {ctx.where} takes sparse_mode 0 only and no atten_mask where query and "
                                f"key lengths differ: this region's causal mask (Sq {sq}, Sk {sk}) has no form it "
                                "takes")
        elif causal:
            sparse, nxt = 3, 0   # rightDownCausal: key j visible to query i iff j <= i + Sk - Sq
            inputs.append({"name": "atten_mask", "value": None, "const": "causal 2048x2048"})
            notes.append("causal: sparse_mode 3 (rightDownCausal) reads the kernel's optimized 2048 x 2048 "
                         "lower-triangular atten_mask, supplied at deployment")
        if bool_mask:
            inputs.append({"name": "atten_mask", "value": bool_mask})
            precise = 2
            if a.get("bool_mask_mode", "keep") == "keep":
                notes.append("atten_mask marks the positions to drop (1 = masked): it is Not(the region's boolean "
                             "mask), which marks those to keep")
            if card and lengths_differ:
                problems.append(f"{op} on {ctx.where} takes no atten_mask where query and key lengths differ "
                                f"(Sq {sq}, Sk {sk})")
        if bool(int(a.get("nan_guard", 0))):
            precise = 2
        attrs.update(sparse_mode=sparse, pre_tokens=pre, next_tokens=nxt, inner_precise=precise)
    else:
        # decode: the key and value are the whole KV cache (past and new positions, concatenated outside)
        notes.append("decode: one query position per sequence against the whole KV cache that key and value hold")
        if causal:
            notes.append("causal with one query (aligned to the last key) sees every key: no atten_mask needed")
        if bool_mask:
            inputs.append({"name": "atten_mask", "value": bool_mask})
            if a.get("bool_mask_mode", "keep") == "keep":
                notes.append("atten_mask marks the positions to drop (1 = masked): it is Not(the region's boolean "
                             "mask), which marks those to keep")
    batch = _int(q_shape[0]) if q_shape else None
    batch_limit = CARD_PFA_MAX_BATCH_BSH if layout == "BSH" else CARD_PFA_MAX_BATCH
    if card and not decode and batch is not None and batch > batch_limit:
        problems.append(f"{op} on {ctx.where} takes a batch of at most {batch_limit} in the {layout} layout "
                        f"(this region: {batch})")
    if heads is not None and heads > MAX_HEADS:
        problems.append(f"{op} takes at most {MAX_HEADS} heads (this region: {heads})")
    if head_dim is not None and head_dim > MAX_HEAD_DIM:
        problems.append(f"{op} takes a head dim of at most {MAX_HEAD_DIM} (this region: {head_dim})")
    if (heads and head_dim and heads * head_dim >= MAX_ND_BSH and layout in ("BSH", "BSND")
            and (ctx.chip is None or ctx.chip in A2_CHIPS)):
        problems.append(f"{op} in the {layout} layout takes N x D below {MAX_ND_BSH} (this region: {heads} x "
                        f"{head_dim})")
    softcap = float(a.get("softcap", 0.0) or 0.0)
    if softcap > 0:   # first: it is why no chip takes the region, whatever else it has
        problems.insert(0, f"{op} takes no logit soft-capping: no shipped attention kernel (PromptFlashAttention, "
                        "IncreFlashAttention, FusedInferAttentionScore, FlashAttentionScore) applies softcap * "
                        f"tanh(scores / softcap) to the scores (this region: softcap {softcap:g})")
    sinks = node.input[5] if len(node.input) > 5 and node.input[5] else ""
    if sinks:
        # learned sinks (GPT-OSS): FusedInferAttentionScore's learnable_sink, the one attention kernel that takes
        # them (ops-transformer fused_infer_attention_score_def.cpp, 910B / A3 / 950); its scale attribute is `scale`
        op = "FusedInferAttentionScore"
        attrs["scale"] = attrs.pop("scale_value")
        inputs.append({"name": "learnable_sink", "value": sinks})
        notes.append("learnable_sink: the per-head sink logits, one more column in each row's softmax")
        problems = [m.replace("PromptFlashAttention", op).replace("IncreFlashAttention", op) for m in problems]
    rec = kernel_record(op, node, attrs, inputs, bind(("attention_out",), node.output[:1]), notes)
    rec["_problems"] = problems
    return rec


def _add_rms_norm(node: onnx.NodeProto, ctx: _Ctx) -> dict[str, Any]:
    a = attributes(node)
    outs = list(node.output) + [""]
    return kernel_record("AddRmsNorm", node, {"epsilon": float(a.get("epsilon", 1e-5))},
                         bind(("x1", "x2", "gamma"), node.input), bind(("y", "x"), (outs[0], outs[1])),
                         ["x (the kernel's third output) is the sum x1 + x2"] if outs[1] else [])


def _add_layer_norm(node: onnx.NodeProto, ctx: _Ctx) -> dict[str, Any]:
    a = attributes(node)
    outs = list(node.output) + [""]
    notes = [] if len(node.input) > 3 and node.input[3] else ["no beta in the region: the kernel's beta is zeros"]
    attrs = {"epsilon": float(a.get("epsilon", 1e-5)), "additional_output": bool(outs[1])}
    return kernel_record("AddLayerNorm", node, attrs, bind(("x1", "x2", "gamma", "beta"), node.input),
                         bind(("y", "", "", "x"), (outs[0], "", "", outs[1])), notes)


def _rms_norm(node: onnx.NodeProto, ctx: _Ctx) -> dict[str, Any]:
    a = attributes(node)
    return kernel_record("RmsNorm", node, {"epsilon": float(a.get("epsilon", 1e-5))},
                         bind(("x", "gamma"), node.input), bind(("y",), node.output[:1]))


def _group_norm(node: onnx.NodeProto, ctx: _Ctx) -> dict[str, Any]:
    """npufuse.GroupNorm / GroupNormSilu -> GroupNormSilu, its SiLU on or off (activate_silu): the one GroupNorm
    kernel on 910B and 310P (GroupNorm and GroupNormV2 are ascend950 only)."""
    a = attributes(node)
    attrs = {"num_groups": int(a["num_groups"]), "eps": float(a.get("epsilon", 1e-5)),
             "activate_silu": node.op_type == "GroupNormSilu"}
    return kernel_record("GroupNormSilu", node, attrs, bind(("x", "gamma", "beta"), node.input),
                         bind(("y",), node.output[:1]))


# MoeGatingTopKSoftmax(V2) limits (aclnnMoeGatingTopKSoftmax.md, ...V2.md in Ascend/ops-transformer)
MOE_GATING_MAX_K = 1024
MOE_GATING_MAX_EXPERTS = {"ascend950": 2048, INFERENCE_CARD: 256}


def _moe_gating(node: onnx.NodeProto, ctx: _Ctx) -> dict[str, Any]:
    """npufuse.MoeGatingTopKSoftmax -> MoeGatingTopKSoftmax (softmax, then the top k); with renormalize=1
    MoeGatingTopKSoftmaxV2 with renorm=1 (the top k of the logits, then a softmax over those k, which is the top-k
    probabilities divided by their sum; 910B/A3/950 only). x 2-D or 3-D, 0 <= k <= min(E, 1024); on Atlas inference
    cards E a multiple of 16 up to 256 (and fp16 only), on 950 E <= 2048."""
    a = attributes(node)
    k, first = int(a["k"]), bool(int(a.get("topk_first", 0)))
    renorm = bool(int(a.get("renormalize", 0))) or first   # topk_first=1 is V2's renorm=1 itself
    shape = ctx.shape(node.input[0])
    experts = _int(shape[-1]) if shape else None
    problems: list[str] = []
    op = "MoeGatingTopKSoftmaxV2" if renorm else "MoeGatingTopKSoftmax"
    if shape is not None and len(shape) not in (2, 3):
        problems.append(f"{op} takes 2-D or 3-D router logits (this region: rank {len(shape)})")
    if k > MOE_GATING_MAX_K or (experts is not None and k > experts):
        problems.append(f"{op} takes k <= min(experts, {MOE_GATING_MAX_K}) (this region: k {k}, {experts} experts)")
    limit = MOE_GATING_MAX_EXPERTS.get(ctx.chip or "")
    if experts is not None and limit is not None and experts > limit:
        problems.append(f"{op} on {ctx.where} takes at most {limit} experts (this region: {experts})")
    if ctx.chip == INFERENCE_CARD and experts is not None and experts % 16:
        problems.append(f"{op} on {ctx.where} takes a multiple of 16 experts (this region: {experts})")
    notes = ["expert_idx is int32: the model's int64 indices are a Cast of it"]
    attrs: dict[str, Any] = {"k": k}
    if first:
        attrs.update(renorm=1, output_softmax_result_flag=False)
        notes.append("renorm=1: the top k of the logits, then a softmax over those k: the region's computation")
    elif renorm:
        attrs.update(renorm=1, output_softmax_result_flag=False)
        notes.append("renorm=1: the top k of the logits, then a softmax over those k, the same weights as the "
                     "region's top-k probabilities divided by their sum")
    else:
        notes.append("row_idx (the kernel's third output) is not used")
    rec = kernel_record(op, node, attrs, bind(("x",), node.input[:1]), bind(("y", "expert_idx"), node.output[:2]),
                        notes)
    rec["_problems"] = problems
    return rec


def _silu(node: onnx.NodeProto, ctx: _Ctx) -> dict[str, Any]:
    """npufuse.Silu -> Swish with scale 1 (x * sigmoid(x)); the public repositories ship it for ascend950 only."""
    return kernel_record("Swish", node, {"scale": 1.0}, bind(("x",), node.input), bind(("y",), node.output[:1]))


def _layer_norm(node: onnx.NodeProto, ctx: _Ctx) -> dict[str, Any]:
    a = attributes(node)
    inputs = bind(("x", "", "gamma", "beta"), [node.input[0], ""] + list(node.input[1:3]))
    x_shape = ctx.shape(node.input[0])
    axis = int(a.get("axis", -1))
    if x_shape is not None:
        norm = list(x_shape[axis:]) if axis != 0 else list(x_shape)
        inputs.insert(1, {"name": "normalized_shape", "value": None, "const": norm})
    return kernel_record("LayerNormV4", node, {"epsilon": float(a.get("epsilon", 1e-5))}, inputs,
                         bind(("y",), node.output[:1]))


def _gelu(node: onnx.NodeProto, ctx: _Ctx) -> dict[str, Any]:
    a = attributes(node)
    if str(a.get("approximate", "none")) == "quick":
        # x * sigmoid(1.702 x) is FastGelu's formula (x / (1 + exp(-1.702 x)), computed as
        # x / (1 + exp(-1.702 |x|)) * exp(0.851 (x - |x|)))
        return kernel_record("FastGelu", node, {}, bind(("x",), node.input), bind(("y",), node.output[:1]),
                             ["ATC's built-in FastGelu operator, x * sigmoid(1.702 x): the public repositories hold "
                              "FastGelu kernels for ascend950 only"], builtin=True)
    return kernel_record("Gelu", node, {"approximate": str(a.get("approximate", "none"))},
                         bind(("x",), node.input), bind(("y",), node.output[:1]),
                         ["ATC's built-in GELU operator: the public repositories hold GELU kernels (Gelu, GeluV2) "
                          "for ascend950 only"], builtin=True)


_MATMUL_EPILOGUE = {
    "gelu": {"op": "Gelu", "attrs": {"approximate": "none"}},
    "gelu_tanh": {"op": "Gelu", "attrs": {"approximate": "tanh"}},
    "relu": {"op": "Relu"},
    "silu": {"op": "Swish", "attrs": {"scale": 1.0}},
    "tanh": {"op": "Tanh"},
    "sigmoid": {"op": "Sigmoid"},
    "quick_gelu": {"op": "FastGelu"},
}


def _fused_matmul(node: onnx.NodeProto, ctx: _Ctx) -> dict[str, Any]:
    """FusedMatMul -> MatMulV3 (2-D A) or BatchMatMulV3, the bias as the kernel's bias, an activation epilogue
    joined by ATC's UB fusion. A norm epilogue has no kernel: none of the catalogue fuses a MatMul with a norm."""
    a = attributes(node)
    steps = [s.decode() if isinstance(s, bytes) else str(s) for s in a.get("epilogue", [])]
    a_shape = ctx.shape(node.input[0])
    batched = a_shape is not None and len(a_shape) > 2
    op = "BatchMatMulV3" if batched else "MatMulV3"
    attrs = {"adj_x1": False, "adj_x2": False} if batched else {"transpose_x1": False, "transpose_x2": False}
    ins = list(node.input) + [""] * 5
    inputs = bind(("x1", "x2"), ins[:2])
    if "bias" in steps and ins[2]:
        inputs.append({"name": "bias", "value": ins[2]})
    epilogue = [dict(_MATMUL_EPILOGUE[s]) for s in steps if s in _MATMUL_EPILOGUE]
    extra: dict[str, Any] = {}
    if epilogue:
        extra["epilogue"] = epilogue
        extra["fusion"] = "ATC UB fusion: " + " + ".join([op] + [e["op"] for e in epilogue])
    rec = kernel_record(op, node, attrs, inputs, bind(("y",), node.output[:1]), **extra)
    norms = [s for s in steps if s in ("layernorm", "rmsnorm")]
    rec["_problems"] = [f"{op} takes no {norms[0]} epilogue: no kernel fuses a MatMul with a row norm ({op} has no "
                        "gamma, beta or epsilon)"] if norms else []
    return rec


_CONV_ACTIVATION = {"Relu": "Relu", "Sigmoid": "Sigmoid", "HardSwish": "HardSwish", "HardSigmoid": "HardSigmoid",
                    "LeakyRelu": "LeakyRelu", "Silu": "Swish", "Clip": "ClipByValue"}


def _conv(node: onnx.NodeProto, ctx: _Ctx) -> dict[str, Any]:
    """Conv / FusedConv -> ATC's Conv2D (Conv3D for 3-D), the activation joined by ATC's UB fusion."""
    a = attributes(node)
    w_shape = ctx.shape(node.input[1]) if len(node.input) > 1 else None
    spatial = len(w_shape) - 2 if w_shape is not None and len(w_shape) >= 3 else 2
    op = "Conv3D" if spatial == 3 else "Conv2D"
    notes = ["a 1-D convolution runs as Conv2D with H = 1"] if spatial == 1 else []
    k = max(spatial, 2) if op == "Conv2D" else 3

    def per_axis(key: str, default: int) -> list[int]:
        vals = [int(x) for x in a.get(key, [default] * spatial)]
        return [1, 1] + [default] * (k - len(vals)) + vals

    pads = [int(x) for x in a.get("pads", [0] * (2 * spatial))]
    begin, end = pads[: len(pads) // 2], pads[len(pads) // 2:]
    begin, end = [0] * (k - len(begin)) + begin, [0] * (k - len(end)) + end
    attrs: dict[str, Any] = {"strides": per_axis("strides", 1),
                             "pads": [p for pair in zip(begin, end) for p in pair],
                             "dilations": per_axis("dilations", 1), "groups": int(a.get("group", 1)),
                             "data_format": "NCDHW" if op == "Conv3D" else "NCHW"}
    if a.get("auto_pad", "NOTSET") not in ("NOTSET", ""):
        attrs["pad_mode"] = a["auto_pad"]
    extra: dict[str, Any] = {}
    act = a.get("activation")
    steps: list[dict[str, Any]] = []
    ins = list(node.input) + [""] * 6
    if int(a.get("affine", 0)) and ins[4] and ins[5]:
        # fp16/bf16 model: npufuse kept the BatchNorm as a float32 per-channel scale/shift after the conv (folding it
        # into fp16 weights loses precision); ATC's UB fusion joins a BNInfer (or folds it, ConvBatchnormFusionPass)
        steps.append({"op": "BNInfer", "inputs": [{"name": "scale", "value": ins[4]}, {"name": "offset", "value": ins[5]}]})
        notes.append(f"the BatchNorm's scale {ins[4]!r} and shift {ins[5]!r} are float32, applied after the conv")
    if int(a.get("residual", 0)) and ins[3]:
        # ResNet's Conv -> Add(shortcut) -> Relu: ATC's UB fusion joins the elementwise Add (and the activation after
        # it) to Conv2D; the shortcut is the Add's second input, read once from GM
        steps.append({"op": "Add", "inputs": [{"name": "x2", "value": ins[3]}]})
        notes.append(f"the residual {ins[3]!r} is the fused Add's second input x2, read from GM once")
    if act:
        if act == "Clip" and float(a.get("min", float("-inf"))) == 0.0 and float(a.get("max", float("inf"))) == 6.0:
            step: dict[str, Any] = {"op": "Relu6"}
        elif act == "Gelu":
            step, gelu_notes = _conv_gelu_step(str(a.get("approximate", "none")))
            notes.extend(gelu_notes)
        else:
            step = {"op": _CONV_ACTIVATION.get(act, act)}
            params = {k2: a[k2] for k2 in ("alpha", "beta", "min", "max") if k2 in a}
            if act == "Silu":
                params = {"scale": 1.0}
            if params:
                step["attrs"] = params
        steps.append(step)
    if steps:
        extra = {"epilogue": steps, "fusion": "ATC UB fusion: " + " + ".join([op] + [st["op"] for st in steps])}
    return kernel_record(op, node, attrs, bind(("x", "filter", "bias"), node.input[:3]),
                         bind(("y",), node.output[:1]), notes, builtin=True, **extra)


def _conv_gelu_step(approximate: str) -> tuple[dict[str, Any], list[str]]:
    """FusedConv's GELU epilogue: ATC's Gelu (FastGelu for the quick form) joined to Conv2D by the UB fusion
    TbeCommonRules0FusionPass, which takes a Conv2D and up to three elementwise ops of any type (a longer chain
    only from a whitelist without Gelu); no dedicated Conv + GELU pass or kernel exists."""
    notes = ["ATC's UB fusion TbeCommonRules0FusionPass joins the GELU to Conv2D (a Conv2D and 1 to 3 elementwise "
             "ops of any type); no dedicated Conv + GELU fusion pass or kernel exists"]
    if approximate == "quick":
        return {"op": "FastGelu"}, notes
    if approximate == "none":
        notes.append("ATC's TBE Gelu kernel (impl/gelu.py in CANN's public TBE sources) computes the tanh form, "
                     "x / (1 + exp(-1.5957691 (x + 0.044715 x^3))): an erf GELU runs as its tanh approximation "
                     "(they differ by under 1e-3)")
    return {"op": "Gelu", "attrs": {"approximate": approximate}}, notes


def _gemm(node: onnx.NodeProto, ctx: _Ctx) -> dict[str, Any]:
    """A standard Gemm (BatchNormalization folded into it) -> MatMulV3 with its bias."""
    a = attributes(node)
    attrs = {"transpose_x1": bool(a.get("transA", 0)), "transpose_x2": bool(a.get("transB", 0))}
    return kernel_record("MatMulV3", node, attrs, bind(("x1", "x2", "bias"), node.input),
                         bind(("y",), node.output[:1]))


def _gated_mlp(node: onnx.NodeProto, ctx: _Ctx) -> dict[str, Any]:
    """npufuse.GatedMLP -> MatMulV3 / BatchMatMulV3 (x against the gate and up weights side by side) then SwiGlu
    (silu) or GeGluV2 (gelu, gelu_tanh) on its output: two kernels. ReGLU has no gating kernel: the MatMul with
    Relu and Mul after it, ATC's UB fusion."""
    a = attributes(node)
    act = str(a.get("activation", "silu"))
    merged, gate_first, has_bias = (bool(int(a.get(k, d))) for k, d in (("merged", 0), ("gate_first", 1),
                                                                         ("has_bias", 0)))
    x, w_gate, w_up, b_gate, b_up = (list(node.input) + [""] * 5)[:5]
    x_shape = ctx.shape(x)
    batched = x_shape is not None and len(x_shape) > 2
    mm_op = "BatchMatMulV3" if batched else "MatMulV3"
    mm_attrs = {"adj_x1": False, "adj_x2": False} if batched else {"transpose_x1": False, "transpose_x2": False}
    if merged:
        mm_inputs = bind(("x1", "x2", "bias"), (x, w_gate, b_gate if has_bias else ""))
    else:
        mm_inputs = bind(("x1",), (x,)) + [{"name": "x2", "value": None, "concat": [w_gate, w_up]}]
        if has_bias:
            mm_inputs.append({"name": "bias", "value": None, "concat": [b_gate, b_up]})
    prologue = [{"op": mm_op, "attrs": mm_attrs, "inputs": mm_inputs}]
    notes = [] if merged else ["the gate and up weights (and biases) are concatenated along N, constants folded "
                               "once, so one MatMul computes both halves"]
    gated_in = [{"name": "x", "value": None, "from": mm_op}]
    outputs = bind(("y",), node.output[:1])
    if act == "silu":
        if not gate_first:
            notes.append("SwiGlu activates the first half: the weight's two halves are swapped (a constant)")
        rec = kernel_record("SwiGlu", node, {"dim": -1}, gated_in, outputs, notes, prologue=prologue)
    elif act in ("gelu", "gelu_tanh"):
        attrs = {"dim": -1, "approximate": 1 if act == "gelu_tanh" else 0, "activate_left": gate_first}
        rec = kernel_record("GeGluV2", node, attrs, gated_in, outputs, notes, prologue=prologue)
    else:
        notes.append(f"no gating kernel for {act}: the MatMul with {act} and Mul after it, ATC's UB fusion")
        rec = kernel_record(mm_op, node, mm_attrs, mm_inputs, outputs, notes,
                            epilogue=[{"op": "Relu" if act == "relu" else act}, {"op": "Mul"}],
                            fusion=f"ATC UB fusion: {mm_op} + Relu + Mul")
    return rec


Mapper = Callable[[onnx.NodeProto, _Ctx], dict[str, Any]]
MAPPERS: dict[tuple[str, str], Mapper] = {
    (FUSED_DOMAIN, "FusedAttention"): _attention,
    (FUSED_DOMAIN, "AddRMSNorm"): _add_rms_norm,
    (FUSED_DOMAIN, "AddLayerNorm"): _add_layer_norm,
    (FUSED_DOMAIN, "RMSNorm"): _rms_norm,
    ("", "RMSNormalization"): _rms_norm,
    (FUSED_DOMAIN, "LayerNorm"): _layer_norm,
    (FUSED_DOMAIN, "GroupNorm"): _group_norm,
    (FUSED_DOMAIN, "Silu"): _silu,
    (FUSED_DOMAIN, "GroupNormSilu"): _group_norm,
    (FUSED_DOMAIN, "MoeGatingTopKSoftmax"): _moe_gating,
    ("", "LayerNormalization"): _layer_norm,
    (FUSED_DOMAIN, "Gelu"): _gelu,
    ("", "Gelu"): _gelu,
    (FUSED_DOMAIN, "FusedMatMul"): _fused_matmul,
    (FUSED_DOMAIN, "FusedConv"): _conv,
    (FUSED_DOMAIN, "GatedMLP"): _gated_mlp,
    ("", "Conv"): _conv,
    ("", "Gemm"): _gemm,
}


def register(domain: str, op_type: str) -> Callable[[Mapper], Mapper]:
    """Decorator for a pattern module that emits a new op: `@register("npufuse", "MyOp") def f(node, ctx): ...`
    returning `kernel_record(op, node, attrs, bind(kernel_inputs, node.input), ...)` (`op` a catalogue kernel,
    or `builtin=True`); `ctx.shape(value)` gives a value's shape, `ctx.chip` the target's chip and `ctx.ub_bytes`
    its UB per core (None where unknown)."""
    def deco(fn: Mapper) -> Mapper:
        MAPPERS[(domain, op_type)] = fn
        return fn
    return deco


def _user_kernel_record(node: onnx.NodeProto, ctx: _Ctx, kernels: Sequence[UserKernel],
                        dtype_of: Callable[[str], str | None] | None) -> dict[str, Any] | None:
    first = node.input[0] if node.input else ""
    shape = ctx.shape(first)
    attrs = attributes(node)
    k = find_kernel(kernels, node.op_type, attrs, ctx.chip, dtype_of(first) if dtype_of and first else None, shape)
    if k is None:
        return None
    rec = {"op": k.name, "source": f"user kernel ({k.source})", "builtin": False, "node": node.name, "attrs": attrs,
           "inputs": [{"name": f"input{i}", "value": v} for i, v in enumerate(node.input) if v],
           "outputs": [{"name": f"output{i}", "value": v} for i, v in enumerate(node.output) if v],
           "notes": [f"the user's kernel {k.name}, declared in {k.source} for npufuse.{k.implements}"],
           "chip": ctx.chip, "available": True, "problem": None, "user_kernel": True}
    return rec


def region_kernel(nodes: Iterable[onnx.NodeProto], shape_of: ShapeOf | None = None, chip: str | None = None,
                  profile: str | None = None, replaced_ops: Iterable[str] = (),
                  ub_bytes: int | None = None, user_kernels: Sequence[UserKernel] = (),
                  dtype_of: Callable[[str], str | None] | None = None) -> dict[str, Any] | None:
    """The kernel record of a fusion's replacement (the first node with a kernel; views such as a trailing
    Reshape have none), for `chip` (None: no chip, nothing refused for availability). None where no node maps.

    `replaced_ops`: the op types the region replaced; a standard op among them (Conv, Gemm with BatchNormalization
    folded in) needs no new kernel, so its record is `folded` and the chip does not decide. `user_kernels`: the
    kernels the user declared (npu_model.user_kernels): one that runs an npufuse node on `chip` (its first input's
    dtype from `dtype_of`) is that node's kernel."""
    ctx = _Ctx(shape_of or (lambda v: None), chip, profile, ub_bytes)
    replaced = set(replaced_ops)
    for node in nodes:
        domain = "" if node.domain == "ai.onnx" else node.domain
        if user_kernels and domain == FUSED_DOMAIN:
            rec = _user_kernel_record(node, ctx, user_kernels, dtype_of)
            if rec is not None:
                return rec
        mapper = MAPPERS.get((domain, node.op_type))
        if mapper is None:
            continue
        rec = mapper(node, ctx)
        problems = list(rec.pop("_problems", []))
        folded = domain == "" and node.op_type in replaced
        if folded:
            rec["folded"] = True
            rec["notes"].append(f"BatchNormalization folded into the {node.op_type}'s weights and bias: it runs as "
                                "the unfused op would, so no new kernel is needed")
        rec["chip"] = chip
        if chip is None:
            rec["available"] = None
        elif rec["builtin"] or folded:
            rec["available"] = True
        else:
            ops = [p["op"] for p in rec.get("prologue") or []] + [rec["op"]]
            missing = [why for op in ops if (why := no_kernel(op, chip, profile)) is not None]
            rec["available"] = not missing
            problems[:0] = missing[:1]
        if folded:
            problems = []
        rec["problem"] = problems[0] if problems else None
        return rec
    return None
