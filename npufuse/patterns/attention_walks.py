"""Graph walks the attention matcher leans on: is a Softmax attention at all, where its score and probability
MatMuls are, KV-cache concats, static sequence lengths, the NaN guard after Softmax."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
import numpy as np
import onnx
from onnx import TensorProto
from npufuse.ir.graph import Graph, attributes
from npufuse.ir.matching import is_last_axis, std_op
from npufuse.algebra.layout import (Dims, uniform_constant)
from npufuse.patterns.attention_op import (_FLOAT_DEFAULTS, attention_body, attention_reference, causal_keep)  # noqa: F401


_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})


@dataclass(frozen=True)
class _Stage:
    """One step outward from the attention core on a Q/K/V/output side: what the fused op would read
    (or write) if the walk stopped here, and the nodes this step absorbs."""

    value: str
    layout: str
    nodes: tuple[str, ...] = ()
    scale: float = 1.0                      # a scalar factor this step folds into `scale`
    heads: int | None = None                # heads of `value`, known from a proven head split
    rep: tuple[int, str] | None = None      # (n_rep, kv_repeat) of a GQA repeat absorbed here
    perm: tuple[int, ...] | None = None     # K, or V of V'·Pᵀ: the op reads Transpose(value, perm) ([B,H,S,D]), made outside


def _static_seq(g: Graph, dims: Dims, sym: str, stages: Sequence[_Stage]) -> int | None:
    """The sequence length `sym` (Sq or Sk) where it is a fixed int: from the attention's own dims, else from the
    sequence axis of any stage on that side (every stage of a side keeps it; shape inference may have lost it on
    some, say after a rotary embedding, and kept it on others, say after the head merge)."""
    n = dims.int_value(dims.sym(sym))
    if n is not None:
        return n
    for st in stages:
        shape = g.shape(st.value)
        axis = 2 if st.layout == "BNSD" else 1
        if st.perm:
            axis = st.perm[axis]
        if shape is not None and len(shape) > axis and isinstance(shape[axis], int):
            return shape[axis]
    return None


def _kv_cache_concat(g: Graph, value: str, layout: str) -> bool:
    """True if K or V `value` (as the fused op reads it, in `layout`) is a KV cache: a Concat of the past
    keys/values and the new ones along the sequence axis (its output, the present cache, often a graph output).
    The Concat stays outside the fused op: the op reads the whole cache."""
    p = g.producer_of(value)
    while p is not None and p.op_type == "Identity":
        p = g.producer_of(p.input[0])
    rank = {"BNSD": 4, "BSND": 4, "BSH": 3}[layout]
    if p is None or p.op_type != "Concat" or len(p.input) < 2 or g.rank(p.output[0]) not in (None, rank):
        return False
    axis = attributes(p).get("axis", 0)
    return (axis + rank if axis < 0 else axis) == (2 if layout == "BNSD" else 1)


def _leads_to_matmul(g: Graph, value: str, depth: int) -> bool:
    """True if `value` comes from a MatMul through score-like steps (scale, mask, cast, soft-cap) within `depth`
    nodes."""
    if depth <= 0 or g.is_constant(value):
        return False
    p = g.producer_of(value)
    if p is None:
        return False
    if p.op_type == "MatMul":
        return True
    if p.op_type in ("Cast", "Identity", "Tanh"):   # Tanh: logit soft-capping
        return _leads_to_matmul(g, p.input[0], depth - 1)
    if p.op_type in ("Mul", "Div", "Add"):
        return any(_leads_to_matmul(g, x, depth - 1) for x in p.input[:2])
    if p.op_type == "Where" and len(p.input) == 3:
        return any(_leads_to_matmul(g, x, depth - 1) for x in p.input[1:])
    return False


def _pick_scores_operand(g: Graph, operands: Sequence[str]) -> str | None:
    """Of a mask step's two operands, the one carrying the scores (the other is the mask or fill)."""
    leads = [x for x in operands if _leads_to_matmul(g, x, 8)]
    if len(leads) == 2:  # both look like scores: take the one only this chain reads
        single = [x for x in leads if len(g.consumers_of(x)) == 1 and x not in g.graph_outputs]
        leads = single or leads
    return leads[0] if leads else None


