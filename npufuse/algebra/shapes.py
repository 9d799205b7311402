"""Static shape arithmetic and Slice bounds, shared by the patterns that must prove where a tensor is cut.

Exporters compute Slice bounds and Split sizes from shapes (TorchScript writes `d = h.shape[-1] // 2;
h[..., :d], h[..., d:]` as Shape -> Gather -> Div -> Unsqueeze -> Slice). Where the dims involved are fixed, the
bounds are constants in all but form: `static_ints` evaluates them, and `slice_bounds` reads a Slice's starts,
ends, axes and steps whichever way the opset gives them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npufuse.ir.graph import Graph, attributes
from npufuse.ir.matching import MatchRefused, std_op

# Ops of the static shape arithmetic that may compute Slice bounds or Split sizes (TorchScript's
# `d = h.shape[-1] // 2; h[..., :d], h[..., d:]`).
_SHAPE_ARITHMETIC_OPS = ("Shape", "Gather", "Unsqueeze", "Squeeze", "Reshape", "Identity", "Cast", "Concat", "Div",
                         "Mul", "Add", "Sub", "Floor", "Slice")
_MAX_SHAPE_DEPTH = 16


def _int_div(a: int, b: int) -> int:
    """Integer Div as onnxruntime computes it (truncation toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def static_ints(g: Graph, v: str, visited: list[str], depth: int = 0) -> np.ndarray | None:
    """`v` as an int64 array if it is a constant or static shape arithmetic (Shape of a value whose needed dims
    are fixed -> Gather / Slice / Unsqueeze / Concat / Div / ...), else None. Nodes evaluated are added to
    `visited`. An object array holds None for a dim that is not fixed; only a fully known result is returned."""
    arr = _static(g, v, visited, depth)
    if arr is None or any(e is None for e in arr.reshape(-1)):
        return None
    return np.array(arr.tolist(), dtype=np.int64).reshape(arr.shape)


def _static(g: Graph, v: str, visited: list[str], depth: int) -> np.ndarray | None:
    if g.is_constant(v):
        c = g.constant(v)
        if c is None or c.size > 64 or c.dtype.kind not in "iuf":
            return None
        return np.array([int(e) for e in c.reshape(-1)], dtype=object).reshape(c.shape)
    p = g.producer_of(v)
    if depth > _MAX_SHAPE_DEPTH or p is None or not std_op(p, *_SHAPE_ARITHMETIC_OPS):
        return None
    a = attributes(p)
    if p.op_type == "Shape":
        shape = g.shape(p.input[0])
        if shape is None:
            return None
        dims = [d if isinstance(d, int) else None for d in shape]
        start, end = int(a.get("start", 0)), a.get("end")
        dims = dims[start:] if end is None else dims[start:int(end)]
        visited.append(p.name)
        return np.array(dims, dtype=object)
    ins: list[np.ndarray | None] = []
    for i in p.input:
        ins.append(_static(g, i, visited, depth + 1) if i else None)
    data = ins[0]
    if data is None:
        return None
    try:
        out = _evaluate(p, a, data, ins)
    except (ValueError, IndexError, TypeError, ZeroDivisionError):
        return None
    if out is None:
        return None
    visited.append(p.name)
    return np.asarray(out, dtype=object)


def _evaluate(p: onnx.NodeProto, a: dict[str, Any], data: np.ndarray, ins: list) -> np.ndarray | None:
    """One node of static shape arithmetic on object arrays (None: an unknown dim)."""
    t = p.op_type
    known = [x for x in ins[1:] if x is not None]

    def ints(x: np.ndarray | None) -> list[int] | None:
        if x is None or any(e is None for e in x.reshape(-1)):
            return None
        return [int(e) for e in x.reshape(-1)]

    if t in ("Identity", "Cast", "Floor"):
        return data
    if t == "Gather":
        idx = ints(ins[1]) if len(ins) > 1 else None
        if idx is None or data.ndim != 1 or int(a.get("axis", 0)) != 0:
            return None
        return data[np.array(idx, dtype=np.int64).reshape(ins[1].shape)]
    if t == "Unsqueeze":
        axes = a.get("axes") if "axes" in a else ints(ins[1]) if len(ins) > 1 else None
        if axes is None:
            return None
        out = data
        for ax in sorted(int(x) % (data.ndim + len(axes)) for x in axes):
            out = np.expand_dims(out, ax)
        return out
    if t == "Squeeze":
        return data.reshape(tuple(d for d in data.shape if d != 1))
    if t == "Reshape":
        shape = ints(ins[1]) if len(ins) > 1 else None
        return None if shape is None else data.reshape(shape)
    if t == "Concat":
        parts = [data] + known
        if len(parts) != len([i for i in p.input if i]):
            return None
        return np.concatenate(parts, axis=int(a.get("axis", 0)))
    if t == "Slice":
        starts, ends = (ints(ins[1]), ints(ins[2])) if len(ins) > 2 else (a.get("starts"), a.get("ends"))
        if starts is None or ends is None or data.ndim != 1 or len(starts) != 1:
            return None
        steps = ints(ins[4]) if len(ins) > 4 and ins[4] is not None else [1]
        return data[slice(int(starts[0]), int(ends[0]), int(steps[0]))]
    if t in ("Div", "Mul", "Add", "Sub") and len(ins) == 2 and ins[1] is not None:
        lhs, rhs = np.broadcast_arrays(data, ins[1])
        fn = {"Div": _int_div, "Mul": lambda x, y: x * y, "Add": lambda x, y: x + y,
              "Sub": lambda x, y: x - y}[t]
        flat = [None if x is None or y is None else fn(int(x), int(y))
                for x, y in zip(lhs.reshape(-1), rhs.reshape(-1))]
        return np.array(flat, dtype=object).reshape(lhs.shape)
    return None


def slice_bounds(g: Graph, sl: onnx.NodeProto, shape_nodes: list[str]
                 ) -> tuple[list[int], list[int], list[int] | None, list[int] | None]:
    """(starts, ends, axes, steps) of a Slice, from its attributes (opset < 10) or its inputs, constant or static
    shape arithmetic (whose nodes join `shape_nodes`); axes and steps are None where not given. Raises
    MatchRefused("slice-bounds-unknown") where a bound cannot be proven."""
    a = attributes(sl)

    def values(i: int, attr: str) -> list[int] | None:
        if len(sl.input) > 1 or attr not in a:   # opset >= 10: inputs
            if len(sl.input) <= i or not sl.input[i]:
                return None
            arr = static_ints(g, sl.input[i], shape_nodes)
            if arr is None:
                raise MatchRefused(sl.name, "slice-bounds-unknown", f"input {i} ({sl.input[i]!r}) of Slice "
                                   f"{sl.name!r} is not constant nor static shape arithmetic")
            return [int(x) for x in arr.reshape(-1)]
        return [int(x) for x in a[attr]]

    starts, ends = values(1, "starts"), values(2, "ends")
    if starts is None or ends is None:
        raise MatchRefused(sl.name, "slice-bounds-unknown", f"Slice {sl.name!r} has no starts/ends")
    return starts, ends, values(3, "axes"), values(4, "steps") if len(sl.input) > 4 else None


def clamp_index(v: int, width: int, lo: int = 0, hi: int | None = None) -> int:
    """A Slice bound on an axis of size `width`, as ONNX clamps it: negative counts from the end, then clamped to
    [lo, hi] (hi None: `width`). A step > 0 takes the defaults; a step < 0 clamps its start to [0, width - 1] and
    its end to [-1, width - 1]."""
    return min(max(v + width if v < 0 else v, lo), width if hi is None else hi)


# ---- static values: what shape arithmetic computes where the graph's own structure fixes it ------------------
#
# `StaticValues` evaluates values computed by shape arithmetic (Shape -> Gather / Slice / Concat / Div / Cast /
# Sqrt / ...) where the dims they read are fixed, even though the tensors around them have symbolic dims. An
# entry may be unknown while the vector is built (Shape of [batch, 16] is [?, 16]; Gather of its entry 1 is 16).
# Fully known results are computed exactly as onnxruntime computes them: integer arithmetic, and IEEE operations
# that are correctly rounded (+ - * / sqrt, casts); no transcendental functions, whose last bit libm may round
# differently.

# Ops a static evaluation computes when all its inputs are known.
STATIC_OPS = frozenset({"Shape", "Size", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Reshape", "Identity",
                        "Cast", "Div", "Mul", "Add", "Sub", "Floor", "Ceil", "Sqrt", "Neg", "Abs", "Reciprocal", "Max",
                        "Min", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or",
                        "Where", "Range", "ConstantOfShape", "Expand", "Mod", "Transpose",
                        "Clip"})
# Ops it also computes on int vectors with unknown entries.
_PARTIAL_OPS = frozenset({"Gather", "Unsqueeze", "Squeeze", "Reshape", "Identity", "Cast", "Concat", "Div", "Mul",
                          "Add", "Sub", "Floor", "Slice", "Equal", "Where"})
_INT_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT16,
                        onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.UINT16,
                        onnx.TensorProto.UINT32, onnx.TensorProto.UINT64})
