"""Structural dims: the dims of a value as terms of where they come from, so that two values whose shapes shape
inference named differently (`batch` against `unk__16`, or a dim it lost) can still be shown to have one shape.

A dim is a term, equal terms meaning equal run-time sizes:

    int                          a fixed size
    ("sym", name)                a named dim: a graph input's symbol, or one shape inference made up (`unk__N`:
                                 one run names each unknown afresh, so one name is one size)
    ("of", value, axis)          the axis of a value where nothing better is known: a size equal only to itself
    ("prod", k, atoms)           k times the product of the atoms (Reshape / Flatten / Tile arithmetic)
    ("win", d, offset, stride)   floor((d + offset) / stride) + 1: a Conv / pooling window over an axis of size d
    ("winc", d, offset, stride)  the same with ceil (pooling's ceil_mode)
    ("sum", dims)                a Concat's axis: the sum of its inputs' (order kept)
    ("add", a, b) / ("sub", a, b) / ("div", a, k) / ("scale", d, s)
                                 shape arithmetic (a Range's bounds, a Resize by a scale other than 1)

Every value's dims are computed once per view version, in topological order (no recursion: a UNet is deep),
from its producer's inputs: elementwise ops broadcast (a dim other than 1 wins; two different unknowns give a fresh
atom, never one of them: a symbol may be 1 at run time and the other side not), Conv and pooling follow their
window arithmetic (a 1x1 or a stride-1 'same' window keeps the axis), Concat keeps the dims every input shares,
Reshape / Expand / Tile / Range / ConstantOfShape read their shape operands as terms (`entries`: the contents of
small int vectors, Shape(x) being x's dims), and the norms, activations and casts keep their input's shape. Where
an axis cannot be followed, the inferred dim stands (its int or its name), else a fresh atom. The model is
assumed valid (what onnxruntime would run): a Concat's inputs agree off the axis, a broadcast's sides are equal
or 1. Sizes are assumed below 2^24 where a Resize multiplies them by 1.0 in float32.

`value_dims(g, v)` gives the terms, `same_shape(g, a, b)` whether two values provably have one shape, `dim_str`
renders a term for a near-miss.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from npufuse import FUSED_DOMAIN
from npufuse.algebra.shapes import squeezed
from npufuse.ir.graph import Graph, attributes

Dim = Any

_SHAPE_KEEPING = frozenset({
    "Cast", "CastLike", "Identity", "Relu", "Gelu", "Erf", "Tanh", "Sigmoid", "Neg", "Sqrt", "Exp", "Log", "Abs",
    "Softmax", "LogSoftmax", "Dropout", "LayerNormalization", "RMSNormalization", "Clip", "LeakyRelu", "HardSwish",
    "HardSigmoid", "Reciprocal", "Softplus", "Softsign", "Mish", "Elu", "Selu", "Celu", "ThresholdedRelu", "Sin",
    "Cos", "Not", "Floor", "Ceil", "Round", "Sign", "IsNaN", "IsInf", "BitwiseNot", "Trilu", "BatchNormalization",
    "InstanceNormalization", "GroupNormalization", "LpNormalization", "MeanVarianceNormalization", "Shrink",
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "Swish", "CumSum",
})
# npufuse's own ops whose first output has their first input's shape
_FUSED_SHAPE_KEEPING = frozenset({"LayerNorm", "RMSNorm", "Gelu", "Silu", "GroupNorm", "GroupNormSilu"})
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mean", "Sum", "Where", "And", "Or",
                           "Xor", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Mod", "PRelu",
                           "BitwiseAnd", "BitwiseOr", "BitwiseXor"})
_POOLS = frozenset({"MaxPool", "AveragePool", "LpPool"})
_REDUCES = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                      "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"})
_INT_TYPES = frozenset({TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8,
                        TensorProto.UINT64, TensorProto.UINT32, TensorProto.UINT16, TensorProto.UINT8})
_MAX_ENTRIES = 64            # shape operands are short; a longer int tensor is data, not a shape
_UNBOUNDED_END = 2 ** 31 - 1  # a Slice end at or past this takes the whole axis

_Facts = tuple  # (dims: tuple[Dim, ...] | None, entries: list[Dim] | None)
_CACHE: "weakref.WeakKeyDictionary[Graph, tuple[int, dict[str, _Facts]]]" = weakref.WeakKeyDictionary()


# ---- the public surface ----------------------------------------------------------------------------------------

def value_dims(g: Graph, v: str) -> tuple[Dim, ...] | None:
    """The dims of `v` as terms (see the module doc), or None where even its rank is unknown."""
    return _facts(g, v)[0]


def shape_entries(g: Graph, v: str) -> list[Dim] | None:
    """The elements of a small int tensor (a shape operand) as terms, or None where they are not followed."""
    return _facts(g, v)[1]


def same_shape(g: Graph, a: str, b: str) -> bool:
    """True only where `a` and `b` have one shape at run time, whatever the inputs' sizes."""
    da, db = value_dims(g, a), value_dims(g, b)
    return da is not None and db is not None and len(da) == len(db) and all(
        x == y for x, y in zip(da, db))


