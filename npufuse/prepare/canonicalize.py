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
  matcher reads a softmax scale (scaling commutes with moving elements around, exactly);
- attention with the heads merged into the batch (torch's bmm/baddbmm: [B·H, M, N] = Reshape of a 4-D
  [B, H, M, N]) runs in 4-D: `unmerge_matmul`, `unmerge_elementwise` (a [B·H, Y, Z] bias is reshaped to
  [B, H, Y, Z]), `unmerge_unary` (Softmax over the last axis, Cast), `sink_transpose_merge` (Kᵀ),
  `split_heads_transpose` (sequence-first [P, B, H·D] -> [P, B·H, D] -> Transpose, nn.MultiheadAttention), each
  leaving the 3-D name written by a merge of the 4-D result; `cancel_reshapes` (a Reshape, or two, back to
  the shape of its source is the source) and `shape_of_reshape` (Shape of a literal Reshape is its target)
  clean up after them.

- `rotate_halves`: the rotary embedding written on the halves with half-width tables (GPT-OSS: cat(x1·cos -
  x2·sin, x2·cos + x1·sin)) is x·cat(cos, cos) + cat(-x2, x1)·cat(sin, sin), the rotate_half form (`prepare.rules.
  rotary_halves`);

- `fold_static_value` (a phase before the rules, and again after them while they change the graph, in graphs that
  read shapes): shape arithmetic whose value the graph fixes (a Slice bound `Shape(q)[-1] // 2`, a softmax scale
  `Sqrt(Cast(Shape(q)[-1]))`, a query length of 1) becomes an initializer of the same name, even where the
  tensors it reads have symbolic dims; the shapes it proves beyond onnx shape inference (a -1 of a Reshape whose
  other dims cancel, an Expand target, Range(0, d), dims carried through Transpose / Slice / broadcasting /
  MatMul: `algebra.layout.ShapeProver`) are recorded into `types`, and shape inference runs again after a fold.

Values computed only from constants are folded lazily by `Graph.constant` whatever their size (positional
tables, ALiBi slopes); `normalize` materialises the small ones. The rules use the layout algebra the patterns
share (`npufuse.algebra`). This module is the driver (rounds, guards, which rules an op type tries); the rules live
in `prepare.rules` by theme (basic, softmax_scale, merged_heads) and the static-value phase in
`prepare.static_values`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping

import onnx

from npufuse.ir.graph import Graph
from npufuse.prepare.rules.apply import _apply, _reads_renamed, _reads_rewritten, _write_nodes
from npufuse.prepare.rules.basic import drop_cast_round_trip, drop_identity, fold_reshapes, fold_transposes
from npufuse.prepare.rules.edit import _LAYOUT_OPS, Edit, Rule, _Names, _perm, _producer_op
from npufuse.prepare.rules.rotary_halves import rotate_halves
from npufuse.prepare.rules.softmax_scale import move_scale_to_matmul
from npufuse.prepare.rules.merged_heads import (_SPLIT_PERMS, cancel_reshapes, shape_of_reshape, sink_transpose_merge,
                                                split_heads_transpose, unflatten_k_transpose, unmerge_elementwise,
                                                unmerge_matmul, unmerge_unary)
from npufuse.prepare.static_values import fold_static_values

log = logging.getLogger(__name__)

MAX_ROUNDS = 16


def canonicalize(model: onnx.ModelProto, types: dict[str, onnx.TypeProto], base_dir: str | None = None,
                 view: Graph | None = None) -> tuple[Counter, Graph | None]:
    """Rewrite `model` (in place) to its canonical form; `types` gains the types of new values. Returns how many
    times each rule applied, and a view of the result where one was built after the last change (`view`: one of
    `model` as it is now, if the caller has it: indexing a 100k-node graph is the cost of this phase)."""
    applied: Counter = Counter()
    g = view
    reads_shapes = any(n.op_type in ("Shape", "Size") for n in model.graph.node)
    for phase in range(MAX_PHASES):
        if reads_shapes:   # after the rules too: a head merge lifted to 4-D shows dims the 3-D form hid
            g, changed = fold_static_values(model, types, base_dir, g, applied)
            if phase and not changed:
                break
        g, changed = _rewrite_rounds(model, types, base_dir, g, applied)
        if not changed or not reads_shapes:
            break
    return applied, g


