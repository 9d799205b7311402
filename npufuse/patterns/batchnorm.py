"""What the BatchNormalization folds share: the inference-mode checks, the per-channel affine a BN computes, and the
walk from a BN back to the MatMul whose output columns it normalises.

An inference-mode BatchNormalization is y = x * s + t per channel (axis 1), s = gamma / sqrt(var + eps),
t = beta - mean * s. It folds into the op that produced x where that op's weights own the channel: a Conv's output
channels (conv_bn_act), a Gemm's or MatMul's output columns (linear_bn), or into a Conv that reads it where the
Conv's padding does not see the shift (conv_bn_act's BN before a Conv).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from npufuse.ir.graph import Graph, attributes
from npufuse.ir.matching import last_axis_vector_problem, split_constant, std_op

# Ops a MatMul's output may pass through on its way to the BatchNormalization (LeViT's Linear -> BatchNorm1d is
# MatMul -> Flatten or Reshape to [B*N, C] -> BN): pure data movement, checked to keep the columns on the BN's axis.
LAYOUT_OPS = ("Reshape", "Flatten", "Transpose", "Identity")
_SHAPE_READERS = ("Shape", "Size")
_MAX_LAYOUT_STEPS = 6


def batchnorm_problem(g: Graph, bn: onnx.NodeProto, channels: int) -> tuple[str, str] | None:
    """(reason, detail) if `bn` is not an inference-mode BatchNormalization with constant statistics of
    `channels` channels (so it cannot fold into the op before it), else None."""
    a = attributes(bn)
    if a.get("training_mode", 0) != 0 or any(o for o in bn.output[1:]):
        return "bn-training-mode", (f"BatchNormalization {bn.name!r} runs in training mode (it updates its "
                                    "statistics); export the model in eval mode")
    if a.get("spatial", 1) == 0:
        return "bn-not-spatial", (f"BatchNormalization {bn.name!r} has spatial=0 (per-activation statistics), "
                                  "which does not fold per channel")
    for role, v in zip(("scale", "bias", "mean", "var"), bn.input[1:5]):
        if not g.is_constant(v):
            return "bn-nonconstant-params", f"BatchNormalization {role} {v!r} is not a constant"
    for role, v in zip(("scale", "bias", "mean", "var"), bn.input[1:5]):
        p = g.constant(v)
        if p is None or p.shape != (channels,):
            return "bn-shape-mismatch", (f"BatchNormalization {role} {v!r} has shape {None if p is None else p.shape},"
                                         f" not ({channels},) of the op before it")
    return None


def batchnorm_affine(gamma: np.ndarray, beta: np.ndarray, mean: np.ndarray, var: np.ndarray,
                     eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Inference-mode BatchNormalization as y = x * s + t per channel."""
    s = gamma / np.sqrt(var + eps)
    return s, beta - mean * s


def bn_scale_shift(g: Graph, bn: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray]:
    """The (s, t) of a BatchNormalization whose statistics are constants (see `batchnorm_problem`), in float64."""
    gamma, beta, mean, var = (g.constant(v).astype(np.float64) for v in bn.input[1:5])
    return batchnorm_affine(gamma, beta, mean, var, float(attributes(bn).get("epsilon", 1e-5)))


def low_precision(elem_type: int | None) -> bool:
    """fp16 / bf16: a folded weight's rounding can exceed the model's own error (see conv_bn_act's module doc)."""
    return elem_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


@dataclass(frozen=True)
class LinearChain:
    """MatMul(A, W) [-> Add(bias)] -> layout ops -> BatchNormalization, with the BN over the MatMul's columns."""

    matmul: onnx.NodeProto
    bias_add: onnx.NodeProto | None
    bias: str | None                            # the bias Add's constant operand
    layout: tuple[onnx.NodeProto, ...]          # from the MatMul (or its bias Add) to the BN, in order
    shape_readers: tuple[onnx.NodeProto, ...]   # Shape/Size nodes reading a value of the chain (only its shape)
    n_cols: int


@dataclass(frozen=True)
class ChainRefusal:
    """A MatMul is behind the BatchNormalization, but the BN does not fold into it."""

    node: str
    reason: str
    detail: str
    nodes: tuple[str, ...]


