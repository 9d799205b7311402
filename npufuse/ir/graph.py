"""The one graph view the whole package shares.

`Graph` indexes an `onnx.ModelProto` once: nodes in topological order, the producer and the consumers
of every value, constants as lazily evaluated numpy arrays, shapes and dtypes from shape inference, and
successor lists by position for graph algorithms (convexity, acyclicity). Nobody re-derives consumers with a
list scan.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable, Mapping
from functools import cached_property
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npufuse.ir.weights import read_array

Dim = int | str | None
Shape = tuple[Dim, ...]
_UNSEEN = object()   # a cache miss, where None is a cached answer

# Quantization steps are part of what a quantized model means on the device, not arithmetic to precompute: a
# DequantizeLinear of an int8 weight folded into a float weight leaves the int8 initializer dead and the deployment
# graph float (issue 12). Their outputs are never constant, so nothing downstream folds them away either.
QUANTIZATION_OPS = frozenset(
    {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger",
     "QLinearConv", "QLinearMatMul"}
)
# Ops that are not a pure function of their inputs (random, control flow, sequences, Dropout's mask), and the
# quantization steps: a node of any other default-domain op with constant inputs is a constant.
_NON_FOLDABLE_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
     "If", "Loop", "Scan", "SequenceConstruct", "SequenceEmpty", "Optional", "Dropout"}
) | QUANTIZATION_OPS
# Ops that may read an input only for its static type or shape (see Graph._stand_in).
_STAND_IN_OPS = frozenset({"CastLike", "Shape", "Size"})
# A folded constant larger than this stays a node: folding is for weights, not for blowing up the file.
_MAX_FOLDED_ELEMENTS = 1 << 28


def attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """A node's attributes as plain python values (bytes decoded to str)."""
    out: dict[str, Any] = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [x.decode("utf-8", "replace") for x in v]
        out[a.name] = v
    return out


@functools.lru_cache(maxsize=None)
def np_dtype(elem_type: int) -> np.dtype | None:
    """numpy dtype of an ONNX tensor element type, or None where numpy has none."""
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return None


