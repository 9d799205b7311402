"""Shape terms and layout algebra shared by the patterns and the canonicaliser.

What a shape-computing subgraph evaluates to (`ShapeEval`: ints and run-time dims as terms), which dimensions
are provably equal (`Dims`: a union-find over (value, axis), inferred symbols and ints), and which Reshape /
Transpose / Expand / Tile / Concat chains are a head split, a K transpose (plain or flattened to 3-D), or a
grouped-query head repeat. Also the scalar factors (a Mul/Div by a constant scalar) that may move through such
layout steps, and the shape-only side computations an absorbed region may take with it.

Exporters build Reshape and Expand targets from shapes at run time (Shape -> Gather -> Concat), so proofs here
are symbolic: a target proven to keep [B, S] of its input is as good as a constant one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from npufuse.graph import Graph, attributes

# Ops that only compute shapes: absorbed with the attention when they read its intermediates' shapes
# and feed nothing but the absorbed nodes.
SHAPE_OPS = frozenset({"Shape", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Cast", "Reshape", "Mul",
                        "Add", "Sub", "Div", "Equal", "Where", "ConstantOfShape", "Identity", "Range", "Expand"})
_MAX_CLOSURE_NODES = 64


# ---- shape arithmetic: what a shape-computing subgraph evaluates to --------------------------------------
#
# A term is an int, ("dim", value, axis) — the size of `value` along `axis` at run time — or
# ("mul", term, k). Evaluating the small Shape/Gather/Concat/... subgraphs exporters build for Reshape and
# Expand targets lets the matcher prove what a Reshape does without running it.

Term = Any


class ShapeEval:
    """Evaluates 1-D int shape tensors to lists of terms (memoised per match)."""

    def __init__(self, g: Graph) -> None:
        self.g = g
        self.memo: dict[str, tuple[list[Term], bool] | None] = {}

    def terms(self, value: str) -> list[Term] | None:
        r = self.eval(value)
        return None if r is None or r[1] else r[0]

    def eval(self, value: str, depth: int = 0) -> tuple[list[Term], bool] | None:
        """(terms, is_scalar) or None where the value is not a shape expression this understands."""
        if value in self.memo:
            return self.memo[value]
        self.memo[value] = None  # guards against cycles in malformed graphs
        r = self._eval(value, depth) if depth < 24 else None
        self.memo[value] = r
        return r

    def _eval(self, value: str, depth: int) -> tuple[list[Term], bool] | None:
        g = self.g
        if g.is_constant(value):
            arr = g.constant(value)
            if arr is None or arr.ndim > 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
                return None
            vals = [bool(x) if arr.dtype == np.bool_ else int(x) for x in arr.reshape(-1)]
            return vals, arr.ndim == 0
        p = g.producer_of(value)
        if p is None:
            return None
        op, a = p.op_type, attributes(p)
        ev = (lambda v: self.eval(v, depth + 1))
        if op == "Shape":
            rank = g.rank(p.input[0])
            if rank is None:
                return None
            start, end = _clamp_range(a.get("start", 0), a.get("end", rank), rank)
            shape = g.shape(p.input[0]) or (None,) * rank
            return [shape[i] if isinstance(shape[i], int) else ("dim", p.input[0], i) for i in range(start, end)], False
        if op in ("Cast", "Identity"):
            return ev(p.input[0])
        if op == "Gather" and a.get("axis", 0) == 0:
            data, idx = ev(p.input[0]), g.constant(p.input[1])
            if data is None or data[1] or idx is None or idx.ndim > 1:
                return None
            n = len(data[0])
            try:
                picked = [data[0][int(i) + (n if int(i) < 0 else 0)] for i in idx.reshape(-1)]
            except IndexError:
                return None
            return picked, idx.ndim == 0
        if op == "Unsqueeze":
            x = ev(p.input[0])
            return (x[0], False) if x is not None and x[1] else None
        if op == "Squeeze":
            x = ev(p.input[0])
            return (x[0], True) if x is not None and len(x[0]) == 1 else None
        if op == "Concat":
            parts = [ev(v) for v in p.input]
            if any(x is None or x[1] for x in parts):
                return None
            return [t for x in parts for t in x[0]], False
        if op == "Reshape":
            x, shape = ev(p.input[0]), g.constant(p.input[1])
            if x is None or shape is None or shape.size != 1 or int(shape.reshape(-1)[0]) not in (-1, len(x[0])):
                return None
            return x[0], False
        if op == "Slice":
            data = ev(p.input[0])
            consts = [g.constant(v) if v else None for v in list(p.input[1:]) + [""] * (5 - len(p.input))]
            starts, ends, axes, steps = consts[0], consts[1], consts[2], consts[3]
            if data is None or data[1] or starts is None or ends is None or starts.size != 1 or ends.size != 1:
                return None
            if (axes is not None and int(axes.reshape(-1)[0]) not in (0, -1)) or \
                    (steps is not None and int(steps.reshape(-1)[0]) != 1):
                return None
            n = len(data[0])
            s, e = _clamp_range(int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0]), n)
            return data[0][s:e], False
        if op == "ConstantOfShape":
            shape = ev(p.input[0])
            if shape is None or shape[1] or len(shape[0]) != 1 or not isinstance(shape[0][0], int):
                return None
            t = a.get("value")
            fill = numpy_helper.to_array(t).reshape(-1)[0].item() if t is not None else 0
            return [fill] * shape[0][0], False
        if op in ("Mul", "Equal"):
            x, y = ev(p.input[0]), ev(p.input[1])
            if x is None or y is None:
                return None
            pairs = _broadcast_pairs(x[0], y[0])
            if pairs is None:
                return None
            fn = _term_mul if op == "Mul" else _term_equal
            out = [fn(u, w) for u, w in pairs]
            if any(o is None for o in out):
                return None
            return out, x[1] and y[1]
        if op == "Where":
            c, x, y = ev(p.input[0]), ev(p.input[1]), ev(p.input[2])
            if c is None or x is None or y is None or any(not isinstance(b, bool) for b in c[0]):
                return None
            n = max(len(c[0]), len(x[0]), len(y[0]))
            if any(len(t[0]) not in (1, n) for t in (c, x, y)):
                return None
            pick = [(x[0] if len(x[0]) > 1 else x[0] * n)[i] if (c[0] if len(c[0]) > 1 else c[0] * n)[i]
                    else (y[0] if len(y[0]) > 1 else y[0] * n)[i] for i in range(n)]
            return pick, c[1] and x[1] and y[1]
        return None


def _clamp_range(start: int, end: int, n: int) -> tuple[int, int]:
    start = start + n if start < 0 else start
    end = end + n if end < 0 else end
    return max(0, min(start, n)), max(0, min(end, n))


def _broadcast_pairs(x: list, y: list) -> list[tuple] | None:
    if len(x) == len(y):
        return list(zip(x, y))
    if len(x) == 1:
        return [(x[0], w) for w in y]
    if len(y) == 1:
        return [(u, y[0]) for u in x]
    return None


def _term_mul(u: Term, w: Term) -> Term | None:
    if isinstance(u, bool) or isinstance(w, bool):
        return None
    if isinstance(u, int) and isinstance(w, int):
        return u * w
    if isinstance(w, int):
        u, w = w, u
    if isinstance(u, int):
        return w if u == 1 else ("mul", w, u)
    return None


def _term_equal(u: Term, w: Term) -> bool | None:
    if isinstance(u, int) and isinstance(w, int):
        return u == w
    # a run-time dimension is never negative: comparing it with -1 (the expand idiom) is decidable
    if isinstance(u, int) and u < 0 or isinstance(w, int) and w < 0:
        return False
    return None


class Dims:
    """Which dimensions are known to be equal: a union-find over (value, axis), inferred symbols, ints and
    the attention's own symbols (B, H, Sq, Sk, D, Dv), so a Reshape target built from the shape of some
    other tensor can be proven to keep the batch or sequence dimension."""

    def __init__(self, g: Graph) -> None:
        self.g = g
        self.parent: dict[Any, Any] = {}
        self.int_of: dict[Any, int] = {}

    def _find(self, k: Any) -> Any:
        self.parent.setdefault(k, k)
        while self.parent[k] != k:
            self.parent[k] = self.parent[self.parent[k]]
            k = self.parent[k]
        return k

    def _union(self, a: Any, b: Any) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra == rb:
            return
        self.parent[rb] = ra
        if rb in self.int_of:
            self.int_of.setdefault(ra, self.int_of[rb])

    def key(self, value: str, axis: int) -> Any:
        """The class of `value`'s dimension `axis`, linked to its inferred int or symbol on first use."""
        k = ("v", value, axis)
        if k not in self.parent:
            self.parent[k] = k
            shape = self.g.shape(value)
            if shape is not None and 0 <= axis < len(shape):
                d = shape[axis]
                if isinstance(d, int):
                    self.set_int(k, d)
                elif isinstance(d, str) and d:
                    # symbols from one shape-inference run are consistent across the graph
                    self._union(("sym", d), k)
                    product = _symbol_product(d)
                    if product is not None:   # the dynamo exporter's '4*batch': 4 times the dim 'batch'
                        factor, name = product
                        self._union(("sym", d), self._find(("mulc", self._find(("sym", name)), factor)))
        return self._find(k)

    def set_int(self, k: Any, n: int) -> None:
        self._union(("int", n), k)
        self.int_of[self._find(k)] = n

    def bind(self, value: str, symbols: Sequence[str | None]) -> None:
        """Declare `value`'s dimensions to be the attention's symbols (None: leave that axis alone)."""
        for axis, s in enumerate(symbols):
            if s is not None:
                self._union(("c", s), self.key(value, axis))

    def sym(self, s: str) -> Any:
        return self._find(("c", s))

    def int_value(self, k: Any) -> int | None:
        return self.int_of.get(self._find(k))

    def term_key(self, t: Term) -> Any | None:
        """The class a term belongs to (ints by value), or None for a product this cannot resolve."""
        if isinstance(t, bool):
            return None
        if isinstance(t, int):
            return self._find(("int", t))
        if t[0] == "dim":
            return self.key(t[1], t[2])
        if t[0] == "mul":
            inner = self.term_key(t[1])
            if inner is None:
                return None
            n = self.int_value(inner)
            return self._find(("int", n * t[2])) if n is not None else self._find(("mulc", self._find(inner), t[2]))
        return None

    def same(self, a: Any, b: Any) -> bool:
        if a is None or b is None:
            return False
        ra, rb = self._find(a), self._find(b)
        if ra == rb:
            return True
        ia, ib = self.int_of.get(ra), self.int_of.get(rb)
        return ia is not None and ia == ib


