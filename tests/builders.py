"""Small ONNX graphs built with onnx.helper for the tests (real exports live in tests/fixtures)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npufuse.patterns.norms import LayerNormPattern

IR = 10


def conv_chain(*, rank: int = 2, cin: int = 4, cout: int = 6, group: int = 1, bias: bool = True,
               bn: bool = True, act: str | None = "Relu", opset: int = 17, seed: int = 0,
               spatial: int = 7, training_mode: int = 0, bn_params_as_inputs: bool = False,
               weight_as_input: bool = False, extra_conv_consumer: bool = False, bn_out_is_graph_output: bool = False,
               conv_out_is_graph_output: bool = False, dtype=np.float32, conv_attrs: dict | None = None
               ) -> onnx.ModelProto:
    """X -> Conv -> [BN] -> [activation] -> Y with seeded, non-trivial weights."""
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    k = [3] * rank
    w = rng.standard_normal((cout, cin // group, *k)).astype(dtype) * 0.3
    inits = []
    inputs = [helper.make_tensor_value_info("X", elem, [1, cin] + [spatial] * rank)]
    if weight_as_input:
        inputs.append(helper.make_tensor_value_info("W", elem, list(w.shape)))
    else:
        inits.append(numpy_helper.from_array(w, "W"))
    conv_in = ["X", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(cout).astype(dtype), "B"))
        conv_in.append("B")
    attrs = dict(group=group, pads=[1] * (2 * rank), kernel_shape=k)
    attrs.update(conv_attrs or {})
    nodes = [helper.make_node("Conv", conv_in, ["c"], name="conv", **attrs)]
    outputs = []
    cur = "c"
    if bn:
        params = {"scale": rng.uniform(0.5, 1.5, cout), "bbias": rng.standard_normal(cout),
                  "mean": rng.standard_normal(cout) * 0.5, "var": rng.uniform(0.2, 2.0, cout)}
        for name, v in params.items():
            if bn_params_as_inputs and name == "mean":
                inputs.append(helper.make_tensor_value_info(name, elem, [cout]))
            else:
                inits.append(numpy_helper.from_array(v.astype(dtype), name))
        bn_attrs = {"epsilon": 1e-3}
        bn_outputs = ["b"]
        if training_mode:
            bn_attrs["training_mode"] = 1
            bn_outputs = ["b", "running_mean", "running_var"]
        nodes.append(helper.make_node("BatchNormalization", ["c", "scale", "bbias", "mean", "var"], bn_outputs,
                                      name="bn", **bn_attrs))
        cur = "b"
        if bn_out_is_graph_output:
            outputs.append(helper.make_tensor_value_info("b", elem, None))
    if act is not None:
        nodes.extend(activation_nodes(act, cur, "Y", opset, inits, dtype))
        cur = "Y"
    else:
        nodes.append(helper.make_node("Identity", [cur], ["Y"], name="out"))
    if extra_conv_consumer:
        nodes.append(helper.make_node("Neg", ["c"], ["side"], name="side"))
        outputs.append(helper.make_tensor_value_info("side", elem, None))
    if conv_out_is_graph_output:
        outputs.append(helper.make_tensor_value_info("c", elem, None))
    outputs.insert(0, helper.make_tensor_value_info("Y", elem, None))
    g = helper.make_graph(nodes, "conv_chain", inputs, outputs, inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR))


def with_output_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Declare the graph outputs' shapes (onnx.checker requires them) from shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for o in model.graph.output:
        if not o.type.tensor_type.HasField("shape") and o.name in known:
            o.type.CopyFrom(known[o.name].type)
    onnx.checker.check_model(model)
    return model


def activation_nodes(act: str, x: str, y: str, opset: int, inits: list, dtype=np.float32) -> list[onnx.NodeProto]:
    """The nodes an exporter emits for `act` at `opset`."""
    if act == "Silu":
        return [helper.make_node("Sigmoid", [x], ["sig"], name="sig"), helper.make_node("Mul", [x, "sig"], [y], name="mul")]
    if act == "Clip":  # ReLU6
        if opset < 11:
            return [helper.make_node("Clip", [x], [y], name="act", min=0.0, max=6.0)]
        inits += [numpy_helper.from_array(np.array(0.0, dtype), "clip_min"),
                  numpy_helper.from_array(np.array(6.0, dtype), "clip_max")]
        return [helper.make_node("Clip", [x, "clip_min", "clip_max"], [y], name="act")]
    if act == "LeakyRelu":
        return [helper.make_node("LeakyRelu", [x], [y], name="act", alpha=0.1)]
    if act == "HardSigmoid":
        return [helper.make_node("HardSigmoid", [x], [y], name="act", alpha=0.25, beta=0.4)]
    return [helper.make_node(act, [x], [y], name="act")]


def random_feeds(model: onnx.ModelProto, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for i in model.graph.input:
        if i.name in inits:
            continue
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        dt = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        feeds[i.name] = rng.standard_normal(shape).astype(dt)
    return feeds


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


TensorProto = TensorProto


def to_bfloat16(model: onnx.ModelProto, source: int = TensorProto.FLOAT16) -> onnx.ModelProto:
    """A copy of `model` in bfloat16: every `source`-typed tensor (initializers, Constant values), value type and
    Cast/dtype attribute becomes bf16 (an fp16 export's finfo(fp16).min masks fit bf16's range; finite values
    beyond it are clamped to bf16's largest finite value, as a bf16 exporter writes finfo(bf16).min)."""
    import ml_dtypes   # onnx's own bf16 dtype (onnx depends on it)

    bf16 = TensorProto.BFLOAT16
    big = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    m = onnx.ModelProto()
    m.CopyFrom(model)

    def tensor(t: onnx.TensorProto) -> None:
        if t.data_type == source:
            a = numpy_helper.to_array(t).astype(np.float32)
            a = np.where(np.isfinite(a), np.clip(a, -big, big), a)
            t.CopyFrom(numpy_helper.from_array(a.astype(ml_dtypes.bfloat16), t.name))

    def graph(g: onnx.GraphProto) -> None:
        for t in g.initializer:
            tensor(t)
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type == source:
                vi.type.tensor_type.elem_type = bf16
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.INT and a.name in ("to", "dtype") and a.i == source:
                    a.i = bf16
                elif a.type == onnx.AttributeProto.TENSOR:
                    tensor(a.t)
                elif a.type == onnx.AttributeProto.GRAPH:
                    graph(a.g)

    graph(m.graph)
    onnx.checker.check_model(m)
    return m


class WrongEpsilonLayerNorm(LayerNormPattern):
    """Builds the LayerNorm with epsilon 10 instead of the model's 1e-5: a bug the verifier must catch."""

    def build(self, g, m):
        rep = super().build(g, m)
        for a in rep.nodes[0].attribute:
            if a.name == "epsilon":
                a.f = 10.0
        return rep
