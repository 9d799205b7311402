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

- `fold_static_value` (a phase before the rules, and again after them while they change the graph, in graphs that
  read shapes): shape arithmetic whose value the graph fixes (a Slice bound `Shape(q)[-1] // 2`, a softmax scale
  `Sqrt(Cast(Shape(q)[-1]))`, a query length of 1) becomes an initializer of the same name, even where the
  tensors it reads have symbolic dims; the shapes it proves beyond onnx shape inference (a -1 of a Reshape whose
  other dims cancel, an Expand target, Range(0, d), dims carried through Transpose / Slice / broadcasting /
  MatMul: `layout_algebra.ShapeProver`) are recorded into `types`, and shape inference runs again after a fold.

Values computed only from constants are folded lazily by `Graph.constant` whatever their size (positional
tables, ALiBi slopes); `normalize` materialises the small ones. The rules use the layout algebra the patterns
share (`patterns.layout_algebra`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
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
            rules = _RULES_BY_OP.get(n.op_type)
            if not rules or n.domain not in ("", "ai.onnx"):
                admitted.discard(n.name)
                continue
            rules = [r for r in rules if _GUARDS[r](g, n)]
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


def _write_nodes(model: onnx.ModelProto, g: Graph) -> None:
    """Write the view's node list into the model (`g.model`), the view then referring to the model's nodes."""
    assert g.model is model
    g.write_nodes()


# ---- static values: shape arithmetic whose value the graph's structure fixes becomes a constant -----------------

MAX_FOLD_ROUNDS = 4
_MAX_FOLDED_ELEMENTS = 1 << 16     # as normalize materialises constants: shapes, bounds, scales, not weights


def fold_static_values(model: onnx.ModelProto, types: dict[str, onnx.TypeProto], base_dir: str | None,
                       view: Graph | None, applied: Counter) -> tuple[Graph | None, bool]:
    """`fold_static_value`: a value computed by shape arithmetic (Shape / Gather / Slice / Concat / Div / Cast /
    Sqrt / ... on ints or on static dims) whose every element the graph fixes becomes an initializer of the same
    name, where it meets the computation (the Slice bound `Shape(q)[-1] // 2`, the softmax scale
    `Sqrt(Cast(Shape(q)[-1]))`, the sequence length 1 of a decode step), even where onnx shape inference left the
    tensors it reads symbolic; dims are read from the proven shapes (`layout_algebra.ShapeProver`). After a fold
    shape inference runs again (the folded constants make more shapes static), with the proven shapes as hints,
    until nothing folds; then the shapes proven beyond inference are recorded into `types`, for the rules and the
    patterns. Exact: the values are computed as onnxruntime computes them (`shape_algebra.StaticValues`).
    Returns the view of the model as it is now (None where none was built) and whether anything changed."""
    from npufuse.patterns.layout_algebra import ShapeProver

    g = view
    hinted: dict[str, tuple] = {}
    changed = False
    for _ in range(MAX_FOLD_ROUNDS):
        g = g if g is not None else Graph(model, base_dir, value_types=types)
        prover = ShapeProver(g)
        edits = _static_folds(g, prover)
        if not edits:
            better = prover.better()
            if better:
                _record_shapes(g, types, better)
                changed, g = True, None
            break
        hinted.update(prover.better())
        _apply(g, edits, types)
        model.graph.initializer.extend(t for e in edits for t in e.initializers)
        _write_nodes(model, g)
        applied["fold_static_value"] += len(edits)
        if model.ir_version < 4:  # IR 3 lists every initializer among the inputs
            model.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                     for e in edits for t in e.initializers)
        _reinfer(model, types, hinted)
        changed, g = True, None
    return g, changed


def _record_shapes(g: Graph, types: dict[str, onnx.TypeProto], proven: dict[str, tuple]) -> None:
    """Proven shapes into `types` (their symbols are those of the run `types` came from)."""
    for v, s in proven.items():
        et = g.elem_type(v)
        if et and v not in g.graph_outputs:
            types[v] = _tensor_type(et, s)


