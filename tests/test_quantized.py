"""Quantized models keep their quantization (issue 12, item 8).

A QDQ model's DequantizeLinear(int8 weight) -> Conv/MatMul/Gemm -> QuantizeLinear groups are what the device runs
in int8: npufuse must never fold a DequantizeLinear (or QuantizeLinear) into a float constant, never leave an int8
initializer dead, and report each quantized group a pattern refuses as a `quantized` near-miss naming the
quantization node. The fixtures are onnxruntime's own quantizer run on fixtures we have (tools/make_qdq_fixtures.py).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from builders import conv_chain
from onnx import TensorProto, helper, numpy_helper

from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import Graph
from npufuse.ir.modelio import load_model, write_model
from npufuse.verify.inputs import model_inputs

QDQ = Path(__file__).parent / "fixtures" / "qdq"
STATIC = ["conv_bn_relu_qdq.onnx", "mlp_bn_qdq.onnx", "resnet_qdq_per_channel.onnx", "bert_qdq.onnx"]
QUANT_OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger")
COMPUTE = ("Conv", "MatMul", "Gemm")


def _op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node if n.op_type in QUANT_OPS)


def _int8_initializers(model: onnx.ModelProto) -> set[str]:
    return {t.name for t in model.graph.initializer if t.data_type in (TensorProto.INT8, TensorProto.UINT8)}


def _read(model: onnx.ModelProto) -> set[str]:
    return {v for n in model.graph.node for v in n.input}


def _ort(model_or_path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    src = str(model_or_path) if isinstance(model_or_path, Path) else model_or_path.SerializeToString()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {i.name: feeds[i.name] for i in sess.get_inputs()})))


def _optimize_file(path: Path, tmp_path: Path):
    model = load_model(path)
    res = optimize(model, str(path.parent), OptimizeOptions())
    assert res.ok
    out = write_model(res.model, tmp_path / "out.onnx", str(path.parent), external=False)
    return model, res, onnx.load(out), out


@pytest.mark.parametrize("name", STATIC)
def test_static_qdq_keeps_every_quantization_node_and_int8_weight(name: str, tmp_path: Path) -> None:
    path = QDQ / name
    original = onnx.load(path)
    _, res, written, out = _optimize_file(path, tmp_path)
    assert _op_counts(written) == _op_counts(original) and _op_counts(original)["DequantizeLinear"] > 0
    int8 = _int8_initializers(original)
    assert int8 and int8 <= _int8_initializers(written)
    assert int8 <= _read(written), f"dead int8 initializers: {sorted(int8 - _read(written))[:3]}"
    # no float copy of a dequantized weight appeared: the float initializers are the input's (plus small shape
    # constants canonicalisation may fold)
    new_floats = {t.name for t in written.graph.initializer if t.data_type == TensorProto.FLOAT} - \
        {t.name for t in original.graph.initializer}
    assert not any(n.endswith(("_DequantizeLinear_Output", "_dequantized")) for n in new_floats)
    # Outputs: the optimized model on onnxruntime matches the input on onnxruntime.
    feeds = model_inputs(Graph(original), seed=3)
    want, got = _ort(path, feeds), _ort(out, feeds)
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-5)
    assert unaccounted(res) == []


@pytest.mark.parametrize("name", STATIC)
def test_each_quantized_compute_node_is_a_named_near_miss(name: str) -> None:
    model = load_model(QDQ / name)
    res = optimize(model, str(QDQ), OptimizeOptions(verify=False))
    g = Graph(model)
    quantized = [f for f in res.refusals if f.reason == "quantized"]
    covered = {n for f in quantized for n in f.nodes}
    for n in model.graph.node:
        if n.op_type in COMPUTE and any(g.producer_of(v) is not None and g.producer_of(v).op_type ==
                                        "DequantizeLinear" for v in n.input):
            assert n.name in covered, f"{n.op_type} {n.name} reads a DequantizeLinear but no near-miss names it"
    named = {g.node(f.node).op_type for f in quantized}
    assert named <= {"DequantizeLinear", "QuantizeLinear"} and quantized
    assert not res.applied or all(not any(g.node(n).op_type in COMPUTE for n in r.match.nodes) for r in res.applied)


def test_com_microsoft_qdq_is_quantized_not_a_dynamic_weight() -> None:
    """onnxruntime's contrib Q/DQ (int16/int4, UseQDQContribOps) mean the same as the standard ones: each group is
    a `quantized` near-miss, not `dynamic-weight` (what a pattern says of a weight it cannot see as a constant)."""
    model = load_model(QDQ / "conv_bn_relu_qdq.onnx")
    for n in model.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            n.domain = "com.microsoft"
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    res = optimize(model, str(QDQ), OptimizeOptions(verify=False))
    reasons = Counter(f.reason for f in res.refusals)
    assert reasons["quantized"] >= 1 and reasons["dynamic-weight"] == 0, reasons
    assert not any(g_op in ("Conv", "Gemm", "MatMul") for r in res.applied for g_op in
                   (Graph(model).node(n).op_type for n in r.match.nodes))
    ms = [n for n in res.model.graph.node if n.domain == "com.microsoft"]
    assert Counter(n.op_type for n in ms) == Counter(n.op_type for n in model.graph.node
                                                     if n.domain == "com.microsoft")


def _weight_only_conv_bn(per_channel: bool) -> onnx.ModelProto:
    """conv_chain's Conv -> BN -> Relu with its weight stored int8 and dequantized in the graph (weight-only
    quantization: float activations, nothing after the Conv is quantized)."""
    m = conv_chain(act="Relu", opset=17)
    w = next(t for t in m.graph.initializer if t.name == "W")
    wf = numpy_helper.to_array(w)
    axis_scale = np.abs(wf).reshape(wf.shape[0], -1).max(axis=1) / 127 if per_channel else np.abs(wf).max() / 127
    scale = np.asarray(axis_scale, np.float32)
    bshape = (-1, 1, 1, 1) if per_channel else ()
    q = np.clip(np.round(wf / scale.reshape(bshape)), -127, 127).astype(np.int8)
    m.graph.initializer.remove(w)
    m.graph.initializer.extend([numpy_helper.from_array(q, "W_q"), numpy_helper.from_array(scale, "W_scale"),
                                numpy_helper.from_array(np.zeros(scale.shape, np.int8), "W_zp")])
    attrs = {"axis": 0} if per_channel else {}
    m.graph.node.insert(0, helper.make_node("DequantizeLinear", ["W_q", "W_scale", "W_zp"], ["W"], name="dq_w",
                                            **attrs))
    onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("per_channel", [False, True])
def test_weight_only_quantized_conv_is_not_folded_into_a_float_weight(per_channel: bool, tmp_path: Path) -> None:
    """Before the fix the BN was folded into the Conv by reading DequantizeLinear(W_q) as a constant: the fused
    Conv read a new float weight and W_q was left dead."""
    m = _weight_only_conv_bn(per_channel)
    res = optimize(m, None, OptimizeOptions())
    after = res.model
    assert _op_counts(after)["DequantizeLinear"] == 1
    assert "W_q" in _read(after)
    conv = next(n for n in after.graph.node if n.op_type == "Conv")
    assert conv.input[1] == "W" and "BatchNormalization" in {n.op_type for n in after.graph.node}
    refusal = next(f for f in res.refusals if f.reason == "quantized" and f.pattern == "conv_bn_act")
    assert refusal.node == "dq_w" and "conv" in refusal.nodes and "dq_w" in refusal.detail
    feeds = model_inputs(Graph(m), seed=1)
    np.testing.assert_allclose(_ort(after, feeds)["Y"], _ort(m, feeds)["Y"], rtol=1e-6, atol=1e-6)


def test_dequantize_linear_is_never_a_constant() -> None:
    g = Graph(_weight_only_conv_bn(True))
    assert g.is_constant("W_q") and not g.is_constant("W") and g.constant("W") is None


def test_dynamic_quantized_model_stays_correct(tmp_path: Path) -> None:
    """quantize_dynamic's DynamicQuantizeLinear -> MatMulInteger groups survive; the float parts around them may
    fuse, and the result matches the input on onnxruntime."""
    path = QDQ / "bert_dynamic_quant.onnx"
    original = onnx.load(path)
    _, res, written, out = _optimize_file(path, tmp_path)
    assert res.model_check is not None and res.model_check.ok
    assert _op_counts(written) == _op_counts(original) and _op_counts(original)["MatMulInteger"] > 0
    int8 = _int8_initializers(original)
    assert int8 and int8 <= _read(written)
    feeds = model_inputs(Graph(original), seed=3)
    want, got = _ort(path, feeds), _ort(out, feeds)
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-3, atol=1e-4)
