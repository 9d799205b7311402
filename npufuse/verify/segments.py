"""Running a model of any size in bounded memory: segment by segment on onnxruntime.

A whole-model onnxruntime session holds every weight at once; for a 7B LLM that is 13 GB before the first
activation. Here the topologically ordered nodes are cut into consecutive segments whose weights fit a budget.
Each segment becomes a small model of its own (its nodes, the initializers they read as the same external-data
references, the values it needs from earlier segments as graph inputs), is run in its own session, and the
session is dropped before the next is built. Between segments only the boundary activations still needed later
are kept; everything else the caller wants to look at goes to an `ActivationStore` that spills to disk.

Weight bytes are never read by Python: onnxruntime reads them itself from `base_dir`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import onnx
from onnx import helper

from npufuse.ir.graph import _node_value_inputs
from npufuse.ir.runtime import release_freed_memory, session
from npufuse.ir.weights import is_external, iter_tensors, tensor_nbytes

DEFAULT_VERIFY_MEMORY_BYTES = 1 << 30

# Segment models keep the original IR version, but never below 4: before IR 4 every initializer had to be
# listed as a graph input too, and a segment lists only the values it is fed.
_MIN_SEGMENT_IR = 4


@dataclass
class Segment:
    """One run of consecutive nodes, executed as a model of its own."""

    index: int
    node_positions: range  # consecutive positions in model.graph.node
    weight_bytes: int  # bytes of initializers (and node-embedded tensors) it reads, each counted once
    inputs: tuple[str, ...]  # dynamic values read from outside: graph inputs or earlier segments' outputs
    outputs: tuple[str, ...]  # values later segments, graph outputs, or the caller's capture need


@dataclass
class _Plan:
    """What planning learns beyond the public segments, so that running needs no second pass over the graph."""

    segments: list[Segment]
    initializers: list[tuple[str, ...]]  # per segment, the initializers it reads (names of `static`)
    static: dict[str, onnx.TensorProto]  # initializers that stay constant (not overridden by a feed)
    produced: set[str]  # every value some node produces


def plan_segments(model: onnx.ModelProto, budget_bytes: int, capture: Collection[str] = ()) -> list[Segment]:
    """Cut the topologically ordered nodes into consecutive segments whose initializer bytes fit budget_bytes
    (a node alone over budget gets a segment of its own).

    Initializer bytes come from the tensors' external-data `length` (or dims × element size), never from the
    data. A segment's weight bytes count each initializer it reads once, plus tensors embedded in its nodes
    (Constant values, subgraph initializers), since its session holds those too. Nodes that bring no new
    weight bytes never start a segment: they join the current one, so a node over budget may share its segment
    with the weightless nodes after it. Linear in the size of the graph."""
    return _plan(model, budget_bytes, set(capture), capture_all=False, fed=()).segments


def _plan(model: onnx.ModelProto, budget_bytes: int, capture: set[str], capture_all: bool,
          fed: Collection[str]) -> _Plan:
    g = model.graph
    static = {t.name: t for t in g.initializer}
    if model.ir_version >= 4:
        # An initializer that is also a graph input is only a default: a feed for it makes it a dynamic value.
        for i in g.input:
            if i.name in fed:
                static.pop(i.name, None)
    nodes = g.node
    n_nodes = len(nodes)

    # Pass 1: what each node reads, and where segments start (greedy: cut when the next node's new weights
    # would overflow the budget).
    reads: list[tuple[str, ...]] = []
    starts: list[int] = []
    seg_inits: list[list[str]] = []
    seg_bytes: list[int] = []
    cur: set[str] = set()
    size_of: dict[str, int] = {}
    for pos, node in enumerate(nodes):
        r = tuple(dict.fromkeys(_node_value_inputs(node)))
        reads.append(r)
        inits = [v for v in r if v in static]
        new = [v for v in inits if v not in cur]
        embedded = _embedded_bytes(node)
        add = sum(_size(static, size_of, v) for v in new) + embedded
        if not starts or (add > 0 and seg_bytes[-1] + add > budget_bytes):
            if starts:
                new = inits
                add = sum(_size(static, size_of, v) for v in new) + embedded
            starts.append(pos)
            seg_inits.append([])
            seg_bytes.append(0)
            cur = set()
        cur.update(new)
        seg_inits[-1].extend(new)
        seg_bytes[-1] += add
    ranges = [range(s, starts[k + 1] if k + 1 < len(starts) else n_nodes) for k, s in enumerate(starts)]

    # Pass 2: the segment producing each value, the last segment reading it, and each segment's inputs.
    prod_seg: dict[str, int] = {}
    last_seg: dict[str, int] = {}
    seg_inputs: list[dict[str, None]] = []
    for s, rg in enumerate(ranges):
        ins: dict[str, None] = {}
        for pos in rg:
            for v in reads[pos]:
                if v in static:
                    continue
                last_seg[v] = s
                if prod_seg.get(v, -1) < s:
                    ins[v] = None
            for o in nodes[pos].output:
                if o:
                    prod_seg.setdefault(o, s)
        seg_inputs.append(ins)

    # Pass 3: each segment's outputs, now that every value's last reader is known.
    graph_outputs = {o.name for o in g.output}
    segments = []
    for s, rg in enumerate(ranges):
        outs: dict[str, None] = {}
        for pos in rg:
            for o in nodes[pos].output:
                if o and prod_seg[o] == s and (last_seg.get(o, -1) > s or o in graph_outputs or capture_all
                                               or o in capture):
                    outs[o] = None
        segments.append(Segment(s, rg, seg_bytes[s], tuple(seg_inputs[s]), tuple(outs)))
    return _Plan(segments, [tuple(x) for x in seg_inits], static, set(prod_seg))


def _size(static: dict[str, onnx.TensorProto], cache: dict[str, int], name: str) -> int:
    n = cache.get(name)
    if n is None:
        n = cache[name] = tensor_nbytes(static[name])
    return n


def _embedded_bytes(node: onnx.NodeProto) -> int:
    """Bytes of tensors held inside a node: Constant values, tensor attributes, subgraph initializers."""
    total = 0
    for a in node.attribute:
        if a.type == onnx.AttributeProto.TENSOR:
            total += tensor_nbytes(a.t)
        elif a.type == onnx.AttributeProto.TENSORS:
            total += sum(tensor_nbytes(t) for t in a.tensors)
        elif a.type == onnx.AttributeProto.GRAPH:
            total += _graph_bytes(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            total += sum(_graph_bytes(sub) for sub in a.graphs)
    return total


def _graph_bytes(g: onnx.GraphProto) -> int:
    return sum(tensor_nbytes(t) for t in g.initializer) + sum(_embedded_bytes(n) for n in g.node)


# ---- activation store ------------------------------------------------------------------------------------------

class ActivationStore:
    """Holds captured arrays; keeps up to `memory_bytes` in RAM and spills the rest to .npy files in a private
    temp dir (read back with np.load(mmap_mode='r')). Context manager; removes its temp dir on close.

    Arrays kept in RAM are stored as given (not copied). Nothing is evicted: an array that does not fit in
    what is left of `memory_bytes` goes to disk. The temp dir is made on the first spill, inside `dir` (or the
    system's temp folder), and is removed on close or, failing that, when the store is garbage-collected."""

    def __init__(self, memory_bytes: int = 256 << 20, dir: str | None = None):
        self.memory_bytes = memory_bytes
        self._parent = dir
        self._ram: dict[str, np.ndarray] = {}
        self._ram_bytes = 0
        self._files: dict[str, tuple[str, bool]] = {}  # name -> (path, pickled)
        self._dir: str | None = None
        self._cleanup: weakref.finalize | None = None
        self._count = 0

    @property
    def dir(self) -> str | None:
        """The private spill folder, or None while nothing has spilled."""
        return self._dir

    @property
    def ram_bytes(self) -> int:
        return self._ram_bytes

    def put(self, name: str, arr: np.ndarray) -> None:
        """Store `arr` under `name`, replacing any earlier array of that name."""
        arr = np.asarray(arr)
        self._discard(name)
        if self._ram_bytes + arr.nbytes <= self.memory_bytes:
            self._ram[name] = arr
            self._ram_bytes += arr.nbytes
            return
        # Names are value names (any characters): files are numbered instead.
        path = os.path.join(self._spill_dir(), f"{self._count}.npy")
        self._count += 1
        pickled = arr.dtype.hasobject  # string tensors come back from onnxruntime as object arrays
        np.save(path, arr, allow_pickle=pickled)
        self._files[name] = (path, pickled)

    def get(self, name: str) -> np.ndarray | None:
        """The array stored under `name` (a read-only memory map if it was spilled), or None."""
        arr = self._ram.get(name)
        if arr is not None:
            return arr
        entry = self._files.get(name)
        if entry is None:
            return None
        path, pickled = entry
        if pickled:  # object arrays cannot be memory-mapped
            return np.load(path, allow_pickle=True)
        return np.load(path, mmap_mode="r")

    def __contains__(self, name: object) -> bool:
        return name in self._ram or name in self._files

    def __len__(self) -> int:
        return len(self._ram) + len(self._files)

    def names(self) -> set[str]:
        return set(self._ram) | set(self._files)

    def close(self) -> None:
        """Forget every array and remove the spill folder. Arrays already handed out by `get` stay readable
        where the OS allows it (on POSIX a removed file stays mapped)."""
        self._ram.clear()
        self._ram_bytes = 0
        self._files.clear()
        if self._cleanup is not None:
            self._cleanup()
        self._cleanup = None
        self._dir = None

    def __enter__(self) -> ActivationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _discard(self, name: str) -> None:
        arr = self._ram.pop(name, None)
        if arr is not None:
            self._ram_bytes -= arr.nbytes
        entry = self._files.pop(name, None)
        if entry is not None:
            try:
                os.remove(entry[0])
            except OSError:
                pass  # still mapped by someone on a platform that forbids removal; the folder goes on close

    def _spill_dir(self) -> str:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="npufuse-activations-", dir=self._parent)
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
        return self._dir


