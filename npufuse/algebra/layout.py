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
from onnx import TensorProto

from npufuse.algebra.prover import ShapeEval, ShapeProver, Term  # noqa: F401  (the algebra's one import surface)
from npufuse.ir.graph import Graph, attributes

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


class Dims:
    """Which dimensions are known to be equal: a union-find over (value, axis), inferred symbols, ints and
    the attention's own symbols (B, H, Sq, Sk, D, Dv), so a Reshape target built from the shape of some
    other tensor can be proven to keep the batch or sequence dimension."""

    def __init__(self, g: Graph) -> None:
        self.g = g
        self.parent: dict[Any, Any] = {}
        self.int_of: dict[Any, int] = {}

    def _find(self, k: Any) -> Any:
        parent = self.parent
        p = parent.get(k)
        if p is None:   # a new class of its own (no parent is None)
            parent[k] = k
            return k
        while p != k:   # path halving
            parent[k] = gp = parent[p]
            k, p = gp, parent[gp]
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
        if k in self.parent:
            return self._find(k)
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
# proven shapes and the static values of its shape operands (`algebra.shapes.StaticValues`): a Reshape to a target
# whose entries are fixed (a -1 too, where the other dims cancel against the input's), an Expand's target, a
# static dim carried through Transpose / Slice / Concat / elementwise broadcasting / MatMul. Dims are ints,
# symbols (of the one inference run the types come from) or None; a proof only ever adds to what inference said.
