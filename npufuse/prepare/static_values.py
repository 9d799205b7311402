"""`fold_static_value`: shape arithmetic whose value the graph's structure fixes becomes a constant (the phase canonicalisation
runs before its rules, and again after them while they change a graph that reads shapes)."""

from __future__ import annotations

from collections import Counter
import onnx
from onnx import helper, numpy_helper
from npufuse.ir.graph import Graph
from npufuse.prepare.rules.edit import (Edit, _has_subgraph, _perm, _private, _producer_op, _reads, _renamable)  # noqa: F401
from npufuse.prepare.rules.apply import _apply, _drop_dead, _reads_renamed, _reads_rewritten, _write_nodes  # noqa: F401


MAX_FOLD_ROUNDS = 4


_MAX_FOLDED_ELEMENTS = 1 << 16     # as normalize materialises constants: shapes, bounds, scales, not weights


def fold_static_values(model: onnx.ModelProto, types: dict[str, onnx.TypeProto], base_dir: str | None,
                       view: Graph | None, applied: Counter, max_rounds: int = MAX_FOLD_ROUNDS
                       ) -> tuple[Graph | None, bool]:
    """`fold_static_value`: a value computed by shape arithmetic (Shape / Gather / Slice / Concat / Div / Cast /
    Sqrt / ... on ints or on static dims) whose every element the graph fixes becomes an initializer of the same
    name, where it meets the computation (the Slice bound `Shape(q)[-1] // 2`, the softmax scale
    `Sqrt(Cast(Shape(q)[-1]))`, the sequence length 1 of a decode step), even where onnx shape inference left the
    tensors it reads symbolic; dims are read from the proven shapes (`algebra.layout.ShapeProver`). After a fold
    shape inference runs again (the folded constants make more shapes static), with the proven shapes as hints,
    until nothing folds; then the shapes proven beyond inference are recorded into `types`, for the rules and the
    patterns. Exact: the values are computed as onnxruntime computes them (`algebra.shapes.StaticValues`).
    Each round re-infers the whole model, and the shapes a fold fixes reach the next fold only through that
    inference (a chain of computed pads, one per block of an EfficientNet, takes a round each): `max_rounds`
    bounds it. Returns the view of the model as it is now (None where none was built) and whether anything
    changed."""
    from npufuse.algebra.layout import ShapeProver

    g = view
    hinted: dict[str, tuple] = {}
    changed = False
    for _ in range(max_rounds):
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
    from npufuse.algebra.shapes import STATIC_OPS

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
    from npufuse.prepare.infer import infer_value_types

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
