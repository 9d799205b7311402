"""From graph nodes to the cost model's plain workload records, and the fuse/skip decision."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from npufuse.cost_model import (
    FusionCandidate,
    FusionDecision,
    OpWork,
    TensorInfo,
    decide,
)
from npufuse.cost_model.recipes import INPLACE_ATTR
from npufuse.fusion.ascend import replacement_kernel
from npufuse.fusion.inplace import inplace_nodes
from npufuse.ir.candidates import Match, Replacement
from npufuse.ir.graph import Graph, attributes, np_dtype
from npufuse.npu_model.spec import NpuSpec
from npufuse.verify.inputs import concrete_shape

# Symbolic dims when pricing: the sizes a deployment sees, not the small ones verification runs with.
# `--dim NAME=INT` overrides any of them; names match as in `verify.inputs.dim_default` (whole names, then
# words, `past` first); a symbol none of these names fits (e.g. shape inference's `unk__3`) counts as 1, and an
# optimize run notes each such symbol of the graph inputs (`fusion.engine`).
COST_DEFAULT_DIMS = {"batch": 1, "seq": 512, "sequence": 512, "len": 512, "past": 0, "height": 224, "width": 224}
COST_OTHER_DIM = 1


class CostShapes:
    """Concrete shapes at deployment sizes, for pricing.

    The graph inputs' symbolic dims are set to their cost defaults (or `--dim` values) and shapes are
    inferred again, so shapes computed at run time (Shape -> Gather -> Concat -> Reshape, as TorchScript
    exports do for every head split) come out concrete instead of `unk__N`. onnxruntime's symbolic shape
    inference does this well (it evaluates shape arithmetic with sympy); where it fails, onnx's shape
    inference with data propagation is the fallback. Weights take no part: the inference runs on a light
    copy that keeps only small constants.
    """

    _SMALL_CONSTANT_ELEMENTS = 4096

    def __init__(self, model: onnx.ModelProto, dims: Mapping[str, int] | None,
                 fallback: CostShapes | None = None, types: Mapping[str, onnx.TypeProto] | None = None) -> None:
        self.dims = dict(dims or {})
        self.decisions: dict[str, Any] = {}   # see price(): one decision per distinct candidate
        self._fallback = fallback
        self._shapes: dict[str, tuple[int | str | None, ...]] = {}
        self._concrete: dict[str, tuple[int, ...]] = {}   # concrete shapes by value name, for one Graph view
        self._concrete_graph: tuple[Graph, int] | None = None   # that view and its version
        self._value_keys: dict[str, tuple] = {}   # (concrete shape, elem type, constness) by name, same view
        self._concrete_of: dict[tuple, tuple[int, ...]] = {}   # concrete_shape by shape: layers repeat shapes
        self._told_shapes: dict[tuple, bool] = {}   # see _all_told
        self._told_concrete: dict[tuple, tuple[int, ...]] = {}   # concrete_shape of each `_all_told` shape
        # values priced on an assumed size: a dim (or the whole shape) no shape inference could tell, priced at
        # COST_OTHER_DIM; a modeled time built on them says so (reporting.document's `assumed_shapes`)
        self.assumed: set[str] = set()
        # values fixed at these sizes by shape arithmetic (folded on the light copy, `_folded_shapes`): ATC, which
        # compiles at fixed sizes, folds them too, so the nodes computing them are no kernels
        self.static: frozenset[str] = frozenset()
        # the graph inputs' symbols: a symbolic dim elsewhere that is none of them was made up by shape inference
        # (`unk__3`), so its size is as unknown as an empty dim
        self._input_symbols = {d.dim_param for vi in model.graph.input if vi.type.HasField("tensor_type")
                               for d in vi.type.tensor_type.shape.dim if d.dim_param}
        if types is not None and self._from_symbolic(model, types):
            return
        light = self._light_copy(model)
        inferred = None
        try:
            inferred = onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=True)
        except Exception:
            pass
        recorded, concrete = _recorded_shapes(inferred) if inferred is not None else ({}, False)
        if not concrete:
            # Shape arithmetic onnx cannot follow (dynamic head splits): onnxruntime's symbolic inference
            # can, at the price of importing sympy, so only here.
            try:
                inferred = _symbolic_shapes(light)
            except Exception:
                if inferred is None:  # pricing falls back to the symbolic shapes with defaults
                    return
            else:
                recorded, concrete = _recorded_shapes(inferred)
            # (where it failed, `inferred` is still onnx's, already found not concrete, its shapes `recorded`)
        if not concrete:
            # Shape arithmetic neither inference evaluates (a TF-"same" pad from Shape -> Cast -> Div -> Ceil, as
            # timm's EfficientNets compute it) is fixed once the inputs' dims are: folded as canonicalisation
            # folds static shapes, on the light copy at these sizes, then inferred again.
            folded, static = _folded_shapes(light)
        else:
            folded, static = None, frozenset()
        self._shapes = recorded
        if folded is not None:
            # a value's shape from the folded model where it is whole and the first pass's is not: each pass
            # keeps what it could tell, so the fold never loses a shape
            better = {v: s for v, s in _shapes_of(folded).items()
                      if all(isinstance(d, int) for d in s) and not all(isinstance(d, int)
                                                                        for d in self._shapes.get(v, (None,)))}
            if better:
                self._shapes.update(better)
                self.static = static

    def _from_symbolic(self, model: onnx.ModelProto, types: Mapping[str, onnx.TypeProto]) -> bool:
        """Use the shapes normalisation inferred when every dim of every computed value is a number or one of
        the graph inputs' own symbols: setting those symbols then gives exactly what inferring again at
        deployment sizes would (and costs nothing on a 100k-node graph). False where any dim is unknown or
        was made up by inference (`unk__3`): shape arithmetic that only a concrete pass can follow."""
        inits = {t.name for t in model.graph.initializer}
        symbols = {d.dim_param for vi in model.graph.input if vi.name not in inits
                   for d in vi.type.tensor_type.shape.dim if d.HasField("dim_param")}
        shapes: dict[str, tuple[int | str | None, ...]] = {}
        by_bytes: dict[bytes, tuple | None] = {}   # the layers of a big model repeat a few shapes
        for n in model.graph.node:
            for o in n.output:
                t = types.get(o) if o else None
                if not o or t is None:
                    if o:
                        return False
                    continue
                tt = t.tensor_type
                if not tt.HasField("shape"):
                    return False
                shape = tt.shape
                key = shape.SerializeToString()
                dims = by_bytes.get(key, by_bytes)   # the dict itself: not seen yet
                if dims is by_bytes:
                    dims = by_bytes[key] = _symbolic_dims(shape, symbols)
                if dims is None:
                    return False
                shapes[o] = dims
        for vi in model.graph.input:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
                shapes[vi.name] = tuple(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None)
                                        for d in vi.type.tensor_type.shape.dim)
        self._shapes = shapes
        return True

    def _light_copy(self, model: onnx.ModelProto) -> onnx.ModelProto:
        from onnx import helper

        graph = model.graph
        small = [t for t in graph.initializer
                 if int(np.prod(t.dims)) <= self._SMALL_CONSTANT_ELEMENTS and t.data_location != onnx.TensorProto.EXTERNAL]
        small_names = {t.name for t in small}
        inits = {t.name for t in graph.initializer}
        inputs = []
        for vi in graph.input:
            if vi.name in inits:
                continue
            shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in vi.type.tensor_type.shape.dim]
            concrete = concrete_shape(tuple(shape), self.dims, COST_DEFAULT_DIMS, COST_OTHER_DIM)
            inputs.append(helper.make_tensor_value_info(vi.name, vi.type.tensor_type.elem_type, list(concrete)))
        inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                   for t in graph.initializer if t.name not in small_names]
        light = helper.make_graph(list(graph.node), graph.name, inputs, list(graph.output), small)
        return helper.make_model(light, opset_imports=list(model.opset_import), ir_version=max(model.ir_version, 4),
                                 functions=list(model.functions))

    def _view(self, g: Graph) -> None:
        """Start this view's caches afresh where `g` is another view, or changed since (one cache per state of the
        view: a rewrite may give a name another meaning)."""
        if self._concrete_graph is None or self._concrete_graph[0] is not g or self._concrete_graph[1] != g.version:
            self._concrete, self._concrete_graph, self._value_keys = {}, (g, g.version), {}

    def shape(self, g: Graph, value: str) -> tuple[int, ...]:
        self._view(g)
        cached = self._concrete.get(value)
        if cached is None:
            cached = self._concrete[value] = self._shape(g, value)
        return cached

    def _shape(self, g: Graph, value: str) -> tuple[int, ...]:
        known = self._shapes.get(value)
        if known is None and self._fallback is not None:
            known = self._fallback._shapes.get(value)
        if known is not None:
            told = self._told_concrete.get(known)
            if told is not None:   # a shape seen before with every dim told (most values): its concrete shape
                return told
            if not self._all_told(known):   # else the graph's own shape has nothing to add (most values)
                known = self._with_graph_dims(known, g.shape(value))
                self._note_unknown(value, known)
                return self._concrete_shape(known)
            told = self._told_concrete[known] = self._concrete_shape(known)
            return told
        shape = g.shape(value)
        if shape is None:
            arr = g.constant(value) if g.is_constant(value) else None
            if arr is None:
                self.assumed.add(value)
            shape = arr.shape if arr is not None else ()
        else:
            self._note_unknown(value, shape)
        return self._concrete_shape(tuple(shape))

    def _told(self, d: Any) -> bool:
        """A dim whose size is known: a number, a graph input's symbol or one the user sized."""
        return isinstance(d, int) or (isinstance(d, str) and (d in self._input_symbols or d in self.dims))

    def _all_told(self, shape: tuple) -> bool:
        """Whether every dim of `shape` is `_told`, memoised by shape: layers repeat a few shapes."""
        told = self._told_shapes.get(shape)
        if told is None:
            told = self._told_shapes[shape] = all(self._told(d) for d in shape)
        return told

    def _with_graph_dims(self, inferred: tuple, own: tuple | None) -> tuple:
        """The shape inferred at deployment sizes, each dim it could not tell (`unk__3`, None) taken from the
        graph's own shape where that one knows it: the inference at concrete sizes loses a head count or a batch
        through shape arithmetic that normalisation's symbolic pass followed (BERT's [batch, 4, seq, seq] scores
        came out [unk, unk, 512, 512] and were priced as one head of batch 1)."""
        if own is None or len(own) != len(inferred) or self._all_told(inferred):
            return inferred
        return tuple(d if self._told(d) or not self._told(o) else o for d, o in zip(inferred, own))

    def _note_unknown(self, value: str, shape: Sequence[Any]) -> None:
        if not self._all_told(tuple(shape)):
            self.assumed.add(value)

    def _concrete_shape(self, shape: tuple) -> tuple[int, ...]:
        out = self._concrete_of.get(shape)
        if out is None:
            out = self._concrete_of[shape] = concrete_shape(shape, self.dims, COST_DEFAULT_DIMS, COST_OTHER_DIM)
        return out

    def value_keys(self, g: Graph) -> dict[str, tuple]:
        """The value keys known for the view `g` as it is now (a candidate's key reads dozens: one check of the
        view's version for all of them); a value missing from it is asked of `_value_key_now`."""
        self._view(g)
        return self._value_keys

    def _value_key_now(self, g: Graph, value: str) -> tuple:
        """(concrete shape, element type, constness) of `value`, what a candidate's key holds of each value, where
        `value_keys(g)` has just (re)started this view's caches: no version check."""
        shape = self._concrete.get(value)
        if shape is None:
            shape = self._concrete[value] = self._shape(g, value)
        key = self._value_keys[value] = (shape, g.elem_type(value), g.is_constant(value))
        return key