class Graph:
    """An indexed view of a model's main graph.

    Built once per optimize and brought up to date by whoever edits the model (the canonical rules, the engine's
    rewrites) with `patch`, which costs the edit, not the graph; only `write_nodes` writes the model's node list.
    """

    def __init__(self, model: onnx.ModelProto, base_dir: str | None = None,
                 value_types: dict[str, onnx.TypeProto] | None = None) -> None:
        self.model = model
        self.base_dir = base_dir
        g = model.graph
        self.opset: dict[str, int] = {o.domain or "": o.version for o in model.opset_import}
        self.nodes: list[onnx.NodeProto] = list(g.node)
        self.node_by_name: dict[str, onnx.NodeProto] = {}
        self.topo_index: dict[str, int] = {}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        # Nodes that may hold subgraphs (If, Loop, Scan, other domains' ops), and every value they read, the
        # outer-scope values their subgraphs read included: those are consumers like any other.
        self.holders: list[onnx.NodeProto] = []
        self.holder_reads: set[str] = set()
        # The hot loop of every round on a 100k-node graph: locals, and protobuf fields read once.
        # The names of the nodes of each op type: a stage that looks at a few op types (a phase's anchors) does not
        # walk every node.
        self.names_by_op: dict[str, set[str]] = defaultdict(set)
        # What the node loop does not depend on comes first: the constant test below reads types and initializers.
        self.initializers: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
        self.graph_outputs: set[str] = {o.name for o in g.output}
        # In IR < 4 every initializer had to be listed as an input too; those are still constants.
        # From IR 4 on, an initializer that is also an input can be overridden at run time: not constant.
        input_names = [i.name for i in g.input]
        if model.ir_version < 4:
            self.graph_inputs = [n for n in input_names if n not in self.initializers]
            self._overridable: set[str] = set()
        else:
            self.graph_inputs = input_names
            self._overridable = {n for n in input_names if n in self.initializers}
        # Types, first found wins: declared in the model, then inferred (`value_types`, shared, not copied: the
        # view is rebuilt every round of a 100k-node graph), then an initializer's own type (made on demand).
        self._declared: dict[str, onnx.TypeProto] = {}
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.HasField("tensor_type"):
                self._declared[vi.name] = vi.type
        self._inferred: Mapping[str, onnx.TypeProto] = value_types or {}
        self._initializer_types: dict[str, onnx.TypeProto] = {}
        self._shapes: dict[str, Shape | None] = {}
        self._elem_types: dict[str, int] = {}   # the patterns ask each value's type many times
        self._const_cache: dict[str, np.ndarray | None] = {}
        node_by_name, topo_index, producer, consumers = self.node_by_name, self.topo_index, self.producer, \
            self.consumers
        names_by_op, holders, holder_reads = self.names_by_op, self.holders, self.holder_reads
        # The nodes `_find_constant_values` judges (pure default-domain ops), with their inputs and outputs: the
        # fields of each node are read once.
        pure: list[tuple[onnx.NodeProto, str, list[str], list[str]]] = []
        for i, n in enumerate(self.nodes):
            name = n.name
            node_by_name[name] = n
            topo_index[name] = i
            op = n.op_type
            names_by_op[op].add(name)
            outs = list(n.output)
            for o in outs:
                if o:
                    producer[o] = n
            domain = n.domain
            if op not in _SUBGRAPH_OPS and domain in _FLAT_DOMAINS:
                reads = list(n.input)
                if op not in _NON_FOLDABLE_OPS and (domain == "" or domain == "ai.onnx"):
                    pure.append((n, op, reads, outs))
            else:
                reads = list(_all_value_inputs(n))
                holders.append(n)
                holder_reads.update(reads)
            for v in (reads if len(reads) < 2 else dict.fromkeys(reads)):
                if v:
                    consumers[v].append(n)
        self._constant_values = self._find_constant_values(pure)
        # Bumped by every patch: a cache of facts derived from the view (keyed by view and version) is exact.
        self.version = 0
        # Whether `nodes` is known to be in topological order (every value read after its producer): whoever
        # builds the view from a sorted node list says so (normalize); `patch` keeps it by checking only the edges
        # of the nodes it adds, and a rewrite that needs the order restored sorts only when it is not known.
        self.in_topological_order = False
        self._written = 0   # the version whose node list the model holds (see write_nodes)
        self._successors: dict[int, list[int]] = {}   # successors_at, by position (see _drop_successors)

    # ---- patching (canonicalize's rounds: a 100k-node graph is not re-indexed for a few edits) ----------
    def patch(self, nodes: list[onnx.NodeProto], removed: Iterable[onnx.NodeProto], added: Iterable[onnx.NodeProto],
              rename: Mapping[str, str] | None = None, initializers: Iterable[onnx.TensorProto] = ()) -> set[str]:
        """Bring the view up to date with `nodes`, the new node list (in topological order), where `removed` left
        the graph, `added` joined it, and every reader of a value in `rename` (a kept node or an added one) now
        reads its replacement (this renames their inputs). The result is the view a fresh `Graph` of the model
        holding `nodes` would be, but the model's own node list is not written: see `write_nodes`. Returns the
        values the removed nodes read (where a rewrite's dead-code walk starts)."""
        removed, added = list(removed), list(added)
        self.version += 1
        consumers, consts = self.consumers, self._constant_values
        before: dict[str, bool] = {}
        touched_values, removed_outputs, holders_changed = self._unindex(removed)
        removed_reads = set(touched_values)
        for o in removed_outputs:
            before.setdefault(o, o in consts)
            consts.discard(o)
        readers: list[onnx.NodeProto] = []
        if rename:
            ids = set()
            for old in rename:
                for c in consumers.get(old, ()):
                    if id(c) not in ids:
                        ids.add(id(c))
                        readers.append(c)
            touched_values.update(self._unindex(readers)[0])
            for n in readers + added:
                for i, v in enumerate(n.input):
                    if v in rename:
                        n.input[i] = rename[v]
            for v in rename:
                self._forget(v)
            added = added + readers
        for t in initializers:
            self.initializers[t.name] = t
            if t.name not in self._overridable:
                consts.add(t.name)
            self._forget(t.name)
        for n in added:
            self._index(n)
            for o in n.output:
                if o:
                    before.setdefault(o, o in consts)
                    consts.discard(o)
                    self._forget(o)
            touched_values.update(_node_value_inputs(n))
        self.nodes = nodes
        self.topo_index = {n.name: i for i, n in enumerate(nodes)}
        self._drop_successors()
        # the kept nodes keep their relative order and a removal breaks no edge: only the added nodes' edges count
        self.in_topological_order = self.in_topological_order and self._edges_forward(added)
        if holders_changed or any(self._is_holder(n) for n in added):
            self.holders = [n for n in nodes if self._is_holder(n)]
            self.holder_reads = {v for h in self.holders for v in _all_value_inputs(h)}
        topo = self.topo_index
        for v in touched_values:   # a fresh index lists a value's readers in topological order
            cs = consumers.get(v)
            if cs and len(cs) > 1:
                cs.sort(key=lambda c: topo[c.name])
        # constants: the added nodes (and whatever reads a value whose constness changed), in topological order
        import heapq

        heap = [(topo[n.name], id(n), n) for n in added if n.name in topo and self.node_by_name.get(n.name) is n]
        heapq.heapify(heap)
        seen: set[int] = set()
        while heap:
            _, key, n = heapq.heappop(heap)
            if key in seen:
                continue
            seen.add(key)
            is_const = self._node_is_constant(n)
            for o in n.output:
                if not o:
                    continue
                was = before.pop(o, o in consts)
                if is_const:
                    consts.add(o)
                else:
                    consts.discard(o)
                if was != is_const:
                    self._forget(o)
                    for c in consumers.get(o, ()):
                        if id(c) not in seen:
                            heapq.heappush(heap, (topo[c.name], id(c), c))
        for o, was in before.items():   # values no node writes any more
            if was:
                self._forget(o)
        return removed_reads

    def _edges_forward(self, nodes: Iterable[onnx.NodeProto]) -> bool:
        """Whether every edge into or out of `nodes` goes forward in `self.nodes`."""
        topo, producer, consumers = self.topo_index, self.producer, self.consumers
        for n in nodes:
            at = topo[n.name]
            for v in _node_value_inputs(n):
                p = producer.get(v)
                if p is not None and topo[p.name] >= at:
                    return False
            for o in n.output:
                if o and any(topo[c.name] <= at for c in consumers.get(o, ())):
                    return False
        return True

    def reorder(self, nodes: list[onnx.NodeProto]) -> None:
        """The same nodes in a topological order: positions and every reader list follow it."""
        self.version += 1
        self.in_topological_order = True
        self.nodes = nodes
        self.topo_index = topo = {n.name: i for i, n in enumerate(nodes)}
        self._drop_successors()
        for cs in self.consumers.values():
            if len(cs) > 1:
                cs.sort(key=lambda c: topo[c.name])
        if len(self.holders) > 1:
            self.holders.sort(key=lambda h: topo[h.name])

    def drop_initializers(self, names: Iterable[str], input_names: list[str]) -> None:
        """Forget initializers the model no longer holds (`input_names`: its graph inputs now)."""
        for name in names:
            self.initializers.pop(name, None)
            self._constant_values.discard(name)
            self._overridable.discard(name)
            self._forget(name)
        if self.model.ir_version < 4:
            self.graph_inputs = [n for n in input_names if n not in self.initializers]
        else:
            self.graph_inputs = list(input_names)

    def forget_declared(self, names: Iterable[str]) -> None:
        """The model no longer declares the types of `names` (their value_info went with their producers)."""
        for name in names:
            self._declared.pop(name, None)
            self._forget(name)

    def forget(self, names: Iterable[str]) -> None:
        """Drop what the view cached about `names` (values that left the graph)."""
        for name in names:
            self._forget(name)

    def write_nodes(self) -> None:
        """Make the model's node list `self.nodes` (after `patch`): nodes the model holds stay the same objects
        (reordered, not copied: protobuf keeps them), the new ones are copied in, and the view then refers to the
        copies."""
        if self._written == self.version:   # the model's node list is the view's already
            return
        self._written = self.version
        rep = self.model.graph.node
        if 2 * len(self.nodes) < len(rep):
            self._write_afresh()
            return
        owned = {id(n) for n in rep}
        free = [n for n in self.nodes if id(n) not in owned]
        start = len(rep)
        rep.extend(free)
        copies = {id(f): rep[start + i] for i, f in enumerate(free)}
        end = len(self.nodes)
        pos = {id(copies.get(id(n), n)): i for i, n in enumerate(self.nodes)}
        rep.sort(key=lambda n: pos.get(id(n), end))
        del rep[end:]
        if not free:
            return
        self.nodes = [copies.get(id(n), n) for n in self.nodes]
        values: set[str] = set()
        for f in free:
            c = copies[id(f)]
            self.node_by_name[c.name] = c
            for o in c.output:
                if o:
                    self.producer[o] = c
            values.update(self._reads_of(c))
        for v in values:   # each reader list rewritten once (see _unindex)
            self.consumers[v] = [copies.get(id(x), x) for x in self.consumers[v]]
        if any(id(h) in copies for h in self.holders):
            self.holders = [copies.get(id(h), h) for h in self.holders]
        self._drop_successors()

    def _write_afresh(self) -> None:
        """`write_nodes` where most of the model's nodes went (a fusion run replaces most of a transformer): the
        survivors are copied into a cleared list, which costs less than sorting every node the list still holds,
        and every index is pointed at the copies."""
        staged = onnx.GraphProto()
        staged.node.extend(self.nodes)
        graph = self.model.graph
        graph.ClearField("node")
        graph.node.extend(staged.node)
        new = list(graph.node)
        copy_of = {id(old): c for old, c in zip(self.nodes, new)}
        self.nodes = new
        self.node_by_name = {k: copy_of[id(n)] for k, n in self.node_by_name.items()}
        self.producer = {v: copy_of[id(n)] for v, n in self.producer.items()}
        consumers: defaultdict[str, list[onnx.NodeProto]] = defaultdict(list)
        for v, cs in self.consumers.items():
            consumers[v] = [copy_of[id(c)] for c in cs]
        self.consumers = consumers
        self.holders = [copy_of[id(h)] for h in self.holders]
        self._drop_successors()

    def _is_holder(self, n: onnx.NodeProto) -> bool:
        return not (n.op_type not in _SUBGRAPH_OPS and n.domain in _FLAT_DOMAINS)

    def _reads_of(self, n: onnx.NodeProto) -> list[str]:
        reads = list(n.input) if not self._is_holder(n) else list(_all_value_inputs(n))
        return [v for v in dict.fromkeys(reads) if v]

    def _index(self, n: onnx.NodeProto) -> None:
        self.node_by_name[n.name] = n
        self.names_by_op[n.op_type].add(n.name)
        for o in n.output:
            if o:
                self.producer[o] = n
        for v in self._reads_of(n):
            self.consumers[v].append(n)

    def _unindex(self, nodes: list[onnx.NodeProto]) -> tuple[set[str], list[str], bool]:
        """Take `nodes` out of the indices: each reader list is filtered once, whatever number of its readers go
        (a value every layer reads, like a rotary table, has thousands). Returns what they read, what they wrote
        and whether one of them held subgraphs (each node's fields are read once: most of a fused graph goes)."""
        ids = {id(n) for n in nodes}
        node_by_name, producer, consumers = self.node_by_name, self.producer, self.consumers
        values: set[str] = set()
        outputs: list[str] = []
        holders = False
        names_by_op = self.names_by_op
        for n in nodes:
            name, op = n.name, n.op_type
            if node_by_name.get(name) is n:
                del node_by_name[name]
                names_by_op[op].discard(name)
            for o in n.output:
                if o:
                    outputs.append(o)
                    if producer.get(o) is n:
                        del producer[o]
            if op not in _SUBGRAPH_OPS and n.domain in _FLAT_DOMAINS:
                values.update(n.input)
            else:
                holders = True
                values.update(_all_value_inputs(n))
        values.discard("")
        for v in values:
            cs = consumers.get(v)
            if cs is None:
                continue
            if len(cs) == 1:   # most values have one reader
                if id(cs[0]) in ids:
                    del consumers[v]
                continue
            kept = [c for c in cs if id(c) not in ids]
            if kept:
                if len(kept) != len(cs):
                    consumers[v] = kept
            else:
                del consumers[v]
        return values, outputs, holders

    def _forget(self, value: str) -> None:
        """Drop what the view cached about `value` (its producer or constness changed)."""
        self._shapes.pop(value, None)
        self._elem_types.pop(value, None)
        self._const_cache.pop(value, None)
        self._initializer_types.pop(value, None)

    def _node_is_constant(self, n: onnx.NodeProto) -> bool:
        """`_find_constant_values`' test for one node."""
        if n.op_type in _NON_FOLDABLE_OPS or n.domain not in ("", "ai.onnx") or n.op_type in _SUBGRAPH_OPS:
            return False
        consts, stand_ins = self._constant_values, n.op_type in _STAND_IN_OPS
        return all(not v or v in consts or (stand_ins and self._stand_in(n, i) is not None)
                   for i, v in enumerate(n.input))

    # ---- structure -------------------------------------------------------------------------
    def node(self, name: str) -> onnx.NodeProto:
        return self.node_by_name[name]

    def nodes_of(self, op_types: Iterable[str]) -> list[onnx.NodeProto]:
        """The nodes whose op type is one of `op_types`, in topological order."""
        names = [x for op in set(op_types) for x in self.names_by_op.get(op, ())]
        topo, by_name = self.topo_index, self.node_by_name
        return [by_name[x] for x in sorted(names, key=topo.__getitem__)]

    def consumers_of(self, value: str) -> list[onnx.NodeProto]:
        return self.consumers.get(value, [])

    def single_consumer(self, value: str) -> onnx.NodeProto | None:
        """The only consumer of `value`, or None if it has none, several, or is a graph output."""
        cs = self.consumers.get(value, [])
        if len(cs) != 1 or value in self.graph_outputs:
            return None
        return cs[0]

    def producer_of(self, value: str) -> onnx.NodeProto | None:
        return self.producer.get(value)

    def boundary_inputs(self, names: Iterable[str]) -> tuple[str, ...]:
        """Values the nodes `names` read that none of them produces, in first-use order."""
        nodes = [self.node_by_name[n] for n in names]
        produced = {o for n in nodes for o in n.output if o}
        return tuple(dict.fromkeys(v for n in nodes for v in _node_value_inputs(n) if v not in produced))

    def successors_at(self, position: int) -> list[int]:
        """`successor_positions[position]`, computed for that one node (a walk that visits a few nodes need not
        index every node's successors) and kept until the view changes: the boundary check and the selection of one
        round ask for the same candidates' nodes. The list is shared: read it, do not change it."""
        succ = self._successors.get(position)
        if succ is None:
            topo, consumers = self.topo_index, self.consumers
            succ = self._successors[position] = [topo[c.name] for o in self.nodes[position].output if o
                                                 for c in consumers.get(o, ())]
        return succ

    def _drop_successors(self) -> None:
        """Forget the successor lists: positions or readers changed."""
        self.__dict__.pop("successor_positions", None)
        self._successors = {}

    @cached_property
    def successor_positions(self) -> list[list[int]]:
        """For the node at each topological position, the positions of the nodes that read its outputs."""
        topo, consumers = self.topo_index, self.consumers
        return [[topo[c.name] for o in n.output if o for c in consumers.get(o, ())] for n in self.nodes]

    # ---- constants ---------------------------------------------------------------------------
    def is_constant(self, value: str) -> bool:
        """True if `value` is fixed at export time: an initializer, a Constant, or a pure node of constants."""
        return not value or value in self._constant_values

    def _find_constant_values(self, pure: list[tuple[onnx.NodeProto, str, list[str], list[str]]]) -> set[str]:
        """One topological pass: a value is constant if its producer is pure and reads only constants, or
        reads a value only for what is statically known of it (CastLike's target type, the Shape or Size of
        a value whose shape is fixed: exporters compute a zero conv bias as Expand(CastLike(0, x), Shape(W))).
        `pure`: the nodes that may be constant (default-domain ops neither random nor holding subgraphs, see
        `_node_is_constant`), in order, each with its op type, inputs and outputs."""
        consts = {n for n in self.initializers if n not in self._overridable}
        for n, op, ins, outs in pure:
            stand_ins = op in _STAND_IN_OPS
            if all(not v or v in consts or (stand_ins and self._stand_in(n, i) is not None)
                   for i, v in enumerate(ins)):
                consts.update(o for o in outs if o)
        return consts

    def _stand_in(self, node: onnx.NodeProto, i: int) -> np.ndarray | None:
        """For an input the node reads only for its static type or shape, an array with exactly that (and no
        meaningful data); None where the node needs the input's values."""
        v = node.input[i]
        dtype = self.dtype(v)
        if dtype is None:
            return None
        if node.op_type == "CastLike" and i == 1:
            return np.zeros((0,), dtype=dtype)
        if node.op_type in ("Shape", "Size") and i == 0:
            shape = self.shape(v)
            if shape is not None and all(isinstance(d, int) for d in shape):
                return np.broadcast_to(np.zeros((), dtype=dtype), shape)  # a view: no memory for the data
        return None

    def constant(self, value: str) -> np.ndarray | None:
        """The value as a numpy array if it is constant (evaluated lazily and cached), else None."""
        if value in self._const_cache:
            return self._const_cache[value]
        result: np.ndarray | None = None
        if value in self._overridable:
            result = None
        elif value in self.initializers:
            result = read_array(self.initializers[value], self.base_dir)  # a read-only map of a stored weight
        elif self.is_constant(value):
            result = self._fold(self.producer[value], value)
        self._const_cache[value] = result
        return result

    def _fold(self, node: onnx.NodeProto, value: str) -> np.ndarray | None:
        feeds = {}
        for i, v in enumerate(node.input):
            if v:
                arr = self.constant(v) if v in self._constant_values else self._stand_in(node, i)
                if arr is None:
                    return None
                feeds[v] = arr
        outs = _evaluate_node(node, feeds, self.opset.get("", 1))
        if outs is None:
            return None
        for name, arr in zip([o for o in node.output if o], outs):
            if arr is not None and np.asarray(arr).size <= _MAX_FOLDED_ELEMENTS:
                self._const_cache[name] = np.asarray(arr)
        return self._const_cache.get(value)

    def scalar(self, value: str) -> float | None:
        """A constant holding exactly one element, as a python float; else None."""
        arr = self.constant(value)
        if arr is None or arr.size != 1:
            return None
        return float(arr.reshape(()))

    # ---- types -------------------------------------------------------------------------------
    def type_of(self, value: str) -> onnx.TypeProto | None:
        t = self._declared.get(value)
        if t is None:
            t = self._inferred.get(value)
        if t is None:
            t = self._initializer_types.get(value)
            init = self.initializers.get(value) if t is None else None
            if init is not None:
                t = self._initializer_types[value] = helper.make_tensor_type_proto(init.data_type, list(init.dims))
        return t

    def _own_initializer(self, value: str) -> onnx.TensorProto | None:
        """The initializer `value` where `type_of` would make its type from it (none declared, inferred or made
        yet): its dims and element type are read from it directly, not from a TypeProto made for the asking."""
        init = self.initializers.get(value)   # None for most values: asked first
        if init is None or self._declared.get(value) is not None or self._inferred.get(value) is not None or \
                self._initializer_types.get(value) is not None:
            return None
        return init

    def shape(self, value: str) -> Shape | None:
        """Inferred shape; int for a fixed dim, str for a symbolic one, None for unknown."""
        shape = self._shapes.get(value, _UNSEEN)
        if shape is not _UNSEEN:
            return shape
        init = self._own_initializer(value)
        if init is not None and len(init.dims):   # what `_dims` reads of `type_of`'s TypeProto: the dims, as ints
            self._shapes[value] = shape = tuple(int(d) for d in init.dims)
            return shape
        t = self.type_of(value)
        if t is None or not t.tensor_type.HasField("shape"):
            arr = self._const_cache.get(value)
            return tuple(arr.shape) if arr is not None else None
        self._shapes[value] = shape = _dims(t.tensor_type.shape)
        return shape

    def shape_or_constant(self, value: str) -> Shape | None:
        """`shape`, or where inference has none the shape of the value's constant (folded if need be)."""
        shape = self.shape(value)
        if shape is None:
            arr = self.constant(value)
            shape = None if arr is None else tuple(arr.shape)
        return shape

    def rank(self, value: str) -> int | None:
        s = self.shape(value)
        return None if s is None else len(s)

    def elem_type(self, value: str) -> int:
        elem = self._elem_types.get(value)
        if elem is None:
            init = self._own_initializer(value)
            if init is not None:   # `type_of` makes its type with this element type
                elem = self._elem_types[value] = init.data_type
                return elem
            t = self.type_of(value)
            elem = self._elem_types[value] = t.tensor_type.elem_type if t is not None else onnx.TensorProto.UNDEFINED
        return elem

    def dtype(self, value: str) -> np.dtype | None:
        return np_dtype(self.elem_type(value))

    def value_info(self, value: str) -> onnx.ValueInfoProto:
        """A ValueInfoProto for `value` with whatever type is known (for building sub-models)."""
        vi = onnx.ValueInfoProto(name=value)
        t = self.type_of(value)
        if t is not None:
            vi.type.CopyFrom(t)
        return vi

    @property
    def value_types(self) -> dict[str, onnx.TypeProto]:
        types = {name: t for name in self.initializers if (t := self.type_of(name)) is not None}
        types.update(self._inferred)
        types.update(self._declared)
        return types


