"""Lower an ONNX model to what CANN's ONNX parser (ATC) accepts: no model-local functions, standard ops only, one
default-domain opset between 14 and 18.

- `inline_functions`: ATC's parser drops `ModelProto.functions`, so every call of a model-local function (npufuse's
  fused nodes) is replaced by its body, except the nodes `keep` selects (the emitter turns those into plugin nodes).
- `convert_default_opset`: ATC registers standard ops only up to ai.onnx 18 and looks each node up at exactly the
  model's opset, so the model moves to one target opset, op by op (see `opset_adapters`).
- `decompose_unregistered`: Gelu, GroupNormalization and RMSNormalization have no ATC key at any opset.

All work on the graph structure only: weights are never read (the model may hold external-data references to
files that are not there), and the cost is linear in the number of nodes. Each function returns a new ModelProto;
its initializers are copies of the input's initializer protos, which for a model loaded by npufuse
(`modelio.load_model`) or with `load_external_data=False` are references, not bytes. `in_place=True` rewrites the
input model instead and copies no initializer at all (protobuf cannot share a message between two parents).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import onnx
from onnx import helper

from npufuse.ir.walk import graphs_below
from npufuse.emit.atc.opset_adapters import (
    DECOMPOSE,
    DEFAULT_DOMAINS,
    HANDLERS,
    MAX_TARGET,
    MIN_TARGET,
    NO_LOWERING_FIX,
    Context,
    LoweringError,
    Unsupported,
    crossed,
    numpy_of,
    since_version,
    types_only,
)

__all__ = [
    "LoweringError",
    "convert_default_opset",
    "decompose_unregistered",
    "default_opset",
    "inline_functions",
    "lower_for_atc",
]

FunctionKey = tuple[str, str, str]


# ---- names and types ------------------------------------------------------------------------------------------

class NameGen:
    """Fresh value and node names: `base` itself when unused, else `base_1`, `base_2`, ... (a counter per base keeps
    this O(1) per name)."""

    def __init__(self, values: Iterable[str], nodes: Iterable[str]) -> None:
        self._values, self._nodes = set(values), set(nodes)
        self._next: dict[tuple[int, str], int] = {}

    def _fresh(self, used: set[str], kind: int, base: str) -> str:
        name, i = base, self._next.get((kind, base), 0)
        while name in used:
            i += 1
            name = f"{base}_{i}"
        self._next[(kind, base)] = i
        used.add(name)
        return name

    def value(self, base: str) -> str:
        return self._fresh(self._values, 0, base)

    def node(self, base: str) -> str:
        return self._fresh(self._nodes, 1, base)


def _names_of(model: onnx.ModelProto) -> NameGen:
    values: set[str] = set()
    nodes: set[str] = set()
    for g in graphs_below(model.graph):
        values.update(v.name for v in g.input)
        values.update(v.name for v in g.output)
        values.update(t.name for t in g.initializer)
        for n in g.node:
            values.update(n.input)
            values.update(n.output)
            nodes.add(n.name)
    return NameGen(values, nodes)


class TypeOracle:
    """Element types and shapes of values: from the graph's declarations, and where a value is not declared, from
    one run of ONNX shape inference over a weightless skeleton of the model (initializers become typed inputs)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._model = model
        self._types: dict[str, onnx.TypeProto] = {}
        for g in graphs_below(model.graph):
            for v in [*g.input, *g.output, *g.value_info]:
                if v.type.HasField("tensor_type"):
                    self._types.setdefault(v.name, v.type)
            for t in g.initializer:
                self._types.setdefault(t.name, helper.make_tensor_type_proto(t.data_type, list(t.dims)))
        self._inferred = False

    def _get(self, name: str) -> onnx.TypeProto | None:
        t = self._types.get(name)
        if t is None and not self._inferred:
            self._infer()
            t = self._types.get(name)
        return t

    def _infer(self) -> None:
        self._inferred = True
        src = self._model
        skel = onnx.ModelProto(ir_version=src.ir_version)
        skel.opset_import.extend(src.opset_import)
        skel.functions.extend(src.functions)
        g = skel.graph
        g.node.extend(src.graph.node)
        g.input.extend(src.graph.input)
        g.output.extend(src.graph.output)
        g.value_info.extend(src.graph.value_info)
        declared = {v.name for v in src.graph.input}
        g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                       for t in src.graph.initializer if t.name not in declared)
        try:
            inferred = onnx.shape_inference.infer_shapes(skel, strict_mode=False)
        except Exception:  # noqa: BLE001 - inference is a best effort: an adapter lacking a type says so
            return
        for v in [*inferred.graph.value_info, *inferred.graph.output]:
            if v.type.HasField("tensor_type"):
                self._types.setdefault(v.name, v.type)

    def elem_type(self, name: str) -> int:
        t = self._get(name)
        return t.tensor_type.elem_type if t is not None else 0

    def shape(self, name: str) -> list[int | str | None] | None:
        t = self._get(name)
        if t is None or not t.tensor_type.HasField("shape"):
            return None
        return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.tensor_type.shape.dim]

    def rank(self, name: str) -> int | None:
        s = self.shape(name)
        return None if s is None else len(s)

    def dim(self, name: str, axis: int) -> int | str | None:
        s = self.shape(name)
        if s is None or not -len(s) <= axis < len(s):
            return None
        return s[axis]