def dim_str(d: Dim) -> str:
    """A term as a person reads it: 4, batch, 2*batch*seq, x[1], win(H, -1, 2)."""
    if isinstance(d, int):
        return str(d)
    tag = d[0]
    if tag == "sym":
        return d[1]
    if tag == "of":
        return f"{d[1]}[{d[2]}]"
    if tag == "prod":
        return "*".join([str(d[1])] * (d[1] != 1) + [dim_str(x) for x in d[2]])
    if tag == "sum":
        return "(" + "+".join(dim_str(x) for x in d[1]) + ")"
    return f"{tag}(" + ", ".join(dim_str(x) if isinstance(x, (int, tuple)) else str(x) for x in d[1:]) + ")"


def fresh(d: Dim) -> bool:
    """True for a term that names no more than one value's axis (`("of", value, axis)`)."""
    return isinstance(d, tuple) and d[0] == "of"


# ---- the pass ----------------------------------------------------------------------------------------------------

def _facts(g: Graph, v: str) -> _Facts:
    version, cache = _CACHE.get(g, (None, None))
    if version != g.version or cache is None:   # the view was patched since: its values may have other producers
        cache = {}
        _CACHE[g] = (g.version, cache)
    if v in cache:
        return cache[v]
    # post-order over the producers' inputs not yet known, without recursion
    stack: list[tuple[str, bool]] = [(v, False)]
    busy: set[str] = set()
    while stack:
        x, ready = stack.pop()
        if x in cache:
            continue
        if ready:
            try:
                cache[x] = _compute(g, x, cache)
            except (ValueError, IndexError, TypeError, KeyError, ZeroDivisionError, OverflowError):
                cache[x] = (_inferred(g, x), None)
            busy.discard(x)
            continue
        if x in busy:           # a cycle in a malformed graph: what inference says
            cache[x] = (_inferred(g, x), None)
            continue
        busy.add(x)
        stack.append((x, True))
        p = None if not x or g.is_constant(x) else g.producer_of(x)
        if p is not None:
            stack.extend((i, False) for i in p.input if i and i not in cache and i not in busy)
    return cache[v]


def _inferred(g: Graph, v: str) -> tuple[Dim, ...] | None:
    shape = g.shape(v)
    if shape is None:
        return None
    return tuple(d if isinstance(d, int) else ("sym", d) if isinstance(d, str) and d else ("of", v, i)
                 for i, d in enumerate(shape))


def _rank(d: Dim) -> int:
    """How much a term says: a fixed size; a symbol of the model's; a structural term; a name inference made up;
    nothing."""
    if isinstance(d, int):
        return 4
    if d[0] == "sym":
        return 1 if d[1].startswith("unk__") else 3
    return 0 if d[0] == "of" else 2


def _merge(g: Graph, v: str, derived: tuple[Dim, ...] | None) -> tuple[Dim, ...] | None:
    """Per axis, the derived term or the inferred one, whichever says more (both are true of the value)."""
    inferred = _inferred(g, v)
    if derived is None:
        return inferred
    if inferred is None or len(inferred) != len(derived):
        return tuple(derived)
    out = []
    for d, i in zip(derived, inferred):
        if isinstance(d, int) and isinstance(i, int) and d != i:
            return inferred          # the derivation contradicts inference: trust neither beyond inference
        out.append(d if _rank(d) >= _rank(i) else i)
    return tuple(out)