def _symbolic_dims(shape: onnx.TensorShapeProto, symbols: set[str]) -> tuple[int | str, ...] | None:
    """The dims of `shape` when each is a number or one of `symbols`, else None."""
    dims: list[int | str] = []
    for d in shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param in symbols:
            dims.append(d.dim_param)
        else:
            return None
    return tuple(dims)


def _all_concrete(model: onnx.ModelProto) -> bool:
    """True if every value in `model` has a known shape with fixed dims."""
    g = model.graph
    produced = {o for n in g.node for o in n.output if o}
    known = {vi.name: vi for vi in list(g.value_info) + list(g.output)}
    memo: dict[bytes, tuple] = {}
    for v in produced:
        vi = known.get(v)
        if vi is None or not vi.type.tensor_type.HasField("shape") or \
                not all(type(d) is int for d in _shape_dims(vi.type.tensor_type.shape, memo)):
            return False
    return True


def _shapes_of(model: onnx.ModelProto) -> dict[str, tuple[int | str | None, ...]]:
    """Every value's shape `model` records (partial ones too: a dim inference could not reach stays symbolic)."""
    g = model.graph
    memo: dict[bytes, tuple] = {}
    out = {}
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        t = vi.type
        if t.HasField("tensor_type") and t.tensor_type.HasField("shape"):
            out[vi.name] = _shape_dims(t.tensor_type.shape, memo)
    return out


