"""The verifier itself: it must not be fooled by NaN, must feed inputs that exercise the computation, and
must refuse to judge a model it cannot run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import WrongEpsilonLayerNorm, conv_chain, with_output_shapes
from onnx import TensorProto, helper, numpy_helper

import npufuse
from npufuse.errors import InputError
from npufuse.fusion.engine import APPLIED, ROLLED_BACK, OptimizeOptions, optimize
from npufuse.ir.graph import Graph
from npufuse.guard.stats import measure
from npufuse.ir.runtime import run
from npufuse.verify.compare import compare
from npufuse.verify.inputs import model_inputs


def test_a_reference_that_is_mostly_nan_is_not_evidence() -> None:
    want = np.full((4, 8), np.nan, dtype=np.float32)
    c = compare("y", want.copy(), want)
    assert not c.ok
    assert "NaN" in c.detail
    some = np.ones((4, 8), dtype=np.float32)
    some[0, 0] = np.nan
    assert compare("y", some.copy(), some).ok  # a stray NaN on both sides is still a match


def _log_then_layernorm() -> onnx.ModelProto:
    """x -> Log -> decomposed LayerNorm (opset 14): Log needs positive inputs to mean anything."""
    eps = numpy_helper.from_array(np.array(1e-5, np.float32), "eps")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes = [
        helper.make_node("Log", ["x"], ["lx"], name="log"),
        helper.make_node("ReduceMean", ["lx"], ["mean"], name="rm1", axes=[-1]),
        helper.make_node("Sub", ["lx", "mean"], ["d"], name="sub"),
        helper.make_node("Pow", ["d", "two"], ["sq"], name="pow"),
        helper.make_node("ReduceMean", ["sq"], ["var"], name="rm2", axes=[-1]),
        helper.make_node("Add", ["var", "eps"], ["ve"], name="add"),
        helper.make_node("Sqrt", ["ve"], ["std"], name="sqrt"),
        helper.make_node("Div", ["d", "std"], ["y"], name="div"),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [eps, two])
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)], ir_version=10))


def test_differences_below_the_smallest_normal_are_not_drift() -> None:
    # An output that is all subnormal (SiLU of a large negative pre-activation): two correct kernels differ by whole
    # subnormal steps there, far above atol_scale * max|want|.
    want = np.array([8.4e-45, -5.6e-45, 0.0, 1.4e-45], np.float32)
    got = want.copy()
    got[0] = np.float32(5.6e-45)
    assert compare("y", got, want).ok
    assert measure("y", got, want).ok           # `npufuse check` judges it the same way
    # A normal value still counts in full, however small, on either side.
    tiny = np.array([1e-30, 2e-30], np.float32)
    assert not compare("y", tiny * np.float32(1.01), tiny).ok
    assert not measure("y", tiny * np.float32(1.01), tiny).ok
    assert not compare("y", np.array([2e-38], np.float32), np.array([0.0], np.float32)).ok
    half = np.array([1e-5, 1e-2], np.float16)   # float16's smallest normal is 6.1e-5: 1e-5 is subnormal
    assert compare("y", np.array([2e-5, 1e-2], np.float16), half).ok
    assert not compare("y", np.array([1e-5, 1.1e-2], np.float16), half).ok


def test_a_rewrite_whose_output_is_all_subnormal_is_not_rolled_back() -> None:
    # Conv -> Sigmoid with pre-activations near -100: the sigmoid is subnormal everywhere, and FusedConv's body
    # rounds it differently from the standalone Sigmoid by a few subnormal steps. Found on EfficientNet / MobileViT
    # (SiLU after the squeeze-excite reduce), where the rewrite was rolled back as drift.
    model = conv_chain(bn=False, act="Sigmoid")
    for t in model.graph.initializer:
        if t.name == "B":
            t.CopyFrom(numpy_helper.from_array(np.full(6, -100.0, np.float32), "B"))
        elif t.name == "W":
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * np.float32(0.01), "W"))
    res = optimize(model, options=OptimizeOptions())
    assert [r.status for r in res.records] == [APPLIED], [r.reason for r in res.records]
    assert [n.op_type for n in res.model.graph.node] == ["FusedConv"]


def _noisy(extra_node: bool) -> onnx.ModelProto:
    """y = x + RandomUniformLike(x), without a seed (ViT-MAE's patch shuffle noise); with `extra_node` an unrelated
    Relu -> Identity branch comes first, as a model differs from its optimized copy elsewhere than at the draw."""
    nodes = [helper.make_node("RandomUniformLike", ["x"], ["r"], name="noise"),
             helper.make_node("Add", ["x", "r"], ["y"], name="add")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 5])]
    if extra_node:
        nodes = [helper.make_node("Relu", ["x"], ["x0"], name="relu")] + nodes + \
            [helper.make_node("Identity", ["x0"], ["z"], name="id")]
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 5]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5])], outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_an_unseeded_random_op_draws_alike_in_both_models() -> None:
    """Unseeded, onnxruntime drew different numbers for the same RandomUniformLike in two models that differ
    elsewhere, so `npufuse check` called ViT-MAE's optimized model drift (exit 1). Verification seeds the draw; the
    model itself is left unseeded."""
    feeds = {"x": np.zeros((4, 5), np.float32)}
    plain, other = _noisy(False), _noisy(True)
    want, got = run(plain, feeds)["y"], run(other, feeds)["y"]
    assert want.std() > 0.1                                     # it is noise, not a constant
    np.testing.assert_array_equal(got, want)
    assert not any(a.name == "seed" for n in plain.graph.node for a in n.attribute)
    assert npufuse.check(plain, other).ok


def test_inputs_of_log_are_positive_so_a_wrong_rewrite_is_caught() -> None:
    model = _log_then_layernorm()
    feeds = model_inputs(Graph(model), seed=0)
    assert (feeds["x"] > 0).all()
    res = optimize(model, options=OptimizeOptions(patterns=[WrongEpsilonLayerNorm()]))
    assert [r.status for r in res.records] == [ROLLED_BACK]
    assert res.applied == []


def test_overridable_initializer_inputs_keep_their_stored_values() -> None:
    model = conv_chain(act="Relu")
    # IR >= 4: an initializer also listed as a graph input may be overridden, so it is not a constant;
    # the verifier must still run it with its stored value, not a random one (a negative variance).
    model.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in model.graph.initializer)
    feeds = model_inputs(Graph(model), seed=0)
    assert set(feeds) == {"X"}


def test_a_model_onnxruntime_cannot_run_is_bad_input(tmp_path: Path) -> None:
    node = helper.make_node("Frobnicate", ["x"], ["y"], domain="acme")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme", 1)],
                              ir_version=10)
    with pytest.raises(InputError, match="cannot run the input model"):
        optimize(model, options=OptimizeOptions())
    p = tmp_path / "custom.onnx"
    onnx.save(model, p)
    r = subprocess.run([sys.executable, "-m", "npufuse", "optimize", str(p), "-o", str(tmp_path / "o.onnx")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "--no-verify" in r.stderr
    r = subprocess.run([sys.executable, "-m", "npufuse", "optimize", str(p), "-o", str(tmp_path / "o.onnx"),
                        "--no-verify"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