def _symbol_product(d: str) -> tuple[int, str] | None:
    """(k, name) for a symbolic dim written 'k*name' or 'name*k' (torch.export's dims of a merged batch)."""
    parts = d.split("*")
    if len(parts) != 2:
        return None
    a, b = (p.strip() for p in parts)
    if a.isdigit() and b.isidentifier():
        return int(a), b
    if b.isdigit() and a.isidentifier():
        return int(b), a
    return None


def product_key(dims: Dims, value: str, i: int, j: int) -> Any | None:
    """The class of dims i·j of `value` (one of them an int), or None where both are symbolic."""
    ki, kj = dims.key(value, i), dims.key(value, j)
    ni, nj = dims.int_value(ki), dims.int_value(kj)
    if ni is not None and nj is not None:
        return dims._find(("int", ni * nj))
    if nj is not None:
        return dims.term_key(("mul", ("dim", value, i), nj))
    if ni is not None:
        return dims.term_key(("mul", ("dim", value, j), ni))
    return None


def merged_heads(g: Graph, ev: ShapeEval, dims: Dims, node: onnx.NodeProto | None) -> str | None:
    """x if `node` is Reshape(x, [B·H, M, N]) of a 4-D x [B, H, M, N] (the heads merged into the batch, as
    torch's bmm/baddbmm attention writes it), proven from the target or the inferred shapes; else None."""
    if node is None or node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    x = node.input[0]
    if g.rank(x) != 4 or g.rank(node.output[0]) not in (None, 3):
        return None
    first = product_key(dims, x, 0, 1)
    expected = [first if first is not None else ("unprovable", node.name), dims.key(x, 2), dims.key(x, 3)]
    return x if reshape_keeps(g, dims, ev, node, expected) else None