def _static_folds(g: Graph, prover) -> list[Edit]:
    """One edit per node whose value is statically known and read by a node whose value is not (the frontier
    of the static region): its value becomes an initializer, and the shape arithmetic behind it is dropped
    where nothing else reads it."""
    from npufuse.patterns.shape_algebra import STATIC_OPS

    static = prover.static
    small: dict[str, bool] = {}

    def known(n: onnx.NodeProto) -> bool:
        if n.name not in small:
            small[n.name] = n.op_type in STATIC_OPS and n.domain in ("", "ai.onnx") and len(n.output) == 1 and \
                static.known(n.output[0]) is not None and static.known(n.output[0]).size <= _MAX_FOLDED_ELEMENTS
        return small[n.name]

    edits = []
    for n in g.nodes:
        if n.op_type not in STATIC_OPS or n.op_type == "Constant" or not known(n):
            continue
        out = n.output[0]
        if out in g.graph_outputs:
            continue
        # read by the computation: a node whose value is not known here, and not itself a constant (a weight
        # computed from constants stays lazy, as normalize leaves it)
        if not any(not known(c) and not all(g.is_constant(o) for o in c.output if o) for c in g.consumers_of(out)):
            continue
        arr = static.known(out)
        et = g.elem_type(out)
        if et and helper.np_dtype_to_tensor_dtype(arr.dtype) != et:
            continue
        edits.append(Edit("fold_static_value", [n.name], initializers=[numpy_helper.from_array(arr, out)]))
    return edits


def _reinfer(model: onnx.ModelProto, types: dict[str, onnx.TypeProto], hints: dict[str, tuple]) -> None:
    """Shape inference again, with the proven shapes as hints (inference keeps a dim a hint fixes where it finds
    none): `types` becomes its result. Only ints and the model's own symbols are hinted: the symbols inference
    makes up (unk__N) are named afresh by each run."""
    from npufuse.normalize import infer_value_types

    io = {v.name for v in model.graph.input} | {v.name for v in model.graph.output}
    declared = {vi.name: vi for vi in model.graph.value_info}
    added = 0
    for v, s in hints.items():
        if v in io:
            continue
        t = types.get(v)
        if t is None or not t.tensor_type.elem_type:
            continue
        dims = [d if isinstance(d, int) or (isinstance(d, str) and "unk__" not in d) else None for d in s]
        hint = _tensor_type(t.tensor_type.elem_type, dims)
        if v in declared:     # the model's own value_info: a proven shape is as true as the exporter's
            declared[v].type.CopyFrom(_merge_type(declared[v].type, hint))
        else:
            model.graph.value_info.append(helper.make_value_info(v, hint))
            added += 1
    try:
        inferred = infer_value_types(model)
    finally:
        if added:
            del model.graph.value_info[len(model.graph.value_info) - added:]
    for v, s in hints.items():   # where inference dropped a hint (it should not), the proof still holds
        t = inferred.get(v)
        if t is not None and t.tensor_type.HasField("shape") and len(t.tensor_type.shape.dim) == len(s):
            for d, p in zip(t.tensor_type.shape.dim, s):
                if isinstance(p, int) and not d.HasField("dim_value"):
                    d.dim_value = p
                elif isinstance(p, str) and "unk__" not in p and not d.HasField("dim_value") and \
                        (not d.dim_param or "unk__" in d.dim_param):
                    d.dim_param = p
    types.clear()
    types.update(inferred)


def _merge_type(t: onnx.TypeProto, hint: onnx.TypeProto) -> onnx.TypeProto:
    out = onnx.TypeProto()
    out.CopyFrom(t)
    if not t.tensor_type.HasField("shape") or len(t.tensor_type.shape.dim) != len(hint.tensor_type.shape.dim):
        out.tensor_type.shape.CopyFrom(hint.tensor_type.shape)
        return out
    for d, h in zip(out.tensor_type.shape.dim, hint.tensor_type.shape.dim):
        if h.HasField("dim_value") and not d.HasField("dim_value"):
            d.Clear()
            d.dim_value = h.dim_value
    return out


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
    return False


# ---- cheap preconditions: each rule returns None wherever its guard is False --------------------------------
# A guard reads only the node, its inputs' producers and types, and its outputs' consumers: after an edit only the
# nodes next to it need judging again (`_rewrite_rounds`).

def _producer_op(g: Graph, n: onnx.NodeProto, i: int = 0) -> str | None:
    inputs = n.input
    p = g.producer.get(inputs[i]) if len(inputs) > i else None
    return p.op_type if p is not None else None


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