_CAST_TARGETS = _INT_TYPES | {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                              onnx.TensorProto.BOOL}
MAX_STATIC_ELEMENTS = 1 << 16
_MAX_STATIC_DEPTH = 48


class StaticValues:
    """Values statically known from the graph's structure (memoised per view): `known(v)` is a numpy array of
    v's type where every element is fixed, else None. `shape_of(v)` gives the dims a Shape reads (ints, None
    where not fixed): the inferred shape by default, or a prover's that knows more."""

    def __init__(self, g: Graph, shape_of=None) -> None:
        self.g = g
        self.shape_of = shape_of if shape_of is not None else g.shape
        self.memo: dict[str, np.ndarray | None] = {}

    def known(self, v: str) -> np.ndarray | None:
        r = self.eval(v)
        return r if r is not None and r.dtype != object else None

    def eval(self, v: str, depth: int = 0) -> np.ndarray | None:
        """A typed array (fully known), an object array of ints and None (an int vector with unknown entries),
        or None."""
        if v in self.memo:
            return self.memo[v]
        self.memo[v] = None     # cycles in malformed graphs
        r = self._eval(v, depth) if depth < _MAX_STATIC_DEPTH else None
        if r is not None and r.size > MAX_STATIC_ELEMENTS:
            r = None
        self.memo[v] = r
        return r

    def _eval(self, v: str, depth: int) -> np.ndarray | None:
        g = self.g
        p = g.producer_of(v)
        if p is None or p.op_type == "Constant":
            if not g.is_constant(v) or not v:
                return None
            c = g.constant(v)
            return None if c is None or c.size > MAX_STATIC_ELEMENTS else np.asarray(c)
        if not std_op(p, *STATIC_OPS) or v != p.output[0]:
            return None
        s = self.shape_of(v)
        if s is not None and (any(not isinstance(d, int) for d in s) or math.prod(s) > MAX_STATIC_ELEMENTS):
            return None     # a tensor whose size is not fixed, or too big to be shape arithmetic
        a = attributes(p)
        if p.op_type in ("Shape", "Size"):
            dims = self.shape_of(p.input[0])
            if dims is None:
                return None
            dims = [d if isinstance(d, int) else Sym.parse(d) or DIM for d in dims]
            if p.op_type == "Size":
                return np.array(math.prod(dims), dtype=np.int64) if all(isinstance(d, int) for d in dims) else None
            n = len(dims)
            start, end = a.get("start", 0), a.get("end", n)
            start, end = (max(0, min(x + n if x < 0 else x, n)) for x in (start, end))
            dims = dims[start:end]
            return np.array(dims, dtype=np.int64) if all(isinstance(d, int) for d in dims) else _objects(dims)
        ins = [self.eval(x, depth + 1) if x else None for x in p.input]
        try:
            if all(x is not None and x.dtype != object for x, name in zip(ins, p.input) if name):
                return _compute(p, a, ins, g.opset.get("", 1))
            if p.op_type in _PARTIAL_OPS and ins and ins[0] is not None:
                if p.op_type == "Cast" and a.get("to") not in _INT_TYPES:
                    return None
                if p.op_type in _PARTIAL_ARITHMETIC:
                    out = _partial_arithmetic(p.op_type, ins)
                else:
                    out = _evaluate(p, a, ins[0], ins)
                return None if out is None else _typed_if_known(np.asarray(out, dtype=object), g.dtype(v))
        except (ValueError, IndexError, TypeError, ZeroDivisionError, OverflowError, KeyError):
            return None
        return None


