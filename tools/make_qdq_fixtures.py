#!/usr/bin/env python3
"""Regenerate tests/fixtures/qdq/: quantized versions of fixtures we already have, made by onnxruntime's quantizer.

Static QDQ (``quantize_static``, ``QuantFormat.QDQ``, int8 weights and activations), calibrated on a few seeded
batches that npufuse's own input generator makes (ids within the vocabulary, masks of 0/1, floats ~N(0,1)):

* ``conv_bn_relu_qdq.onnx``      - ``tests/builders.conv_chain`` (Conv -> BatchNormalization -> Relu), per-tensor
* ``resnet_qdq_per_channel.onnx`` - ``tests/fixtures/resnet_ts17.onnx`` (bottleneck ResNet, BN kept), per-channel
* ``mlp_bn_qdq.onnx``             - ``tests/fixtures/mlp_bn_ts17.onnx`` (Gemm -> BatchNormalization), per-tensor
* ``bert_qdq.onnx``               - ``tests/fixtures/bert_ts17.onnx`` (a 2-layer BERT encoder), per-tensor

Dynamic quantization (``quantize_dynamic``: DynamicQuantizeLinear + MatMulInteger, int8 weights):

* ``bert_dynamic_quant.onnx``     - ``tests/fixtures/bert_ts17.onnx``

Usage::

    python tools/make_qdq_fixtures.py

Needs onnx, onnxruntime and numpy only (the quantizer ships with onnxruntime); run from the repository root.
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from builders import conv_chain  # noqa: E402

from npufuse.ir.graph import Graph  # noqa: E402
from npufuse.verify.inputs import model_inputs  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
OUT = FIXTURES / "qdq"
CALIBRATION_BATCHES = 4


class _Batches(CalibrationDataReader):
    """A few seeded batches shaped and filled the way npufuse's verification fills them."""

    def __init__(self, model: onnx.ModelProto) -> None:
        g = Graph(onnx.shape_inference.infer_shapes(model))
        self._it = iter([model_inputs(g, seed) for seed in range(CALIBRATION_BATCHES)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)


def _static(src: onnx.ModelProto, dst: Path, per_channel: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "float.onnx"
        onnx.save(src, path)
        quantize_static(str(path), str(dst), _Batches(src), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                        weight_type=QuantType.QInt8, activation_type=QuantType.QInt8)


def _dynamic(src: onnx.ModelProto, dst: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "float.onnx"
        onnx.save(src, path)
        quantize_dynamic(str(path), str(dst), weight_type=QuantType.QInt8)


def _summary(path: Path) -> str:
    m = onnx.load(path)
    ops = Counter(n.op_type for n in m.graph.node)
    q = {k: ops[k] for k in ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger") if ops[k]}
    int8 = sum(t.data_type == onnx.TensorProto.INT8 for t in m.graph.initializer)
    ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])   # it must load
    return f"{path.name}: {path.stat().st_size} bytes, {q}, {int8} int8 initializers"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    jobs = [
        ("conv_bn_relu_qdq.onnx", lambda d: _static(conv_chain(act="Relu", opset=17), d, per_channel=False)),
        ("resnet_qdq_per_channel.onnx", lambda d: _static(onnx.load(FIXTURES / "resnet_ts17.onnx"), d, True)),
        ("mlp_bn_qdq.onnx", lambda d: _static(onnx.load(FIXTURES / "mlp_bn_ts17.onnx"), d, False)),
        ("bert_qdq.onnx", lambda d: _static(onnx.load(FIXTURES / "bert_ts17.onnx"), d, False)),
        ("bert_dynamic_quant.onnx", lambda d: _dynamic(onnx.load(FIXTURES / "bert_ts17.onnx"), d)),
    ]
    for name, make in jobs:
        make(OUT / name)
        print(_summary(OUT / name))


if __name__ == "__main__":
    main()