# ---- running ---------------------------------------------------------------------------------------------------

def run_segmented(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], base_dir: str | None,
                  budget_bytes: int = DEFAULT_VERIFY_MEMORY_BYTES, capture: Collection[str] | Literal["all"] = (),
                  store: ActivationStore | None = None,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray]:
    """Run `model` on `feeds` segment by segment; return the graph outputs.

    Values named in `capture` (or, with capture == "all", every tensor a node produces) are put into `store`;
    captured names that are fed graph inputs are stored too. Between segments only values still needed later
    are kept in RAM (each is freed after its last consuming segment). `progress(done_segments,
    total_segments)` is called after each segment.

    External data is read by onnxruntime from `base_dir`; nothing is written there. Feeds whose names are not
    graph inputs are ignored; a feed for an initializer that is also a graph input (IR >= 4) overrides it.
    Raises RuntimeError naming the segment if onnxruntime fails on it."""
    if isinstance(capture, str) and capture != "all":  # set("h0") would silently capture "h" and "0"
        raise ValueError(f"run_segmented: capture must be a collection of names or 'all', not {capture!r}")
    capture_all = capture == "all"
    capture_set: set[str] = set() if capture_all else set(capture)
    if (capture_all or capture_set) and store is None:
        raise ValueError("run_segmented: capture needs a store to put the captured values in")
    g = model.graph
    if base_dir is None and any(is_external(t) for t in iter_tensors(model)):
        raise ValueError("run_segmented: the model has external data; pass the folder it lies in as base_dir")
    input_names = {i.name for i in g.input}
    feeds = {k: (v if isinstance(v, list) else np.asarray(v)) for k, v in feeds.items() if k in input_names}
    plan = _plan(model, budget_bytes, capture_set, capture_all, fed=feeds)
    segments = plan.segments
    total = len(segments)
    types = _known_types(g)
    graph_outputs = [o.name for o in g.output]
    graph_output_set = set(graph_outputs)

    # Free each value after the last segment that reads it: index the frees by segment once.
    last_use: dict[str, int] = {}
    for seg in segments:
        for v in seg.inputs:
            last_use[v] = seg.index
    frees: list[list[str]] = [[] for _ in segments]
    for v, s in last_use.items():
        frees[s].append(v)

    live: dict[str, Any] = {k: v for k, v in feeds.items() if k in last_use}
    if store is not None:
        for k in capture_set & feeds.keys():
            store.put(k, feeds[k])
    results: dict[str, Any] = {}
    for seg in segments:
        s = seg.index
        if seg.outputs:  # a segment nobody needs anything from (dead code) is not run
            res = _run_segment(model, plan, seg, live, types, base_dir, total)
            for name, arr in zip(seg.outputs, res):
                if name in graph_output_set:
                    results[name] = arr
                if store is not None and (name in capture_set or (capture_all and isinstance(arr, np.ndarray))):
                    store.put(name, arr)
                if last_use.get(name, -1) > s:
                    live[name] = arr
            del res
        for v in frees[s]:
            live.pop(v, None)
        release_freed_memory()
        if progress is not None:
            progress(s + 1, total)

    # Graph outputs no node produces: a graph input handed back, or an initializer returned as is.
    from_inits = []
    for name in dict.fromkeys(graph_outputs):
        if name in results or name in plan.produced:
            continue
        if name in feeds:
            results[name] = feeds[name]
        elif name in plan.static:
            from_inits.append(name)
        else:
            raise RuntimeError(f"graph output {name!r} has no producer, feed or initializer")
    if from_inits:
        results.update(_read_initializers(model, from_inits, plan.static, base_dir))
    return {name: results[name] for name in graph_outputs if name in results}