def _recorded_shapes(model: onnx.ModelProto) -> tuple[dict[str, tuple[int | str | None, ...]], bool]:
    """(`_shapes_of(model)`, `_all_concrete(model)`) from one read of each value_info (each is seconds' worth of
    protobuf reads on a 100k-node graph)."""
    g = model.graph
    memo: dict[bytes, tuple] = {}

    def dims(vis: Sequence[onnx.ValueInfoProto]) -> list[tuple[str, tuple | None]]:
        out = []
        for vi in vis:
            t = vi.type
            has = t.HasField("tensor_type") and t.tensor_type.HasField("shape")
            out.append((vi.name, _shape_dims(t.tensor_type.shape, memo) if has else None))
        return out

    value_info, inputs, outputs = dims(g.value_info), dims(g.input), dims(g.output)
    shapes = {name: d for name, d in value_info + inputs + outputs if d is not None}
    known = dict(value_info + outputs)   # what _all_concrete reads: value_info, then outputs (the later wins)
    produced = {o for n in g.node for o in n.output if o}
    concrete = all((d := known.get(v)) is not None and all(type(x) is int for x in d) for v in produced)
    return shapes, concrete


def _shape_dims(shape: onnx.TensorShapeProto, memo: dict[bytes, tuple]) -> tuple[int | str | None, ...]:
    """`shape`'s dims: an int where it has a dim_value, else its dim_param or None. Memoised on the shape's bytes
    (`memo`): the layers of a 100k-node graph repeat a few dozen shapes."""
    key = shape.SerializeToString()
    dims = memo.get(key)
    if dims is None:
        dims = memo[key] = tuple(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None)
                                 for d in shape.dim)
    return dims


