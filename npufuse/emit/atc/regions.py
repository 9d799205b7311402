"""Each fused region of the ONNX form, as ATC should see it: the CANN plugin node that computes it (with every
attribute the plugin reads written explicitly), or, where no plugin computes exactly what the model does, a
stable reason and standard ops (the region's function body, inlined by the emitter).

A mapper takes the npufuse node and what is known of its values and returns a `PluginRegion` (the plugin node,
helper nodes in standard ops that adapt layouts or build a mask, and 0-element tensors for absent optional
inputs) or a `StaysStandard` reason. The plugin contracts, and every semantic cited, are in `plugins.py` and
`reference_kernels.py`; `plugins.check_node` is run on each plugin node before it is kept, so a region whose
node would break its contract on the target chip stays standard too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npufuse import FUSED_DOMAIN
from npufuse.emit.atc.plugins import INT_MAX, check_node
from npufuse.ir.graph import attributes
from npufuse.npu_model.user_kernels import UserKernel

NPU_DOMAIN = "npu"
RMS_NORM_PLUGIN_EPSILON = 1e-6   # NPURmsNorm / NPUAddRmsNorm read no attribute: the kernel's epsilon is fixed


@dataclass
class PluginRegion:
    """The plugin node (domain `npu`) that replaces one fused node, with what it needs around it."""

    kernel: str                                   # the CANN kernel, e.g. PromptFlashAttention
    nodes: list[onnx.NodeProto]                   # helper nodes first (standard ops), the plugin node(s) last
    initializers: list[onnx.TensorProto] = field(default_factory=list)


@dataclass(frozen=True)
class StaysStandard:
    """Why a region is written back as standard ops: a stable key and one sentence."""

    reason: str
    detail: str


@dataclass
class Values:
    """What the mappers may ask of a value: static shape (ints, None for unknown dims) and ONNX element type."""

    shapes: Mapping[str, tuple[int | str | None, ...] | None]   # ints, symbolic dims by name, None: unknown
    elem_types: Mapping[str, int]
    opset: int
    chip: str | None
    precision_mode: str | None = None   # ATC's --precision_mode: what dtype a plugin kernel runs float32 in

    def shape(self, v: str) -> tuple[int | None, ...] | None:
        return self.shapes.get(v)

    def static(self, v: str) -> tuple[int, ...] | None:
        s = self.shapes.get(v)
        return tuple(s) if s is not None and all(isinstance(d, int) for d in s) else None  # type: ignore[arg-type]


Mapper = Callable[[onnx.NodeProto, Values, "Namer"], "PluginRegion | StaysStandard"]


class Namer:
    """Fresh value and node names, prefixed by the fused node's name so a region stays traceable."""

    def __init__(self, taken: set[str]) -> None:
        self.taken = taken

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _contract(kernel: str, nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], values: Values
              ) -> PluginRegion | StaysStandard:
    """The region, unless a plugin node breaks its contract on the target chip (then: stays standard)."""
    if values.chip:
        graph = _context_graph(nodes, inits, values)
        for n in nodes:
            if n.domain == NPU_DOMAIN:
                problems = check_node(n, values.chip, graph, values.precision_mode)
                if problems:
                    return StaysStandard("plugin-constraint", f"{n.op_type} on {values.chip}: {problems[0]}")
    return PluginRegion(kernel, nodes, inits)


def _context_graph(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], values: Values) -> onnx.GraphProto:
    """A graph holding the region's nodes and the shapes/dtypes known of their inputs: what check_node reads."""
    infos = []
    for n in nodes:
        for v in n.input:
            if v and v in values.elem_types:
                shape = values.shape(v)
                infos.append(helper.make_tensor_value_info(v, values.elem_types[v],
                                                           None if shape is None else [d if isinstance(d, int)
                                                                                       else None for d in shape]))
    return helper.make_graph(nodes, "region", [], [], initializer=inits, value_info=infos)


# ---- RmsNorm / AddRmsNorm -------------------------------------------------------------------------------------

def _epsilon_refusal(node: onnx.NodeProto, kernel: str) -> StaysStandard | None:
    eps = float(_attrs(node).get("epsilon", 1e-5))
    if np.float32(eps) != np.float32(RMS_NORM_PLUGIN_EPSILON):
        return StaysStandard("rmsnorm-epsilon", f"the model's epsilon is {eps:g}; the {kernel} plugin fixes it at "
                                                "1e-6 (it reads no attribute), so the kernel would compute another norm")
    return None