def _compute(g: Graph, v: str, cache: dict[str, _Facts]) -> _Facts:
    if g.is_constant(v):
        return _constant_facts(g, v)
    n = g.producer_of(v)
    if n is None:
        return _inferred(g, v), None
    dims_of = lambda i: cache[n.input[i]][0] if len(n.input) > i and n.input[i] in cache else None  # noqa: E731
    entries_of = lambda i: cache[n.input[i]][1] if len(n.input) > i and n.input[i] in cache else None  # noqa: E731
    std = n.domain in ("", "ai.onnx")
    derived = _derive_dims(g, n, v, dims_of, entries_of) if std or n.domain == FUSED_DOMAIN else None
    dims = _merge(g, v, derived)
    entries = _derive_entries(g, n, v, dims_of, entries_of) if std else None
    if entries is not None and dims is not None and (len(dims) > 1 or (dims and dims[0] != len(entries))):
        entries = None
    return dims, entries


def _constant_facts(g: Graph, v: str) -> _Facts:
    shape = g.shape(v)
    # a weight's shape is its type's; only a short int vector (a shape operand) is read
    small = g.elem_type(v) in _INT_TYPES and shape is not None and len(shape) <= 1 and \
        all(isinstance(d, int) for d in shape) and (not shape or shape[0] <= _MAX_ENTRIES)
    arr = g.constant(v) if small else None
    if arr is not None:
        shape = tuple(int(d) for d in arr.shape)
    dims = tuple(shape) if shape is not None and all(isinstance(d, int) for d in shape) else None
    entries = None
    if arr is not None and arr.ndim <= 1 and arr.size <= _MAX_ENTRIES and np.issubdtype(arr.dtype, np.integer):
        entries = [int(x) for x in arr.reshape(-1)]
    return dims, entries


# ---- dims of an op's output ----------------------------------------------------------------------------------

def _broadcast(cols: list[tuple[Dim, ...]], v: str) -> tuple[Dim, ...]:
    rank = max(len(c) for c in cols)
    padded = [(1,) * (rank - len(c)) + tuple(c) for c in cols]
    out: list[Dim] = []
    for i in range(rank):
        rest = [c[i] for c in padded if c[i] != 1]
        ints = {d for d in rest if isinstance(d, int)}
        if len(ints) > 1:
            raise ValueError("incompatible broadcast")
        if ints:
            out.append(ints.pop())           # a fixed size other than 1 is the result (the others are 1 or it)
        elif not rest:
            out.append(1)
        elif all(d == rest[0] for d in rest):
            out.append(rest[0])
        else:
            out.append(("of", v, i))         # two different unknowns: either may be 1
    return tuple(out)