def _is_passthrough(g: Graph, node: onnx.NodeProto) -> bool:
    """Cast between float types, Identity, or an inference-mode Dropout whose mask nobody reads."""
    if node.op_type == "Identity":
        return True
    if node.op_type == "Cast":
        return attributes(node).get("to") in _FLOAT_TYPES
    if node.op_type == "Dropout":
        if len(node.output) > 1 and node.output[1] and g.consumers_of(node.output[1]):
            return False
        if len(node.input) > 2 and node.input[2]:
            mode = g.constant(node.input[2]) if g.is_constant(node.input[2]) else None
            return mode is not None and not bool(np.asarray(mode).reshape(-1)[0])
        return not attributes(node).get("training_mode", 0)
    return False


def _nan_guard(g: Graph, p: str, cons: Sequence[onnx.NodeProto]) -> tuple[onnx.NodeProto, onnx.NodeProto] | None:
    """The SDPA export's guard Where(IsNaN(p), 0, p) on the probabilities `p`, or None."""
    isnan = next((c for c in cons if c.op_type == "IsNaN"), None)
    if isnan is None:
        return None
    where = g.single_consumer(isnan.output[0])
    if where is None or where.op_type != "Where" or where.input[0] != isnan.output[0] or where.input[2] != p or \
            where not in cons:
        return None
    fill = uniform_constant(g, where.input[1])
    return (isnan, where) if fill == 0.0 else None


_LAYOUT_OPS = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Expand", "Flatten"})


# steps a score chain may take between Q·Kᵀ and the Softmax (fusible or not): elementwise and layout ops
_SCORE_STEPS = _LAYOUT_OPS | frozenset({"Cast", "Identity", "Mul", "Div", "Add", "Sub", "Where", "Tanh", "Neg",
                                        "Clip", "Max", "Min", "Slice", "Concat", "Relu", "Sigmoid"})


_PROBS_STEPS = _LAYOUT_OPS | frozenset({"Cast", "Identity", "Dropout", "Where", "Mul", "Div"})


_LIKE_DEPTH = 10


def _activation_matmul(g: Graph, value: str, depth: int = _LIKE_DEPTH) -> onnx.NodeProto | None:
    """A MatMul of two activations (neither a constant) that reaches `value` through elementwise and layout
    steps within `depth` nodes (the scores' Q·Kᵀ, in whatever form); None if there is none."""
    seen: set[str] = set()
    frontier = [value]
    for _ in range(depth):
        nxt: list[str] = []
        for v in frontier:
            if v in seen or not v or g.is_constant(v):
                continue
            seen.add(v)
            p = g.producer_of(v)
            if p is None:
                continue
            if p.op_type == "MatMul":
                if not any(g.is_constant(x) for x in p.input[:2]):
                    return p
                continue   # a projection by a weight: the Softmax of x·W (a classifier, a router)
            if p.op_type in _SCORE_STEPS:
                nxt += list(p.input[1:] if p.op_type == "Where" else
                            p.input[:1] if p.op_type in _LAYOUT_OPS or p.op_type == "Slice" else p.input)
        frontier = nxt
        if not frontier:
            break
    return None


def _probs_matmul(g: Graph, value: str, depth: int = _LIKE_DEPTH) -> onnx.NodeProto | None:
    """A MatMul that multiplies the probabilities `value` (through pass-through and layout steps within `depth`
    nodes) by an activation (P·V or V·P, V not a constant); None if there is none."""
    seen: set[str] = set()
    frontier = [value]
    for _ in range(depth):
        nxt: list[str] = []
        for v in frontier:
            if v in seen:
                continue
            seen.add(v)
            for c in g.consumers_of(v):
                if c.op_type == "MatMul":
                    other = [x for x in c.input[:2] if x != v]
                    if other and not g.is_constant(other[0]):
                        return c
                elif c.op_type in _PROBS_STEPS or c.op_type == "IsNaN":
                    nxt += [o for o in c.output[:1] if o]
        frontier = nxt
        if not frontier:
            break
    return None


