"""Canonical forms before matching: small rewrite rules, run to a fixed point, that bring what exporters write
to one spelling so the patterns match semantics rather than syntax.

Each rule replaces a few nodes by nodes that compute exactly the same values (bit for bit: no reassociation of
float arithmetic, no narrowing), keeps the name of every value read outside the rewritten nodes, never gives an
existing name a different value (activations captured on the model before canonicalisation stay valid), and
never renames a graph output. The rules:

- `drop_identity`: Identity(x) is x;
- `drop_cast_round_trip`: Cast to the type a value already has, and Cast(Cast(x, wider), type of x), are x;
- `fold_transposes`: Transpose(Transpose(x, p), q) is one Transpose (none when the composition is the identity);
- `fold_reshapes`: Reshape(Reshape(x, s), t) is Reshape(x, t) when t does not copy dims from the intermediate;
- `unflatten_k_transpose`: Reshape(Transpose(Reshape(y, [B·H, S, D]), (0,2,1)), [B, H, D, S]), the dynamo
  exporter's K transpose done in 3-D (y 4-D, or the 5-D head repeat of grouped-query attention), is
  Transpose(Reshape(y, [B, H, S, D]), (0,1,3,2)): the repeat and the transpose the attention matcher knows;
- `move_scale_to_matmul`: a Mul/Div by a constant scalar followed by layout steps (Reshape, Transpose,
  Squeeze, Unsqueeze, Expand) that end in a MatMul moves to just before the MatMul, where the attention
  matcher reads a softmax scale (scaling commutes with moving elements around, exactly).

Values computed only from constants are folded lazily by `Graph.constant` whatever their size (positional
tables, ALiBi slopes); `normalize` materialises the small ones. The rules use the layout algebra the patterns
share (`patterns.layout_algebra`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npufuse.graph import Graph, attributes

log = logging.getLogger(__name__)

MAX_ROUNDS = 16
_LAYOUT_OPS = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Expand"})
_MAX_SCALE_WALK = 6
# Casts that represent every value of the source type exactly, so casting back restores it bit for bit.
_EXACT_WIDENING: dict[int, frozenset[int]] = {
    TensorProto.FLOAT16: frozenset({TensorProto.FLOAT, TensorProto.DOUBLE}),
    TensorProto.BFLOAT16: frozenset({TensorProto.FLOAT, TensorProto.DOUBLE}),
    TensorProto.FLOAT: frozenset({TensorProto.DOUBLE}),
    TensorProto.INT8: frozenset({TensorProto.INT16, TensorProto.INT32, TensorProto.INT64}),
    TensorProto.UINT8: frozenset({TensorProto.INT16, TensorProto.INT32, TensorProto.INT64}),
    TensorProto.INT16: frozenset({TensorProto.INT32, TensorProto.INT64}),
    TensorProto.INT32: frozenset({TensorProto.INT64}),
    TensorProto.BOOL: frozenset({TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
                                 TensorProto.UINT8}),
}


@dataclass
class Edit:
    """One application of a rule: drop `remove`, put `add` where the last of them was, make every reader of a
    value in `rename` read its replacement, and record the types of the new intermediate values."""

    rule: str
    remove: list[str]
    add: list[onnx.NodeProto] = field(default_factory=list)
    rename: dict[str, str] = field(default_factory=dict)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    types: dict[str, onnx.TypeProto] = field(default_factory=dict)


class _Names:
    """Fresh node and value names for one round."""

    def __init__(self, g: Graph) -> None:
        self.g = g
        self.taken: set[str] = set()

    def value(self, base: str) -> str:
        name, k = f"{base}_canon", 1
        while name in self.taken or name in self.g.producer or name in self.g.consumers or name in self.g.initializers:
            name, k = f"{base}_canon{k}", k + 1
        self.taken.add(name)
        return name

    def node(self, base: str) -> str:
        name, k = f"{base}_canon", 1
        while name in self.taken or name in self.g.node_by_name:
            name, k = f"{base}_canon{k}", k + 1
        self.taken.add(name)
        return name


Rule = Callable[[Graph, onnx.NodeProto, _Names], Edit | None]


def canonicalize(model: onnx.ModelProto, types: dict[str, onnx.TypeProto], base_dir: str | None = None,
                 view: Graph | None = None) -> tuple[Counter, Graph | None]:
    """Rewrite `model` (in place) to its canonical form; `types` gains the types of new values. Returns how many
    times each rule applied, and a view of the result where one was built after the last change (`view`: one of
    `model` as it is now, if the caller has it: indexing a 100k-node graph is the cost of this phase)."""
    applied: Counter = Counter()
    g = view
    for _ in range(MAX_ROUNDS):
        if g is None:
            if not _may_apply(model.graph):
                return applied, None
            g = Graph(model, base_dir, value_types=types)
        names = _Names(g)
        touched: set[str] = set()
        edits: list[Edit] = []
        for n in g.nodes:
            rules = _RULES_BY_OP.get(n.op_type)
            if not rules or n.domain not in ("", "ai.onnx") or n.name in touched:
                continue
            for rule in rules:
                e = rule(g, n, names)
                if e is None or touched.intersection(e.remove) or any(_reads_renamed(g, v, touched) for v in e.rename):
                    continue
                touched.update(e.remove)
                # the readers of a renamed value are edited too: keep them out of other edits this round
                touched.update(c.name for v in e.rename for c in g.consumers_of(v))
                edits.append(e)
                applied[e.rule] += 1
                break
        if not edits:
            return applied, g
        _apply(model, g, edits, types)
        g = None
    return applied, None


def _may_apply(graph: onnx.GraphProto) -> bool:
    """Whether any rule could apply, judged from op types alone (a pass far cheaper than indexing the graph)."""
    producer_op = {o: n.op_type for n in graph.node for o in n.output}
    for n in graph.node:
        op = n.op_type
        if op in ("Identity", "Cast"):
            return True
        if op in ("Transpose", "Reshape") and n.input and producer_op.get(n.input[0]) in ("Transpose", "Reshape"):
            return True
        if op == "MatMul" and any(producer_op.get(v) in _LAYOUT_OPS for v in n.input):
            return True   # a scale may sit before the layout steps
    return False


def _reads_renamed(g: Graph, value: str, touched: set[str]) -> bool:
    return any(c.name in touched for c in g.consumers_of(value))


def _apply(model: onnx.ModelProto, g: Graph, edits: list[Edit], types: dict[str, onnx.TypeProto]) -> None:
    from npufuse.normalize import set_nodes

    removed = {name for e in edits for name in e.remove}
    placed = {e.remove[-1]: e.add for e in edits}
    rename = {old: new for e in edits for old, new in e.rename.items()}
    nodes: list[onnx.NodeProto] = []
    for n in g.nodes:
        nodes.extend(placed.get(n.name, ()))
        if n.name not in removed:
            nodes.append(n)
    if rename:   # a renamed value is an alias: every reader, old or new, reads what it stands for
        for n in nodes:
            for i, v in enumerate(n.input):
                if v in rename:
                    n.input[i] = rename[v]
    nodes = _drop_dead(nodes, g, {v for e in edits for name in e.remove for v in g.node(name).input})
    set_nodes(model.graph, nodes)
    model.graph.initializer.extend(t for e in edits for t in e.initializers)
    for e in edits:
        types.update(e.types)


def _drop_dead(nodes: list[onnx.NodeProto], g: Graph, candidates: set[str]) -> list[onnx.NodeProto]:
    """Remove the nodes an edit left unread (the first Transpose of a folded pair, say), transitively from the
    values the removed nodes read; nodes that were dead in the input stay (not ours to judge)."""
    read: Counter = Counter(v for n in nodes for v in _reads(n))
    outputs = g.graph_outputs
    by_output = {o: n for n in nodes for o in n.output if o}
    dead: set[str] = set()
    frontier = [v for v in candidates if v not in outputs]
    while frontier:
        v = frontier.pop()
        p = by_output.get(v)
        if p is None or p.name in dead or _has_subgraph(p) or any(read[o] or o in outputs for o in p.output if o):
            continue
        dead.add(p.name)
        for x in _reads(p):
            read[x] -= 1
            frontier.append(x)
    return [n for n in nodes if n.name not in dead] if dead else nodes


def _reads(n: onnx.NodeProto) -> list[str]:
    from npufuse.graph import _node_value_inputs  # the one definition of what a node reads (subgraphs included)

    return [v for v in _node_value_inputs(n) if v]


def _has_subgraph(n: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)


def _renamable(g: Graph, value: str) -> bool:
    """A value whose readers can be pointed elsewhere: not a graph output, and read only as a node input (a
    subgraph reading it from the outer scope would need its body edited)."""
    return value not in g.graph_outputs and all(value in c.input for c in g.consumers_of(value))


def _private(g: Graph, value: str) -> bool:
    """Read by exactly one node, as an input, and not a graph output."""
    return g.single_consumer(value) is not None and _renamable(g, value)


# ---- the rules ------------------------------------------------------------------------------------------------

def drop_identity(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    if not n.input or not n.input[0] or not _renamable(g, n.output[0]):
        return None
    return Edit("drop_identity", [n.name], rename={n.output[0]: n.input[0]})


def drop_cast_round_trip(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    to = attributes(n).get("to")
    x, y = n.input[0], n.output[0]
    if not _renamable(g, y):
        return None
    src = g.elem_type(x)
    if src and src == to:
        return Edit("drop_cast_round_trip", [n.name], rename={y: x})
    p = g.producer_of(x)
    if p is None or p.op_type != "Cast" or p.domain not in ("", "ai.onnx"):
        return None
    origin = p.input[0]
    t0 = g.elem_type(origin)
    if t0 and t0 == to and attributes(p).get("to") in _EXACT_WIDENING.get(t0, ()):
        return Edit("drop_cast_round_trip", [n.name], rename={y: origin})
    return None


def fold_transposes(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    p = g.producer_of(n.input[0])
    if p is None or p.op_type != "Transpose" or p.domain not in ("", "ai.onnx"):
        return None
    rank = g.rank(p.input[0])
    p_perm = attributes(p).get("perm") or (list(range(rank))[::-1] if rank is not None else None)
    q_perm = attributes(n).get("perm") or (p_perm and list(range(len(p_perm)))[::-1])
    if not p_perm or not q_perm or len(p_perm) != len(q_perm):
        return None
    perm = [p_perm[i] for i in q_perm]
    y = n.output[0]
    if perm == list(range(len(perm))) and _renamable(g, y):
        return Edit("fold_transposes", [n.name], rename={y: p.input[0]})
    node = helper.make_node("Transpose", [p.input[0]], [y], name=n.name, perm=perm)
    return Edit("fold_transposes", [n.name], add=[node])


def fold_reshapes(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    p = g.producer_of(n.input[0])
    if p is None or p.op_type != "Reshape" or p.domain not in ("", "ai.onnx") or len(n.input) < 2:
        return None
    # A 0 in the target copies that dim of the reshaped value, which the fold would change; a constant target
    # shows it has none (or allowzero says 0 means 0).
    target = g.constant(n.input[1]) if g.is_constant(n.input[1]) else None
    if not attributes(n).get("allowzero", 0) and (target is None or np.any(target == 0)):
        return None
    node = onnx.NodeProto()
    node.CopyFrom(n)
    node.input[0] = p.input[0]
    return Edit("fold_reshapes", [n.name], add=[node])


def unflatten_k_transpose(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    from npufuse.patterns.layout_algebra import Dims, ShapeEval, is_transpose

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


def move_scale_to_matmul(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    from npufuse.patterns.layout_algebra import scale_op

    scale = scale_op(g, n)
    if scale is None or not _private(g, n.output[0]):
        return None
    x = scale[0]
    c = n.input[1] if x == n.input[0] else n.input[0]
    c_rank = g.constant(c).ndim
    if g.rank(x) is None or c_rank > g.rank(x):
        return None   # the Mul broadcasts x up: it is not a pure scale
    chain: list[onnx.NodeProto] = []
    cur = n.output[0]
    for _ in range(_MAX_SCALE_WALK):
        nxt = g.single_consumer(cur)
        if nxt is None or nxt.domain not in ("", "ai.onnx"):
            return None
        if nxt.op_type == "MatMul" and list(nxt.input).count(cur) == 1:
            break
        if nxt.op_type not in _LAYOUT_OPS or nxt.input[0] != cur or cur in nxt.input[1:] or not _private(g, cur):
            return None
        chain.append(nxt)
        cur = nxt.output[0]
    else:
        return None
    if not chain or g.rank(cur) is None or c_rank > g.rank(cur):
        return None
    # The layout steps now carry unscaled values: new names (a name keeps its value, so activations captured on
    # the model before canonicalisation stay valid), and the scale writes `cur`, the name the MatMul reads.
    moved, types = [], {}
    prev = x
    for step in chain:
        copy = onnx.NodeProto()
        copy.CopyFrom(step)
        copy.input[0] = prev
        copy.output[0] = prev = names.value(step.output[0])
        if g.type_of(step.output[0]) is not None:
            types[prev] = g.type_of(step.output[0])
        moved.append(copy)
    operands = [prev, c] if x == n.input[0] else [c, prev]
    moved.append(helper.make_node(n.op_type, operands, [cur], name=n.name))
    return Edit("move_scale_to_matmul", [n.name] + [s.name for s in chain], add=moved, types=types)


_RULES_BY_OP: dict[str, tuple[Rule, ...]] = {
    "Identity": (drop_identity,),
    "Cast": (drop_cast_round_trip,),
    "Transpose": (fold_transposes,),
    "Reshape": (unflatten_k_transpose, fold_reshapes),
    "Mul": (move_scale_to_matmul,),
    "Div": (move_scale_to_matmul,),
}