# ops that keep their dynamic operand's shape when the other operand is a constant scalar
_SHAPE_KEEPING_UNARY = frozenset({"Cast", "Neg", "Identity", "Softmax", "Relu", "Exp", "Sqrt", "Abs"})
_SCALAR_BINARY = frozenset({"Add", "Sub", "Mul", "Div"})


def dim_is(g: Graph, ev: ShapeEval, dims: Dims, value: str, axis: int, want: Any, depth: int = 6) -> bool:
    """True if dim `axis` of `value` is provably the class `want`: from the inferred shape, or followed up
    through ops that keep the shape (Cast, a scalar Mul/Add/..., ...) to a Reshape whose target says so."""
    if want is None:
        return False
    if dims.same(dims.key(value, axis), want):
        return True
    p = g.producer_of(value)
    if p is None or depth <= 0 or p.domain not in ("", "ai.onnx"):
        return False
    if p.op_type in _SHAPE_KEEPING_UNARY and p.input:
        return dim_is(g, ev, dims, p.input[0], axis, want, depth - 1)
    if p.op_type in _SCALAR_BINARY and len(p.input) == 2:
        pair = const_operand(g, p)
        c = g.constant(pair[1]) if pair is not None else None
        if c is not None and c.size == 1 and c.ndim <= (g.rank(pair[0]) or 0):
            return dim_is(g, ev, dims, pair[0], axis, want, depth - 1)
        return False
    if p.op_type == "Reshape" and len(p.input) > 1:
        terms = ev.terms(p.input[1])
        if terms is None or axis >= len(terms):
            return False
        t = terms[axis]
        if t == 0 and not attributes(p).get("allowzero", 0):
            return dim_is(g, ev, dims, p.input[0], axis, want, depth - 1) if axis < (g.rank(p.input[0]) or 0) \
                else False
        return t != -1 and dims.same(dims.term_key(t), want)
    return False


def static_shape(g: Graph, value: str, depth: int = 8) -> tuple[Any, ...] | None:
    """The inferred shape of `value`, or where shape inference lost it (a Reshape target that became a constant
    only after inference ran) the shape recomputed from its producers: Reshape to a constant target, Unsqueeze,
    Squeeze, Transpose, Gather of a scalar index, Cast / Identity. Dims are ints or symbols; None if unknown."""
    s = g.shape(value)
    if s is not None or depth <= 0:
        return s
    p = g.producer_of(value)
    if p is None or p.domain not in ("", "ai.onnx") or not p.input:
        return None
    a = attributes(p)
    op = p.op_type
    if op in ("Cast", "Identity"):
        return static_shape(g, p.input[0], depth - 1)
    x = static_shape(g, p.input[0], depth - 1)
    if x is None:
        return None
    if op == "Reshape" and len(p.input) > 1 and g.is_constant(p.input[1]):
        t = g.constant(p.input[1])
        if t is None or t.ndim != 1:
            return None
        out = [x[i] if v == 0 and not a.get("allowzero", 0) and i < len(x) else int(v) for i, v in enumerate(t)]
        if -1 in out:
            if not all(isinstance(d, int) for d in x) or any(not isinstance(d, int) for d in out):
                return None
            known = math.prod(d for d in out if d != -1)
            if known == 0 or math.prod(x) % known:
                return None
            out[out.index(-1)] = math.prod(x) // known
        return tuple(out)
    if op in ("Unsqueeze", "Squeeze"):
        axes = a.get("axes")
        if axes is None and len(p.input) > 1 and g.is_constant(p.input[1]):
            c = g.constant(p.input[1])
            axes = None if c is None else [int(v) for v in c.reshape(-1)]
        if axes is None:
            return None
        if op == "Squeeze":
            axes = {ax % len(x) for ax in axes}
            return tuple(d for i, d in enumerate(x) if i not in axes)
        n = len(x) + len(axes)
        axes = {ax % n for ax in axes}
        it = iter(x)
        return tuple(1 if i in axes else next(it) for i in range(n))
    if op == "Transpose":
        perm = a.get("perm") or list(range(len(x)))[::-1]
        return tuple(x[i] for i in perm) if len(perm) == len(x) else None
    if op == "Gather" and len(p.input) > 1 and g.is_constant(p.input[1]):
        idx = g.constant(p.input[1])
        axis = a.get("axis", 0) % len(x)
        return x[:axis] + tuple(idx.shape) + x[axis + 1:] if idx is not None else None
    return None