def matmul_behind(g: Graph, bn: onnx.NodeProto) -> LinearChain | ChainRefusal | None:
    """The MatMul whose output columns `bn` normalises (through a bias Add and layout ops), a refusal where a MatMul
    is behind it but the BN does not fold into it, or None where no MatMul is behind it."""
    if not bn.input:
        return None
    layout: list[onnx.NodeProto] = []
    v = bn.input[0]
    p = g.producer_of(v)
    while std_op(p, *LAYOUT_OPS) and len(layout) < _MAX_LAYOUT_STEPS and p.input:
        layout.insert(0, p)
        v = p.input[0]
        p = g.producer_of(v)
    bias_add, bias = None, None
    if std_op(p, "Add"):
        sc = split_constant(g, p)
        q = g.producer_of(sc[0]) if sc is not None else None
        if not std_op(q, "MatMul"):
            return None
        bias_add, bias, p = p, sc[1], q
    if not std_op(p, "MatMul") or len(p.input) != 2:
        return None
    mm = p
    nodes = tuple(n.name for n in [mm] + ([bias_add] if bias_add is not None else []) + layout + [bn])

    def refuse(node: onnx.NodeProto, reason: str, detail: str) -> ChainRefusal:
        return ChainRefusal(node.name, reason, detail, nodes)

    w = g.constant(mm.input[1]) if g.is_constant(mm.input[1]) else None
    if w is None or w.ndim != 2:
        return refuse(mm, "dynamic-weight", f"MatMul {mm.name!r} before BatchNormalization {bn.name!r}: its weight "
                      f"{mm.input[1]!r} is not a constant matrix, so there is nothing to fold the BN into")
    n_cols = int(w.shape[1])
    if bias is not None:
        problem = last_axis_vector_problem(g, bias, n_cols)
        if problem is not None:
            return refuse(bias_add, "bias-shape", f"the Add {bias_add.name!r} after MatMul {mm.name!r}: its "
                          f"constant {bias!r} {problem}")
    axis_problem = _columns_reach_bn_axis(g, mm, bias_add, layout, bn, n_cols)
    if axis_problem is not None:
        return refuse(bn, "bn-axis", axis_problem)
    chain = [mm] + ([bias_add] if bias_add is not None else []) + layout
    readers: list[onnx.NodeProto] = []
    for i, n in enumerate(chain):
        out = n.output[0]
        nxt = chain[i + 1] if i + 1 < len(chain) else bn
        if out in g.graph_outputs:
            return refuse(n, "intermediate-is-output", f"{out!r} (output of {n.name!r}) between MatMul {mm.name!r} "
                          f"and BatchNormalization {bn.name!r} is a graph output; folding would change it")
        for c in g.consumers_of(out):
            if c is nxt:
                continue
            if std_op(c, *_SHAPE_READERS):   # reads only the shape, which the fold keeps
                readers.append(c)
                continue
            return refuse(n, "shared-intermediate", f"{out!r} (output of {n.name!r}) between MatMul {mm.name!r} "
                          f"and BatchNormalization {bn.name!r} is also read by {c.name!r}; folding would change "
                          "what it reads")
    problem = batchnorm_problem(g, bn, n_cols)
    if problem is not None:
        return refuse(bn, *problem)
    if low_precision(g.elem_type(mm.output[0]) or g.elem_type(mm.input[1])):
        return refuse(bn, "bn-low-precision", f"BatchNormalization {bn.name!r} after MatMul {mm.name!r} in a "
                      "float16/bfloat16 model: its scale rounded into the weights can exceed the model's own error "
                      "(see conv_bn_act), and a MatMul has no float32 per-column epilogue to keep it exact")
    return LinearChain(mm, bias_add, bias, tuple(layout), tuple(readers), n_cols)