# ---- rebuilding a model around its initializers ---------------------------------------------------------------

def rebuilt(model: onnx.ModelProto, nodes: list[onnx.NodeProto], *, in_place: bool,
             functions: list[onnx.FunctionProto] | None = None,
             opset_import: list[onnx.OperatorSetIdProto] | None = None,
             value_info: Iterable[onnx.ValueInfoProto] = (), initializers: Iterable[onnx.TensorProto] = (),
             drop_initializers: set[str] = frozenset()) -> onnx.ModelProto:
    """`model` with its top graph's nodes replaced, functions/opset_import replaced where given, extra value_info
    and initializers appended and the `drop_initializers` removed: in place, or as a new ModelProto."""
    if in_place:
        out = model
    else:
        out = onnx.ModelProto()
        for fd, value in model.ListFields():
            if fd.name == "graph" or (fd.name == "functions" and functions is not None) or \
                    (fd.name == "opset_import" and opset_import is not None):
                continue
            _copy_field(out, fd, value)
        for fd, value in model.graph.ListFields():
            if fd.name not in ("node", "initializer"):
                _copy_field(out.graph, fd, value)
        out.graph.initializer.extend(model.graph.initializer)   # references or small: see the module docstring
    g = out.graph
    del g.node[:]
    g.node.extend(nodes)
    if functions is not None:
        del out.functions[:]
        out.functions.extend(functions)
    if opset_import is not None:
        del out.opset_import[:]
        out.opset_import.extend(opset_import)
    g.value_info.extend(value_info)
    if drop_initializers:
        # Delete in place (from the end, so indices hold): the remaining protos are never copied.
        for i in range(len(g.initializer) - 1, -1, -1):
            if g.initializer[i].name in drop_initializers:
                del g.initializer[i]
    g.initializer.extend(initializers)
    return out


def _copy_field(dst: onnx.ModelProto | onnx.GraphProto, fd, value) -> None:
    if fd.is_repeated:
        getattr(dst, fd.name).extend(value)
    elif fd.type == fd.TYPE_MESSAGE:
        getattr(dst, fd.name).CopyFrom(value)
    else:
        setattr(dst, fd.name, value)