def broadcast_shape(a: Sequence[Any] | None, b: Sequence[Any] | None) -> tuple[Any, ...] | None:
    """The shape numpy broadcasting gives two shapes (ints, symbols, None for unknown); None where the rank is
    unknown. A dim is kept where both agree or one is 1, else unknown."""
    if a is None or b is None:
        return None
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + tuple(a)
    b = (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        out.append(y if x == 1 else x if y == 1 or x == y else None)
    return tuple(out)


def reshape_keeps(g: Graph, dims: Dims, ev: ShapeEval, node: onnx.NodeProto,
                   expected: Sequence[Any]) -> bool:
    """True if Reshape `node` provably produces dims `expected` (classes from `dims`, or ints).

    A Reshape keeps the element count, so when every output dim but one is proven and the input holds
    exactly the expected number of elements, the last one is forced as well."""
    out = node.output[0]
    terms = ev.terms(node.input[1])
    if terms is not None and len(terms) != len(expected):
        return False
    out_rank = g.rank(out)
    if terms is None and out_rank != len(expected):
        return False
    allowzero = attributes(node).get("allowzero", 0)
    unproven = 0
    for j, want in enumerate(expected):
        want_key = dims._find(("int", want)) if isinstance(want, int) else want
        proven = dims.same(dims.key(out, j), want_key) if out_rank == len(expected) else False
        if not proven and terms is not None:
            t = terms[j]
            if t == 0 and not allowzero:
                in_rank = g.rank(node.input[0])
                proven = in_rank is not None and j < in_rank and dims.same(dims.key(node.input[0], j), want_key)
            elif t != -1:
                proven = dims.same(dims.term_key(t), want_key)
        unproven += not proven
    return unproven <= 1


def is_transpose(node: onnx.NodeProto | None, perm: tuple[int, ...]) -> bool:
    return node is not None and node.op_type == "Transpose" and tuple(attributes(node).get("perm", ())) == perm


def const_operand(g: Graph, node: onnx.NodeProto) -> tuple[str, str] | None:
    """(dynamic operand, constant operand) of a binary op, in either order; None unless exactly one is constant."""
    a, b = node.input[0], node.input[1]
    if g.is_constant(b) and not g.is_constant(a):
        return a, b
    if g.is_constant(a) and not g.is_constant(b):
        return b, a
    return None


def scale_op(g: Graph, node: onnx.NodeProto) -> tuple[str, float] | None:
    """(scaled operand, factor) of Mul(x, c) / Mul(c, x) / Div(x, c) by a constant scalar; else None."""
    if node.op_type not in ("Mul", "Div") or len(node.input) != 2:
        return None
    pair = const_operand(g, node)
    if pair is None:
        return None
    x, c = pair
    if node.op_type == "Div" and x != node.input[0]:
        return None
    value = uniform_constant(g, c)
    arr = g.constant(c)
    if value is None or arr is None or arr.size != 1 or not math.isfinite(value) or value == 0.0:
        return None
    return x, (1.0 / value if node.op_type == "Div" else value)


def uniform_constant(g: Graph, value: str) -> float | None:
    """A constant whose elements are all equal, as a float (scalars and filled tensors); else None."""
    arr = g.constant(value) if g.is_constant(value) else None
    # bfloat16 (ml_dtypes) is a float numpy does not know as one: its kind is "V"
    if arr is None or arr.size == 0 or (arr.dtype.kind not in "fiu" and arr.dtype.name != "bfloat16"):
        return None
    flat = arr.reshape(-1)
    first = flat[0]
    if not (np.all(flat == first) or (np.isnan(first) and np.all(np.isnan(flat)))):
        return None
    return float(first)


def head_split(g: Graph, ev: ShapeEval, dims: Dims, reshape: onnx.NodeProto) -> int | None:
    """Heads N if `reshape` splits [B, S, N*D] into [B, S, N, D] (provably), else None."""
    x, out = reshape.input[0], reshape.output[0]
    if g.rank(x) != 3:
        return None
    hd = dims.int_value(dims.key(x, 2))
    terms = ev.terms(reshape.input[1])
    d = dims.int_value(dims.key(out, 3)) if g.rank(out) == 4 else None
    if d is None and terms is not None and len(terms) == 4 and isinstance(terms[3], int) and terms[3] > 0:
        d = terms[3]
    if not hd or not d or hd % d:
        return None
    n = hd // d
    if reshape_keeps(g, dims, ev, reshape, [dims.key(x, 0), dims.key(x, 1), n, d]):
        return n
    return None


def flattened_k_transpose(g: Graph, ev: ShapeEval, dims: Dims, last: onnx.NodeProto
                         ) -> tuple[str, list[str]] | None:
    """Kᵀ written as Reshape(Transpose(Reshape(K, [-1, S, D]), (0,2,1)), [B, H, D, S]) (dynamo's SDPA)."""
    if last.op_type != "Reshape":
        return None
    tr = g.producer_of(last.input[0])
    if not is_transpose(tr, (0, 2, 1)):
        return None
    first = g.producer_of(tr.input[0])
    if first is None or first.op_type != "Reshape" or g.rank(first.input[0]) != 4:
        return None
    k = first.input[0]
    t1, t2 = ev.terms(first.input[1]), ev.terms(last.input[1])
    if t1 is None or t2 is None or len(t1) != 3 or len(t2) != 4:
        return None
    kd = [dims.key(k, i) for i in range(4)]
    same = lambda t, key: dims.same(dims.term_key(t), key) if t not in (0, -1) else False  # noqa: E731
    if not (t1[0] == -1 and same(t1[1], kd[2]) and same(t1[2], kd[3])):
        return None
    if not (same(t2[0], kd[0]) and same(t2[1], kd[1]) and same(t2[2], kd[3]) and same(t2[3], kd[2])):
        return None
    return k, [first.name, tr.name, last.name]


def gqa_repeat(g: Graph, ev: ShapeEval, dims: Dims, value: str) -> tuple[str, list[str], int, str] | None:
    """K/V heads repeated for grouped-query attention: (source, nodes, n_rep, "interleave" | "tile")."""
    p = g.producer_of(value)
    if p is None:
        return None
    if p.op_type == "Tile" and g.rank(p.input[0]) == 4:
        reps = g.constant(p.input[1]) if g.is_constant(p.input[1]) else None
        if reps is not None and reps.size == 4 and [int(r) for r in reps[[0, 2, 3]]] == [1, 1, 1] and reps[1] > 1:
            return p.input[0], [p.name], int(reps[1]), "tile"
        return None
    if p.op_type == "Concat" and attributes(p).get("axis") in (1, -3) and len(p.input) > 1 and \
            len(set(p.input)) == 1 and g.rank(p.input[0]) == 4:
        return p.input[0], [p.name], len(p.input), "tile"
    if p.op_type == "Expand" and g.rank(p.input[0]) == 4:   # MQA: [B, 1, S, D] -> [B, H, S, D]
        x, terms = p.input[0], ev.terms(p.input[1])
        if dims.int_value(dims.key(x, 1)) == 1 and terms is not None and len(terms) == 4 and \
                isinstance(terms[1], int) and terms[1] > 1 and \
                all(t == 1 or dims.same(dims.term_key(t), dims.key(x, j)) for j, t in enumerate(terms) if j != 1):
            return x, [p.name], terms[1], "interleave"
        return None
    if p.op_type != "Reshape":
        return None
    src = g.producer_of(p.input[0])
    if src is None:
        return None
    n_rep: int | None = None
    unsq_value = src.input[0] if src.input else ""
    if src.op_type == "Expand":
        terms = ev.terms(src.input[1])
        if terms is None or len(terms) != 5 or not isinstance(terms[2], int):
            return None
        n_rep = terms[2]
    elif src.op_type == "Tile":
        reps = g.constant(src.input[1]) if g.is_constant(src.input[1]) else None
        if reps is None or reps.size != 5 or [int(r) for r in reps[[0, 1, 3, 4]]] != [1, 1, 1, 1]:
            return None
        n_rep = int(reps[2])
    elif src.op_type == "Concat" and attributes(src).get("axis") in (2, -3) and len(set(src.input)) == 1:
        n_rep = len(src.input)
    if not n_rep or n_rep < 2:
        return None
    unsq = g.producer_of(unsq_value)
    if unsq is None or unsq.op_type != "Unsqueeze" or g.rank(unsq.input[0]) != 4:
        return None
    axes = attributes(unsq).get("axes")
    if axes is None and len(unsq.input) > 1:
        c = g.constant(unsq.input[1])
        axes = None if c is None else [int(a) for a in c.reshape(-1)]
    if axes is None or [a % 5 for a in axes] != [2]:
        return None
    x = unsq.input[0]
    if src.op_type == "Expand":
        terms = ev.terms(src.input[1])
        for j, t in enumerate(terms):
            if j != 2 and t != 1 and not dims.same(dims.term_key(t), dims.key(x, j if j < 2 else j - 1)):
                return None
    g_heads = dims.int_value(dims.key(x, 1))
    heads_key: Any = g_heads * n_rep if g_heads is not None else dims.term_key(("mul", ("dim", x, 1), n_rep))
    if not reshape_keeps(g, dims, ev, p, [dims.key(x, 0), heads_key, dims.key(x, 2), dims.key(x, 3)]):
        return None
    return x, [p.name, src.name, unsq.name], n_rep, "interleave"


def shape_closure(g: Graph, value: str, inside: set[str], keep_outside: set[str]) -> set[str] | None:
    """Nodes outside `inside` that read `value` only for its shape and feed nothing but `inside` (through
    shape arithmetic) and none of `keep_outside`: absorbing them keeps `value` private. None if any use is
    a real one."""
    if value in g.graph_outputs:
        return None
    frontier = [c for c in g.consumers_of(value) if c.name not in inside]
    found: set[str] = set()
    while frontier:
        c = frontier.pop()
        if c.name in found:
            continue
        if c.op_type not in SHAPE_OPS or c.domain not in ("", "ai.onnx"):
            return None
        if c.op_type != "Shape" and any(not is_shape_like(g, x) for x in c.input if x):
            return None
        found.add(c.name)
        if len(found) > _MAX_CLOSURE_NODES or any(o in keep_outside for o in c.output):
            return None
        for o in c.output:
            if o in g.graph_outputs:
                return None
            frontier.extend(cc for cc in g.consumers_of(o) if cc.name not in inside and cc.name not in found)
    return found


def is_shape_like(g: Graph, value: str) -> bool:
    """An int/bool tensor of rank <= 1: shape arithmetic, not data."""
    et = g.elem_type(value)
    rank = g.rank(value)
    if rank is None and g.is_constant(value) and g.constant(value) is not None:
        rank = g.constant(value).ndim
    return et in (TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL) and rank is not None and rank <= 1


# ---- proven shapes: what the graph's structure fixes where onnx shape inference left a dim symbolic ----------
#
# Shape inference loses dims at shape arithmetic it cannot evaluate (a Reshape or Expand target computed from
# Shape -> Gather -> Div, a Slice bound likewise) and everything downstream inherits the loss. `ShapeProver`
# walks the graph once, in topological order, and recomputes each value's shape from its producer's inputs'
# proven shapes and the static values of its shape operands (`shape_algebra.StaticValues`): a Reshape to a target
# whose entries are fixed (a -1 too, where the other dims cancel against the input's), an Expand's target, a
# static dim carried through Transpose / Slice / Concat / elementwise broadcasting / MatMul. Dims are ints,
# symbols (of the one inference run the types come from) or None; a proof only ever adds to what inference said.

_SAME_SHAPE_OPS = frozenset({"Cast", "CastLike", "Identity", "Neg", "Sqrt", "Exp", "Log", "Relu", "Sigmoid", "Tanh",
                             "Erf", "Softmax", "LogSoftmax", "Abs", "Reciprocal", "Not", "IsNaN", "IsInf", "Floor",
                             "Ceil", "Gelu", "Dropout", "LayerNormalization", "Sin", "Cos", "LeakyRelu", "Elu",
                             "HardSigmoid", "HardSwish", "Softplus", "Sign", "Round", "Clip", "Mish", "Celu",
                             "Selu", "ThresholdedRelu", "Trilu", "BitwiseNot"})
_BROADCAST_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "And", "Or", "Xor", "Equal", "Less",
                            "Greater", "LessOrEqual", "GreaterOrEqual", "Max", "Min", "Mod", "PRelu", "Sum", "Mean",
                            "BitwiseAnd", "BitwiseOr", "BitwiseXor"})


