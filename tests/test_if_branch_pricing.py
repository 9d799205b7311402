"""Whole-model pricing through an If (fusion/branches.py): optimum's merged decoder holds the whole decoder in the two
branches of one If (use_cache), and is priced as its costlier branch, as report, optimize and calibrate all do; a
model without an If is priced as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import npufuse
from npufuse.cost_model import estimate_ops
from npufuse.fusion.branches import ops_through_branches
from npufuse.fusion.costing import CostShapes, model_ops
from npufuse.ir.graph import Graph
from npufuse.npu_model.spec import load_profile
from npufuse.prepare.normalize import normalize

FIXTURES = Path(__file__).parent / "fixtures"
P310 = load_profile("Ascend310P3")


def test_the_merged_whisper_decoder_costs_its_costlier_branch():
    doc = npufuse.report(str(FIXTURES / "optimum" / "whisper_decoder_merged.onnx"), target="Ascend310P3", verify=False)
    s = doc["summary"]
    [choice] = s["if_branches"]
    assert choice["priced"] in ("then_branch", "else_branch") and choice["time_us"] >= choice["other_us"] > 0
    # the decoder's kernels, not one generic If: dozens of launches and the branch's time
    assert doc["model_estimate"]["after"]["launches"] > 20
    assert abs(s["modeled_time_us"]["after"] - choice["time_us"]) < 0.05 * choice["time_us"] + 20
    assert s["modeled_time_us"]["before"] > s["modeled_time_us"]["after"]


def _if_model(heavy_in_then: bool) -> onnx.ModelProto:
    """y = If(c) { x @ W (512x512) } else { x + 1 }: one branch a MatMul, the other an Add."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((512, 512)).astype(np.float32), "W")
    heavy = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["yb"])], "heavy", [],
                              [helper.make_tensor_value_info("yb", TensorProto.FLOAT, [256, 512])])
    light = helper.make_graph([helper.make_node("Add", ["x", "one"], ["ya"])], "light", [],
                              [helper.make_tensor_value_info("ya", TensorProto.FLOAT, [256, 512])])
    then_b, else_b = (heavy, light) if heavy_in_then else (light, heavy)
    g = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then_b, else_branch=else_b, name="the_if")],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 512]),
                                helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 512])],
                          [w, numpy_helper.from_array(np.array(1.0, np.float32), "one")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _priced(model: onnx.ModelProto):
    norm, types = normalize(model)
    g = Graph(norm, None, types)
    choices = []
    ops = ops_through_branches(g, CostShapes(norm, {}, types=types), P310, None, {}, choices)
    return ops, choices, g


def test_either_branch_order_prices_the_matmul_branch():
    for heavy_in_then in (True, False):
        ops, [choice], _ = _priced(_if_model(heavy_in_then))
        assert [op.op_type for op in ops] == ["MatMul"]
        assert choice.node == "the_if" and choice.priced == ("then_branch" if heavy_in_then else "else_branch")
        assert choice.time_us > choice.other_us


def test_a_model_without_an_if_is_priced_as_model_ops_prices_it():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 512])
    m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 512])]),
                          opset_imports=[helper.make_opsetid("", 17)])
    ops, choices, g = _priced(m)
    assert choices == [] and [o.op_type for o in ops] == [o.op_type for o in model_ops(g, CostShapes(g.model, {}))]
    assert estimate_ops(ops, P310).time_us > 0