def _stash_refusal(node: onnx.NodeProto, values: Values) -> StaysStandard | None:
    stash = int(_attrs(node).get("stash_type", 1))
    if stash != TensorProto.FLOAT:
        return StaysStandard("rmsnorm-stash-type", f"statistics in element type {stash}; the kernel keeps them "
                                                   "in float32")
    return None


def map_rms_norm(node: onnx.NodeProto, values: Values, fresh: Namer) -> PluginRegion | StaysStandard:
    """npufuse.RMSNorm(X, gamma) -> NPURmsNorm(x, gamma) -> (y, rstd): last axis, epsilon 1e-6 only."""
    refusal = _epsilon_refusal(node, "RmsNorm") or _stash_refusal(node, values)
    if refusal:
        return refusal
    rstd = fresh(f"{node.name}/rstd")
    plugin = helper.make_node("NPURmsNorm", [node.input[0], node.input[1]], [node.output[0], rstd],
                              name=node.name, domain=NPU_DOMAIN)
    return _contract("RmsNorm", [plugin], [], values)


def map_add_rms_norm(node: onnx.NodeProto, values: Values, fresh: Namer) -> PluginRegion | StaysStandard:
    """npufuse.AddRMSNorm(A, B, gamma) -> (Y, S?) becomes NPUAddRmsNorm(x1, x2, gamma) -> (y, rstd, x)."""
    refusal = _epsilon_refusal(node, "AddRmsNorm") or _stash_refusal(node, values)
    if refusal:
        return refusal
    # The pattern fuses only operands proven to have one shape (else its near-miss is operand-broadcast or
    # residual-shape-unproven); a fixed dim that differs here would mean the proof is wrong: refuse, loudly.
    a, b = values.shape(node.input[0]), values.shape(node.input[1])
    if a is not None and b is not None and (len(a) != len(b) or any(
            isinstance(x, int) and isinstance(y, int) and x != y for x, y in zip(a, b))):
        return StaysStandard("add-operands-shape", f"AddRmsNorm adds two tensors of one shape; the operands are "
                                                   f"{a} and {b}")
    rstd = fresh(f"{node.name}/rstd")
    s = node.output[1] if len(node.output) > 1 and node.output[1] else fresh(f"{node.name}/x")
    plugin = helper.make_node("NPUAddRmsNorm", [node.input[0], node.input[1], node.input[2]],
                              [node.output[0], rstd, s], name=node.name, domain=NPU_DOMAIN)
    return _contract("AddRmsNorm", [plugin], [], values)


# ---- GroupNormSilu ---------------------------------------------------------------------------------------------

def map_group_norm_silu(node: onnx.NodeProto, values: Values, fresh: Namer) -> PluginRegion | StaysStandard:
    """npufuse.GroupNormSilu(X, scale, bias) -> NPUGroupNormSilu(x, gamma, beta) -> (y, mean, rstd): `group` and
    `eps` written explicitly (without `group` the plugin passes 0 groups); the SiLU is always applied."""
    a = _attrs(node)
    mean, rstd = fresh(f"{node.name}/mean"), fresh(f"{node.name}/rstd")
    plugin = helper.make_node("NPUGroupNormSilu", list(node.input[:3]), [node.output[0], mean, rstd],
                              name=node.name, domain=NPU_DOMAIN, group=int(a["num_groups"]),
                              eps=float(a.get("epsilon", 1e-5)))
    return _contract("GroupNormSilu", [plugin], [], values)


def map_group_norm(node: onnx.NodeProto, values: Values, fresh: Namer) -> StaysStandard:
    """npufuse.GroupNorm without SiLU: the GroupNormSilu plugin never sets activate_silu (the kernel's default
    applies it), and no other GroupNorm kernel has an ONNX plugin."""
    return StaysStandard("groupnorm-no-silu", "the NPUGroupNormSilu plugin always applies SiLU (it never writes "
                                              "activate_silu); a GroupNorm without it stays standard ops")


# ---- MoeGatingTopKSoftmax ----------------------------------------------------------------------------------