def _dims(shape: onnx.TensorShapeProto) -> Shape:
    """A shape as a tuple: int for a fixed dim, str for a symbolic one, None for unknown. Memoised by the shape's
    bytes: the layers of a big model repeat a few shapes thousands of times, and reading dims is slow."""
    key = shape.SerializeToString()
    out = _DIMS_BY_BYTES.get(key)
    if out is None:
        dims: list[Dim] = []
        for d in shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param"):
                dims.append(d.dim_param)
            else:
                dims.append(None)
        out = tuple(dims)
        if len(_DIMS_BY_BYTES) < 1 << 16:
            _DIMS_BY_BYTES[key] = out
    return out


_DIMS_BY_BYTES: dict[bytes, Shape] = {}


def _evaluate_node(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int) -> list | None:
    """Run one pure node on constant inputs: the two ops that generate most weights directly, else onnx's
    reference evaluator, else onnxruntime (the reference evaluator picks the newest kernel for some
    old-opset ops, e.g. Unsqueeze-1 with an `axes` attribute)."""
    if node.op_type == "ConstantOfShape" and node.input and node.input[0] in feeds:
        value = next((numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"),
                     np.zeros(1, dtype=np.float32))
        return [np.full(tuple(int(d) for d in feeds[node.input[0]]), value.reshape(-1)[0], dtype=value.dtype)]
    if node.op_type == "Identity" and node.input and node.input[0] in feeds:
        return [feeds[node.input[0]]]
    from onnx.reference import ReferenceEvaluator

    try:
        return list(ReferenceEvaluator(node, opsets={"": opset}).run(None, feeds))
    except Exception:
        pass
    try:
        from npufuse.ir.runtime import IR_VERSION, session

        outs = [o for o in node.output if o]
        g = helper.make_graph(
            [node], "fold", [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                             for k, v in feeds.items()],
            [onnx.ValueInfoProto(name=o) for o in outs])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
        return list(session(model).run(outs, feeds))
    except Exception:  # an op neither can run simply stays unfolded
        return None


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


# Standard ops with graph attributes; a node of any other default-domain op reads only its inputs, and
# its attributes need not be looked at (the hot path of indexing a 100k-node graph).
_SUBGRAPH_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})
_FLAT_DOMAINS = frozenset({"", "ai.onnx", "npufuse"})   # npufuse's own ops never hold a subgraph