from npufuse.patterns.shape_algebra import StaticValues, Sym  # noqa: E402  (shape_algebra needs no layout)


class ShapeProver:
    """Proven shapes of every value of a view (`shape(v)`), computed in one topological pass on first use."""

    def __init__(self, g: Graph) -> None:
        self.g = g
        self.proven: dict[str, tuple[Any, ...]] = {}
        self.static = StaticValues(g, self.shape)
        self.ev = ShapeEval(g)
        for n in g.nodes:
            if n.domain not in ("", "ai.onnx") or not n.output or not n.output[0]:
                continue
            try:
                s = self._derive(n)
            except (ValueError, IndexError, TypeError, KeyError, ZeroDivisionError):
                s = None
            merged = _merge_shapes(g.shape(n.output[0]), s)
            if merged is not None:
                self.proven[n.output[0]] = merged

    def shape(self, v: str) -> tuple[Any, ...] | None:
        s = self.proven.get(v)
        return s if s is not None else self.g.shape(v)

    def better(self) -> dict[str, tuple[Any, ...]]:
        """The values whose proven shape fixes a dim that inference left unknown or symbolic, or names one that
        inference named afresh (unk__N) by a symbol of the model's inputs (`batch`)."""
        out = {}
        for v, s in self.proven.items():
            inferred = self.g.shape(v)
            if inferred is None or len(inferred) != len(s) or \
                    any(_dim_rank(p) > _dim_rank(i) for p, i in zip(s, inferred)):
                out[v] = s
        return out

    def _vector(self, v: str) -> list[Any] | None:
        """A 1-D shape operand's entries: ints where static, symbols for dims read by Shape, else None."""
        arr = self.static.eval(v)
        entries = None if arr is None or arr.ndim != 1 else \
            [int(e) if isinstance(e, (int, np.integer)) and not isinstance(e, bool) else
             e.render() if isinstance(e, Sym) else None for e in arr.tolist()]
        terms = self.ev.terms(v)
        if terms is not None and (entries is None or len(entries) == len(terms)):
            entries = entries or [None] * len(terms)
            for i, t in enumerate(terms):
                if entries[i] is None and isinstance(t, tuple) and t[0] == "dim":
                    s = self.shape(t[1])
                    d = s[t[2]] if s is not None and 0 <= t[2] < len(s) else None
                    entries[i] = d if isinstance(d, (int, str)) and d != "" else None
                elif entries[i] is None and isinstance(t, int) and not isinstance(t, bool):
                    entries[i] = t
        return entries

    def _derive(self, n: onnx.NodeProto) -> tuple[Any, ...] | None:
        op, a = n.op_type, attributes(n)
        ins = [self.shape(v) if v else None for v in n.input]
        x = ins[0] if ins else None
        if op in _SAME_SHAPE_OPS:
            return x
        if op in _BROADCAST_OPS:
            return _broadcast_all([s for s, v in zip(ins, n.input) if v])
        if op == "Range" and len(n.input) == 3:
            return (self._range_length(n),)
        if x is None:
            return None
        if op == "Transpose":
            perm = a.get("perm") or list(range(len(x)))[::-1]
            return tuple(x[i] for i in perm) if len(perm) == len(x) else None
        if op == "MatMul" and ins[1] is not None and len(x) >= 2 and len(ins[1]) >= 2:
            batch = _broadcast_all([x[:-2], ins[1][:-2]])
            return None if batch is None else batch + (x[-2], ins[1][-1])
        if op == "Reshape" and len(n.input) > 1:
            return self._reshape(n, x, a)
        if op == "Expand" and len(n.input) > 1:
            t = self._vector(n.input[1])
            if t is None:
                return None
            rank = max(len(t), len(x))
            xs = (1,) * (rank - len(x)) + tuple(x)
            ts = [1] * (rank - len(t)) + list(t)
            return tuple(xs[i] if ts[i] == 1 else ts[i] if isinstance(ts[i], int) or xs[i] == 1 else
                         xs[i] if isinstance(xs[i], int) else ts[i] if ts[i] == xs[i] else None
                         for i in range(rank))
        if op == "Slice" and len(n.input) >= 3:
            return self._slice(n, x)
        if op == "Concat":
            if any(s is None or len(s) != len(x) for s in ins):
                return None
            axis = a.get("axis", 0) % len(x)
            out = list(_broadcast_all([s[:axis] + s[axis + 1:] for s in ins]) or [None] * (len(x) - 1))
            sizes = [s[axis] for s in ins]
            out.insert(axis, sum(sizes) if all(isinstance(d, int) for d in sizes) else None)
            return tuple(out)
        if op == "GatherElements" and len(ins) > 1:
            return ins[1]
        if op == "Tile" and len(n.input) > 1:
            reps = self._vector(n.input[1])
            if reps is None or len(reps) != len(x):
                return None
            return tuple(_render(_monomial([d, r])) for d, r in zip(x, reps))
        if op in ("Unsqueeze", "Squeeze", "Gather"):
            return _static_shape_step(self.g, n, x, a, self.static)
        return None

    def _range_length(self, n: onnx.NodeProto) -> Any:
        """Range(0, d, 1) of a dim d has d elements (its symbol where d is symbolic)."""
        start, delta = self.static.known(n.input[0]), self.static.known(n.input[2])
        limit = self.static.known(n.input[1])
        if start is None or delta is None or start.size != 1 or delta.size != 1:
            return None
        s0, d0 = start.reshape(-1)[0], delta.reshape(-1)[0]
        if limit is not None and start.dtype.kind in "iu" and d0:
            return max(0, -(-(int(limit.reshape(-1)[0]) - int(s0)) // int(d0)))
        r = self.ev.eval(n.input[1])
        if s0 != 0 or d0 != 1 or r is None or len(r[0]) != 1:
            return None
        t = r[0][0]
        if isinstance(t, tuple) and t[0] == "dim":
            shape = self.shape(t[1])
            d = shape[t[2]] if shape is not None and 0 <= t[2] < len(shape) else None
            return d if isinstance(d, (int, str)) and d != "" else None
        return None

    def _reshape(self, n: onnx.NodeProto, x: tuple, a: dict) -> tuple[Any, ...] | None:
        t = self._vector(n.input[1])
        if t is None:
            return None
        out = [x[i] if d == 0 and not a.get("allowzero", 0) and i < len(x) else d for i, d in enumerate(t)]
        if out.count(-1) == 1:   # the element count: what the input has over what the other dims take
            j = out.index(-1)
            src, rest = _monomial(x), _monomial([d for i, d in enumerate(out) if i != j])
            out[j] = None
            if src is not None and rest is not None and rest[0] and src[0] % rest[0] == 0:
                syms = list(src[1])
                try:
                    for name in rest[1]:
                        syms.remove(name)
                except ValueError:
                    syms = None
                k = src[0] // rest[0]
                if syms == []:
                    out[j] = k
                elif syms is not None and len(syms) == 1:
                    out[j] = Sym(syms[0], k).render()
        return tuple(d if (isinstance(d, int) and d >= 0) or isinstance(d, str) else None for d in out)

    def _slice(self, n: onnx.NodeProto, x: tuple) -> tuple[Any, ...] | None:
        from npufuse.patterns.shape_algebra import clamp_index

        def entries(i: int) -> list | None:
            if len(n.input) <= i or not n.input[i]:
                return None
            arr = self.static.eval(n.input[i])
            return None if arr is None or arr.ndim > 1 else arr.reshape(-1).tolist()

        starts, ends, axes, steps = entries(1), entries(2), entries(3), entries(4)
        if starts is None or ends is None or (len(n.input) > 3 and n.input[3] and axes is None) or \
                (len(n.input) > 4 and n.input[4] and steps is None) or len(starts) != len(ends):
            return None
        fixed = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool)  # noqa: E731
        if axes is not None and not all(fixed(a) for a in axes) or steps is not None and \
                not all(fixed(st) for st in steps):
            return None
        axes = [int(v) % len(x) for v in axes] if axes is not None else list(range(len(starts)))
        steps = [int(v) for v in steps] if steps is not None else [1] * len(starts)
        out = list(x)
        for s, e, ax, st in zip(starts, ends, axes, steps):
            d = x[ax]
            if st <= 0 or not fixed(s):
                out[ax] = None
            elif isinstance(d, int) and fixed(e):
                lo, hi = clamp_index(int(s), d), clamp_index(int(e), d)
                out[ax] = max(0, -(-(hi - lo) // st))
            elif int(s) == 0 and st == 1 and (fixed(e) and int(e) >= 2 ** 31 - 1 or
                                               isinstance(e, Sym) and isinstance(d, str) and e.render() == d):
                pass      # the whole axis: the dim (or its symbol) is kept
            else:
                out[ax] = None
        return tuple(out)


def _static_shape_step(g: Graph, n: onnx.NodeProto, x: tuple, a: dict, static) -> tuple[Any, ...] | None:
    op = n.op_type
    if op == "Gather":
        idx = static.known(n.input[1]) if len(n.input) > 1 else None
        if idx is None:
            s = g.shape(n.input[1]) if len(n.input) > 1 else None
            if s is None:
                return None
            idx_shape = tuple(s)
        else:
            idx_shape = tuple(idx.shape)
        axis = a.get("axis", 0) % len(x)
        return tuple(x[:axis]) + idx_shape + tuple(x[axis + 1:])
    axes = a.get("axes")
    if axes is None and len(n.input) > 1 and n.input[1]:
        c = static.known(n.input[1])
        axes = None if c is None else [int(v) for v in c.reshape(-1)]
    if op == "Squeeze":
        if axes is None:
            return None if len(n.input) > 1 and n.input[1] else \
                (tuple(d for d in x if d != 1) if all(isinstance(d, int) for d in x) else None)
        drop = {ax % len(x) for ax in axes}
        return tuple(d for i, d in enumerate(x) if i not in drop)
    if axes is None:
        return None
    rank = len(x) + len(axes)
    axes = {ax % rank for ax in axes}
    it = iter(x)
    return tuple(1 if i in axes else next(it) for i in range(rank))


def _broadcast_all(shapes: list) -> tuple[Any, ...] | None:
    """Numpy broadcasting of shapes (ints, symbols, None for unknown), for a valid model: a dim other than 1 on
    any side is the result; all 1 is 1; a symbol is kept where every side that is not 1 has it."""
    if any(s is None for s in shapes) or not shapes:
        return None
    rank = max(len(s) for s in shapes)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    out = []
    for i in range(rank):
        col = [s[i] for s in padded]
        ints = {d for d in col if isinstance(d, int) and d != 1}
        if len(ints) > 1:
            return None
        if ints:
            out.append(ints.pop())
            continue
        rest = [d for d in col if d != 1]
        if not rest:
            out.append(1)
        elif all(d is not None and d == rest[0] for d in rest):
            out.append(rest[0])
        else:
            out.append(None)
    return tuple(out)


def _monomial(dims) -> tuple[int, list[str]] | None:
    """The product of dims as (int factor, symbol names), or None where a dim is unknown."""
    k, names = 1, []
    for d in dims:
        if isinstance(d, bool) or d is None:
            return None
        if isinstance(d, int):
            if d < 0:
                return None
            k *= d
            continue
        s = Sym.parse(d)
        if s is None:
            return None
        k *= s.k
        names.append(s.name)
    return k, sorted(names)


def _render(m: tuple[int, list[str]] | None) -> Any:
    """A monomial as a dim: an int, a symbol `k*name`, or None where it is not one of those."""
    if m is None or len(m[1]) > 1:
        return None
    return m[0] if not m[1] else Sym(m[1][0], m[0]).render() if m[0] else 0


def _dim_rank(d: Any) -> int:
    """How much a dim says: a fixed size, a symbol of the model's own, one inference made up, nothing."""
    if isinstance(d, int):
        return 3
    if isinstance(d, str) and d:
        return 1 if "unk__" in d else 2
    return 0


def _merge_shapes(inferred: tuple | None, derived: tuple | None) -> tuple[Any, ...] | None:
    """The inferred shape, with the dims a proof fixes where inference has none (or a symbol)."""
    if derived is None:
        return inferred
    if inferred is None:
        return tuple(derived)
    if len(inferred) != len(derived):
        return inferred
    return tuple(d if _dim_rank(d) > _dim_rank(i) else i for i, d in zip(inferred, derived))