def _unknown_count(model: onnx.ModelProto) -> int:
    """How many values `model`'s nodes compute have no shape with every dim fixed."""
    known = {vi.name: vi for vi in list(model.graph.value_info) + list(model.graph.output)}
    return sum(1 for n in model.graph.node for o in n.output if o and (
        (vi := known.get(o)) is None or not vi.type.tensor_type.HasField("shape") or
        not all(d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim)))


_PRICING_FOLD_ROUNDS = 256


def _folded_shapes(light: onnx.ModelProto) -> tuple[onnx.ModelProto | None, frozenset[str]]:
    """`light` (concrete input dims, no big weights) with its static shape arithmetic folded into constants
    (prepare.static_values, exact as onnxruntime computes it), shapes inferred again, and the names of the values
    no node computes any more (folded, or read only by what was); (None, {}) where that fails or nothing folds."""
    from collections import Counter

    from npufuse.prepare.infer import infer_value_types
    from npufuse.prepare.static_values import fold_static_values

    work = onnx.ModelProto()
    work.CopyFrom(light)
    try:
        types = infer_value_types(work)
        # as many rounds as the chain of computed pads asks: the light copy at fixed sizes infers in milliseconds
        _, changed = fold_static_values(work, types, None, None, Counter(), max_rounds=_PRICING_FOLD_ROUNDS)
        if not changed:
            return None, frozenset()
        inferred = onnx.shape_inference.infer_shapes(work, strict_mode=False, data_prop=True)
    except Exception:   # folding is a refinement: pricing keeps what inference gave
        return None, frozenset()
    if not _all_concrete(inferred):
        try:   # on the folded model itself (onnxruntime's pass asserts on the untyped value_info onnx leaves)
            symbolic = _symbolic_shapes(work)
            if _unknown_count(symbolic) < _unknown_count(inferred):
                inferred = symbolic
        except Exception:
            pass
    # the values the fold made constant (their shapes those of the constants) and those only they read (dropped
    # with the nodes computing them)
    before = {t.name for t in light.graph.initializer}
    for t in work.graph.initializer:
        if t.name not in before:
            inferred.graph.value_info.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    still = {o for n in work.graph.node for o in n.output}
    return inferred, frozenset(o for n in light.graph.node for o in n.output if o and o not in still)