def map_moe_gating(node: onnx.NodeProto, values: Values, fresh: Namer) -> PluginRegion | StaysStandard:
    """npufuse.MoeGatingTopKSoftmax(X) -> (Y, Indices) becomes NPUMoeGatingTopKSoftmax(x) -> (y, expert_idx,
    row_idx) with `k` written (INT: the plugin fails without it), a Cast of expert_idx (int32) to the model's int64
    indices, row_idx unused. The kernel has no renormalisation (MoeGatingTopKSoftmaxV2, which has, has no ONNX
    plugin): with renormalize=1 the division by the sum follows the plugin node as ReduceSum + Div."""
    a = _attrs(node)
    # topk_first=1 (softmax over the k largest logits) is the top-k probabilities over their sum: renormalised
    k, renorm = int(a["k"]), bool(int(a.get("renormalize", 0))) or bool(int(a.get("topk_first", 0)))
    x, y = node.input[0], node.output[0]
    shape = values.shape(x)
    if shape is None or len(shape) not in (2, 3):
        rank = "of unknown rank" if shape is None else f"{len(shape)}-D"
        return StaysStandard("moe-gating-rank", f"the MoeGatingTopKSoftmax kernel takes 2-D or 3-D router logits; "
                                                f"this region's are {rank}")
    top = fresh(f"{node.name}/topk") if renorm else y
    idx32, row = fresh(f"{node.name}/expert_idx"), fresh(f"{node.name}/row_idx")
    plugin = helper.make_node("NPUMoeGatingTopKSoftmax", [x], [top, idx32, row], name=node.name, domain=NPU_DOMAIN,
                              k=k)
    indices = node.output[1] if len(node.output) > 1 and node.output[1] else fresh(f"{node.name}/indices")
    after = [helper.make_node("Cast", [idx32], [indices], name=fresh(f"{node.name}/cast"), to=TensorProto.INT64)]
    inits: list[onnx.TensorProto] = []
    if renorm:
        total = fresh(f"{node.name}/sum")
        if values.opset >= 13:
            axes = fresh(f"{node.name}/axes")
            inits.append(_const(axes, np.array([-1], np.int64)))
            after.append(helper.make_node("ReduceSum", [top, axes], [total], name=fresh(f"{node.name}/reducesum"),
                                          keepdims=1))
        else:
            after.append(helper.make_node("ReduceSum", [top], [total], name=fresh(f"{node.name}/reducesum"),
                                          axes=[-1], keepdims=1))
        after.append(helper.make_node("Div", [top, total], [y], name=fresh(f"{node.name}/div")))
    return _contract("MoeGatingTopKSoftmax", [plugin, *after], inits, values)


# ---- rotary ------------------------------------------------------------------------------------------------

def _rotary_refusal(node: onnx.NodeProto, values: Values, x: str) -> StaysStandard | None:
    a = _attrs(node)
    shape = values.shape(x)
    width = shape[-1] if shape else None
    r = int(a.get("rotary_dim", 0))
    if r and r != width:
        return StaysStandard("rotary-partial", f"rotary_dim {r} of a head dim {width}: RotaryMul rotates the whole "
                                               "last axis")
    if int(a.get("interleaved", 0)):
        return StaysStandard("rotary-interleaved", "interleaved rotation (rotate_every_two): RotaryMul rotates "
                                                   "halves")
    if shape is None or len(shape) != 4:
        return StaysStandard("rotary-rank", f"x is {shape}: RotaryMul takes a 4-D x")
    return None


def _full_width(cs: str, values: Values, x: str) -> bool:
    """cos/sin carry the whole last axis (RotaryMul multiplies x by them elementwise)."""
    c, s = values.shape(cs), values.shape(x)
    return bool(c) and bool(s) and c[-1] == s[-1] and len(c) == 4


def map_rotary(node: onnx.NodeProto, values: Values, fresh: Namer) -> PluginRegion | StaysStandard:
    """npufuse.RotaryEmbedding(X, cos, sin), half rotation of the whole 4-D last axis -> NPURotaryMul."""
    refusal = _rotary_refusal(node, values, node.input[0])
    if refusal:
        return refusal
    if not (_full_width(node.input[1], values, node.input[0]) and _full_width(node.input[2], values, node.input[0])):
        return StaysStandard("rotary-table-shape", "cos/sin are not 4-D tables over the whole head dim")
    plugin = helper.make_node("NPURotaryMul", list(node.input[:3]), [node.output[0]], name=node.name,
                              domain=NPU_DOMAIN)
    return _contract("RotaryMul", [plugin], [], values)


