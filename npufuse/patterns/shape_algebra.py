"""Static shape arithmetic and Slice bounds, shared by the patterns that must prove where a tensor is cut.

Exporters compute Slice bounds and Split sizes from shapes (TorchScript writes `d = h.shape[-1] // 2;
h[..., :d], h[..., d:]` as Shape -> Gather -> Div -> Unsqueeze -> Slice). Where the dims involved are fixed, the
bounds are constants in all but form: `static_ints` evaluates them, and `slice_bounds` reads a Slice's starts,
ends, axes and steps whichever way the opset gives them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from npufuse.graph import Graph, attributes
from npufuse.patterns.matching import MatchRefused, std_op

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


def clamp_index(v: int, width: int) -> int:
    """A Slice bound on an axis of size `width`, as ONNX clamps it (negative counts from the end; step > 0)."""
    return min(max(v + width if v < 0 else v, 0), width)
