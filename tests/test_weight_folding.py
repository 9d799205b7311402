"""Weights computed from weights (NFNet's scaled weight standardisation: mean and variance over each conv weight)
are computed once by normalize, not on every inference, where the weights they read are embedded in the model and
within a byte budget; weights in an external data file stay references (a 7B model's are never read to fold)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

import npufuse
from npufuse.ir.runtime import run
from npufuse.prepare import normalize as normalize_module

COUT, CIN, K = 128, 64, 3      # 73728 weights: above the small-constant limit (65536 elements)


def _ws_conv() -> onnx.ModelProto:
    """x -> Conv(x, standardise(W) * gain) -> Relu, the standardisation written out over W (timm's ScaledStdConv2d
    as exported: Reshape -> ReduceMean -> Sub -> Mul -> ReduceMean -> Add -> Sqrt -> Div -> Reshape -> Mul)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((COUT, CIN, K, K)).astype(np.float32)
    gain = (rng.random(COUT) + 0.5).astype(np.float32) * (CIN * K * K) ** -0.5
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([1, COUT, -1], np.int64), "shp"),
             numpy_helper.from_array(np.array(w.shape, np.int64), "wshape"),
             numpy_helper.from_array(np.zeros(COUT, np.float32), "b"),
             numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
             numpy_helper.from_array(gain.reshape(COUT, 1, 1, 1), "g4")]
    nodes = [helper.make_node("Reshape", ["W", "shp"], ["w3"]),
             helper.make_node("ReduceMean", ["w3"], ["mu"], axes=[2], keepdims=1),
             helper.make_node("Sub", ["w3", "mu"], ["d"]), helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["var"], axes=[2], keepdims=1),
             helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["wn"]), helper.make_node("Reshape", ["wn", "wshape"], ["w4"]),
             helper.make_node("Mul", ["w4", "g4"], ["ws"]),
             helper.make_node("Conv", ["x", "ws", "b"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y"], ["z"])]
    for i, n in enumerate(nodes):
        n.name = f"{n.op_type}_{i}"
    g = helper.make_graph(nodes, "ws", [helper.make_tensor_value_info("x", 1, ["batch", CIN, 16, 16])],
                          [helper.make_tensor_value_info("z", 1, ["batch", COUT, 16, 16])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((2, CIN, 16, 16)).astype(np.float32)}


def test_a_standardised_weight_is_computed_once(tmp_path):
    path = tmp_path / "ws.onnx"
    onnx.save(_ws_conv(), path)
    r = npufuse.optimize(str(path))
    assert [n.op_type for n in r.model.graph.node] == ["FusedConv"]
    assert r.ok and r.verified
    want = run(_ws_conv(), _feeds())["z"]
    np.testing.assert_allclose(run(r.model, _feeds())["z"], want, rtol=1e-4, atol=1e-4)
    doc = npufuse.report(str(path), verify=False)
    assert doc["summary"]["unaccounted"] == [] and doc["summary"]["applied_by_kind"] == {"FusedConv[Relu]": 1}


def test_weights_in_a_data_file_stay_references(tmp_path):
    path = tmp_path / "ws.onnx"
    onnx.save(_ws_conv(), path, save_as_external_data=True, location="ws.onnx.data", size_threshold=1024)
    r = npufuse.optimize(str(path))
    ops = [n.op_type for n in r.model.graph.node]
    assert "FusedConv" in ops and len(ops) > 1      # the standardisation still runs: W was not read to fold it
    assert r.ok and r.verified


def test_the_budget_bounds_what_is_folded(tmp_path, monkeypatch):
    monkeypatch.setattr(normalize_module, "_MAX_MATERIALISED_WEIGHT_BYTES", 1 << 16)
    path = tmp_path / "ws.onnx"
    onnx.save(_ws_conv(), path)
    ops = [n.op_type for n in npufuse.optimize(str(path), verify=False).model.graph.node]
    assert len(ops) > 1


def test_a_generated_weight_is_not_expanded_into_the_file(tmp_path):
    """A weight a ConstantOfShape generates (the onnx model zoo's weight-free graphs) stays a node: materialising it
    would turn a few bytes of shape into the whole tensor in the written file."""
    m = _ws_conv()
    g = m.graph
    keep = [t for t in g.initializer if t.name != "W"]
    del g.initializer[:]
    g.initializer.extend(keep + [numpy_helper.from_array(np.array([COUT, CIN, K, K], np.int64), "wdims")])
    g.node.insert(0, helper.make_node("ConstantOfShape", ["wdims"], ["W"], name="gen",
                                      value=numpy_helper.from_array(np.array([0.01], np.float32))))
    path = tmp_path / "gen.onnx"
    onnx.save(m, path)
    out = tmp_path / "gen.npufuse.onnx"
    r = npufuse.optimize(str(path), output=str(out))
    assert "ConstantOfShape" in [n.op_type for n in r.model.graph.node]
    assert out.stat().st_size < COUT * CIN * K * K * 4 // 4