@functools.lru_cache(maxsize=1)
def _symbolic_shape_inference_class() -> type:
    """onnxruntime's SymbolicShapeInference, loaded from its file: importing it as `onnxruntime.tools.…` runs
    that package's __init__, which imports all of torch (a second or more) whenever torch is installed."""
    import importlib.util
    import os
    import sys

    import onnxruntime

    name = "_npufuse_ort_symbolic_shape_infer"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(onnxruntime.__file__), "tools", "symbolic_shape_infer.py")
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:  # an onnxruntime laid out otherwise: the plain import
            from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

            return SymbolicShapeInference
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].SymbolicShapeInference


def _symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's symbolic shape inference, keeping what it inferred even where it could not finish.

    Its `infer_shapes` entry point raises on an incomplete pass (ops it does not know, like npufuse's) and
    first saves the model into the current directory; driving the class directly does neither."""
    ssi = _symbolic_shape_inference_class()(int_max=2**31 - 1, auto_merge=True, guess_output_rank=False, verbose=0)
    ssi._preprocess(model)
    while ssi.run_:
        ssi._infer_impl()
    ssi._update_output_from_vi()
    return ssi.out_mp_


def tensor_info(g: Graph, value: str, shapes: CostShapes,
                extra: Mapping[str, onnx.TensorProto] | None = None) -> TensorInfo | None:
    """The cost model's view of a value: concrete shape at deployment sizes, dtype, constness."""
    if not value:
        return None
    if extra and value in extra:
        t = extra[value]
        return TensorInfo(tuple(int(d) for d in t.dims), np_dtype(t.data_type).name, True)
    return TensorInfo(shapes.shape(g, value), _dtype_name(g.elem_type(value)), g.is_constant(value))


@functools.lru_cache(maxsize=None)
def _dtype_name(elem_type: int) -> str:
    return (np_dtype(elem_type) or np.dtype(np.float32)).name


def op_work(g: Graph, node: onnx.NodeProto, shapes: CostShapes,
            extra: Mapping[str, onnx.TensorProto] | None = None, made: Mapping[str, TensorInfo] | None = None
            ) -> OpWork:
    """`node` as cost-model work; `made`: values a replacement computes itself, with the shapes derived for them."""
    made = made or {}
    ins = tuple(made.get(v) or tensor_info(g, v, shapes, extra) for v in node.input)
    outs = tuple(made.get(v) or tensor_info(g, v, shapes, extra) or TensorInfo((), "float32")
                 for v in node.output if v)
    return OpWork(node.name, node.op_type, node.domain, ins, outs, attributes(node))


def fusion_candidate(g: Graph, m: Match, rep: Replacement, shapes: CostShapes) -> FusionCandidate:
    extra = {t.name: t for t in rep.initializers}
    unfused = tuple(op_work(g, g.node(n), shapes) for n in m.nodes)
    fused, made = [], {}
    for n in rep.nodes:
        w = op_work(g, n, shapes, extra, made)
        made.update(_new_value_infos(g, n, w, made))
        fused.append(op_work(g, n, shapes, extra, made) if any(o in made for o in n.output) else w)
    return FusionCandidate(m.pattern, unfused, tuple(fused))


def _new_value_infos(g: Graph, node: onnx.NodeProto, work: OpWork, made: Mapping[str, TensorInfo]
                     ) -> dict[str, TensorInfo]:
    """Shapes of the values a replacement computes for itself before its fused op (attention's K transpose, its
    summed bias terms): the graph has never seen them, so onnx's own per-node inference derives them from the
    node's concrete inputs. Without this the fused op would be priced on shapeless operands."""
    todo = [o for o in node.output if o and g.shape(o) is None and o not in made]
    if not todo or node.domain not in ("", "ai.onnx"):
        return {}
    from onnx import helper

    try:
        schema = onnx.defs.get_schema(node.op_type, g.opset.get("", 1), "")
        types = {v: helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype)), list(t.shape))
                 for v, t in zip(node.input, work.inputs) if v and t is not None}
        inferred = onnx.shape_inference.infer_node_outputs(schema, node, types)
    except Exception:   # an op onnx cannot infer: priced on what the graph knows, as before
        return {}
    out = {}
    for o in todo:
        t = inferred.get(o)
        if t is not None and t.tensor_type.HasField("shape") and \
                all(d.HasField("dim_value") for d in t.tensor_type.shape.dim):
            out[o] = TensorInfo(tuple(int(d.dim_value) for d in t.tensor_type.shape.dim),
                                _dtype_name(t.tensor_type.elem_type))
    return out


