"""Shape terms and their evaluator (ShapeEval: a dim as a product of ints and symbols), and proven shapes: what
the graph's structure fixes where onnx shape inference left a dim symbolic (a -1 of a Reshape whose other dims
cancel, an Expand target, Range(0, d), dims carried through Transpose / Slice / broadcasting / MatMul)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from npufuse.ir.graph import Graph, attributes
from npufuse.algebra.shapes import StaticValues, Sym, squeezed


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


_SAME_SHAPE_OPS = frozenset({"Cast", "CastLike", "Identity", "Neg", "Sqrt", "Exp", "Log", "Relu", "Sigmoid", "Tanh",
                             "Erf", "Softmax", "LogSoftmax", "Abs", "Reciprocal", "Not", "IsNaN", "IsInf", "Floor",
                             "Ceil", "Gelu", "Dropout", "LayerNormalization", "Sin", "Cos", "LeakyRelu", "Elu",
                             "HardSigmoid", "HardSwish", "Softplus", "Sign", "Round", "Clip", "Mish", "Celu",
                             "Selu", "ThresholdedRelu", "Trilu", "BitwiseNot"})


_BROADCAST_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "And", "Or", "Xor", "Equal", "Less",
                            "Greater", "LessOrEqual", "GreaterOrEqual", "Max", "Min", "Mod", "PRelu", "Sum", "Mean",
                            "BitwiseAnd", "BitwiseOr", "BitwiseXor"})


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
        from npufuse.algebra.shapes import clamp_index

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
        if c is None:
            return None
        axes = [int(v) for v in c.reshape(-1)]
    return squeezed(op, x, axes)


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