def _run_segment(model: onnx.ModelProto, plan: _Plan, seg: Segment, live: Mapping[str, Any],
                 types: Mapping[str, onnx.TypeProto], base_dir: str | None, total: int) -> list[Any]:
    nodes = model.graph.node
    first, last = seg.node_positions[0], seg.node_positions[-1]
    where = (f"segment {seg.index + 1}/{total} "
             f"(nodes {_node_label(nodes[first], first)}..{_node_label(nodes[last], last)})")
    missing = [v for v in seg.inputs if v not in live]
    if missing:
        raise RuntimeError(f"{where}: no value for {', '.join(map(repr, missing))} (not fed and not produced)")
    feeds = {v: live[v] for v in seg.inputs}
    m = _segment_model(model, plan, seg, feeds, types)
    try:
        sess = session(m, base_dir=base_dir)
        del m
        # The session goes out of scope on return, before the next segment's is built: at most one
        # segment's weights are inside onnxruntime at a time.
        return sess.run(list(seg.outputs), feeds)
    except Exception as e:  # onnxruntime raises its own exception classes, not all RuntimeErrors
        lines = str(e).strip().splitlines()
        raise RuntimeError(f"{where}: {lines[0] if lines else type(e).__name__}") from e


def _node_label(node: onnx.NodeProto, pos: int) -> str:
    return node.name or f"<{node.op_type} #{pos}>"


