"""Attention with the heads merged into the batch ([B·H, M, N], torch's bmm/baddbmm) run in 4-D, the dynamo exporter's 3-D
K transpose unflattened, and the Reshapes the lifts leave cancelled."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from npufuse.ir.graph import Graph, attributes
from npufuse.prepare.rules.edit import (Edit, _Names,
                                        _has_subgraph, _perm, _private, _producer_op, _reads, _renamable)  # noqa: F401
from npufuse.prepare.rules.apply import _apply, _drop_dead, _reads_renamed, _reads_rewritten, _write_nodes  # noqa: F401
from npufuse.prepare.static_values import (MAX_FOLD_ROUNDS, _MAX_FOLDED_ELEMENTS, _tensor_type, fold_static_values)  # noqa: F401
from npufuse.prepare.rules.basic import (drop_cast_round_trip, drop_identity, fold_reshapes, fold_transposes)  # noqa: F401
from npufuse.prepare.rules.softmax_scale import _algebra, _merged, move_scale_to_matmul  # noqa: F401


def unflatten_k_transpose(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    from npufuse.algebra.layout import Dims, ShapeEval, is_transpose

    tr = g.producer_of(n.input[0])
    if not is_transpose(tr, (0, 2, 1)) or not _private(g, tr.output[0]):
        return None
    first = g.producer_of(tr.input[0])
    if first is None or first.op_type != "Reshape" or not _private(g, first.output[0]) or len(n.input) < 2:
        return None
    ev, dims = ShapeEval(g), Dims(g)
    t1, t2 = ev.terms(first.input[1]), ev.terms(n.input[1])
    if t1 is None or t2 is None or len(t1) != 3 or len(t2) != 4 or 0 in t2 or 0 in t1:
        return None
    if attributes(n).get("allowzero", 0) or attributes(first).get("allowzero", 0):
        return None
    same = lambda a, b: a == b if isinstance(a, int) and isinstance(b, int) else \
        dims.same(dims.term_key(a), dims.term_key(b)) and -1 not in (a, b)  # noqa: E731
    # [X, S, D] -> transpose -> [B, H, D, S]: S and D must be the same dims on both sides; X is B·H because
    # both reshapes keep the element count of y.
    if -1 in (t1[1], t1[2], t2[2], t2[3]) or not (same(t1[1], t2[3]) and same(t1[2], t2[2])):
        return None
    y = first.input[0]
    if g.rank(y) == 4 and all(same(t, ("dim", y, i)) for t, i in ((t2[0], 0), (t2[1], 1), (t1[1], 2), (t1[2], 3))):
        # y is [B, H, S, D] already: the flatten and unflatten cancel
        node = helper.make_node("Transpose", [y], [n.output[0]], name=n.name, perm=[0, 1, 3, 2])
        return Edit("unflatten_k_transpose", [first.name, tr.name, n.name], add=[node])
    new_target, inits, add = _permuted_target(g, n.input[1], (0, 1, 3, 2), names)
    v = names.value(first.output[0])
    add += [helper.make_node("Reshape", [first.input[0], new_target], [v], name=names.node(first.name)),
            helper.make_node("Transpose", [v], [n.output[0]], name=n.name, perm=[0, 1, 3, 2])]
    types = {}
    t_out = g.type_of(n.output[0])
    if t_out is not None and t_out.tensor_type.HasField("shape") and len(t_out.tensor_type.shape.dim) == 4:
        t_v = onnx.TypeProto()
        t_v.CopyFrom(t_out)
        d = t_v.tensor_type.shape.dim
        d2, d3 = onnx.TensorShapeProto.Dimension(), onnx.TensorShapeProto.Dimension()
        d2.CopyFrom(d[3])
        d3.CopyFrom(d[2])
        d[2].CopyFrom(d2)
        d[3].CopyFrom(d3)
        types[v] = t_v
    return Edit("unflatten_k_transpose", [first.name, tr.name, n.name], add=add, initializers=inits, types=types)


def _permuted_target(g: Graph, target: str, perm: tuple[int, ...], names: _Names
                     ) -> tuple[str, list[onnx.TensorProto], list[onnx.NodeProto]]:
    """A shape value holding `target`'s entries in the order `perm`: a new constant, or a Gather at run time."""
    arr = g.constant(target) if g.is_constant(target) else None
    if arr is not None:
        name = names.value(target)
        return name, [numpy_helper.from_array(np.asarray(arr)[list(perm)].astype(np.int64), name)], []
    idx, out = names.value(f"{target}_perm"), names.value(target)
    return out, [numpy_helper.from_array(np.asarray(perm, dtype=np.int64), idx)], \
        [helper.make_node("Gather", [target, idx], [out], name=names.node(f"{target}_perm"), axis=0)]