def map_rotary_pair(node: onnx.NodeProto, values: Values, fresh: Namer) -> PluginRegion | StaysStandard:
    """npufuse.RotaryEmbeddingPair(q, k, cos, sin) -> two NPURotaryMul nodes (ApplyRotaryPosEmb has no plugin)."""
    q, k, cos, sin = node.input[:4]
    for x in (q, k):
        refusal = _rotary_refusal(node, values, x)
        if refusal:
            return refusal
        if not (_full_width(cos, values, x) and _full_width(sin, values, x)):
            return StaysStandard("rotary-table-shape", "cos/sin are not 4-D tables over the whole head dim")
    nodes = [helper.make_node("NPURotaryMul", [x, cos, sin], [y], name=f"{node.name}/{role}", domain=NPU_DOMAIN)
             for x, y, role in ((q, node.output[0], "q"), (k, node.output[1], "k"))]
    return _contract("RotaryMul", nodes, [], values)


# ---- attention ---------------------------------------------------------------------------------------------

_SEQ_AXIS = {"BNSD": 2, "BSND": 1, "BSH": 1}


def _const(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name)


def _empty(name: str, elem_type: int) -> onnx.TensorProto:
    """A 0-element tensor: how a PartitionedCall plugin is told an optional input is absent (an empty name fails
    there, see the plugin contract)."""
    return helper.make_tensor(name, elem_type, [0], [])


