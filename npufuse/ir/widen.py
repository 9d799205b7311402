"""bfloat16 models run on an fp32 copy: onnxruntime's CPU provider has no bf16 kernels for most ops.

onnxruntime (CPU) cannot run Add, Mul, MatMul, Relu ... on bfloat16, nor take a bf16 numpy array as a feed. So a
model that mentions bfloat16 anywhere (a weight, a graph value's type, a Cast to it) is run as a copy in which every
bf16 tensor is widened to float32 (exactly: bf16 is the upper half of an fp32), every bf16 type and every `to` /
`dtype` attribute naming bf16 says float32, feeds are widened and outputs the model declares bf16 are rounded back
to bf16. Every op then computes in fp32, so a check compares the graphs in fp32 arithmetic at bf16 tolerance; it
does not reproduce bf16 rounding between ops (a device computes those in bf16 or with fp32 accumulation). Both
sides of a comparison run this way; verification says so in its notes.

The widened weights of the main graph are handed to onnxruntime as in-memory values (`add_external_initializers`),
not serialised into the model, so a segment of a large bf16 model stays under protobuf's 2 GiB limit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from npufuse.ir.walk import graphs_below

BF16 = TensorProto.BFLOAT16
NOTE = ("bfloat16: onnxruntime has no bf16 kernels for most ops, so the model was run as an fp32 copy (weights and "
        "inputs widened exactly, bf16 outputs rounded back) and compared at bf16 tolerance; bf16 rounding between "
        "ops is not reproduced")

# Attributes that hold an element type (Cast's `to`, EyeLike / Random* / Multinomial / Bernoulli's `dtype`).
_TYPE_ATTRS = frozenset({"to", "dtype"})


def is_bfloat16(dtype: Any) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def mentions_bf16(model: onnx.ModelProto) -> bool:
    """True when any tensor, value type or type attribute of the model (subgraphs and functions too) is bf16."""
    for g in _graphs(model):
        if any(t.data_type == BF16 for t in g.initializer):
            return True
        if any(_type_has_bf16(vi.type) for vi in list(g.input) + list(g.output) + list(g.value_info)):
            return True
        if any(_node_has_bf16(n) for n in g.node):
            return True
    return any(_node_has_bf16(n) for f in model.functions for n in f.node)


def widen(model: onnx.ModelProto, base_dir: str | None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The fp32 copy of `model`, and the widened main-graph bf16 weights by name (to be handed to onnxruntime as
    external initializers: in the copy they are placeholders)."""
    from npufuse.ir.weights import read_array

    m = onnx.ModelProto()
    m.CopyFrom(model)
    weights: dict[str, np.ndarray] = {}
    for t in m.graph.initializer:
        if t.data_type == BF16:
            weights[t.name] = np.asarray(read_array(t, base_dir), dtype=np.float32)
            _placeholder(t)
    for g in _graphs(m):
        for t in g.initializer:
            if t.data_type == BF16 and t.name not in weights:   # a subgraph's: small, embedded
                t.CopyFrom(_widened_tensor(t, base_dir))
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            _widen_type(vi.type)
        for n in g.node:
            _widen_node(n, base_dir)
    for f in m.functions:
        for n in f.node:
            _widen_node(n, base_dir)
    return m, weights


def widen_feed(value: Any) -> Any:
    return value.astype(np.float32) if isinstance(value, np.ndarray) and is_bfloat16(value.dtype) else value


def narrow_outputs(model: onnx.ModelProto, names: Sequence[str], values: Sequence[Any]) -> list[Any]:
    """Outputs of the fp32 copy back in the types `model` (the original) gives them: bf16 rounded back to bf16."""
    types = output_elem_types(model, names)
    return [v.astype(onnx.helper.tensor_dtype_to_np_dtype(BF16))
            if types.get(n) == BF16 and isinstance(v, np.ndarray) and v.dtype == np.float32 else v
            for n, v in zip(names, values)]