def _pick(*dims_):
    """The most informative of dims known to be equal: an int, else a symbol, else None."""
    for d in dims_:
        if isinstance(d, int):
            return d
    return next((d for d in dims_ if isinstance(d, str) and d), None)


class _ShapeBuilder:
    """A 1-D int64 shape tensor from entries of a value's shape: ints, ("dim", i) or ("prod", i, j); a constant
    where every entry is static, else Shape/Gather/Mul/Concat nodes (which need a literal Reshape: opset 14's
    allowzero, so a dim of 0 stays 0)."""

    def __init__(self, g: Graph, names: _Names) -> None:
        self.g, self.names = g, names
        self.inits: list[onnx.TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []

    def const(self, base: str, arr) -> str:
        name = self.names.value(base)
        self.inits.append(numpy_helper.from_array(np.asarray(arr, dtype=np.int64), name))
        return name

    def build(self, x: str, shape, entries) -> tuple[str, bool] | None:
        """(shape value, literal) for `entries` of x (whose shape is `shape`); None where it needs nodes and the
        model's opset has no allowzero."""
        ints = []
        for e in entries:
            if isinstance(e, int):
                ints.append(e)
            elif e[0] == "dim" and isinstance(shape[e[1]], int):
                ints.append(shape[e[1]])
            elif e[0] == "prod" and isinstance(shape[e[1]], int) and isinstance(shape[e[2]], int):
                ints.append(shape[e[1]] * shape[e[2]])
            else:
                break
        else:
            return self.const(f"{x}_shape", ints), False
        if self.g.opset.get("", 1) < 14:
            return None
        shp = self.names.value(f"{x}_shape")
        self.nodes.append(helper.make_node("Shape", [x], [shp], name=self.names.node(f"{x}_Shape")))

        def dim(i: int) -> str:
            if isinstance(shape[i], int):
                return self.const(f"{x}_dim{i}", [shape[i]])
            out = self.names.value(f"{x}_dim{i}")
            self.nodes.append(helper.make_node("Gather", [shp, self.const(f"{x}_axis{i}", [i])], [out],
                                               name=self.names.node(f"{x}_Gather{i}"), axis=0))
            return out

        parts: list[str] = []
        for e in entries:
            if isinstance(e, int):
                parts.append(self.const(f"{x}_dim", [e]))
            elif e[0] == "dim":
                parts.append(dim(e[1]))
            else:
                out = self.names.value(f"{x}_dim{e[1]}{e[2]}")
                self.nodes.append(helper.make_node("Mul", [dim(e[1]), dim(e[2])], [out],
                                                   name=self.names.node(f"{x}_Mul{e[1]}{e[2]}")))
                parts.append(out)
        out = self.names.value(f"{x}_target")
        self.nodes.append(helper.make_node("Concat", parts, [out], name=self.names.node(f"{x}_Concat"), axis=0))
        return out, True

    def reshape(self, x: str, shape, entries, out: str, base: str) -> bool:
        """Append Reshape(x, entries) writing `out`; False where the target cannot be built."""
        built = self.build(x, shape, entries)
        if built is None:
            return False
        target, literal = built
        attrs = {"allowzero": 1} if literal else {}
        self.nodes.append(helper.make_node("Reshape", [x, target], [out], name=self.names.node(base), **attrs))
        return True

    def merge(self, x4: str, shape4, out: str, base: str) -> bool:
        """Append the head merge Reshape(x4, [B·H, M, N]) writing `out`."""
        return self.reshape(x4, shape4, [("prod", 0, 1), ("dim", 2), ("dim", 3)], out, base)


def _shape4(g: Graph, value: str):
    s = g.shape(value)
    return s if s is not None and len(s) == 4 else (None,) * 4


def _lifted(g: Graph, n: onnx.NodeProto, rule: str, node4: onnx.NodeProto, shape4, sb: _ShapeBuilder,
            before: tuple[list, list, dict] = ([], [], {})) -> Edit | None:
    """The edit replacing `n` by `node4` (writing a new 4-D value of shape `shape4`; `before`: nodes,
    initializers and types it reads) and the merge of its result into `n`'s output."""
    if not sb.merge(node4.output[0], shape4, n.output[0], n.name):
        return None
    nodes, inits, types = before
    types = dict(types)
    types[node4.output[0]] = _tensor_type(g.elem_type(n.output[0]), shape4)
    return Edit(rule, [n.name], add=nodes + [node4] + sb.nodes, initializers=inits + sb.inits, types=types)


def unmerge_matmul(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    """MatMul(merge(a4), merge(b4)) is merge(MatMul(a4, b4)) when a4 and b4 have the same B and H."""
    ev, dims = _algebra(g)
    if len(n.input) != 2:
        return None
    a4, b4 = _merged(g, ev, dims, n.input[0]), _merged(g, ev, dims, n.input[1])
    if a4 is None or b4 is None or not all(dims.same(dims.key(a4, i), dims.key(b4, i)) for i in (0, 1)):
        return None
    sa, sb_ = _shape4(g, a4), _shape4(g, b4)
    shape4 = (_pick(sa[0], sb_[0]), _pick(sa[1], sb_[1]), sa[2], sb_[3])
    y4 = names.value(n.output[0])
    node4 = helper.make_node("MatMul", [a4, b4], [y4], name=names.node(n.name))
    return _lifted(g, n, "unmerge_matmul", node4, shape4, _ShapeBuilder(g, names))


def unmerge_elementwise(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    """Add/Sub/Mul/Div(merge(a4), other) is merge(op(a4, other4)): `other` of rank <= 2 broadcasts over the same
    last axes in 4-D; a merge(b4) of the same B and H is b4; any other [B·H, Y, Z] operand (B·H proven) is
    reshaped to [B, H, Y, Z] (a bias such as ALiBi's [B·H, 1, S])."""
    from npufuse.algebra.layout import broadcast_shape, dim_is, product_key

    if len(n.input) != 2 or n.input[0] == n.input[1]:
        return None
    ev, dims = _algebra(g)
    merged = [_merged(g, ev, dims, v) for v in n.input]
    i = 0 if merged[0] is not None else 1 if merged[1] is not None else None
    if i is None:
        return None
    a4, other = merged[i], n.input[1 - i]
    sa = _shape4(g, a4)
    so = g.shape(other)
    if so is None and g.is_constant(other) and g.constant(other) is not None:
        so = tuple(g.constant(other).shape)
    if so is None or len(so) > 3:
        return None
    before: tuple[list, list, dict] = ([], [], {})
    if len(so) <= 2:
        o4 = other
    elif merged[1 - i] is not None and all(dims.same(dims.key(a4, k), dims.key(merged[1 - i], k)) for k in (0, 1)):
        o4 = merged[1 - i]
        so = _shape4(g, o4)
    elif dim_is(g, ev, dims, other, 0, product_key(dims, a4, 0, 1)):
        o4 = names.value(other)
        nodes, inits = _two_value_target(g, names, a4, sa, other, so, o4)
        if nodes is None:
            return None
        so = (sa[0], sa[1], so[1], so[2])
        before = (nodes, inits, {o4: _tensor_type(g.elem_type(other), so)})
    else:
        return None
    shape4 = broadcast_shape(sa, so)
    if shape4 is None or len(shape4) != 4:
        return None
    y4 = names.value(n.output[0])
    node4 = helper.make_node(n.op_type, [a4, o4] if i == 0 else [o4, a4], [y4], name=names.node(n.name))
    return _lifted(g, n, "unmerge_elementwise", node4, shape4, _ShapeBuilder(g, names), before)


def _two_value_target(g: Graph, names: _Names, a4: str, sa, other: str, so, out: str):
    """Nodes and initializers of Reshape(other [B·H, Y, Z], [B, H, Y, Z]) writing `out` (B, H: a4's dims 0, 1).
    B·H is divided by whichever of B and H is static, so the target reads `other`'s shape only, not a4's (the
    attention scores, which nothing outside the attention should read); a4's shape where neither is."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def const(base: str, vals) -> str:
        name = names.value(base)
        inits.append(numpy_helper.from_array(np.asarray(vals, dtype=np.int64), name))
        return name

    static = [sa[0], sa[1], so[1], so[2]]
    if all(isinstance(d, int) for d in static):
        nodes.append(helper.make_node("Reshape", [other, const(f"{other}_shape", static)], [out],
                                      name=names.node(f"{other}_Reshape")))
        return nodes, inits
    if g.opset.get("", 1) < 14:
        return None, None
    shapes: dict[str, str] = {}

    def dim(v: str, i: int) -> str:
        if v not in shapes:
            shapes[v] = names.value(f"{v}_shape")
            nodes.append(helper.make_node("Shape", [v], [shapes[v]], name=names.node(f"{v}_Shape")))
        d = names.value(f"{v}_dim{i}")
        nodes.append(helper.make_node("Gather", [shapes[v], const(f"{v}_axis{i}", [i])], [d],
                                      name=names.node(f"{v}_Gather{i}"), axis=0))
        return d

    def quotient(k: int) -> str:   # B·H / k
        q = names.value(f"{other}_dim0")
        nodes.append(helper.make_node("Div", [dim(other, 0), const(f"{other}_factor", [k])], [q],
                                      name=names.node(f"{other}_Div")))
        return q

    b, h = sa[0], sa[1]
    if isinstance(h, int):
        parts = [const(f"{other}_b", [b]) if isinstance(b, int) else quotient(h), const(f"{other}_h", [h])]
    elif isinstance(b, int):
        parts = [const(f"{other}_b", [b]), quotient(b)]
    else:
        parts = [dim(a4, 0), dim(a4, 1)]
    parts += [const(f"{other}_d{i}", [so[i]]) if isinstance(so[i], int) else dim(other, i) for i in (1, 2)]
    target = names.value(f"{other}_target")
    nodes.append(helper.make_node("Concat", parts, [target], name=names.node(f"{other}_Concat"), axis=0))
    nodes.append(helper.make_node("Reshape", [other, target], [out], name=names.node(f"{other}_Reshape"),
                                  allowzero=1))
    return nodes, inits


def unmerge_unary(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    """Softmax over the last axis, or a Cast, of merge(a4) is merge(Softmax/Cast(a4))."""
    if not n.input:
        return None
    if n.op_type == "Softmax":
        if g.opset.get("", 1) < 13 or attributes(n).get("axis", -1) not in (-1, 2):
            return None   # before opset 13 Softmax flattens its input to 2-D
    ev, dims = _algebra(g)
    a4 = _merged(g, ev, dims, n.input[0])
    if a4 is None:
        return None
    y4 = names.value(n.output[0])
    node4 = onnx.NodeProto()
    node4.CopyFrom(n)
    node4.input[0], node4.output[0], node4.name = a4, y4, names.node(n.name)
    if n.op_type == "Softmax":
        del node4.attribute[:]
        node4.attribute.append(helper.make_attribute("axis", -1))
    return _lifted(g, n, "unmerge_unary", node4, _shape4(g, a4), _ShapeBuilder(g, names))


def sink_transpose_merge(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    """Transpose(merge(x4), (0,2,1)) is merge(Transpose(x4, (0,1,3,2))) (Kᵀ of bmm attention)."""
    from npufuse.algebra.layout import is_transpose

    if not is_transpose(n, (0, 2, 1)):
        return None
    nxt = g.single_consumer(n.output[0])
    if nxt is not None and nxt.op_type == "Reshape" and unflatten_k_transpose(g, nxt, names) is not None:
        return None   # the K transpose flattened to 3-D: unflatten_k_transpose's
    ev, dims = _algebra(g)
    x4 = _merged(g, ev, dims, n.input[0])
    if x4 is None:
        return None
    s = _shape4(g, x4)
    t4 = names.value(n.output[0])
    node4 = helper.make_node("Transpose", [x4], [t4], name=names.node(n.name), perm=[0, 1, 3, 2])
    return _lifted(g, n, "sink_transpose_merge", node4, (s[0], s[1], s[3], s[2]), _ShapeBuilder(g, names))


# 3-D permutations of [P, B·H, D] that bring B·H first, and the same on the head split [B, P, H, D]
_SPLIT_PERMS = {(1, 0, 2): (0, 2, 1, 3), (1, 2, 0): (0, 2, 3, 1)}


def split_heads_transpose(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    """Transpose(Reshape(x [P, B, H·D], [P, B·H, D]), (1,0,2)) (torch's MultiheadAttention, sequence first) is
    merge(Transpose(Reshape(Transpose(x, (1,0,2)), [0, 0, H, D]), (0,2,1,3))): batch first, the head split
    [B, P, H, D], then [B, H, P, D] merged; with (1,2,0) (its Kᵀ) the last permutation is (0,2,3,1)."""
    from npufuse.algebra.layout import is_transpose, reshape_keeps, static_shape

    perm4 = next((q4 for q3, q4 in _SPLIT_PERMS.items() if is_transpose(n, q3)), None)
    if perm4 is None:
        return None
    r = g.producer_of(n.input[0])
    if r is None or r.op_type != "Reshape" or r.domain not in ("", "ai.onnx") or len(r.input) < 2:
        return None
    x = r.input[0]
    sx, so = static_shape(g, x), static_shape(g, r.output[0])
    if sx is None or len(sx) != 3 or not isinstance(sx[2], int):
        return None
    ev, dims = _algebra(g)
    terms = ev.terms(r.input[1])
    d = so[2] if so is not None and len(so) == 3 and isinstance(so[2], int) else \
        terms[2] if terms is not None and len(terms) == 3 and isinstance(terms[2], int) else None
    if not d or d <= 0 or sx[2] % d or sx[2] == d:
        return None
    h = sx[2] // d
    p_dim = sx[0] if isinstance(sx[0], int) else dims.key(x, 0)
    bh = sx[1] * h if isinstance(sx[1], int) else dims.term_key(("mul", ("dim", x, 1), h))
    if not reshape_keeps(g, dims, ev, r, [p_dim, bh, d]):
        return None
    sb = _ShapeBuilder(g, names)
    xt, x4, t4 = names.value(x), names.value(r.output[0]), names.value(n.output[0])
    split = sb.const(f"{x}_heads", [0, 0, h, d])
    nodes = [helper.make_node("Transpose", [x], [xt], name=names.node(f"{r.name}_batch_first"), perm=[1, 0, 2]),
             helper.make_node("Reshape", [xt, split], [x4], name=names.node(r.name)),
             helper.make_node("Transpose", [x4], [t4], name=names.node(n.name), perm=list(perm4))]
    shape_x4 = (sx[1], sx[0], h, d)
    shape4 = tuple(shape_x4[i] for i in perm4)
    if not sb.merge(t4, shape4, n.output[0], n.name):
        return None
    et = g.elem_type(x)
    return Edit("split_heads_transpose", [n.name], add=nodes + sb.nodes, initializers=sb.inits,
                types={xt: _tensor_type(et, (sx[1], sx[0], sx[2])), x4: _tensor_type(et, shape_x4),
                       t4: _tensor_type(et, shape4)})


def cancel_reshapes(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    """Reshape(x, t), or Reshape(Reshape(x, s), t), whose result provably has x's shape is x (a head merge
    followed by the split, left by the rules above)."""
    from npufuse.algebra.layout import reshape_keeps

    y = n.output[0]
    if len(n.input) < 2 or not _renamable(g, y):
        return None
    ev, dims = _algebra(g)
    candidates = [n.input[0]]
    p = g.producer_of(n.input[0])
    if p is not None and p.op_type == "Reshape" and p.domain in ("", "ai.onnx"):
        candidates.append(p.input[0])
    for x in candidates:
        rank = g.rank(x)
        if rank is None or g.rank(y) not in (None, rank) or g.elem_type(x) != g.elem_type(y):
            continue
        if _disproven(g, ev, n, x):
            continue
        if reshape_keeps(g, dims, ev, n, [dims.key(x, i) for i in range(rank)]):
            return Edit("cancel_reshapes", [n.name], rename={y: x})
    return None


def _disproven(g: Graph, ev, n: onnx.NodeProto, x: str) -> bool:
    """True if some static dim of Reshape n's result (inferred, or from its target) differs from x's."""
    sx = g.shape(x) or ()
    out = list(g.shape(n.output[0]) or ())
    terms = ev.terms(n.input[1]) or []
    src = g.shape(n.input[0]) or ()
    for j, t in enumerate(terms):
        if t == 0 and not attributes(n).get("allowzero", 0):
            t = src[j] if j < len(src) else None
        if isinstance(t, int) and t != -1:
            out += [None] * (j + 1 - len(out))
            out[j] = t if not isinstance(out[j], int) else out[j]
            if out[j] != t:
                return True
    return any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(out, sx)) or \
        (bool(terms) and len(terms) != len(sx))


def shape_of_reshape(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    """Shape(Reshape(x, t)) is t where t is literal (no -1, and allowzero or no 0)."""
    a = attributes(n)
    if a.get("start", 0) != 0 or "end" in a or not _renamable(g, n.output[0]):
        return None
    r = g.producer_of(n.input[0])
    if r is None or r.op_type != "Reshape" or r.domain not in ("", "ai.onnx") or len(r.input) < 2:
        return None
    t = r.input[1]
    if g.elem_type(t) != TensorProto.INT64 and not (g.is_constant(t) and g.constant(t) is not None
                                                   and g.constant(t).dtype == np.int64):
        return None
    ev, _ = _algebra(g)
    terms = ev.terms(t)
    if terms is None or -1 in terms or (0 in terms and not attributes(r).get("allowzero", 0)):
        return None
    if not attributes(r).get("allowzero", 0) and any(not isinstance(x, int) for x in terms):
        return None   # a run-time 0 would copy a dim of x
    return Edit("shape_of_reshape", [n.name], rename={n.output[0]: t})