def map_attention(node: onnx.NodeProto, values: Values, fresh: Namer) -> PluginRegion | StaysStandard:
    """npufuse.FusedAttention -> NPUPromptFlashAttention (PromptFlashAttention), where the plugin can say what the
    model computes: one layout for q, k, v and the output (BNSD, BSND or BSH), known heads, GQA as repeat_interleave,
    a causal triangle or a boolean mask (made 1 = masked out, as the kernel reads it) of a shape the kernel
    takes, an additive bias as pse_shift of the full [B, N, Sq, Sk] shape (not on 310P). The token band is left
    open (pre_tokens = next_tokens = 2147483647; sparse_mode 0) and every attribute written."""
    a = {k: _text(v) if isinstance(v, bytes) else v for k, v in _attrs(node).items()}
    layout = a.get("q_layout", "BNSD")
    out_layout = a.get("out_layout", "BNSD")
    q, k, v = node.input[0], node.input[1], node.input[2]
    bias = node.input[3] if len(node.input) > 3 and node.input[3] else None
    bool_mask = node.input[4] if len(node.input) > 4 and node.input[4] else None
    qs, ks = values.shape(q), values.shape(k)
    heads = int(a.get("num_heads", 0))
    head_axis = {"BNSD": 1, "BSND": 2}.get(layout)
    if not heads and head_axis is not None and qs and isinstance(qs[head_axis], int):
        heads = int(qs[head_axis])
    if not heads:
        return StaysStandard("attention-heads-unknown", "the number of query heads is not known statically: "
                                                        "PromptFlashAttention needs num_heads")
    kv_heads = int(a.get("kv_num_heads", 0)) or heads
    if len(node.input) > 5 and node.input[5]:
        return StaysStandard("attention-sinks", "learned sinks: PromptFlashAttention has no sink input and "
                                                "FusedInferAttentionScore, which has, has no ONNX plugin")
    if float(a.get("softcap", 0.0) or 0.0) > 0:
        return StaysStandard("attention-softcap", f"logit soft-capping (softcap {float(a['softcap']):g}): "
                                                  "PromptFlashAttention has no softcap; tanh(scores / cap) * cap "
                                                  "stays in standard ops")
    if kv_heads != heads and a.get("kv_repeat", "interleave") != "interleave":
        return StaysStandard("attention-kv-repeat", "kv heads tiled (h reads h % G): the kernel groups query heads "
                                                    "over kv heads as repeat_interleave")
    elem = values.elem_types.get(q, TensorProto.FLOAT)
    for opt, what in ((int(a.get("softmax_dtype", 0)), "softmax_dtype"), (int(a.get("out_dtype", 0)), "out_dtype")):
        if opt and opt not in (elem, TensorProto.FLOAT):
            return StaysStandard("attention-precision", f"{what} {opt}: the kernel accumulates in float32")
    steps = [s for s in str(a.get("mask_order", "")).split(",") if s]
    helpers: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    # k and v in q's layout (the kernel takes one input_layout): the model's own head split, moved before it
    for role in ("k", "v"):
        src = a.get(f"{role}_layout", "BNSD")
        if src != layout:
            moved, value = _relayout(k if role == "k" else v, src, layout, kv_heads, f"{node.name}/{role}", None,
                                     fresh, inits)
            helpers.extend(moved)
            k, v = (value, v) if role == "k" else (k, value)
            ks = ks if role != "k" else None
    mask_name = pse_name = None
    seq_axis = _SEQ_AXIS[layout]
    if "where" in steps:
        sq = qs[seq_axis] if qs else None
        sk = ks[seq_axis] if ks else None
        if int(a.get("causal", 0)) and sq == 1:
            pass        # one query row, aligned to the last key: it sees every key, no mask to write
        elif int(a.get("causal", 0)):
            if not (isinstance(sq, int) and isinstance(sk, int)):
                return StaysStandard("attention-causal-dynamic", "a causal triangle over symbolic sequence lengths: "
                                                                 "the mask is written only for static ones")
            keep = np.arange(sk)[None, :] <= (np.arange(sq)[:, None] + (sk - sq))
            mask_name = fresh(f"{node.name}/causal_mask")
            inits.append(_const(mask_name, ~keep))          # 1 = masked out
        else:
            ms = values.shape(bool_mask)
            if ms is None or len(ms) not in (2, 3, 4) or (len(ms) == 4 and ms[1] != 1):
                return StaysStandard("attention-mask-shape", f"a boolean mask of shape {ms}: the kernel takes "
                                                             "(Sq, Sk), (B|1, Sq, Sk) or (B|1, 1, Sq, Sk)")
            if ms[-2] != sq or ms[-1] != sk or not isinstance(sq, int):
                return StaysStandard("attention-mask-shape", f"a boolean mask of shape {ms} against Sq={sq}, "
                                                             f"Sk={sk}: the kernel does not broadcast a mask")
            mask_name = bool_mask
            if values.elem_types.get(bool_mask, TensorProto.BOOL) != TensorProto.BOOL:
                cast = fresh(f"{node.name}/mask_bool")
                helpers.append(helper.make_node("Cast", [mask_name], [cast], to=TensorProto.BOOL,
                                                name=fresh(f"{node.name}/cast_mask")))
                mask_name = cast
            if a.get("bool_mask_mode", "keep") == "keep":   # the model keeps where 1; the kernel drops where 1
                inv = fresh(f"{node.name}/mask_drop")
                helpers.append(helper.make_node("Not", [mask_name], [inv], name=fresh(f"{node.name}/not_mask")))
                mask_name = inv
    if "add" in steps:
        bs = values.shape(bias)
        if bs is not None and len(bs) > 4:
            return StaysStandard("attention-bias-shape", f"an additive term of rank {len(bs)}: pse_shift is "
                                                         "(B, N, Sq, Sk)")
        if values.elem_types.get(bias) != elem:
            return StaysStandard("attention-bias-dtype", "the additive term's type differs from q's")
        if steps.index("add") > 0 and "where" in steps:
            return StaysStandard("attention-mask-order", "a mask applied before the additive term")
        expand, pse_name = _pse_of(bias, q, k, layout, heads, node.name, fresh, inits)
        helpers.extend(expand)
    sq = qs[seq_axis] if qs else None
    if sq == 1 and kv_heads == 1:
        return _incre_flash_attention(node, values, fresh, q, k, v, pse_name, mask_name, helpers, inits, heads,
                                      layout, out_layout, float(a.get("scale", 1.0)), elem)
    if pse_name is None and mask_name is not None:
        pse_name = fresh(f"{node.name}/no_pse")
        inits.append(_empty(pse_name, elem))
    ins = [q, k, v] + ([pse_name, mask_name or _absent_mask(fresh, node, inits)] if pse_name else [])
    out = node.output[0] if out_layout == layout else fresh(f"{node.name}/{layout}")
    plugin = helper.make_node(
        "NPUPromptFlashAttention", ins, [out], name=node.name, domain=NPU_DOMAIN,
        num_heads=heads, input_layout=layout, scale_value=float(a.get("scale", 1.0)), pre_tokens=INT_MAX,
        next_tokens=INT_MAX, num_key_value_heads=0 if kv_heads == heads else kv_heads, sparse_mode=0,
        inner_precise=1)
    after = _relayout(out, layout, out_layout, heads, f"{node.name}/out", node.output[0], fresh, inits)[0] \
        if out != node.output[0] else []
    return _contract("PromptFlashAttention", [*helpers, plugin, *after], inits, values)