def _derive_dims(g: Graph, n: onnx.NodeProto, v: str, dims_of, entries_of) -> tuple[Dim, ...] | None:
    op, a = n.op_type, attributes(n)
    first = v == n.output[0]
    x = dims_of(0)
    if n.domain == FUSED_DOMAIN:
        if op in _FUSED_SHAPE_KEEPING and first:
            return x
        if op in ("AddLayerNorm", "AddRMSNorm") and x is not None and dims_of(1) is not None:
            return _broadcast([x, dims_of(1)], v)
        if op == "FusedMatMul" and first:
            return _matmul(x, dims_of(1), v)
        if op == "FusedConv" and first:
            return _conv(g, n, a, x, dims_of(1), v)
        if op == "FusedAttention" and first:
            return _attention(g, a, x, v)
        if op == "GatedMLP" and first and x:
            # rows as the input's, the width the down projection writes (the value's own last dim)
            own = _inferred(g, v)
            return x[:-1] + own[-1:] if own and isinstance(own[-1], int) else None
        return None
    if op in _SHAPE_KEEPING:
        return x if first else None
    if op in _BROADCASTING:
        ins = [dims_of(i) for i, name in enumerate(n.input) if name]
        return None if not ins or any(d is None for d in ins) else _broadcast(ins, v)
    if op in ("MatMul", "MatMulInteger"):
        return _matmul(x, dims_of(1), v)
    if op == "Gemm":
        y = dims_of(1)
        if x is None or y is None or len(x) != 2 or len(y) != 2:
            return None
        return (x[1] if a.get("transA", 0) else x[0], y[0] if a.get("transB", 0) else y[1])
    if op == "Conv":
        return _conv(g, n, a, x, dims_of(1), v)
    if op in _POOLS and first or op == "MaxPool":
        return _pool(a, x)
    if op in ("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"):
        return None if x is None or len(x) < 2 else x[:2] + (1,) * (len(x) - 2)
    if op == "Concat":
        return _concat(n, a, [dims_of(i) for i in range(len(n.input))], v)
    if op == "Range":
        return (_range_length(g, n, entries_of),)
    if op == "ConstantOfShape":
        e = entries_of(0)
        return tuple(e) if e is not None and all(_nonnegative(d) for d in e) else None
    if x is None:
        return None
    if op == "Transpose":
        perm = a.get("perm") or list(reversed(range(len(x))))
        return tuple(x[p] for p in perm)
    if op == "Gather":
        idx = dims_of(1)
        axis = int(a.get("axis", 0)) % len(x)
        return None if idx is None else x[:axis] + tuple(idx) + x[axis + 1:]
    if op == "GatherElements":
        return dims_of(1)
    if op == "Reshape":
        return _reshape(a, x, entries_of(1), v)
    if op == "Flatten":
        axis = int(a.get("axis", 1)) % (len(x) + 1)
        return (_product(x[:axis]), _product(x[axis:]))
    if op == "Expand":
        t = entries_of(1)
        if t is None:
            return None
        rank = max(len(t), len(x))
        xs, ts = (1,) * (rank - len(x)) + tuple(x), [1] * (rank - len(t)) + list(t)
        if not all(_nonnegative(d) for d in ts):
            return None
        return _broadcast([xs, tuple(ts)], v)
    if op == "Tile":
        reps = entries_of(1)
        if reps is None or len(reps) != len(x) or not all(_nonnegative(r) for r in reps):
            return None
        return tuple(_product([d, r]) for d, r in zip(x, reps))
    if op in ("Unsqueeze", "Squeeze"):
        return _squeeze(op, n, a, x, entries_of)
    if op == "Slice":
        return _slice(n, x, entries_of, v)
    if op == "Split":
        inferred = g.shape(v)
        if inferred is None or len(inferred) != len(x):
            return None
        axis = int(a.get("axis", 0)) % len(x)
        return x[:axis] + (inferred[axis] if isinstance(inferred[axis], int) else ("of", v, axis),) + x[axis + 1:]
    if op in _REDUCES or op in ("ArgMax", "ArgMin"):
        return _reduce(op, n, a, x, entries_of)
    if op == "Resize":
        return _resize(g, n, x, entries_of, v)
    if op == "Pad":
        return _pad(n, a, x, entries_of)
    return None


def _pad(n: onnx.NodeProto, a: dict, x: tuple, entries_of) -> tuple[Dim, ...] | None:
    """Each axis grows by its two pads (ints, or terms of the graph's shape arithmetic)."""
    pads = a.get("pads") if len(n.input) < 2 or not n.input[1] else entries_of(1)
    axes = list(range(len(x))) if len(n.input) < 4 or not n.input[3] else entries_of(3)
    if pads is None or axes is None or len(pads) != 2 * len(axes) or \
            not all(isinstance(ax, int) for ax in axes) or a.get("mode", "constant") not in ("constant", "reflect",
                                                                                            "edge", "wrap"):
        return None
    out = list(x)
    for j, ax in enumerate(axes):
        grow = _arith("Add", pads[j], pads[j + len(axes)])
        out[ax % len(x)] = _arith("Add", out[ax % len(x)], grow)
    return tuple(out)


