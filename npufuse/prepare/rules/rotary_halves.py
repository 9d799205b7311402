"""`rotate_halves`: the rotary embedding written on the two halves with half-width tables (GPT-OSS's
`_apply_rotary_emb`: x1, x2 = chunk(x, 2, -1); cat(x1·cos - x2·sin, x2·cos + x1·sin)) becomes the rotate_half form
the rotary pattern knows: x·cat(cos, cos) + cat(-x2, x1)·cat(sin, sin).

Bit for bit: on the first half x1·cos + (-x2)·sin is x1·cos - x2·sin (negation is exact and a - b is a + (-b) in
IEEE arithmetic), on the second x2·cos + x1·sin is the same sum. The halves are taken again as Slices of x (the
pattern reads Slices); the Split (or Slices) the model had are dropped where nothing else reads them. The widened
tables are Concats of the model's own cos and sin: the same for q and k, which `rotary_pair` sees as one table.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npufuse.algebra.shapes import slice_bounds
from npufuse.ir.graph import Graph, attributes
from npufuse.ir.matching import is_last_axis, std_op
from npufuse.prepare.rules.edit import Edit, _Names

INT64_MAX = np.iinfo(np.int64).max


def _products(g: Graph, v: str) -> tuple[tuple[str, str], ...] | None:
    """The two operand pairs of `v` = Mul(a, b) as both orders, None where `v` is no Mul."""
    p = g.producer_of(v)
    if not std_op(p, "Mul") or len(p.input) != 2 or len(g.consumers_of(v)) != 1:
        return None
    a, b = p.input
    return ((a, b), (b, a))


def _halves(g: Graph, x1: str, x2: str) -> str | None:
    """x where x1, x2 are the first and second half of x's last axis (outputs 0 and 1 of a two-way Split, or two
    Slices [0, h) and [h, 2h)), None otherwise."""
    p1, p2 = g.producer_of(x1), g.producer_of(x2)
    if p1 is None or p2 is None:
        return None
    if p1 is p2 and std_op(p1, "Split") and list(p1.output) == [x1, x2] and is_last_axis(g, p1, p1.input[0]):
        x = p1.input[0]
        shape = g.shape(x)
        if not shape or not isinstance(shape[-1], int) or shape[-1] % 2:
            return None
        a = attributes(p1)
        sizes = a.get("split") if "split" in a else (g.constant(p1.input[1]) if len(p1.input) > 1 and p1.input[1]
                                                     else None)
        if sizes is not None and [int(s) for s in np.asarray(sizes).reshape(-1)] != [shape[-1] // 2] * 2:
            return None
        return x
    if std_op(p1, "Slice") and std_op(p2, "Slice") and p1.input[0] == p2.input[0]:
        x = p1.input[0]
        shape = g.shape(x)
        if not shape or not isinstance(shape[-1], int) or shape[-1] % 2:
            return None
        w, rank = shape[-1], len(shape)
        ranges = []
        for s in (p1, p2):
            try:
                starts, ends, axes, steps = slice_bounds(g, s, [])
            except Exception:   # bounds not constant: not this form
                return None
            if len(starts) != 1 or (axes is not None and int(axes[0]) % rank != rank - 1) or \
                    (steps is not None and int(steps[0]) != 1):
                return None
            ranges.append((min(max(int(starts[0]) + (w if starts[0] < 0 else 0), 0), w),
                           min(max(int(ends[0]) + (w if ends[0] < 0 else 0), 0), w)))
        return x if ranges == [(0, w // 2), (w // 2, w)] else None
    return None


def _half_table(g: Graph, t: str, x: str) -> bool:
    """`t` ends in half of x's last axis and broadcasts to x's halves."""
    shape, xs = g.shape_or_constant(t), g.shape(x)
    if not shape or not xs or len(shape) > len(xs) or shape[-1] != xs[-1] // 2:
        return False
    return all(not (isinstance(d, int) and isinstance(e, int) and d not in (1, e))
               for d, e in zip(reversed(shape[:-1]), reversed(xs[:-1])))


def rotate_halves(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    """Concat(x1·c - x2·s, x2·c + x1·s, axis -1) of x's halves x1, x2 with half-width c, s => x·cat(c, c) +
    cat(-x2, x1)·cat(s, s), the output keeping its name."""
    if len(n.input) != 2 or not is_last_axis(g, n, n.output[0]):
        return None
    first, second = g.producer_of(n.input[0]), g.producer_of(n.input[1])
    if not std_op(first, "Sub") or not std_op(second, "Add") or \
            any(len(g.consumers_of(v)) != 1 for v in n.input):
        return None
    plus, minus = _products(g, first.input[0]), _products(g, first.input[1])       # x1·c, x2·s
    cross_a, cross_b = _products(g, second.input[0]), _products(g, second.input[1])
    if plus is None or minus is None or cross_a is None or cross_b is None:
        return None
    for x1, c in plus:
        for x2, s in minus:
            x = _halves(g, x1, x2)
            if x is None or not _half_table(g, c, x) or not _half_table(g, s, x):
                continue
            # the second half, x2·c + x1·s, in either order of the sum and of each product
            want = {frozenset({(x2, c)}), frozenset({(x1, s)})}
            got = [frozenset({pair for pair in cross if pair in ((x2, c), (x1, s))}) for cross in (cross_a, cross_b)]
            if set(got) != want:
                continue
            return _edit(g, n, x, x1, x2, c, s, [first, second], names)
    return None


def _edit(g: Graph, cat: onnx.NodeProto, x: str, x1: str, x2: str, c: str, s: str,
          parts: list[onnx.NodeProto], names: _Names) -> Edit:
    w = g.shape(x)[-1]
    h = w // 2
    products = [g.producer_of(v).name for p in parts for v in p.input]
    v = names.value
    lo, mid, end, last = (v(f"{cat.name}/rot_{k}") for k in ("lo", "mid", "end", "axis"))
    inits = [numpy_helper.from_array(np.array([a], np.int64), nm)
             for nm, a in ((lo, 0), (mid, h), (end, INT64_MAX), (last, -1))]
    a, b, nb, rot, cf, sf, xc, rs = (v(f"{cat.name}/rot_{k}") for k in
                                     ("x1", "x2", "neg", "rotated", "cos_full", "sin_full", "x_cos", "rot_sin"))
    name = names.node
    add = [
        helper.make_node("Slice", [x, lo, mid, last], [a], name=name(f"{cat.name}/slice_first")),
        helper.make_node("Slice", [x, mid, end, last], [b], name=name(f"{cat.name}/slice_second")),
        helper.make_node("Neg", [b], [nb], name=name(f"{cat.name}/neg")),
        helper.make_node("Concat", [nb, a], [rot], name=name(f"{cat.name}/rotate_half"), axis=-1),
        helper.make_node("Concat", [c, c], [cf], name=name(f"{cat.name}/cos_full"), axis=-1),
        helper.make_node("Concat", [s, s], [sf], name=name(f"{cat.name}/sin_full"), axis=-1),
        helper.make_node("Mul", [x, cf], [xc], name=name(f"{cat.name}/x_cos")),
        helper.make_node("Mul", [rot, sf], [rs], name=name(f"{cat.name}/rot_sin")),
        helper.make_node("Add", [xc, rs], [cat.output[0]], name=cat.name),
    ]
    types: dict[str, onnx.TypeProto] = {}
    xt, halft = g.type_of(x), g.type_of(x1)
    for vals, t in (((rot, xc, rs), xt), ((a, b, nb), halft)):
        if t is not None:
            types.update({val: t for val in vals})
    for val, table in ((cf, c), (sf, s)):   # the table widened: its shape with the last dim doubled
        shape, elem = g.shape(table), g.elem_type(table)
        if shape and isinstance(shape[-1], int) and elem:
            dims = [d if isinstance(d, int) else (d or None) for d in shape[:-1]] + [2 * shape[-1]]
            types[val] = helper.make_tensor_type_proto(elem, dims)
    return Edit("rotate_halves", [*products, *(p.name for p in parts), cat.name], add=add, initializers=inits,
                types=types)