def _columns_reach_bn_axis(g: Graph, mm: onnx.NodeProto, bias_add: onnx.NodeProto | None,
                           layout: list[onnx.NodeProto], bn: onnx.NodeProto, n_cols: int) -> str | None:
    """Why the MatMul's output columns (its last axis) do not arrive on the BN's channel axis (axis 1) through the
    layout ops, or None where they do. Tracked per op: a Transpose moves the axis; a Reshape or Flatten keeps a
    last axis of exactly n_cols elements last (a row-major reshape keeps every element's flat index, so its column
    is index mod n_cols on both sides) and refuses anything else."""
    start = (bias_add or mm).output[0]
    shape = g.shape(start)
    if shape is None:
        return f"the rank of {start!r} (output of {mm.name!r}) is unknown, so the BN's axis cannot be traced to it"
    rank, col = len(shape), len(shape) - 1
    for n in layout:
        out_shape = g.shape(n.output[0])
        if n.op_type == "Identity":
            continue
        if n.op_type == "Transpose":
            perm = [int(p) for p in attributes(n).get("perm", list(range(rank))[::-1])]
            if sorted(perm) != list(range(rank)):
                return f"Transpose {n.name!r} has perm {perm} for a rank-{rank} input"
            col = perm.index(col)
            continue
        if col != rank - 1:
            return (f"{n.op_type} {n.name!r} reshapes {n.input[0]!r} while the MatMul's columns are on axis {col}, "
                    "not last: they do not stay one axis")
        if n.op_type == "Flatten":
            axis = int(attributes(n).get("axis", 1))
            axis = axis + rank if axis < 0 else axis
            if axis != rank - 1:
                return (f"Flatten {n.name!r} (axis {axis}) merges the MatMul's {n_cols} columns with other axes of "
                        f"its rank-{rank} input")
            rank, col = 2, 1
            continue
        last = out_shape[-1] if out_shape else None
        target = g.constant(n.input[1]) if len(n.input) > 1 and g.is_constant(n.input[1]) else None
        if last != n_cols and not (target is not None and target.size and int(target.reshape(-1)[-1]) == n_cols):
            return (f"Reshape {n.name!r} gives {n.output[0]!r} the shape {_fmt(out_shape)}: its last axis is not the "
                    f"MatMul's {n_cols} columns")
        if out_shape is None and target is None:
            return f"the rank of {n.output[0]!r} (output of Reshape {n.name!r}) is unknown"
        rank = len(out_shape) if out_shape is not None else int(target.size)
        col = rank - 1
    bn_shape = g.shape(bn.input[0])
    if col != 1 or rank < 2:
        held = "its rows" if rank >= 2 else "nothing"
        return (f"BatchNormalization {bn.name!r} normalises axis 1 of {bn.input[0]!r} ({_fmt(bn_shape)}), which "
                f"holds {held} of MatMul {mm.name!r}: its {n_cols} output columns are on axis {col}; a scale and "
                "shift per row or token does not fold into the weights")
    return None


def _fmt(shape: object) -> str:
    return "unknown shape" if shape is None else str(list(shape))  # type: ignore[arg-type]


AFFINE_OPS = ("Mul", "Add", "Sub", "Div")


def per_channel_affine_chain(g: Graph, z: str, rank: int | None) -> tuple[list[tuple[str, str]], str]:
    """Mul/Add/Sub/Div by per-channel constants right after the conv (or its BN), as exporters emit for
    a learned channel scale and shift (light_inception_v2: BN -> Mul -> Add -> Relu). They fold into W, B.
    Returns [(node name, constant operand)] and the chain's output value."""
    chain: list[tuple[str, str]] = []
    while rank is not None and z not in g.graph_outputs:
        n = g.single_consumer(z)
        if n is None or n.op_type not in AFFINE_OPS or len(n.input) != 2:
            break
        # Sub and Div fold only as x - c and x / c; Mul and Add commute.
        if n.op_type in ("Sub", "Div") and n.input[0] != z:
            break
        other = n.input[1] if n.input[0] == z else n.input[0]
        if other == z or not is_per_channel(g.constant(other) if g.is_constant(other) else None, rank):
            break
        if n.op_type == "Div" and np.any(g.constant(other) == 0):
            break
        chain.append((n.name, other))
        z = n.output[0]
    return chain, z


def is_per_channel(c: np.ndarray | None, rank: int) -> bool:
    """True if constant `c` broadcasts against [N, C, spatial...] along the channel axis only."""
    if c is None or c.ndim > rank or not (np.issubdtype(c.dtype, np.floating) or c.dtype.name == "bfloat16"):
        return False
    shape = (1,) * (rank - c.ndim) + c.shape
    return shape[0] == 1 and all(d == 1 for d in shape[2:])


def apply_affine(g: Graph, op_type: str, const: str, scale: np.ndarray, shift: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Compose (x * scale + shift) with one more per-channel op by a constant."""
    c = np.broadcast_to(g.constant(const).astype(np.float64).reshape(-1), scale.shape)
    if op_type == "Mul":
        return scale * c, shift * c
    if op_type == "Div":
        return scale / c, shift / c
    if op_type == "Add":
        return scale, shift + c
    return scale, shift - c  # Sub, as x - c