class _UnknownDim:
    """An entry of a partially known int vector that is not fixed but is a dim, or sum, product or quotient of
    dims: never negative (so it is not the -1 of the expand idiom)."""

    def __repr__(self) -> str:
        return "DIM"


DIM = _UnknownDim()


class Sym:
    """An entry that is `k` times the symbolic dim `name` (the symbols of one shape-inference run: equal names,
    equal values): how a dim the types leave symbolic is carried through Gather / Concat / Mul / Div, so a
    Reshape target built from it is known by its symbols (`batch`, `4*batch`)."""

    __slots__ = ("name", "k")

    def __init__(self, name: str, k: int = 1) -> None:
        self.name, self.k = name, k

    @staticmethod
    def parse(d: Any) -> Sym | None:
        if not isinstance(d, str) or not d:
            return None
        parts = [p.strip() for p in d.split("*")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isidentifier():
            return Sym(parts[1], int(parts[0]))
        if len(parts) == 2 and parts[1].isdigit() and parts[0].isidentifier():
            return Sym(parts[0], int(parts[1]))
        return Sym(d)

    def render(self) -> str:
        return self.name if self.k == 1 else f"{self.k}*{self.name}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sym) and other.name == self.name and other.k == self.k

    def __hash__(self) -> int:
        return hash((self.name, self.k))

    def __repr__(self) -> str:
        return self.render()
_PARTIAL_ARITHMETIC = frozenset({"Add", "Mul", "Div", "Sub", "Floor", "Equal", "Where"})


def _objects(items) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = list(items)
    return arr


def _partial_arithmetic(op: str, ins: list) -> np.ndarray | None:
    """Elementwise arithmetic on vectors whose entries may be DIM (a non-negative unknown) or None (unknown)."""
    if op == "Floor":
        return ins[0]
    if op == "Where":
        if any(x is None for x in ins[:3]):
            return None
        c, x, y = np.broadcast_arrays(*(np.asarray(i, dtype=object) for i in ins[:3]))
        if any(not isinstance(b, (bool, np.bool_)) for b in c.reshape(-1)):
            return None
        return np.array([u if bool(b) else w for b, u, w in zip(c.reshape(-1), x.reshape(-1), y.reshape(-1))],
                        dtype=object).reshape(c.shape)
    if len(ins) != 2 or ins[1] is None:
        return None
    lhs, rhs = np.broadcast_arrays(np.asarray(ins[0], dtype=object), np.asarray(ins[1], dtype=object))
    out = [_entry(op, u, w) for u, w in zip(lhs.reshape(-1), rhs.reshape(-1))]
    return np.array(out, dtype=object).reshape(lhs.shape)


def _entry(op: str, u, w):
    """One element of partial arithmetic: ints, Sym (a symbolic dim), DIM (a non-negative unknown), None."""
    def fixed(x) -> bool:
        return x is not None and x is not DIM and not isinstance(x, Sym)

    if fixed(u) and fixed(w):
        if op == "Equal":
            return bool(u == w)
        if isinstance(u, (bool, np.bool_)) or isinstance(w, (bool, np.bool_)):
            return None
        u, w = int(u), int(w)
        return {"Add": lambda: u + w, "Sub": lambda: u - w, "Mul": lambda: u * w,
                "Div": lambda: _int_div(u, w) if w else None}[op]()
    if u is None or w is None or isinstance(u, (bool, np.bool_)) or isinstance(w, (bool, np.bool_)):
        return None
    if op == "Equal":   # a dim is never negative; equal symbols are equal dims
        if isinstance(u, Sym) and isinstance(w, Sym) and u == w:
            return True
        other = w if not fixed(u) else u if not fixed(w) else None
        return False if other is not None and fixed(other) and int(other) < 0 else None
    if not fixed(u) and fixed(w) or fixed(u) and not fixed(w):
        sym, c = (u, int(w)) if fixed(w) else (w, int(u))
        if op in ("Add", "Sub") and c == 0 and (op == "Add" or sym is u):
            return sym
        if op == "Mul" and c >= 0:
            return 0 if c == 0 else Sym(sym.name, sym.k * c) if isinstance(sym, Sym) else DIM
        if op == "Div" and sym is u and c > 0:
            return Sym(sym.name, sym.k // c) if isinstance(sym, Sym) and sym.k % c == 0 else DIM
        if op == "Add" and c >= 0:
            return DIM
        return None
    if op == "Sub" and isinstance(u, Sym) and u == w:
        return 0
    return DIM if op in ("Add", "Mul") else None


def _typed_if_known(arr: np.ndarray, dtype) -> np.ndarray:
    if dtype is None or any(e is None or e is DIM or isinstance(e, Sym) for e in arr.reshape(-1)):
        return arr
    return np.array(arr.tolist(), dtype=dtype).reshape(arr.shape)


def _compute(p: onnx.NodeProto, a: dict[str, Any], ins: list, opset: int) -> np.ndarray | None:
    """One node on fully known inputs, exactly as onnxruntime computes it (None: not computed here)."""
    t = p.op_type
    x = ins[0] if ins else None

    def ints(i: int) -> list[int] | None:
        return [int(e) for e in ins[i].reshape(-1)] if len(ins) > i and ins[i] is not None else None

    if t == "Identity":
        return x
    if t == "Cast":
        to = a.get("to")
        if to not in _CAST_TARGETS:
            return None
        if to in _INT_TYPES and x.dtype.kind == "f" and not np.all(np.isfinite(x)):
            return None
        return x.astype(helper.tensor_dtype_to_np_dtype(to))
    if t in ("Add", "Sub", "Mul", "Div", "Max", "Min", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
             "And", "Or"):
        y = ins[1]
        if x.dtype != y.dtype:
            return None
        if t == "Div":
            if x.dtype.kind in "iu":
                if np.any(y == 0):
                    return None
                q = np.abs(x) // np.abs(y)
                return np.where((x >= 0) == (y > 0), q, -q).astype(x.dtype)
            return np.divide(x, y)
        fn = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Max": np.maximum, "Min": np.minimum,
              "Equal": np.equal, "Less": np.less, "Greater": np.greater, "LessOrEqual": np.less_equal,
              "GreaterOrEqual": np.greater_equal, "And": np.logical_and, "Or": np.logical_or}[t]
        if t in ("Max", "Min") and x.dtype.kind == "f" and (np.any(np.isnan(x)) or np.any(np.isnan(y))):
            return None
        with np.errstate(all="ignore"):
            out = fn(x, y)
        return out.astype(x.dtype) if t in ("Add", "Sub", "Mul", "Max", "Min") else out
    if t in ("Sqrt", "Neg", "Abs", "Reciprocal", "Floor", "Ceil", "Not"):
        if t in ("Sqrt", "Reciprocal", "Floor", "Ceil") and x.dtype.kind != "f":
            return None
        fn = {"Sqrt": np.sqrt, "Neg": np.negative, "Abs": np.abs, "Reciprocal": np.reciprocal, "Floor": np.floor,
              "Ceil": np.ceil, "Not": np.logical_not}[t]
        with np.errstate(all="ignore"):
            return fn(x).astype(x.dtype)
    if t == "Mod":
        # Swin's window padding: (window - W % window) % window. Integers only: fmod=0 takes the divisor's sign
        # (numpy's mod), fmod=1 the dividend's (C's fmod); a float Mod is left to onnxruntime.
        y = ins[1]
        if x.dtype != y.dtype or x.dtype.kind not in "iu" or np.any(y == 0):
            return None
        return (np.fmod(x, y) if a.get("fmod", 0) else np.mod(x, y)).astype(x.dtype)
    if t == "Clip":
        # timm's TF-"same" pad: max((ceil(W / s) - 1) * s + (k - 1) * d + 1 - W, 0), in floats or ints (opset >= 11:
        # bounds as inputs, either may be absent). A max or min never rounds; NaN, whose handling may differ, is
        # left to onnxruntime.
        if x.dtype.kind not in "iuf" or opset < 11:
            return None
        lo = ins[1] if len(ins) > 1 and p.input[1] else None
        hi = ins[2] if len(ins) > 2 and p.input[2] else None
        if any(b is not None and (b.dtype != x.dtype or b.size != 1) for b in (lo, hi)):
            return None
        if x.dtype.kind == "f" and any(b is not None and np.any(np.isnan(b)) for b in (x, lo, hi)):
            return None
        out = x
        if lo is not None:
            out = np.maximum(out, lo.reshape(()))
        if hi is not None:
            out = np.minimum(out, hi.reshape(()))
        return out.astype(x.dtype)
    if t == "Transpose":
        perm = a.get("perm")
        return np.transpose(x, [int(i) for i in perm] if perm is not None else None)
    if t == "Where":
        if ins[1].dtype != ins[2].dtype:
            return None
        return np.where(x.astype(bool), ins[1], ins[2])
    if t == "Gather":
        axis = int(a.get("axis", 0))
        idx = ins[1].astype(np.int64)
        n = x.shape[axis]
        if np.any(idx >= n) or np.any(idx < -n):
            return None
        return np.take(x, idx, axis=axis)
    if t == "Concat":
        return np.concatenate([i for i, name in zip(ins, p.input) if name], axis=int(a["axis"]))
    if t in ("Unsqueeze", "Squeeze"):
        axes = a.get("axes") if "axes" in a else ints(1)
        if t == "Squeeze":
            if axes is None:
                return x.reshape(tuple(d for d in x.shape if d != 1))
            return np.squeeze(x, axis=tuple(int(ax) % x.ndim for ax in axes))
        if axes is None:
            return None
        out = x
        for ax in sorted(int(ax) % (x.ndim + len(axes)) for ax in axes):
            out = np.expand_dims(out, ax)
        return out
    if t == "Reshape":
        shape = ints(1)
        if shape is None:
            return None
        if not a.get("allowzero", 0):
            shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return x.reshape(shape)
    if t == "Slice":
        if len(p.input) < 3:
            return None   # opset < 10: bounds as attributes, not seen in shape arithmetic
        starts, ends = ints(1), ints(2)
        axes = ints(3) if len(p.input) > 3 and p.input[3] else list(range(len(starts)))
        steps = ints(4) if len(p.input) > 4 and p.input[4] else [1] * len(starts)
        if any(s == 0 for s in steps):
            return None
        index = [slice(None)] * x.ndim
        for s, e, ax, st in zip(starts, ends, axes, steps):
            n = x.shape[ax]
            if st > 0:
                index[ax] = slice(clamp_index(s, n), clamp_index(e, n), st)
            else:   # a reversal (torch's F.pad flips its pad list); an end of -1 runs through index 0
                end = clamp_index(e, n, -1, n - 1)
                index[ax] = slice(clamp_index(s, n, 0, n - 1), end if end >= 0 else None, st)
        return x[tuple(index)]
    if t == "Range":
        if x.dtype.kind not in "iu":
            return None   # float ranges accumulate: leave them to onnxruntime
        return np.arange(int(x), int(ins[1]), int(ins[2]), dtype=x.dtype) if int(ins[2]) else None
    if t == "ConstantOfShape":
        value = a.get("value")
        fill = numpy_helper.to_array(value).reshape(-1) if value is not None else np.zeros(1, np.float32)
        shape = [int(d) for d in x.reshape(-1)]
        if math.prod(shape) > MAX_STATIC_ELEMENTS:
            return None
        return np.full(shape, fill[0], dtype=fill.dtype)
    if t == "Expand":
        shape = np.broadcast_shapes(x.shape, tuple(int(d) for d in ins[1].reshape(-1)))
        if math.prod(shape) > MAX_STATIC_ELEMENTS:
            return None
        return np.broadcast_to(x, shape).copy()
    return None


def squeezed(op: str, x: tuple, axes: list[int] | None) -> tuple | None:
    """The dims of Squeeze / Unsqueeze (`op`) of dims `x` over `axes` (None: no axes given, which a Squeeze reads
    as every dim of size 1, known only where every dim is a number)."""
    if op == "Squeeze":
        if axes is None:
            return tuple(d for d in x if d != 1) if all(isinstance(d, int) for d in x) else None
        drop = {ax % len(x) for ax in axes}
        return tuple(d for i, d in enumerate(x) if i not in drop)
    if axes is None:
        return None
    rank = len(x) + len(axes)
    put = {ax % rank for ax in axes}
    it = iter(x)
    return tuple(1 if i in put else next(it) for i in range(rank))