MAX_PHASES = 3


def _rewrite_rounds(model: onnx.ModelProto, types: dict[str, onnx.TypeProto], base_dir: str | None,
                    g: Graph | None, applied: Counter) -> tuple[Graph | None, bool]:
    """The rules to a fixed point: (view of the result or None, whether any applied).

    Round 1 looks at every node; a rule runs only where its cheap precondition (`_GUARDS`: the op types of the
    node's neighbours, its input's type) admits the node. Later rounds look at the admitted nodes again and
    re-judge only the nodes next to an edit (a precondition reads nothing further away), so a round costs the
    edits and the admitted nodes, not the graph. The view is patched after each round, not rebuilt, and the
    model's node list is written once, at the end."""
    changed = False
    if g is None:
        if not _may_apply(model.graph, types):
            return None, changed
        g = Graph(model, base_dir, value_types=types)
    admitted: set[str] = set()
    recheck: set[str] | None = None    # None: every node (the first round)
    for _ in range(MAX_ROUNDS):
        names = _Names(g)
        touched: set[str] = set()
        edits: list[Edit] = []
        if recheck is None:
            visit = g.nodes
        else:
            topo, by_name = g.topo_index, g.node_by_name
            visit = [by_name[x] for x in sorted(admitted | recheck, key=lambda x: topo.get(x, -1)) if x in topo]
        for n in visit:
            guarded = _GUARDED_BY_OP.get(n.op_type)
            if not guarded or n.domain not in ("", "ai.onnx"):
                admitted.discard(n.name)
                continue
            rules = [r for r, guard in guarded if guard(g, n)]
            if not rules:
                admitted.discard(n.name)
                continue
            admitted.add(n.name)
            if n.name in touched:
                continue
            for rule in rules:
                e = rule(g, n, names)
                if e is None or touched.intersection(e.remove) or any(_reads_renamed(g, v, touched) for v in e.rename) \
                        or _reads_rewritten(g, e, touched):
                    continue
                touched.update(e.remove)
                # the readers of a renamed value are edited too: keep them out of other edits this round
                touched.update(c.name for v in e.rename for c in g.consumers_of(v))
                edits.append(e)
                applied[e.rule] += 1
                break
        if not edits:
            break
        recheck = _apply(g, edits, types)
        model.graph.initializer.extend(t for e in edits for t in e.initializers)
        changed = True
    else:
        _stopped_early(applied)
    if changed:
        _write_nodes(model, g)
    return g, changed


def _stopped_early(applied: Counter) -> None:
    """The rules still applied after MAX_ROUNDS rounds: the graph is left as it is (correct, but maybe not in its
    canonical form); counted as `stopped_at_max_rounds`, which normalize reports."""
    applied["stopped_at_max_rounds"] += 1
    log.warning("canonicalisation stopped after %d rounds without reaching a fixed point", MAX_ROUNDS)


# ---- static values: shape arithmetic whose value the graph's structure fixes becomes a constant -----------------