def output_elem_types(model: onnx.ModelProto, names: Sequence[str]) -> dict[str, int]:
    """The element type of each value in `names`, as declared, else as onnx shape inference finds it."""
    g = model.graph
    known = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.output) + list(g.value_info) + list(g.input)
             if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type}
    if any(n not in known for n in names):
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
            for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
                if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                    known.setdefault(vi.name, vi.type.tensor_type.elem_type)
        except Exception:  # noqa: BLE001 - inference is advice: an unknown type is left as computed (fp32)
            pass
    return {n: known[n] for n in names if n in known}


class WidenedSession:
    """An onnxruntime session over the fp32 copy of a bf16 model, fed and answering in the original's types."""

    def __init__(self, original: onnx.ModelProto, sess: Any, keep_alive: list[Any]) -> None:
        self._original, self._sess, self._keep_alive = original, sess, keep_alive

    def get_inputs(self) -> list[Any]:
        return self._sess.get_inputs()

    def get_outputs(self) -> list[Any]:
        return self._sess.get_outputs()

    def run(self, names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list[Any]:
        names = list(names) if names is not None else [o.name for o in self._sess.get_outputs()]
        out = self._sess.run(names, {k: widen_feed(v) for k, v in feeds.items()})
        return narrow_outputs(self._original, names, out)


# ---- helpers ----------------------------------------------------------------------------------------------------

def _graphs(model: onnx.ModelProto) -> Iterator[onnx.GraphProto]:
    """The main graph and every subgraph, nested ones too (functions' subgraphs included)."""
    return graphs_below(model.graph, *(a.g for f in model.functions for n in f.node for a in n.attribute
                                       if a.type == onnx.AttributeProto.GRAPH))


def _type_has_bf16(t: onnx.TypeProto) -> bool:
    kind = t.WhichOneof("value")
    if kind == "tensor_type":
        return t.tensor_type.elem_type == BF16
    if kind == "sparse_tensor_type":
        return t.sparse_tensor_type.elem_type == BF16
    if kind in ("sequence_type", "optional_type"):
        return _type_has_bf16(getattr(t, kind).elem_type)
    return False


def _widen_type(t: onnx.TypeProto) -> None:
    kind = t.WhichOneof("value")
    if kind == "tensor_type" and t.tensor_type.elem_type == BF16:
        t.tensor_type.elem_type = TensorProto.FLOAT
    elif kind == "sparse_tensor_type" and t.sparse_tensor_type.elem_type == BF16:
        t.sparse_tensor_type.elem_type = TensorProto.FLOAT
    elif kind in ("sequence_type", "optional_type"):
        _widen_type(getattr(t, kind).elem_type)


def _node_has_bf16(n: onnx.NodeProto) -> bool:
    for a in n.attribute:
        if a.type == onnx.AttributeProto.INT and a.name in _TYPE_ATTRS and a.i == BF16:
            return True
        if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == BF16:
            return True
    return False


def _widen_node(n: onnx.NodeProto, base_dir: str | None) -> None:
    for a in n.attribute:
        if a.type == onnx.AttributeProto.INT and a.name in _TYPE_ATTRS and a.i == BF16:
            a.i = TensorProto.FLOAT
        elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == BF16:
            a.t.CopyFrom(_widened_tensor(a.t, base_dir))


def _widened_tensor(t: onnx.TensorProto, base_dir: str | None) -> onnx.TensorProto:
    from npufuse.ir.weights import read_array

    return numpy_helper.from_array(np.asarray(read_array(t, base_dir), dtype=np.float32), t.name)


def _placeholder(t: onnx.TensorProto) -> None:
    """Make `t` an fp32 external reference whose data onnxruntime gets in memory (add_external_initializers)."""
    from npufuse.ir.weights import set_external_ref

    count = int(np.prod(t.dims, dtype=np.int64))
    t.data_type = TensorProto.FLOAT
    t.ClearField("int32_data")
    set_external_ref(t, "npufuse-widened-in-memory", 0, 4 * count)