def default_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain (ai.onnx) opset version."""
    for o in model.opset_import:
        if o.domain in DEFAULT_DOMAINS:
            return o.version
    raise LoweringError("the model has no default-domain (ai.onnx) opset_import; add one")


def _used_domains(nodes: Iterable[onnx.NodeProto]) -> set[str]:
    return {n.domain for n in _all_nodes(nodes)}


# ---- inlining -------------------------------------------------------------------------------------------------

class _Inliner:
    """Expands calls of model-local functions (matched on domain, name and overload), recursively."""

    def __init__(self, model: onnx.ModelProto, keep: Callable[[onnx.NodeProto], bool] | None) -> None:
        self.model = model
        self.keep = keep
        self.funcs: dict[FunctionKey, onnx.FunctionProto] = {(f.domain, f.name, f.overload): f for f in model.functions}
        self.names = _names_of(model)
        self.opsets = {o.domain: o.version for o in model.opset_import}
        self.value_info: list[onnx.ValueInfoProto] = []
        self._checked: set[FunctionKey] = set()

    def is_call(self, node: onnx.NodeProto) -> bool:
        return (node.domain, node.op_type, node.overload) in self.funcs

    def nodes(self, nodes: Iterable[onnx.NodeProto]) -> list[onnx.NodeProto]:
        """`nodes` with every call expanded (and calls inside their subgraphs too)."""
        out: list[onnx.NodeProto] = []
        for n in nodes:
            if self.is_call(n) and not (self.keep and self.keep(n)):
                self._expand(n, out, depth=0)
            else:
                out.append(self._with_subgraphs(n, lambda g: self._graph(g, {}, None, None)))
        return out

    def _with_subgraphs(self, node: onnx.NodeProto, fn: Callable[[onnx.GraphProto], onnx.GraphProto]) -> onnx.NodeProto:
        """`node` itself when it has no subgraph, else a copy with each subgraph mapped by `fn`."""
        if not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            return node
        new = onnx.NodeProto()
        new.CopyFrom(node)
        for a in new.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                a.g.CopyFrom(fn(a.g))
            elif a.type == onnx.AttributeProto.GRAPHS:
                graphs = [fn(sg) for sg in a.graphs]
                del a.graphs[:]
                a.graphs.extend(graphs)
        return new

    def _check_opsets(self, key: FunctionKey, fn: onnx.FunctionProto) -> None:
        """A body written for another default opset than the model's is inlined only where every op it uses has
        the same schema at both (else its meaning could change); other domains it uses are imported."""
        if key in self._checked:
            return
        self._checked.add(key)
        for o in fn.opset_import:
            mine = self.opsets.get(o.domain)
            if mine is None:
                self.opsets[o.domain] = o.version
            elif mine != o.version and o.domain in DEFAULT_DOMAINS:
                for n in fn.node:
                    if n.domain in DEFAULT_DOMAINS and since_version(n.op_type, o.version) != since_version(n.op_type, mine):
                        raise LoweringError(f"function {fn.domain}::{fn.name} uses {n.op_type} at opset {o.version} "
                                            f"but the model is at {mine}; re-export the function at opset {mine}")

    def _expand(self, call: onnx.NodeProto, out: list[onnx.NodeProto], depth: int) -> None:
        key = (call.domain, call.op_type, call.overload)
        fn = self.funcs[key]
        if depth > 64:
            raise LoweringError(f"node '{call.name}': function {call.domain}::{call.op_type} calls itself; "
                                "break the recursion")
        self._check_opsets(key, fn)
        prefix = call.name or f"{call.op_type}"
        env: dict[str, str] = {"": ""}
        for i, formal in enumerate(fn.input):
            env[formal] = call.input[i] if i < len(call.input) else ""
        for i, formal in enumerate(fn.output):
            env[formal] = call.output[i] if i < len(call.output) and call.output[i] else \
                self.names.value(f"{prefix}/{formal}")
        attrs = {a.name: a for a in fn.attribute_proto}    # defaults, overridden by the caller's
        attrs.update({a.name: a for a in call.attribute})
        for n in fn.node:
            for o in n.output:
                if o and o not in env:
                    env[o] = self.names.value(f"{prefix}/{o}")
        for vi in fn.value_info:
            if env.get(vi.name):
                v = onnx.ValueInfoProto()
                v.CopyFrom(vi)
                v.name = env[vi.name]
                self.value_info.append(v)
        for n in fn.node:
            new = self._instantiate(n, env, attrs, prefix)
            if self.is_call(new) and not (self.keep and self.keep(new)):
                self._expand(new, out, depth + 1)
            else:
                out.append(new)

    def _instantiate(self, n: onnx.NodeProto, env: dict[str, str], attrs: dict[str, onnx.AttributeProto],
                     prefix: str) -> onnx.NodeProto:
        """A body node with values renamed through `env`, attribute references resolved, a traceable name."""
        new = onnx.NodeProto()
        new.op_type, new.domain, new.overload = n.op_type, n.domain, n.overload
        new.name = self.names.node(f"{prefix}/{n.name or n.op_type}")
        new.doc_string = n.doc_string
        new.input.extend(env.get(i, i) for i in n.input)
        new.output.extend(env[o] if o else "" for o in n.output)
        new.metadata_props.extend(n.metadata_props)
        for a in n.attribute:
            resolved = self._attribute(a, env, attrs, prefix)
            if resolved is not None:
                new.attribute.append(resolved)
        return new

    def _attribute(self, a: onnx.AttributeProto, env: dict[str, str], attrs: dict[str, onnx.AttributeProto],
                   prefix: str) -> onnx.AttributeProto | None:
        if a.ref_attr_name:
            src = attrs.get(a.ref_attr_name)
            if src is None:
                return None      # neither given nor defaulted: the attribute is absent (ONNX semantics)
            r = onnx.AttributeProto()
            r.CopyFrom(src)
            r.name = a.name
            return r
        r = onnx.AttributeProto()
        r.CopyFrom(a)
        if r.type == onnx.AttributeProto.GRAPH:
            r.g.CopyFrom(self._graph(a.g, env, attrs, prefix))
        elif r.type == onnx.AttributeProto.GRAPHS:
            graphs = [self._graph(sg, env, attrs, prefix) for sg in a.graphs]
            del r.graphs[:]
            r.graphs.extend(graphs)
        return r

    def _graph(self, g: onnx.GraphProto, outer: dict[str, str], attrs: dict[str, onnx.AttributeProto] | None,
               prefix: str | None) -> onnx.GraphProto:
        """A subgraph: inside a function body (`prefix` set) its own names are made fresh and outer-scope
        references renamed through `outer`; everywhere its calls are expanded."""
        env = dict(outer)
        if prefix is not None:
            local = [v.name for v in g.input] + [t.name for t in g.initializer] + \
                    [o for n in g.node for o in n.output if o]
            for name in local:
                env[name] = self.names.value(f"{prefix}/{name}")
        body: list[onnx.NodeProto] = []
        for n in g.node:
            new = self._instantiate(n, env, attrs or {}, prefix) if prefix is not None else n
            if self.is_call(new) and not (self.keep and self.keep(new)):
                self._expand(new, body, depth=1)
            elif prefix is None:
                body.append(self._with_subgraphs(new, lambda sg: self._graph(sg, {}, None, None)))
            else:
                body.append(new)
        out = onnx.GraphProto()
        out.CopyFrom(g)
        del out.node[:]
        out.node.extend(body)
        if prefix is not None:
            for v in [*out.input, *out.output, *out.value_info]:
                v.name = env.get(v.name, v.name)
            for t in out.initializer:
                t.name = env.get(t.name, t.name)
        return out


def inline_functions(model: onnx.ModelProto, keep: Callable[[onnx.NodeProto], bool] | None = None, *,
                     in_place: bool = False) -> onnx.ModelProto:
    """Replace every node that calls a model-local function by the function's body, recursively.

    Matching is on (domain, op_type, overload). Body values and nodes get fresh names prefixed by the caller's
    node name (`<caller>/<name>`); attribute references are resolved from the caller's attributes, then the
    function's defaults (an attribute referring to neither is left out). Nodes for which `keep(node)` is True
    are left as they are, together with the functions they (transitively) call. Functions no longer called and
    opset imports no longer used are dropped. onnx.inliner is not used: it matches no `keep` per node and
    serializes the whole model, weights included.

    Raises:
        LoweringError: a function's body was written for another default opset with different schemas.
    """
    inl = _Inliner(model, keep)
    nodes = inl.nodes(model.graph.node)
    # Functions still called (by kept nodes), with what they call in turn.
    live: dict[FunctionKey, onnx.FunctionProto] = {}
    stack = [n for n in _all_nodes(nodes) if inl.is_call(n)]
    while stack:
        n = stack.pop()
        key = (n.domain, n.op_type, n.overload)
        if key in live:
            continue
        live[key] = inl.funcs[key]
        stack.extend(m for m in live[key].node if inl.is_call(m))
    functions = [f for f in model.functions if (f.domain, f.name, f.overload) in live]
    used = _used_domains(nodes) | {d for f in functions for d in _used_domains(f.node)} | {f.domain for f in functions}
    opsets = [helper.make_opsetid(d, v) for d, v in inl.opsets.items() if d in used or d in DEFAULT_DOMAINS]
    return rebuilt(model, nodes, in_place=in_place, functions=functions, opset_import=opsets,
                    value_info=inl.value_info)


def _all_nodes(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
    stack = list(nodes)
    while stack:
        n = stack.pop()
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                stack.extend(a.g.node)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sg in a.graphs:
                    stack.extend(sg.node)


# ---- opset conversion -----------------------------------------------------------------------------------------

class _Converter:
    """Rewrites the default-domain nodes of a model (and of its subgraphs) from opset `src` to `dst`."""

    def __init__(self, model: onnx.ModelProto, src: int, dst: int, decompose: bool) -> None:
        self.model = model
        self.decompose = decompose
        # Initializers of subgraphs too (If branches read their own axes); names are unique across scopes.
        self._tensors = {t.name: t for g in graphs_below(model.graph) for t in g.initializer}
        self._producers: dict[str, onnx.NodeProto] | None = None
        self._folded: dict[str, np.ndarray | None] = {}
        self.ctx = Context(src, dst, _names_of(model), TypeOracle(model), self._constant)
        self.failures: list[tuple[onnx.NodeProto, str, str]] = []

    def _constant(self, name: str, depth: int = 0) -> np.ndarray | None:
        """The value of `name` where it is a small constant: an initializer, or the output of a small chain of
        nodes over constants (dynamo's unoptimized exports compute axes with Constant + Reshape), folded with
        onnx's reference evaluator. Large or external tensors are never read."""
        t = self._tensors.get(name)
        if t is not None:
            return None if t.data_location == onnx.TensorProto.EXTERNAL or _big(t) else numpy_of(t)
        if name in self._folded:
            return self._folded[name]
        if self._producers is None:
            self._producers = {o: n for g in graphs_below(self.model.graph) for n in g.node for o in n.output if o}
        node = self._producers.get(name)
        value = None
        if node is not None and depth < 8 and node.domain in DEFAULT_DOMAINS and node.op_type in _FOLDABLE:
            inputs = [self._constant(i, depth + 1) if i else None for i in node.input]
            if all(v is not None for v, i in zip(inputs, node.input) if i):
                value = _evaluate(node, inputs, self.ctx.src)
        self._folded[name] = value
        return value

    def nodes(self, nodes: Iterable[onnx.NodeProto]) -> list[onnx.NodeProto]:
        out: list[onnx.NodeProto] = []
        for n in nodes:
            try:
                out.extend(self._node(n))
            except Unsupported as exc:
                self.failures.append((n, exc.reason, exc.fix))
                out.append(n)
        return out

    def _node(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        ctx = self.ctx
        has_graph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        if node.domain not in DEFAULT_DOMAINS:
            return [self._subgraphs(node)] if has_graph else [node]
        op = node.op_type
        at_src, at_dst = since_version(op, ctx.src), since_version(op, ctx.dst)
        if op in DECOMPOSE and (self.decompose or at_dst != at_src):
            return DECOMPOSE[op](self._copy(node), ctx)
        if at_src is None:
            raise Unsupported(f"{op} is not an ai.onnx op at opset {ctx.src}", "fix the model's opset_import")
        if at_dst is None and op not in HANDLERS:
            raise Unsupported(f"{op} does not exist at opset {ctx.dst}",
                              NO_LOWERING_FIX.get(op, f"keep {op} out of the model or decompose it before lowering"))
        if at_src == at_dst:
            return [self._subgraphs(node)] if has_graph else [node]
        handled, adapter = HANDLERS.get(op, ((), None))
        boundaries = crossed(op, ctx.src, ctx.dst)
        for b in boundaries:
            if b not in handled and not types_only(op, b):
                raise Unsupported(f"{op}-{b} changed its semantics and npufuse has no adapter for it",
                                  f"export the model at opset {ctx.dst} or keep {op} out of it")
        new = self._subgraphs(node) if has_graph else self._copy(node)
        if adapter is not None and any(b in handled for b in boundaries):
            return adapter(new, ctx)
        return [new]

    @staticmethod
    def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
        new = onnx.NodeProto()
        new.CopyFrom(node)
        return new

    def _subgraphs(self, node: onnx.NodeProto) -> onnx.NodeProto:
        """A copy of `node` whose subgraphs (If branches, Loop bodies) are converted too."""
        new = self._copy(node)
        for a in new.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                self._graph(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sg in a.graphs:
                    self._graph(sg)
        return new

    def _graph(self, g: onnx.GraphProto) -> None:
        nodes = self.nodes(g.node)
        del g.node[:]
        g.node.extend(nodes)

    def raise_failures(self) -> None:
        if not self.failures:
            return
        node, reason, fix = self.failures[0]
        same = Counter(n.op_type for n, _, _ in self.failures)
        others = len(self.failures) - same[node.op_type]
        more = f" (and {others} other node(s))" if others else ""
        raise LoweringError(
            f"cannot lower to ai.onnx opset {self.ctx.dst}: node '{node.name}' ({node.op_type}): {reason}; "
            f"{same[node.op_type]} {node.op_type} node(s) affected{more}; fix: {fix}")


_FOLDABLE = {"Constant", "Reshape", "Cast", "Concat", "Unsqueeze", "Squeeze", "Identity", "Gather", "Slice",
             "Add", "Sub", "Mul", "Neg", "Range"}


def _evaluate(node: onnx.NodeProto, inputs: list[np.ndarray | None], opset: int) -> np.ndarray | None:
    """One node over small constant inputs, with onnx's reference evaluator; None where that fails or is big."""
    from onnx.reference import ReferenceEvaluator

    try:
        feeds = {i: v for i, v in zip(node.input, inputs) if i}
        graph = helper.make_graph([node], "fold", [], [helper.make_tensor_value_info(node.output[0], 0, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        value = np.asarray(ReferenceEvaluator(model).run(None, feeds)[0])
    except Exception:  # noqa: BLE001 - not foldable here: the adapter reports a run-time value
        return None
    return value if value.size <= 4096 else None


def _big(t: onnx.TensorProto) -> bool:
    """Constants adapters read (axes, pads, sizes) are tiny; anything large is a weight and never read."""
    n = 1
    for d in t.dims:
        n *= d
    return n > 4096


def _convert(model: onnx.ModelProto, target: int, decompose: bool, in_place: bool) -> onnx.ModelProto:
    src = default_opset(model)
    conv = _Converter(model, src, target, decompose)
    nodes = conv.nodes(model.graph.node)
    conv.raise_failures()
    used = {n for node in _all_nodes(nodes) for n in node.input}
    drop = {name for name in conv.ctx.released if name not in used} - {o.name for o in model.graph.output}
    opsets = []
    for o in model.opset_import:
        if o.domain in DEFAULT_DOMAINS:
            opsets.append(helper.make_opsetid(o.domain, target))
        else:
            opsets.append(o)
    out = rebuilt(model, nodes, in_place=in_place, opset_import=opsets, initializers=conv.ctx.initializers,
                   drop_initializers=drop)
    if target < 21 and out.ir_version > 10:
        out.ir_version = 10     # IR 11 came with opset 23; an older runtime refuses a newer IR
    return out


def convert_default_opset(model: onnx.ModelProto, target: int, *, decompose_unregistered: bool = True,
                          in_place: bool = False) -> onnx.ModelProto:
    """Move the model's default domain (ai.onnx) to opset `target` (14..18), from above or below.

    Per node, the schema in force at the model's opset and at `target` are compared: equal, the node is kept;
    different, the op's adapter rewrites it (see `opset_adapters.HANDLERS`: Reduce* axes, Split, Squeeze/Unsqueeze,
    Pad, Resize, AveragePool, Cast/CastLike, Shape, Reshape, BatchNormalization, RNNs, Scatter*, Softmax-13,
    LayerNormalization below 17), and every other version crossed must only have added types (a relabel).
    If/Loop/Scan bodies are converted too. With `decompose_unregistered` (the default, since ATC has no key for
    them), Gelu, GroupNormalization and RMSNormalization are decomposed whatever their version; otherwise only
    where the target cannot express them.

    Raises:
        LoweringError: a node cannot be expressed at `target` (first node, count and fix in one line), or
            the target is outside 14..18.
    """
    if not MIN_TARGET <= target <= MAX_TARGET:
        raise LoweringError(f"target opset {target}: ATC registers standard ops at ai.onnx {MIN_TARGET}..{MAX_TARGET}; "
                            "pick one of those (17 or 18 unless PromptFlashAttention needs 14-16)")
    if model.functions:
        raise LoweringError(f"the model holds {len(model.functions)} model-local function(s), which ATC drops; "
                            "run inline_functions first")
    return _convert(model, target, decompose_unregistered, in_place)


def decompose_unregistered(model: onnx.ModelProto, *, in_place: bool = False) -> onnx.ModelProto:
    """Decompose the standard ops ATC has no key for at any opset (Gelu, GroupNormalization, RMSNormalization)
    into registered ones, keeping the model's opset. Raises LoweringError where one cannot be decomposed."""
    return _convert(model, default_opset(model), True, in_place)


def lower_for_atc(model: onnx.ModelProto, target: int = 17,
                  keep: Callable[[onnx.NodeProto], bool] | None = None) -> onnx.ModelProto:
    """`inline_functions` (keeping `keep` nodes) then `convert_default_opset(target)`: standard ops at one
    default opset, plus the calls `keep` left, whose functions stay in the model unconverted, for the emitter
    to replace by plugin nodes."""
    inlined = inline_functions(model, keep)
    if not MIN_TARGET <= target <= MAX_TARGET:
        return convert_default_opset(inlined, target)   # raises the target error
    # The kept calls' functions stay in the model while converting: shape inference reads them for the types
    # of the values downstream of a kept node. Their bodies are not converted (the emitter replaces the calls).
    return _convert(inlined, target, True, in_place=True)