def price(g: Graph, m: Match, rep: Replacement, spec: NpuSpec, force: bool, shapes: CostShapes,
          margin: float | None = None) -> FusionDecision:
    """The cost model's decision for one candidate on `spec`.

    Where the target cannot run the region as its Ascend kernel (no kernel for the profile's chip, or an
    attribute the kernel does not take), the candidate is priced as unfused with that reason.
    A candidate identical to one priced before but for its node names (the same fusion in another layer) reuses
    that decision, renamed: pricing is a pure function of op types, shapes, dtypes, constness and attributes,
    and the kernel check of the profile's chip, which is what the key holds."""
    key = _candidate_key(g, m, rep, shapes, f"{spec.name}|{spec.chip}|{spec.precision_mode}|{margin}", force)
    cached = shapes.decisions.get(key)
    if cached is None:
        kernel = replacement_kernel(g, m, rep, spec)
        candidate = fusion_candidate(g, m, rep, shapes)
        moves = layout_transposes(g, kernel, shapes)
        if moves:
            candidate = dataclasses.replace(candidate, fused=tuple(candidate.fused) + moves)
        cached = decide(candidate, spec, force=force, unsupported=kernel.get("problem") if kernel else None,
                        margin=margin, measured_us=_measured_us(g, rep, kernel, spec, shapes))
        if moves and cached.t_fused_us is not None:
            cached = dataclasses.replace(cached, reason=f"{cached.reason}; the fused time includes the {len(moves)} "
                                         f"Transposes ATC puts around {kernel['op']} for its layout")
        shapes.decisions[key] = cached
        return cached
    # A shallow copy with the kernels renamed: what dataclasses.replace gives (the decision has no __post_init__),
    # without running the frozen class's __init__ for each of a 100k-node graph's candidates.
    renamed = object.__new__(type(cached))
    renamed.__dict__.update(cached.__dict__)
    renamed.__dict__["unfused"] = _renamed(cached.unfused, list(m.nodes))
    renamed.__dict__["fused"] = _renamed(cached.fused, [n.name for n in rep.nodes])
    return renamed


def _measured_us(g: Graph, rep: Replacement, kernel: dict[str, Any] | None, spec: NpuSpec, shapes: CostShapes
                 ) -> float | None:
    """A user kernel's measured time for this call (npu_model.user_kernels), matched on the shape its first input
    is priced at (symbolic dims at the sizes the cost model assumes, or --dim)."""
    if not kernel or not kernel.get("user_kernel") or not rep.nodes or not rep.nodes[0].input:
        return None
    k = next((u for u in getattr(spec, "user_kernels", ()) if u.name == kernel["op"]), None)
    if k is None or not k.measured:
        return None
    try:
        shape = shapes.shape(g, rep.nodes[0].input[0])
    except Exception:   # a shape pricing cannot size has no measurement to match
        return None
    return k.measured_us(shape)