def _cancel_guard(g: Graph, n: onnx.NodeProto) -> bool:
    if len(n.input) < 2:
        return False
    y = n.output[0]
    xs = [n.input[0]]
    p = g.producer.get(n.input[0])
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


def _elementwise_guard(g: Graph, n: onnx.NodeProto) -> bool:
    return len(n.input) == 2 and n.input[0] != n.input[1] and \
        (_producer_op(g, n, 0) == "Reshape" or _producer_op(g, n, 1) == "Reshape")


def _matmul_guard(g: Graph, n: onnx.NodeProto) -> bool:
    return len(n.input) == 2 and _producer_op(g, n, 0) == "Reshape" and _producer_op(g, n, 1) == "Reshape"


def _perm(n: onnx.NodeProto) -> tuple[int, ...]:
    return next((tuple(a.ints) for a in n.attribute if a.name == "perm"), ())


def _sink_guard(g: Graph, n: onnx.NodeProto) -> bool:
    return _perm(n) == (0, 2, 1) and _producer_op(g, n) == "Reshape"


def _split_guard(g: Graph, n: onnx.NodeProto) -> bool:
    return _perm(n) in _SPLIT_PERMS and _producer_op(g, n) == "Reshape"


def _always(g: Graph, n: onnx.NodeProto) -> bool:
    return True


def _reads_renamed(g: Graph, value: str, touched: set[str]) -> bool:
    return any(c.name in touched for c in g.consumers_of(value))


def _reads_rewritten(g: Graph, e: Edit, touched: set[str]) -> bool:
    """Whether the edit's new nodes read a value whose producer another edit of this round rewrites (which may
    rename it away): such an edit waits for the next round."""
    for node in e.add:
        for v in node.input:
            p = g.producer_of(v) if v else None
            if p is not None and p.name in touched:
                return True
    return False


def _apply(g: Graph, edits: list[Edit], types: dict[str, onnx.TypeProto]) -> set[str]:
    """Apply `edits` to the view `g` (patched, not rebuilt; the model's node list is written by the caller) and
    record the new values' types. Returns the names of the nodes whose neighbourhood changed: the nodes a rule's
    precondition must judge again."""
    removed = {name for e in edits for name in e.remove}
    placed = {g.topo_index[e.remove[-1]]: e.add for e in edits}
    rename = {old: new for e in edits for old, new in e.rename.items()}
    gone = [g.node(name) for name in removed]
    for e in edits:   # the types first: the patched view judges the new nodes' constness by them
        types.update(e.types)
    old_nodes, nodes = g.nodes, []
    cut = sorted({g.topo_index[name] for name in removed} | set(placed))
    prev = 0
    for i in cut:
        nodes.extend(old_nodes[prev:i])
        nodes.extend(placed.get(i, ()))
        if old_nodes[i].name not in removed:
            nodes.append(old_nodes[i])
        prev = i + 1
    nodes.extend(old_nodes[prev:])
    added = [n for e in edits for n in e.add]
    readers = {c.name for v in rename for c in g.consumers_of(v) if c.name not in removed}
    candidates = {v for n in gone for v in n.input if v}
    g.patch(nodes, gone, added, rename, [t for e in edits for t in e.initializers])
    dead = _drop_dead(g, candidates)
    if dead:
        dead_nodes = [g.node(name) for name in dead]
        candidates |= {v for n in dead_nodes for v in _reads(n)}
        g.patch([n for n in g.nodes if n.name not in dead], dead_nodes, [])
    # what a precondition reads: the node, its inputs' producers, its outputs' consumers
    changed = [g.node_by_name[x] for x in readers if x in g.node_by_name] + \
        [n for n in added if g.node_by_name.get(n.name) is n]
    values = {v for n in changed for v in _reads(n)} | candidates | set(rename) | set(rename.values()) | \
        {o for n in changed for o in n.output if o}
    recheck = {n.name for n in changed}
    for v in values:
        p = g.producer_of(v)
        if p is not None:
            recheck.add(p.name)
        recheck.update(c.name for c in g.consumers_of(v))
    return recheck