def _incre_flash_attention(node: onnx.NodeProto, values: Values, fresh: Namer, q: str, k: str, v: str,
                           pse: str | None, mask: str | None, helpers: list[onnx.NodeProto],
                           inits: list[onnx.TensorProto], heads: int, layout: str, out_layout: str, scale: float,
                           elem: int) -> PluginRegion | StaysStandard:
    """A decode step (query length 1) over one kv head -> NPUIncreFlashAttention(q, k, v, pse_shift, atten_mask,
    actual_seq_lengths): the plugin never sets num_key_value_heads, so the kernel's default 1 is right only for MQA
    (more kv heads stay on PromptFlashAttention with S = 1). The three trailing inputs are always connected
    (0-element = absent: a PartitionedCall plugin); the mask keeps PromptFlashAttention's polarity (1 = masked)."""
    if pse is None:
        pse = fresh(f"{node.name}/no_pse")
        inits.append(_empty(pse, elem))
    if mask is None:
        mask = _absent_mask(fresh, node, inits)
    lengths = fresh(f"{node.name}/no_seq_lengths")
    inits.append(_empty(lengths, TensorProto.INT64))
    out = node.output[0] if out_layout == layout else fresh(f"{node.name}/{layout}")
    plugin = helper.make_node("NPUIncreFlashAttention", [q, k, v, pse, mask, lengths], [out], name=node.name,
                              domain=NPU_DOMAIN, num_heads=heads, input_layout=layout, scale_value=scale)
    after = _relayout(out, layout, out_layout, heads, f"{node.name}/out", node.output[0], fresh, inits)[0] \
        if out != node.output[0] else []
    return _contract("IncreFlashAttention", [*helpers, plugin, *after], inits, values)


def _relayout(x: str, src: str, dst: str, heads: int, name: str, out: str | None, fresh: Namer,
              inits: list[onnx.TensorProto]) -> tuple[list[onnx.NodeProto], str]:
    """Standard ops taking `x` from layout `src` to `dst` (BNSD [B,N,S,D], BSND [B,S,N,D], BSH [B,S,N*D]): the
    model's own head split or merge, moved to the kernel's side of the boundary. Returns the nodes and the value."""
    nodes: list[onnx.NodeProto] = []
    if src == dst:
        return nodes, x

    def step(op: str, inputs: list[str], last: bool, **kw: Any) -> str:
        y = out if last and out else fresh(f"{name}/{op.lower()}")
        nodes.append(helper.make_node(op, inputs, [y], name=fresh(f"{name}/{op.lower()}"), **kw))
        return y

    def shape_const(values: list[int]) -> str:
        c = fresh(f"{name}/shape")
        inits.append(_const(c, np.array(values, np.int64)))
        return c

    if src == "BSH":   # split the heads: [B,S,N*D] -> [B,S,N,D] (-> [B,N,S,D])
        y = step("Reshape", [x, shape_const([0, 0, heads, -1])], dst == "BSND")
        if dst == "BNSD":
            y = step("Transpose", [y], True, perm=[0, 2, 1, 3])
        return nodes, y
    if src == "BNSD":  # [B,N,S,D] -> [B,S,N,D] (-> [B,S,N*D])
        y = step("Transpose", [x], dst == "BSND", perm=[0, 2, 1, 3])
        if dst == "BSH":
            y = step("Reshape", [y, shape_const([0, 0, -1])], True)
        return nodes, y
    # BSND -> BNSD or BSH
    if dst == "BNSD":
        return nodes, step("Transpose", [x], True, perm=[0, 2, 1, 3])
    return nodes, step("Reshape", [x, shape_const([0, 0, -1])], True)


