"""Helpers the canonicalisation tests share (tests/test_rules_*.py, test_static_values.py, test_canonicalize.py):
small models built with onnx.helper, the canonical form of one (`normalize` with its rule counts), and a
bit-for-bit comparison of two models run in onnxruntime."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npufuse.ir.runtime import session
from npufuse.prepare.normalize import normalize

FIXTURES = Path(__file__).parent / "fixtures"
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(m)
    return m


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _c(name, arr) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr), name)


def _canonical(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Counter]:
    applied: Counter = Counter()
    out, _ = normalize(model, None, applied)
    return out, applied


def _feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in model.graph.input:
        t = i.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        feeds[i.name] = rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" else \
            rng.integers(0, 4, shape).astype(dtype)
    return feeds


def _assert_exact(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    feeds = _feeds(before)
    names = [o.name for o in before.graph.output]
    want = session(before).run(names, feeds)
    got = session(after).run(names, feeds)
    for n, w, o in zip(names, want, got):
        assert w.shape == o.shape and w.dtype == o.dtype, n
        np.testing.assert_array_equal(o, w, err_msg=n)


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _rotate_half(last: str | int) -> onnx.ModelProto:
    """TorchScript's rotate_half: x[..., d:], x[..., :d] with d = Shape(x)[-1] // 2, x's batch symbolic."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "minus1"], ["w"], axis=0),
             helper.make_node("Div", ["w", "two"], ["d"]), helper.make_node("Unsqueeze", ["d", "ax0"], ["du"]),
             helper.make_node("Slice", ["x", "zero", "du", "minus1u"], ["lo"]),
             helper.make_node("Slice", ["x", "du", "big", "minus1u"], ["hi"]),
             helper.make_node("Neg", ["hi"], ["nhi"]), helper.make_node("Concat", ["nhi", "lo"], ["y"], axis=-1)]
    return _model(nodes, [_vi("x", F32, ["batch", 4, "seq", last])], [_vi("y", F32, ["batch", 4, "seq", last])],
                  [_c("minus1", np.array(-1, np.int64)), _c("two", np.array(2, np.int64)),
                   _c("ax0", np.array([0], np.int64)), _c("zero", np.array([0], np.int64)),
                   _c("minus1u", np.array([-1], np.int64)), _c("big", np.array([2 ** 62], np.int64))])