def _matmul(x, y, v: str) -> tuple[Dim, ...] | None:
    if x is None or y is None or len(x) < 2 or len(y) < 2:
        return None
    if len(y) == 2:
        return tuple(x[:-1]) + (y[-1],)
    batch = _broadcast([tuple(x[:-2]), tuple(y[:-2])], v)
    return batch + (x[-2], y[-1])


def _window(d: Dim, offset: int, stride: int, ceil: bool) -> Dim:
    """floor((d + offset) / stride) + 1 (ceil for a pooling ceil_mode): a conv / pooling window count. A padded
    axis (d = base + pads, a Pad before the window) folds its pads into the offset."""
    if isinstance(d, tuple) and d[0] == "add" and any(isinstance(t, int) for t in d[1:3]):
        c = d[1] if isinstance(d[1], int) else d[2]
        d, offset = (d[2] if isinstance(d[1], int) else d[1]), offset + c
    if isinstance(d, int):
        num = d + offset
        return (-(-num // stride) if ceil else num // stride) + 1
    if stride == 1:
        return d if offset == -1 else ("win", d, offset, 1)
    return ("winc" if ceil else "win", d, offset, stride)


def _spatial(a: dict, kernel: list[int], x: tuple, ceil: bool) -> tuple[Dim, ...] | None:
    k = len(kernel)
    strides = list(a.get("strides") or [1] * k)
    dilations = list(a.get("dilations") or [1] * k)
    pads = list(a.get("pads") or [0] * (2 * k))
    auto_pad = a.get("auto_pad", "NOTSET")
    if len(strides) != k or len(dilations) != k or len(pads) != 2 * k or len(x) != k + 2:
        return None
    out = []
    for i in range(k):
        span = dilations[i] * (kernel[i] - 1)
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out.append(_window(x[2 + i], -1, strides[i], False))          # ceil(d / stride)
        elif auto_pad == "VALID":
            out.append(_window(x[2 + i], -span - 1, strides[i], ceil))
        elif auto_pad in ("NOTSET", ""):
            out.append(_window(x[2 + i], pads[i] + pads[i + k] - span - 1, strides[i], ceil))
        else:
            return None
    return tuple(out)


def _conv(g: Graph, n: onnx.NodeProto, a: dict, x, w, v: str) -> tuple[Dim, ...] | None:
    if x is None or w is None or len(x) != len(w) or len(x) < 3:
        return None
    kernel = list(a.get("kernel_shape") or w[2:])
    if not all(isinstance(d, int) for d in kernel):
        return None
    spatial = _spatial(a, kernel, x, False)
    return None if spatial is None else (x[0], w[0]) + spatial


def _pool(a: dict, x) -> tuple[Dim, ...] | None:
    kernel = list(a.get("kernel_shape") or [])
    if x is None or not kernel:
        return None
    spatial = _spatial(a, kernel, x, bool(a.get("ceil_mode", 0)))
    return None if spatial is None else tuple(x[:2]) + spatial


def _concat(n: onnx.NodeProto, a: dict, ins: list, v: str) -> tuple[Dim, ...] | None:
    """Off the axis every input has the same size (Concat does not broadcast): each of them names it, the one that
    says most is kept. On the axis, the sum."""
    known = [d for d in ins if d is not None]
    if not known or any(len(d) != len(known[0]) for d in known):
        return None
    rank = len(known[0])
    axis = int(a.get("axis", 0)) % rank
    out: list[Dim] = []
    for i in range(rank):
        if i == axis:
            if len(known) != len(ins):
                out.append(("of", v, i))
            elif all(isinstance(d[i], int) for d in known):
                out.append(sum(d[i] for d in known))
            else:
                parts = [d[i] for d in known if d[i] != 0]
                out.append(parts[0] if len(parts) == 1 else ("sum", tuple(parts)))
        else:
            out.append(max((d[i] for d in known), key=_rank))
    return tuple(out)


def _attention(g: Graph, a: dict, q, v: str) -> tuple[Dim, ...] | None:
    """npufuse.FusedAttention: batch and query length from Q, heads and head size the inferred static dims."""
    inferred = g.shape(v)
    if q is None or inferred is None or len(q) < 3:
        return None
    bs = (q[0], q[2] if a.get("q_layout", "BNSD") == "BNSD" else q[1])
    spots = (0, 2) if a.get("out_layout", "BNSD") == "BNSD" else (0, 1)
    out = [d if isinstance(d, int) else ("of", v, i) for i, d in enumerate(inferred)]
    for spot, dim in zip(spots, bs):
        if spot < len(out):
            out[spot] = dim
    return tuple(out)


def _reshape(a: dict, x: tuple, target: list | None, v: str) -> tuple[Dim, ...] | None:
    if target is None:
        return None
    out: list[Dim] = []
    for i, t in enumerate(target):
        if t == 0 and not a.get("allowzero", 0):
            if i >= len(x):
                return None
            t = x[i]
        elif not (t == -1 or _nonnegative(t)):
            t = ("of", v, i)          # a term that might be -1 or 0 at run time: Reshape reads it otherwise
        out.append(t)
    if out.count(-1) == 1:
        j = out.index(-1)
        out[j] = _quotient(x, [d for i, d in enumerate(out) if i != j]) or ("of", v, j)
    elif -1 in out:
        return None
    return tuple(out)


def _squeeze(op: str, n: onnx.NodeProto, a: dict, x: tuple, entries_of) -> tuple[Dim, ...] | None:
    axes = a.get("axes")
    if axes is None and len(n.input) > 1 and n.input[1]:
        axes = entries_of(1)
        if axes is None or not all(isinstance(ax, int) for ax in axes):
            return None
    return squeezed(op, x, axes)


def _slice(n: onnx.NodeProto, x: tuple, entries_of, v: str) -> tuple[Dim, ...] | None:
    if len(n.input) < 3:
        return None
    starts, ends = entries_of(1), entries_of(2)
    axes = entries_of(3) if len(n.input) > 3 and n.input[3] else list(range(len(starts or [])))
    steps = entries_of(4) if len(n.input) > 4 and n.input[4] else [1] * len(starts or [])
    if starts is None or ends is None or axes is None or steps is None or \
            not len(starts) == len(ends) == len(axes) == len(steps) or \
            not all(isinstance(t, int) for t in list(axes) + list(steps)):
        return None
    out = list(x)
    for s, e, ax, st in zip(starts, ends, axes, steps):
        ax %= len(x)
        d = x[ax]
        if isinstance(s, int) and isinstance(e, int) and isinstance(d, int) and st != 0:
            out[ax] = len(range(*slice(s, e, st).indices(d)))
        elif s == 0 and st == 1 and (isinstance(e, int) and e >= _UNBOUNDED_END or e == d):
            out[ax] = d                 # the whole axis
        elif st == 1 and isinstance(e, int) and e >= _UNBOUNDED_END and not isinstance(d, int) and \
                s == _arith("Sub", 0, d):
            out[ax] = d                 # x[-d:] of an axis of length d: the whole axis (T5's position bias)
        else:
            out[ax] = ("of", v, ax)
    return tuple(out)


def _reduce(op: str, n: onnx.NodeProto, a: dict, x: tuple, entries_of) -> tuple[Dim, ...] | None:
    keep = bool(a.get("keepdims", 1))
    if op in ("ArgMax", "ArgMin"):
        axes = [int(a.get("axis", 0))]
    else:
        axes = a.get("axes")
        if axes is None and len(n.input) > 1 and n.input[1]:
            axes = entries_of(1)
            if axes is None or not all(isinstance(ax, int) for ax in axes):
                return None
        if not axes:
            if a.get("noop_with_empty_axes", 0):
                return x
            axes = list(range(len(x)))
    drop = {ax % len(x) for ax in axes}
    return tuple(1 if i in drop else d for i, d in enumerate(x) if keep or i not in drop)


def _resize(g: Graph, n: onnx.NodeProto, x: tuple, entries_of, v: str) -> tuple[Dim, ...] | None:
    sizes = entries_of(3) if len(n.input) > 3 and n.input[3] else None
    if sizes is not None:
        return tuple(sizes) if len(sizes) == len(x) and all(_nonnegative(d) for d in sizes) else None
    scales_name = n.input[2] if len(n.input) > 2 and n.input[2] else (n.input[1] if len(n.input) == 2 else "")
    scales = g.constant(scales_name) if scales_name and g.is_constant(scales_name) else None
    if scales is None or scales.size != len(x) or attributes(n).get("axes") is not None:
        return None
    inferred = g.shape(v)
    out: list[Dim] = []
    for i, (d, s) in enumerate(zip(x, scales.reshape(-1).tolist())):
        if s == 1.0:
            out.append(d)
        elif inferred is not None and len(inferred) == len(x) and isinstance(inferred[i], int):
            out.append(inferred[i])
        else:
            out.append(("scale", d, float(s)))
    return tuple(out)


def _range_length(g: Graph, n: onnx.NodeProto, entries_of) -> Dim:
    """Range(start, limit, 1) over ints has limit - start elements: `limit` itself from 0, `d` from `start` to
    `start + d`; anything else a fresh atom."""
    start, limit, delta = entries_of(0), entries_of(1), entries_of(2)
    fresh_dim = ("of", n.output[0], 0)
    if g.elem_type(n.output[0]) not in _INT_TYPES or not all(e is not None and len(e) == 1
                                                              for e in (start, limit, delta)):
        return fresh_dim
    s, lim, dl = start[0], limit[0], delta[0]
    if isinstance(s, int) and isinstance(lim, int) and isinstance(dl, int) and dl:
        return max(0, -(-(lim - s) // dl))
    if dl != 1:
        return fresh_dim
    if s == 0 and _nonnegative(lim):
        return lim
    if isinstance(lim, tuple) and lim[0] == "add" and s in lim[1:3]:
        rest = lim[2] if lim[1] == s else lim[1]
        return rest if _nonnegative(rest) else fresh_dim
    return fresh_dim


# ---- entries of small int tensors (shape operands) --------------------------------------------------------------

def _derive_entries(g: Graph, n: onnx.NodeProto, v: str, dims_of, entries_of) -> list[Dim] | None:
    op, a = n.op_type, attributes(n)
    if op == "Shape":
        x = dims_of(0)
        if x is None:
            return None
        start, end = int(a.get("start", 0)), a.get("end")
        return list(x[slice(start, None if end is None else int(end))])
    if op == "Size":
        x = dims_of(0)
        return None if x is None else [_product(x)]
    if op == "Cast":
        return entries_of(0) if a.get("to") in _INT_TYPES and g.elem_type(n.input[0]) in _INT_TYPES else None
    if op in ("Identity", "Unsqueeze", "Squeeze", "Reshape"):
        return entries_of(0)
    if op == "Concat":
        parts = [entries_of(i) for i in range(len(n.input))]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    if op == "Gather" and int(a.get("axis", 0)) == 0:
        src, idx = entries_of(0), entries_of(1)
        if src is None or idx is None:
            return None
        return [src[i] for i in idx] if all(-len(src) <= i < len(src) for i in idx) else None
    if op == "Slice":
        src = entries_of(0)
        starts, ends = entries_of(1), entries_of(2)
        axes = entries_of(3) if len(n.input) > 3 and n.input[3] else [0]
        steps = entries_of(4) if len(n.input) > 4 and n.input[4] else [1]
        if src is None or starts is None or ends is None or axes is None or steps is None or \
                not (len(starts) == len(ends) == len(axes) == len(steps) == 1) or \
                not all(isinstance(t, int) for t in starts + ends + axes + steps) or axes[0] not in (0, -1) or \
                steps[0] == 0:
            return None
        return src[slice(starts[0], ends[0], steps[0])]
    if op in ("Add", "Sub", "Mul", "Div") and g.elem_type(v) in _INT_TYPES:
        x, y = entries_of(0), entries_of(1)
        if x is None or y is None or not (len(x) == len(y) or len(x) == 1 or len(y) == 1):
            return None
        size = max(len(x), len(y))
        x, y = (x * size if len(x) == 1 else x), (y * size if len(y) == 1 else y)
        return [_arith(op, p, q) for p, q in zip(x, y)]
    if op == "Neg" and g.elem_type(v) in _INT_TYPES:
        x = entries_of(0)
        return None if x is None else [_arith("Sub", 0, p) for p in x]
    if op == "ConstantOfShape":
        e, t = entries_of(0), a.get("value")
        if e is None or len(e) != 1 or not isinstance(e[0], int) or e[0] > _MAX_ENTRIES:
            return None
        fill = onnx.numpy_helper.to_array(t).reshape(-1)[0].item() if t is not None else 0
        return [int(fill)] * e[0] if isinstance(fill, int) else None
    return None


def _arith(op: str, p: Dim, q: Dim) -> Dim:
    if isinstance(p, int) and isinstance(q, int):
        if op == "Add":
            return p + q
        if op == "Sub":
            return p - q
        if op == "Mul":
            return p * q
        return int(p / q)     # ONNX integer Div truncates
    if op == "Mul":
        return _product([p, q]) if _nonnegative(p) and _nonnegative(q) else ("mul", p, q)
    if op == "Add":
        if p == 0 or q == 0:
            return q if p == 0 else p
        if isinstance(q, int) and isinstance(p, tuple) and p[0] == "add" and any(isinstance(t, int) for t in p[1:]):
            base, c = (p[2], p[1]) if isinstance(p[1], int) else (p[1], p[2])
            return _arith("Add", base, c + q)
        if isinstance(p, int) and isinstance(q, tuple):
            return _arith("Add", q, p)
        return ("add",) + tuple(sorted((p, q), key=repr))
    if op == "Sub":
        if q == 0:
            return p
        if isinstance(p, tuple) and p[0] == "add" and q in p[1:3]:
            return p[2] if p[1] == q else p[1]
        return ("sub", p, q)
    if isinstance(q, int) and q > 0 and _nonnegative(p):
        m = _mono(p)
        if m[0] % q == 0:
            return _unmono(m[0] // q, list(m[1]))
        return ("div", p, q)
    return ("div", p, q)


# ---- monomials ---------------------------------------------------------------------------------------------------

def _nonnegative(d: Dim) -> bool:
    """A term that is a size (>= 0) whatever the inputs: not a difference, not a negative int."""
    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return d >= 0
    if d[0] in ("sym", "of", "win", "winc", "scale"):
        return True
    if d[0] == "prod":
        return d[1] >= 0 and all(_nonnegative(x) for x in d[2])
    if d[0] == "sum":
        return all(_nonnegative(x) for x in d[1])
    if d[0] == "add":
        return _nonnegative(d[1]) and _nonnegative(d[2])
    if d[0] == "div":
        return _nonnegative(d[1]) and isinstance(d[2], int) and d[2] > 0
    return False


def _mono(d: Dim) -> tuple[int, tuple]:
    """A term as a monomial (coefficient, atoms): 6 -> (6, ()), B -> (1, (B,)), ("prod", 4, (B, S))."""
    if isinstance(d, int):
        return d, ()
    if d[0] == "prod":
        return d[1], d[2]
    return 1, (d,)


def _unmono(coeff: int, atoms: list) -> Dim:
    atoms_t = tuple(sorted(atoms, key=repr))
    if not atoms_t or coeff == 0:
        return coeff
    return atoms_t[0] if coeff == 1 and len(atoms_t) == 1 else ("prod", coeff, atoms_t)


def _product(dims) -> Dim:
    coeff, atoms = 1, []
    for d in dims:
        m = _mono(d)
        coeff *= m[0]
        atoms += list(m[1])
    return _unmono(coeff, atoms)


def _quotient(x: tuple, others: list) -> Dim | None:
    """Reshape's -1: the input's element count over the other target dims, where that divides exactly as a monomial
    (x.view(-1, S) of [B, S] is B; [B*N, S, D].view(-1, N, S, D) is B), else None."""
    coeff, atoms = _mono(_product(x))
    atoms = list(atoms)
    den, den_atoms = _mono(_product(others))
    for atom in den_atoms:
        if atom not in atoms:
            return None
        atoms.remove(atom)
    if den == 0 or coeff % den:
        return None
    return _unmono(coeff // den, atoms)