def _attention_like(g: Graph, softmax: onnx.NodeProto) -> bool:
    """The rule that tells attention from other Softmaxes: a Softmax is attention-like, and so ends in a
    FusedAttention or a near-miss naming where and why its chain broke, when its input is computed by a MatMul
    of two activations (Q·Kᵀ) through elementwise and layout steps (`_activation_matmul`), or its output is
    multiplied by an activation (P·V) through pass-through and layout steps (`_probs_matmul`), each within 10
    nodes. A Softmax with neither, such as a classifier's or a router's Softmax(x·W) that no MatMul of activations
    reads, is provably not attention: its refusal says only that (`not-attention`)."""
    return _activation_matmul(g, softmax.input[0]) is not None or _probs_matmul(g, softmax.output[0]) is not None


def _exact_factor(c: float) -> bool:
    """True if scaling by c is exact in binary floating point (a power of two, 1 included), barring overflow."""
    if c == 0 or not np.isfinite(c):
        return False
    m, _ = np.frexp(abs(c))
    return m == 0.5


# ---- learned attention sinks (GPT-OSS) ------------------------------------------------------------------------

@dataclass(frozen=True)
class SinkForm:
    """Softmax([scores, sinks] - max) over the last axis, the sink column sliced off before ·V: the scores before the
    column is joined, the sink logits (broadcastable to [B, H, Sq, 1]) and the nodes that join them."""

    scores: str
    sinks: str
    nodes: tuple[str, ...]


def sink_form(g: Graph, softmax: onnx.NodeProto) -> SinkForm | None:
    """The sink form of `softmax`'s input, None where it is not one: Concat(scores, Expand(sinks), axis -1),
    optionally minus its ReduceMax over the last axis (GPT-OSS's stabilisation, which the Softmax does itself),
    with sinks [1 or B, H, 1, 1] (or fewer leading axes) and one column joined."""
    v, nodes = softmax.input[0], []
    p = g.producer_of(v)
    if std_op(p, "Sub"):
        m = g.producer_of(p.input[1])
        red = attributes(m) if std_op(m, "ReduceMax") else None
        axes = red.get("axes") if red is not None and "axes" in red else (
            g.constant(m.input[1]) if red is not None and len(m.input) > 1 and m.input[1] else None)
        rank = g.rank(p.input[0])
        if red is None or m.input[0] != p.input[0] or int(red.get("keepdims", 1)) != 1 or axes is None or \
                [int(a) % rank if rank else int(a) for a in np.asarray(axes).reshape(-1)] not in ([-1], [rank - 1]
                                                                                                   if rank else []):
            return None
        nodes += [p.name, m.name]
        p = g.producer_of(p.input[0])
    if not std_op(p, "Concat") or len(p.input) != 2 or not is_last_axis(g, p, p.output[0]):
        return None
    scores, column = p.input
    e = g.producer_of(column)
    col_shape = g.shape_or_constant(column)
    if not col_shape or col_shape[-1] != 1:
        return None
    if g.is_constant(column):   # the expanded column itself, folded to a constant [B, H, Sq, 1] at static sizes
        return SinkForm(scores, column, tuple(nodes + [p.name]))
    sink_shape = g.shape_or_constant(e.input[0]) if std_op(e, "Expand") else None
    if sink_shape is None or len(sink_shape) > 4 or (sink_shape and sink_shape[-1] != 1) or \
            (len(sink_shape) == 4 and sink_shape[2] != 1):
        return None
    return SinkForm(scores, e.input[0], tuple(nodes + [p.name, e.name]))


def drops_last_column(g: Graph, sl: onnx.NodeProto) -> bool:
    """A Slice keeping columns [0, -1) (or [0, width - 1)) of the last axis, step 1."""
    from npufuse.algebra.shapes import slice_bounds

    if not std_op(sl, "Slice"):
        return False
    try:
        starts, ends, axes, steps = slice_bounds(g, sl, [])
    except Exception:   # bounds not constant
        return False
    shape = g.shape(sl.input[0])
    rank = len(shape) if shape else g.rank(sl.input[0])
    if rank is None or len(starts) != 1 or (steps is not None and int(steps[0]) != 1):
        return False
    axis = int(axes[0]) if axes is not None else 0
    width = shape[-1] if shape and isinstance(shape[-1], int) else None
    return axis % rank == rank - 1 and int(starts[0]) == 0 and (
        int(ends[0]) == -1 or (width is not None and int(ends[0]) == width - 1))