def _node_value_inputs(node: onnx.NodeProto) -> Iterable[str]:
    """Values a node reads: its inputs and the outer-scope names its subgraphs use."""
    if node.op_type not in _SUBGRAPH_OPS and node.domain in _FLAT_DOMAINS:
        return [v for v in node.input if v]
    return list(_all_value_inputs(node))


def subgraphs_of(node: onnx.NodeProto) -> list[tuple[str, onnx.GraphProto]]:
    """The graphs a node holds as attributes, each with its label (`then_branch`, `body`, `branches[1]`)."""
    if node.op_type not in _SUBGRAPH_OPS and node.domain in _FLAT_DOMAINS:
        return []
    out: list[tuple[str, onnx.GraphProto]] = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append((a.name, a.g))
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend((f"{a.name}[{i}]", sub) for i, sub in enumerate(a.graphs))
    return out


def outer_scope_reads(g: onnx.GraphProto) -> list[str]:
    """The values of enclosing graphs that `g` (or a graph nested in it) reads, in first-use order."""
    return list(dict.fromkeys(_outer_scope_inputs(g)))


def _all_value_inputs(node: onnx.NodeProto) -> Iterable[str]:
    for v in node.input:
        if v:
            yield v
    for a in node.attribute:
        for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            yield from _outer_scope_inputs(sub)


def _outer_scope_inputs(g: onnx.GraphProto) -> Iterable[str]:
    local = {i.name for i in g.input} | {t.name for t in g.initializer}
    for n in g.node:
        local.update(n.output)
    for n in g.node:
        for v in _node_value_inputs(n):
            if v not in local:
                yield v