def _drop_dead(g: Graph, candidates: set[str]) -> set[str]:
    """The nodes an edit left unread (the first Transpose of a folded pair, say), found transitively from the
    values the removed nodes read; nodes that were dead in the input stay (not ours to judge)."""
    outputs = g.graph_outputs
    read: Counter = Counter()
    dead: set[str] = set()
    frontier = [v for v in candidates if v not in outputs]
    while frontier:
        v = frontier.pop()
        p = g.producer_of(v)
        if p is None or p.name in dead or _has_subgraph(p) or \
                any(len(g.consumers_of(o)) - read[o] > 0 or o in outputs for o in p.output if o):
            continue
        dead.add(p.name)
        for x in set(_reads(p)):
            read[x] += 1     # one reader of x fewer (the view lists a node once per value it reads)
            frontier.append(x)
    return dead


def _reads(n: onnx.NodeProto) -> list[str]:
    from npufuse.graph import _node_value_inputs  # the one definition of what a node reads (subgraphs included)

    return [v for v in _node_value_inputs(n) if v]


def _has_subgraph(n: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)


def _renamable(g: Graph, value: str) -> bool:
    """A value whose readers can be pointed elsewhere: not a graph output, and read only as a node input (a
    subgraph reading it from the outer scope would need its body edited)."""
    return value not in g.graph_outputs and all(value in c.input and not _has_subgraph(c)
                                                for c in g.consumers_of(value))   # an If may read it in a branch too


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
    if _only_head_merges(g, chain):
        return None   # the MatMul is lifted to 4-D instead (unmerge_matmul): moving the scale would undo that
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


# ---- attention with the heads merged into the batch: [B·H, M, N] back to [B, H, M, N] ------------------------
#
# torch's bmm/baddbmm attention (nn.MultiheadAttention, BLOOM, DeBERTa) computes on 3-D tensors whose batch is
# B·H: Reshape(x4, [B·H, M, N]) of a 4-D x4 (a "head merge", `merged_heads`). Each rule below moves one op
# across such a merge: op(merge(x4), ...) computes the same elements as merge(op(x4, ...)) (batched MatMul per
# batch, elementwise ops, Softmax over the last axis, Transpose of the last two axes are all indifferent to how
# the batch axes are grouped), so the op runs in 4-D and the 3-D name, written by a merge of the 4-D result,
# keeps its value. Merges that end up unread are dropped; a merge followed by the matching split cancels
# (`cancel_reshapes`). The attention matcher then sees the [B, H, S, S] scores it knows.

def _algebra(g: Graph):
    from npufuse.patterns.layout_algebra import Dims, ShapeEval

    return ShapeEval(g), Dims(g)


def _merged(g: Graph, ev, dims, value: str) -> str | None:
    from npufuse.patterns.layout_algebra import merged_heads

    return merged_heads(g, ev, dims, g.producer_of(value)) if value else None


def _only_head_merges(g: Graph, chain: list[onnx.NodeProto]) -> bool:
    ev, dims = _algebra(g)
    return all(_merged(g, ev, dims, step.output[0]) is not None for step in chain)


def _tensor_type(elem: int, shape) -> onnx.TypeProto:
    t = onnx.TypeProto()
    t.tensor_type.elem_type = elem
    if shape is not None:
        t.tensor_type.shape.SetInParent()
        for d in shape:
            dim = t.tensor_type.shape.dim.add()
            if isinstance(d, int) and not isinstance(d, bool):
                dim.dim_value = d
            elif isinstance(d, str) and d:
                dim.dim_param = d
    return t


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


_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div"})


def unmerge_elementwise(g: Graph, n: onnx.NodeProto, names: _Names) -> Edit | None:
    """Add/Sub/Mul/Div(merge(a4), other) is merge(op(a4, other4)): `other` of rank <= 2 broadcasts over the same
    last axes in 4-D; a merge(b4) of the same B and H is b4; any other [B·H, Y, Z] operand (B·H proven) is
    reshaped to [B, H, Y, Z] (a bias such as ALiBi's [B·H, 1, S])."""
    from npufuse.patterns.layout_algebra import broadcast_shape, dim_is, product_key

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
    from npufuse.patterns.layout_algebra import is_transpose

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
    from npufuse.patterns.layout_algebra import is_transpose, reshape_keeps, static_shape

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
    from npufuse.patterns.layout_algebra import reshape_keeps

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
}