def _segment_model(model: onnx.ModelProto, plan: _Plan, seg: Segment, feeds: Mapping[str, Any],
                   types: Mapping[str, onnx.TypeProto]) -> onnx.ModelProto:
    """The segment as a model of its own: its nodes, the values it is fed as inputs (typed from the arrays
    themselves), the initializers it reads (the same references: no weight bytes are copied), and the
    original opsets and model-local functions."""
    m = _empty_model_like(model)
    g = m.graph
    g.name = f"{model.graph.name or 'graph'}_segment{seg.index}"
    g.node.extend(model.graph.node[seg.node_positions.start:seg.node_positions.stop])
    g.input.extend(_input_info(v, feeds[v], types.get(v)) for v in seg.inputs)
    g.initializer.extend(plan.static[v] for v in plan.initializers[seg.index])
    g.output.extend(_output_info(v, types.get(v)) for v in seg.outputs)
    return m


def _empty_model_like(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.ir_version = max(model.ir_version, _MIN_SEGMENT_IR)
    m.producer_name = "npufuse-segment"
    m.opset_import.extend(model.opset_import)
    m.functions.extend(model.functions)
    return m


def _known_types(g: onnx.GraphProto) -> dict[str, onnx.TypeProto]:
    types: dict[str, onnx.TypeProto] = {}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.WhichOneof("value") is not None:
            types.setdefault(vi.name, vi.type)
    return types


def _elem_type_of(arr: np.ndarray, known: onnx.TypeProto | None) -> int:
    if arr.dtype.kind in "OUS":
        return onnx.TensorProto.STRING
    try:
        return helper.np_dtype_to_tensor_dtype(arr.dtype)
    except (KeyError, TypeError, ValueError):
        if known is not None and known.HasField("tensor_type") and known.tensor_type.elem_type:
            return known.tensor_type.elem_type
        raise


def _input_info(name: str, value: Any, known: onnx.TypeProto | None) -> onnx.ValueInfoProto:
    """A segment input typed from the array fed to it: declared shapes could disagree with what ran."""
    if isinstance(value, np.ndarray):
        return helper.make_tensor_value_info(name, _elem_type_of(value, known), list(value.shape))
    if known is not None:  # sequences, maps, optionals: as the model declares them
        vi = onnx.ValueInfoProto(name=name)
        vi.type.CopyFrom(known)
        return vi
    if isinstance(value, list) and value and isinstance(value[0], np.ndarray):  # a sequence of tensors
        return helper.make_tensor_sequence_value_info(name, _elem_type_of(value[0], None), None)
    raise TypeError(f"cannot declare the type of segment input {name!r} ({type(value).__name__})")


def _output_info(name: str, known: onnx.TypeProto | None) -> onnx.ValueInfoProto:
    """A segment output: the element type where known, no shape (an exporter's shape may be symbolic or
    stale, and onnxruntime rejects a mismatch); untyped where nothing is known."""
    if known is not None:
        kind = known.WhichOneof("value")
        if kind == "tensor_type" and known.tensor_type.elem_type:
            return helper.make_tensor_value_info(name, known.tensor_type.elem_type, None)
        if kind != "tensor_type":
            vi = onnx.ValueInfoProto(name=name)
            vi.type.CopyFrom(known)
            return vi
    return onnx.ValueInfoProto(name=name)


def _read_initializers(model: onnx.ModelProto, names: Sequence[str], static: Mapping[str, onnx.TensorProto],
                       base_dir: str | None) -> dict[str, np.ndarray]:
    """Initializers that are graph outputs, read by onnxruntime through Identity nodes (Python never reads
    external data, and a node-less graph returning initializers is not something to rely on)."""
    m = _empty_model_like(model)
    if not any(o.domain in ("", "ai.onnx") for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid("", 13))
    outs = []
    for i, name in enumerate(names):
        out = f"__npufuse_initializer_output_{i}"
        m.graph.node.append(helper.make_node("Identity", [name], [out]))
        m.graph.initializer.append(static[name])
        m.graph.output.append(onnx.ValueInfoProto(name=out))
        outs.append(out)
    m.graph.name = "initializer_outputs"
    try:
        res = session(m, base_dir=base_dir).run(outs, {})
    except Exception as e:
        lines = str(e).strip().splitlines()
        raise RuntimeError(f"reading initializers returned as graph outputs ({', '.join(names)}): "
                           f"{lines[0] if lines else type(e).__name__}") from e
    return dict(zip(names, res))