def _pse_of(bias: str, q: str, k: str, layout: str, heads: int, name: str, fresh: Namer,
            inits: list[onnx.TensorProto]) -> tuple[list[onnx.NodeProto], str]:
    """The additive term expanded to pse_shift's [B, N, Sq, Sk] (the kernel does not broadcast it), the target
    shape read from q and k at run time."""
    seq = _SEQ_AXIS[layout]
    nodes: list[onnx.NodeProto] = []

    def c(values: list[int]) -> str:
        n = fresh(f"{name}/pse_const")
        inits.append(_const(n, np.array(values, np.int64)))
        return n

    def dim(x: str, axis: int) -> str:
        shape, d = fresh(f"{name}/pse_shape"), fresh(f"{name}/pse_dim")
        nodes.append(helper.make_node("Shape", [x], [shape], name=fresh(f"{name}/shape")))
        nodes.append(helper.make_node("Gather", [shape, c([axis])], [d], axis=0, name=fresh(f"{name}/gather")))
        return d

    target = fresh(f"{name}/pse_target")
    nodes.append(helper.make_node("Concat", [dim(q, 0), c([heads]), dim(q, seq), dim(k, seq)], [target], axis=0,
                                  name=fresh(f"{name}/concat")))
    pse = fresh(f"{name}/pse_shift")
    nodes.append(helper.make_node("Expand", [bias, target], [pse], name=fresh(f"{name}/expand")))
    return nodes, pse


def _absent_mask(fresh: Namer, node: onnx.NodeProto, inits: list[onnx.TensorProto]) -> str:
    name = fresh(f"{node.name}/no_mask")
    inits.append(_empty(name, TensorProto.BOOL))
    return name


MAPPERS: dict[str, Mapper] = {
    "RMSNorm": map_rms_norm,
    "AddRMSNorm": map_add_rms_norm,
    "GroupNormSilu": map_group_norm_silu,
    "GroupNorm": map_group_norm,
    "MoeGatingTopKSoftmax": map_moe_gating,
    "RotaryEmbedding": map_rotary,
    "RotaryEmbeddingPair": map_rotary_pair,
    "FusedAttention": map_attention,
}


def map_user_kernel(node: onnx.NodeProto, values: Values, user_kernels: Sequence[UserKernel]
                    ) -> PluginRegion | None:
    """The node a user kernel's ATC plugin registers (`--kernels`, its `[kernel.atc]`), where one runs this fused
    node on the chip: the fused node's inputs and outputs in order, the declared attributes carried over."""
    x = node.input[0] if node.input else ""
    elem = values.elem_types.get(x)
    dtype = helper.tensor_dtype_to_np_dtype(elem).name if elem else None
    attrs = attributes(node)
    for k in user_kernels:
        if k.atc is None or k.problem(node.op_type, attrs, values.chip, dtype, values.shape(x)) is not None:
            continue
        carried = {name: attrs[src] for name, src in k.atc.attributes if src in attrs}
        plugin = helper.make_node(k.atc.op_type, list(node.input), list(node.output), name=node.name,
                                  domain=k.atc.domain, **carried)
        return PluginRegion(k.name, [plugin])
    return None


def map_region(node: onnx.NodeProto, values: Values, fresh: Namer,
               user_kernels: Sequence[UserKernel] = ()) -> PluginRegion | StaysStandard:
    """The plugin form of one fused node (a user kernel's node first, where one is declared for it), or why it
    stays standard ops."""
    if node.domain != FUSED_DOMAIN:
        return StaysStandard("not-fused", "a standard op")
    if user_kernels:
        got = map_user_kernel(node, values, user_kernels)
        if got is not None:
            return got
    mapper = MAPPERS.get(node.op_type)
    if mapper is None:
        return StaysStandard("no-onnx-plugin", f"no CANN kernel with an ONNX plugin computes {node.op_type}: "
                                               "written as standard ops for ATC's own fusion passes")
    return mapper(node, values, fresh)