def _may_apply(graph: onnx.GraphProto, types: Mapping[str, onnx.TypeProto]) -> bool:
    """Whether any rule could apply, judged from op types, consumer counts and `types` (a pass far cheaper than
    indexing the graph): the rules' preconditions (`_GUARDS`) where they need no more than that."""
    producer_op = {o: n.op_type for n in graph.node for o in n.output}
    readers: Counter = Counter(v for n in graph.node for v in set(n.input))
    consumer_op = {v: n.op_type for n in graph.node for v in n.input}
    outputs = {o.name for o in graph.output}
    init_type = {t.name: t.data_type for t in graph.initializer}

    def elem(v: str) -> int:
        t = types.get(v)
        return t.tensor_type.elem_type if t is not None else init_type.get(v, 0)

    def rank(v: str) -> int | None:
        t = types.get(v)
        if t is not None:
            return len(t.tensor_type.shape.dim) if t.tensor_type.HasField("shape") else None
        return None

    for n in graph.node:
        op = n.op_type
        if op not in _RULES_BY_OP or n.domain not in ("", "ai.onnx") or not n.input:
            continue
        prods = [producer_op.get(v) for v in n.input]
        if op == "Identity" or (op == "MatMul" and prods == ["Reshape", "Reshape"]) or \
                (op in _ELEMENTWISE and "Reshape" in prods) or (op not in _ELEMENTWISE and prods[0] == "Reshape"):
            return True
        if op == "Cast":
            to = next((a.i for a in n.attribute if a.name == "to"), None)
            if prods[0] == "Cast" or not elem(n.input[0]) or elem(n.input[0]) == to:
                return True
        elif op in ("Transpose", "Reshape") and prods[0] == "Transpose":
            return True
        elif op == "Reshape" and len(n.input) > 1:   # cancel_reshapes: a Reshape to its input's rank and type
            x, y = n.input[0], n.output[0]
            if rank(x) is not None and rank(y) in (None, rank(x)) and elem(x) == elem(y):
                return True
        elif op in ("Mul", "Div") and readers[n.output[0]] == 1 and n.output[0] not in outputs and \
                consumer_op.get(n.output[0]) in _LAYOUT_OPS:
            return True   # a scale before layout steps
        elif op == "Concat" and prods == ["Sub", "Add"]:
            return True   # a rotation written on the halves
    return False


# ---- cheap preconditions: each rule returns None wherever its guard is False --------------------------------
# A guard reads only the node, its inputs' producers and types, and its outputs' consumers: after an edit only the
# nodes next to it need judging again (`_rewrite_rounds`).


def _cast_guard(g: Graph, n: onnx.NodeProto) -> bool:
    if not n.input:
        return False
    if _producer_op(g, n) == "Cast":
        return True
    to = next((a.i for a in n.attribute if a.name == "to"), None)
    src = g.elem_type(n.input[0])
    return bool(src) and src == to


def _reshape_input_guard(g: Graph, n: onnx.NodeProto) -> bool:
    return _producer_op(g, n) == "Reshape"


def _transpose_input_guard(g: Graph, n: onnx.NodeProto) -> bool:
    return _producer_op(g, n) == "Transpose"


def _reads_op(g: Graph, v: str, op: str) -> bool:
    """Whether `v` is written by an `op` node (`_producer_op(...) == op` for an input read once)."""
    p = g.producer.get(v)
    return p is not None and p.op_type == op


def _cancel_guard(g: Graph, n: onnx.NodeProto) -> bool:
    ins = n.input
    if len(ins) < 2:
        return False
    y = n.output[0]
    xs = [ins[0]]
    p = g.producer.get(xs[0])
    if p is not None and p.op_type == "Reshape" and p.domain in ("", "ai.onnx"):
        xs.append(p.input[0])
    for x in xs:
        rank = g.rank(x)
        if rank is not None and g.rank(y) in (None, rank) and g.elem_type(x) == g.elem_type(y):
            return True
    return False


def _scale_guard(g: Graph, n: onnx.NodeProto) -> bool:
    """move_scale_to_matmul: the scaled value's only reader is a layout step (the walk needs at least one)."""
    if len(n.input) != 2:
        return False
    nxt = g.single_consumer(n.output[0])
    return nxt is not None and nxt.op_type in _LAYOUT_OPS and nxt.domain in ("", "ai.onnx")


def _two_inputs(n: onnx.NodeProto) -> tuple[str, str] | None:
    """`n`'s inputs where it has exactly two."""
    ins = n.input
    return (ins[0], ins[1]) if len(ins) == 2 else None


