"""FusedAttention, the fused op: its schema, NumPy reference kernel and ONNX function body (the pattern that emits it
is patterns.attention)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from npufuse import FUSED_DOMAIN
from npufuse.patterns.base import (
    FusedOpDef,
    float_attr_constant,
    make_body,
    node_with_refs,
    overload_with,
)


LAYOUTS = ("BNSD", "BSND", "BSH")


MIN_OPSET = 13   # Softmax before opset 13 coerces its input to 2-D; the body needs Unsqueeze with axes input


ATTENTION_ATTRS = ("scale", "causal", "num_heads", "kv_num_heads", "q_layout", "k_layout", "v_layout",
                   "out_layout", "kv_repeat", "mask_order", "bool_mask_mode", "mask_fill", "nan_guard",
                   "softmax_dtype", "out_dtype")
# declared by a body only where the node sets it: the bodies of attention without soft-capping stay as they were
SOFTCAP_ATTR = "softcap"


_FLOAT_DEFAULTS = {"scale": 1.0, "mask_fill": -np.inf, "softcap": 0.0}   # as the reference kernel reads them


ATTENTION_DOC = """\
FusedAttention(Q, K, V, bias?, bool_mask?) -> Y

    Qh = heads(Q, q_layout, num_heads)                  [B, H, Sq, D]
    Kh = repeat(heads(K, k_layout, kv_num_heads))       [B, H, Sk, D]
    Vh = repeat(heads(V, v_layout, kv_num_heads))       [B, H, Sk, Dv]
    S  = (Qh · Khᵀ) * scale                              computed in softmax_dtype
    for step in mask_order:   "add":   S = S + bias                    (float, broadcastable to [B,H,Sq,Sk])
                              "where": S = Where(keep, S, mask_fill)
         keep = bool_mask (bool_mask_mode "keep") or not bool_mask ("drop"); with causal=1 the where-step
         uses the causal triangle instead: key j is visible to query i iff j <= i + Sk - Sq
    P  = Softmax(S, axis=-1)                              a row whose scores are all -inf gives NaN, a row
                                                          masked by a finite fill gives the uniform average
    P  = Where(IsNaN(P), 0, P)   if nan_guard             fully masked rows -> 0 (the exporters' SDPA guard)
    Y  = merge(P · Vh, out_layout)

Layouts (q_layout, k_layout, v_layout, out_layout):
    BNSD  [B, N, S, D]    the tensor as the attention core sees it (head split/merge left outside)
    BSND  [B, S, N, D]    the op applies Transpose(0,2,1,3) itself
    BSH   [B, S, N*D]     the op splits/merges the heads itself (num_heads / kv_num_heads must be known)
num_heads: H (0: unknown, taken from Q at run time; only with q_layout BNSD/BSND).
kv_num_heads: heads of K and V as given; when smaller than H the op repeats them: kv_repeat "interleave"
    (q-head h reads kv-head h // (H/G), llama's repeat_kv) or "tile" (h reads h % G). K with 1 head
    broadcasts (MQA).
bias: every additive term on the scores in one tensor: an additive (float) mask, a relative position bias
    (T5, Swin, BEiT), ALiBi (BLOOM), DeBERTa's c2p/p2c terms, or their sum (where the model adds several terms
    one after the other, the rewrite sums them outside the op, in the model's order: Ascend's kernels take one
    pse_shift). Added to the scaled scores; a term the model added before a power-of-two scale is scaled
    outside the op too.
mask_order: the mask steps in the order the model applies them: "", "add", "where", "add,where",
    "where,add". mask_fill: the value a where-step writes. softmax_dtype: ONNX element type the scores and
    Softmax are computed in (0: the inputs' type).
out_dtype: ONNX element type of P · V and Y (0: the inputs' type). Set to softmax_dtype where the model
    multiplies the probabilities in it by V cast up (TorchScript's SDPA export of an fp16 model): V is read in
    the inputs' type and cast up inside, and the probabilities are not cast down.
"""


# the doc of a body with soft-capping (kept out of the others' doc, so that their bodies stay byte for byte the same)
SOFTCAP_DOC = """\
softcap: logit soft-capping (Gemma 2), 0 or absent: none. With softcap > 0, right after the scale and before every
    mask step:  S = softcap * tanh(S / softcap). A model computing a * tanh(b * Q·Kᵀ) has softcap |a| and
    scale a * b.
"""


def _to_bnsd(x: np.ndarray, layout: str, heads: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(0, 2, 1, 3)
    if layout == "BSH":
        if heads <= 0:
            raise ValueError("FusedAttention: a BSH input needs num_heads / kv_num_heads")
        b, s, hd = x.shape
        return x.reshape(b, s, heads, hd // heads).transpose(0, 2, 1, 3)
    raise ValueError(f"FusedAttention: unknown layout {layout!r}")


def _from_bnsd(y: np.ndarray, layout: str) -> np.ndarray:
    if layout == "BNSD":
        return y
    y = y.transpose(0, 2, 1, 3)
    if layout == "BSND":
        return y
    if layout == "BSH":
        return y.reshape(y.shape[0], y.shape[1], -1)
    raise ValueError(f"FusedAttention: unknown layout {layout!r}")


def _repeat_kv(x: np.ndarray, heads: int, mode: str) -> np.ndarray:
    g = x.shape[1]
    if g == heads or g == 1:
        return x  # equal, or a single head that broadcasts (MQA)
    if heads % g:
        raise ValueError(f"FusedAttention: {heads} query heads do not group over {g} kv heads")
    n_rep = heads // g
    return np.repeat(x, n_rep, axis=1) if mode == "interleave" else np.tile(x, (1, n_rep, 1, 1))


def causal_keep(sq: int, sk: int) -> np.ndarray:
    """[Sq, Sk] bool: key j is visible to query i iff j <= i + Sk - Sq (aligned to the last key)."""
    return np.arange(sk)[None, :] <= (np.arange(sq)[:, None] + (sk - sq))


SINKS_DOC = """
sinks (input 6, with attribute sinks=1): learned sink logits (GPT-OSS), broadcastable to [B, H, Sq, 1]: a column
    joined to the masked scores, normalised with them by the Softmax and dropped before ·V, so each row's
    probabilities sum to less than 1 by what the sink takes.
"""


def attention_reference(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """FusedAttention in float64, with the masks' exact semantics (see ATTENTION_DOC)."""
    q, k, v = inputs[0], inputs[1], inputs[2]
    bias = inputs[3] if len(inputs) > 3 else None
    bool_mask = inputs[4] if len(inputs) > 4 else None
    heads = int(attrs.get("num_heads", 0))
    kv_heads = int(attrs.get("kv_num_heads", 0)) or heads
    qh = _to_bnsd(q, attrs.get("q_layout", "BNSD"), heads)
    mode = attrs.get("kv_repeat", "interleave")
    kh = _repeat_kv(_to_bnsd(k, attrs.get("k_layout", "BNSD"), kv_heads), qh.shape[1], mode)
    vh = _repeat_kv(_to_bnsd(v, attrs.get("v_layout", "BNSD"), kv_heads), qh.shape[1], mode)
    s = np.matmul(qh, np.swapaxes(kh, -1, -2)) * float(attrs.get("scale", 1.0))
    cap = float(attrs.get("softcap", 0.0))
    if cap > 0:
        s = cap * np.tanh(s / cap)
    fill = float(attrs.get("mask_fill", -np.inf))
    for step in filter(None, str(attrs.get("mask_order", "")).split(",")):
        if step == "add":
            s = s + np.asarray(bias, dtype=np.float64)
        elif step == "where":
            if int(attrs.get("causal", 0)):
                keep = causal_keep(s.shape[-2], s.shape[-1])
            else:
                keep = np.asarray(bool_mask).astype(bool)
                if attrs.get("bool_mask_mode", "keep") == "drop":
                    keep = ~keep
            s = np.where(keep, s, fill)
        else:
            raise ValueError(f"FusedAttention: unknown mask step {step!r}")
    sinks = inputs[5] if len(inputs) > 5 else None
    if sinks is not None:   # one more logit column per row, normalised with the scores and dropped after
        col = np.broadcast_to(np.asarray(sinks, dtype=np.float64), s.shape[:-1] + (1,))
        s = np.concatenate([s, col], axis=-1)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))   # a row of -inf gives NaN, as onnx Softmax does
        p = e / e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        p = p[..., :-1]
    if int(attrs.get("nan_guard", 0)):
        p = np.where(np.isnan(p), 0.0, p)
    y = _from_bnsd(np.matmul(p, vh), attrs.get("out_layout", "BNSD"))
    out = int(attrs.get("out_dtype", 0))
    return [y.astype(helper.tensor_dtype_to_np_dtype(out) if out else np.asarray(v).dtype)]


class _BodyBuilder:
    """Nodes of a function body with fresh value names."""

    def __init__(self, attrs: dict[str, Any], opset: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.n = 0
        self.attrs, self.opset = attrs, opset
        self.tokens: list[str] = []          # what else the overload must name (a baked-in float attribute)

    def op(self, op_type: str, inputs: Sequence[str], refs: Sequence[tuple[str, int]] = (), **attrs: Any) -> str:
        self.n += 1
        out = f"{op_type.lower()}{self.n}"
        self.nodes.append(node_with_refs(op_type, list(inputs), [out], refs, **attrs))
        return out

    def const(self, arr: np.ndarray) -> str:
        return self.op("Constant", [], value=numpy_helper.from_array(np.asarray(arr), f"c{self.n + 1}"))

    def ints(self, *vals: int) -> str:
        return self.const(np.array(vals, dtype=np.int64))

    def float_ref(self, attr: str, elem_type: int) -> str:
        """A scalar of `elem_type` holding the calling node's float attribute `attr`."""
        self.n += 1
        v = f"{attr}{self.n}"
        node, token = float_attr_constant(v, attr, self.attrs, self.opset, _FLOAT_DEFAULTS[attr])
        self.nodes.append(node)
        if token not in self.tokens:
            self.tokens.append(token)
        return v if elem_type == TensorProto.FLOAT else self.op("Cast", [v], to=elem_type)


def _heads_in(b: _BodyBuilder, x: str, layout: str, heads: int) -> str:
    if layout == "BNSD":
        return x
    if layout == "BSH":
        x = b.op("Reshape", [x, b.ints(0, 0, heads, -1)])
    return b.op("Transpose", [x], perm=[0, 2, 1, 3])


def _repeat_in(b: _BodyBuilder, x: str, n_rep: int, mode: str) -> str:
    if n_rep <= 1:
        return x
    if mode == "tile":
        return b.op("Tile", [x, b.ints(1, n_rep, 1, 1)])
    target = b.op("Mul", [b.op("Shape", [x]), b.ints(1, n_rep, 1, 1)])
    x5 = b.op("Expand", [b.op("Unsqueeze", [x, b.ints(2)]), b.ints(1, 1, n_rep, 1, 1)])
    return b.op("Reshape", [x5, target])


def _body_specialisation(attrs: dict[str, Any], elem_type: int) -> str:
    compute = int(attrs.get("softmax_dtype", 0)) or elem_type
    parts = [f"q{attrs.get('q_layout', 'BNSD')}", f"k{attrs.get('k_layout', 'BNSD')}",
             f"v{attrs.get('v_layout', 'BNSD')}", f"o{attrs.get('out_layout', 'BNSD')}",
             f"h{int(attrs.get('num_heads', 0))}", f"g{int(attrs.get('kv_num_heads', 0))}",
             str(attrs.get("kv_repeat", "interleave")), "m" + str(attrs.get("mask_order", "")).replace(",", "+"),
             str(attrs.get("bool_mask_mode", "keep")), f"c{int(attrs.get('causal', 0))}",
             f"n{int(attrs.get('nan_guard', 0))}", f"t{elem_type}", f"s{compute}"]
    if int(attrs.get("out_dtype", 0)) not in (0, elem_type):
        parts.append(f"o{int(attrs['out_dtype'])}")
    if float(attrs.get("softcap", 0.0)) > 0:
        parts.append("softcap")
    if int(attrs.get("sinks", 0)):
        parts.append("sinks")
    return "_".join(parts)


def attention_body(attrs: dict[str, Any], opset: int, elem_type: int) -> onnx.FunctionProto:
    """The ONNX function body of FusedAttention, specialised on layouts, heads, masks and types."""
    if opset < MIN_OPSET:
        raise ValueError(f"FusedAttention needs opset >= {MIN_OPSET} (Softmax semantics), the model has {opset}")
    heads = int(attrs.get("num_heads", 0))
    kv_heads = int(attrs.get("kv_num_heads", 0)) or heads
    compute = int(attrs.get("softmax_dtype", 0)) or elem_type
    mode = str(attrs.get("kv_repeat", "interleave"))
    n_rep = heads // kv_heads if heads and kv_heads and heads != kv_heads else 1
    b = _BodyBuilder(attrs, opset)
    sinks = bool(int(attrs.get("sinks", 0)))
    q = _heads_in(b, "Q", attrs.get("q_layout", "BNSD"), heads)
    k = _repeat_in(b, _heads_in(b, "K", attrs.get("k_layout", "BNSD"), kv_heads), n_rep, mode)
    v = _repeat_in(b, _heads_in(b, "V", attrs.get("v_layout", "BNSD"), kv_heads), n_rep, mode)
    s = b.op("MatMul", [q, b.op("Transpose", [k], perm=[0, 1, 3, 2])])
    if compute != elem_type:
        s = b.op("Cast", [s], to=compute)
    s = b.op("Mul", [s, b.float_ref("scale", compute)])
    softcap = float(attrs.get("softcap", 0.0)) > 0
    if softcap:
        cap = b.float_ref("softcap", compute)
        s = b.op("Mul", [b.op("Tanh", [b.op("Div", [s, cap])]), cap])
    for step in filter(None, str(attrs.get("mask_order", "")).split(",")):
        if step == "add":
            m = "bias" if compute == elem_type else b.op("Cast", ["bias"], to=compute)
            s = b.op("Add", [s, m])
            continue
        fill = b.float_ref("mask_fill", compute)
        if int(attrs.get("causal", 0)):
            shape = b.op("Shape", [s])
            sq, sk = b.op("Gather", [shape, b.const(np.array(2, np.int64))]), \
                b.op("Gather", [shape, b.const(np.array(3, np.int64))])
            zero, one = b.const(np.array(0, np.int64)), b.const(np.array(1, np.int64))
            rows = b.op("Add", [b.op("Range", [zero, sq, one]), b.op("Sub", [sk, sq])])
            keep = b.op("LessOrEqual", [b.op("Range", [zero, sk, one]), b.op("Unsqueeze", [rows, b.ints(1)])])
            s = b.op("Where", [keep, s, fill])
        elif attrs.get("bool_mask_mode", "keep") == "drop":
            s = b.op("Where", ["bool_mask", fill, s])
        else:
            s = b.op("Where", ["bool_mask", s, fill])
    if sinks:   # the sink column: sinks broadcast to [B, H, Sq, 1], joined, normalised with the scores, dropped
        rows = b.op("Concat", [b.op("Slice", [b.op("Shape", [s]), b.ints(0), b.ints(3)]), b.ints(1)], axis=0)
        col = b.op("Expand", ["sinks" if compute == elem_type else b.op("Cast", ["sinks"], to=compute), rows])
        s = b.op("Concat", [s, col], axis=-1)
    p = b.op("Softmax", [s], axis=-1)
    if sinks:
        p = b.op("Slice", [p, b.ints(0), b.ints(-1), b.ints(-1)])
    if int(attrs.get("nan_guard", 0)):
        p = b.op("Where", [b.op("IsNaN", [p]), b.const(np.array(0, helper.tensor_dtype_to_np_dtype(compute))), p])
    out_type = int(attrs.get("out_dtype", 0)) or elem_type
    if compute != out_type:
        p = b.op("Cast", [p], to=out_type)
    if out_type != elem_type:
        v = b.op("Cast", [v], to=out_type)
    y = b.op("MatMul", [p, v])
    out_layout = attrs.get("out_layout", "BNSD")
    if out_layout != "BNSD":
        y = b.op("Transpose", [y], perm=[0, 2, 1, 3])
    if out_layout == "BSH":
        y = b.op("Reshape", [y, b.ints(0, 0, -1)])
    b.nodes.append(helper.make_node("Identity", [y], ["Y"]))
    return make_body(
        FUSED_DOMAIN, "FusedAttention", ["Q", "K", "V", "bias", "bool_mask"] + (["sinks"] if sinks else []), ["Y"],
        b.nodes, [helper.make_opsetid("", opset)],
        attributes=list(ATTENTION_ATTRS) + ([SOFTCAP_ATTR] if softcap else []) + (["sinks"] if sinks else []),
        overload=overload_with(_body_specialisation(attrs, elem_type), *b.tokens),
        doc_string=ATTENTION_DOC + (SOFTCAP_DOC if softcap else ""))


FUSED_ATTENTION = FusedOpDef(
    op_type="FusedAttention",
    doc=ATTENTION_DOC + SOFTCAP_DOC + SINKS_DOC,
    inputs=("Q", "K", "V", "bias?", "bool_mask?", "sinks?"),
    outputs=("Y",),
    attributes=ATTENTION_ATTRS + (SOFTCAP_ATTR, "sinks"),
    reference=attention_reference,
    body=attention_body,
)