def layout_transposes(g: Graph, kernel: dict[str, Any] | None, shapes: CostShapes) -> tuple[OpWork, ...]:
    """The Transposes ATC puts around a kernel whose layout the region's values are not in (a kernel record's
    `layout_transposes`, see npu_model.ascend_kernels.region_kernel), as cost-model work: each moves the whole
    value once, and the fused time pays for them."""
    out = []
    for i, t in enumerate((kernel or {}).get("layout_transposes") or ()):
        ti = tensor_info(g, t["value"], shapes)
        if ti is None:
            continue
        perm = list(t["perm"])
        src = ti if t.get("side") == "in" else dataclasses.replace(ti, shape=tuple(ti.shape[p] for p in perm))
        dst = dataclasses.replace(src, shape=tuple(src.shape[p] for p in perm), is_constant=False)
        out.append(OpWork(f"atc_transpose_{i}_{t['value']}", "Transpose", "", (src,), (dst,), {"perm": perm}))
    return tuple(out)


def _candidate_key(g: Graph, m: Match, rep: Replacement, shapes: CostShapes, profile: str, force: bool) -> tuple:
    """Everything `fusion_candidate` gives the cost model, but node names, as a hashable tuple.

    The hot loop of pricing a 100k-node graph (a key per candidate, dozens of values each): locals, and each
    value's key asked of the cache first (`CostShapes.value_keys`, one check of the view's version per key)."""
    extra = {t.name: t for t in rep.initializers}
    parts: list = [m.pattern, profile, force]
    append = parts.append
    known = shapes.value_keys(g)
    get = known.get
    miss = shapes._value_key_now
    by_name = g.node_by_name
    for node in [by_name[n] for n in m.nodes] + list(rep.nodes):
        attrs = node.attribute
        append((node.op_type, node.domain, tuple([a.SerializeToString() for a in attrs]) if attrs else ()))
        for v in [*node.input, "|", *[o for o in node.output if o]]:
            if v in extra:   # a folded weight is keyed by its own dims and type
                t = extra[v]
                append((tuple(t.dims), t.data_type, True))
            else:
                append((get(v) or miss(g, v)) if v and v != "|" else v)
    return tuple(parts)


def _renamed(kernels: tuple, names: list[str]) -> tuple:
    """The kernels, each a shallow copy renamed (`KernelEstimate.renamed`). Kernels beyond `names` are the ones the
    pricing adds: a format conversion named after its node ("NODE/transdata_b", cost_model.formats) is renamed after
    the node's new name; the layout transposes a kernel record asks for keep theirs."""
    renamed = {k.name: name for k, name in zip(kernels, names)}
    out = [k.renamed(name) for k, name in zip(kernels, names)]
    for k in kernels[len(out):]:
        owner, sep, role = k.name.rpartition("/")
        out.append(k.renamed(f"{renamed[owner]}/{role}") if sep and renamed.get(owner, owner) != owner else k)
    return tuple(out)


def model_ops(g: Graph, shapes: CostShapes) -> Sequence[OpWork]:
    """Every compute node of the model as cost-model work (constant-only subgraphs and shape arithmetic the
    pricing sizes fix excluded: ATC folds both while it compiles). A Concat or Split that GE lays out in place
    (fusion.inplace) carries INPLACE_ATTR: no kernel."""
    static = shapes.static
    infos: dict[str, TensorInfo | None] = {}   # by value: most values are read by one node and written by another

    def info(v: str) -> TensorInfo | None:
        got = infos.get(v, infos)   # the dict itself: not seen yet
        if got is infos:
            got = infos[v] = tensor_info(g, v, shapes)
        return got

    def work(n: onnx.NodeProto) -> OpWork:   # op_work(g, n, shapes), each value's TensorInfo made once
        ins = tuple(info(v) for v in n.input)
        outs = tuple(info(v) or TensorInfo((), "float32") for v in n.output if v)
        return OpWork(n.name, n.op_type, n.domain, ins, outs, attributes(n))

    ops = [(n, work(n)) for n in g.nodes if not all(g.is_constant(o) or o in static for o in n.output if o)]
    if not any(n.op_type in ("Concat", "Split") for n, _ in ops):
        return [w for _, w in ops]

    def dtype_of(v: str) -> str | None:
        dt = g.dtype(v)
        return dt.name if dt is not None else None

    inplace = inplace_nodes(g, lambda v: shapes.shape(g, v), dtype_of)
    return [dataclasses.replace(w, attrs={**w.attrs, INPLACE_ATTR: 1}) if n.name in inplace else w for n, w in ops]