def _elementwise_guard(g: Graph, n: onnx.NodeProto) -> bool:
    ab = _two_inputs(n)
    return ab is not None and ab[0] != ab[1] and (_reads_op(g, ab[0], "Reshape") or _reads_op(g, ab[1], "Reshape"))


def _matmul_guard(g: Graph, n: onnx.NodeProto) -> bool:
    ab = _two_inputs(n)
    return ab is not None and _reads_op(g, ab[0], "Reshape") and _reads_op(g, ab[1], "Reshape")


def _sink_guard(g: Graph, n: onnx.NodeProto) -> bool:
    return _perm(n) == (0, 2, 1) and _producer_op(g, n) == "Reshape"


def _split_guard(g: Graph, n: onnx.NodeProto) -> bool:
    return _perm(n) in _SPLIT_PERMS and _producer_op(g, n) == "Reshape"


def _halves_guard(g: Graph, n: onnx.NodeProto) -> bool:
    ab = _two_inputs(n)
    return ab is not None and _reads_op(g, ab[0], "Sub") and _reads_op(g, ab[1], "Add")


def _always(g: Graph, n: onnx.NodeProto) -> bool:
    return True


# ---- the rules ------------------------------------------------------------------------------------------------


# ---- attention with the heads merged into the batch: [B·H, M, N] back to [B, H, M, N] ------------------------
#
# torch's bmm/baddbmm attention (nn.MultiheadAttention, BLOOM, DeBERTa) computes on 3-D tensors whose batch is
# B·H: Reshape(x4, [B·H, M, N]) of a 4-D x4 (a "head merge", `merged_heads`). Each rule below moves one op
# across such a merge: op(merge(x4), ...) computes the same elements as merge(op(x4, ...)) (batched MatMul per
# batch, elementwise ops, Softmax over the last axis, Transpose of the last two axes are all indifferent to how
# the batch axes are grouped), so the op runs in 4-D and the 3-D name, written by a merge of the 4-D result,
# keeps its value. Merges that end up unread are dropped; a merge followed by the matching split cancels
# (`cancel_reshapes`). The attention matcher then sees the [B, H, S, S] scores it knows.


_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div"})


_RULES_BY_OP: dict[str, tuple[Rule, ...]] = {
    "Identity": (drop_identity,),
    "Cast": (drop_cast_round_trip, unmerge_unary),
    "Transpose": (fold_transposes, sink_transpose_merge, split_heads_transpose),
    "Reshape": (unflatten_k_transpose, cancel_reshapes, fold_reshapes),
    "Mul": (move_scale_to_matmul, unmerge_elementwise),
    "Div": (move_scale_to_matmul, unmerge_elementwise),
    "Add": (unmerge_elementwise,),
    "Sub": (unmerge_elementwise,),
    "MatMul": (unmerge_matmul,),
    "Softmax": (unmerge_unary,),
    "Shape": (shape_of_reshape,),
    "Concat": (rotate_halves,),
}

_GUARDS: dict[Rule, Callable[[Graph, onnx.NodeProto], bool]] = {
    drop_identity: _always,
    drop_cast_round_trip: _cast_guard,
    unmerge_unary: _reshape_input_guard,
    fold_transposes: _transpose_input_guard,
    sink_transpose_merge: _sink_guard,
    split_heads_transpose: _split_guard,
    unflatten_k_transpose: _transpose_input_guard,
    cancel_reshapes: _cancel_guard,
    fold_reshapes: _reshape_input_guard,
    move_scale_to_matmul: _scale_guard,
    unmerge_elementwise: _elementwise_guard,
    unmerge_matmul: _matmul_guard,
    shape_of_reshape: _reshape_input_guard,
    rotate_halves: _halves_guard,
}

# The rules an op type tries, each with its guard, in order (the driver's loop over every node reads no dict more).
_GUARDED_BY_OP: dict[str, tuple[tuple[Rule, Callable[[Graph, onnx.NodeProto], bool]], ...]] = {
    op: tuple((r, _GUARDS[r]) for r in rules) for op, rules in _RULES_BY_OP.items()}
