"""Pricing shapes vs checking shapes in `npufuse report` (issue 22): the cost model prices at the user's --dim sizes
while the numeric checks run at small ones; and a modeled time resting on shapes no inference could tell (a pad
computed at run time, TF-"same" style) says so instead of printing a confident number."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

import npufuse

FIXTURES = Path(__file__).parent / "fixtures"


def test_report_prices_at_dim_and_checks_at_small_sizes():
    small = npufuse.report(str(FIXTURES / "bert_ts17.onnx"), dims={"batch": 1, "sequence": 256})
    big = npufuse.report(str(FIXTURES / "bert_ts17.onnx"), dims={"batch": 64, "sequence": 256})
    assert big["summary"]["model_check"]["ok"]
    note = next(n for n in big["summary"]["notes"] if n.startswith("checked at"))
    assert "batch=2, sequence=8" in note and "batch=64, sequence=256" in note
    assert big["summary"]["modeled_time_us"]["before"] > small["summary"]["modeled_time_us"]["before"]
    assert "checked at sequence=8, priced at sequence=256" in small["summary"]["notes"][-1]   # batch 1: no smaller


def test_scores_are_priced_with_their_heads_and_batch():
    """BERT's attention scores [batch, 4, seq, seq]: inference at deployment sizes leaves the first two dims
    made up (shape arithmetic through the head split); the graph's own shape knows them, and pricing takes them
    (they were priced as 1: one head of batch 1, whatever --dim batch said)."""
    from npufuse.fusion.costing import CostShapes
    from npufuse.ir.graph import Graph
    from npufuse.prepare.normalize import normalize

    model, types = normalize(onnx.load(str(FIXTURES / "bert_ts17.onnx")), str(FIXTURES))
    g = Graph(model, str(FIXTURES), types)
    shapes = CostShapes(model, {"batch": 64}, types=types)
    assert shapes.shape(g, "/m/encoder/layer.0/attention/self/Softmax_output_0") == (64, 4, 512, 512)


def _computed_pad(height, width) -> onnx.ModelProto:
    """x [1, 8, H, W] -> TF-"same" padding computed from Shape at run time (float Div, Ceil, Max) -> Conv s2 -> Relu."""
    def i64(name, v):
        return numpy_helper.from_array(np.array(v, np.int64), name)

    inits = [numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 8, 3, 3)).astype(np.float32) * .1,
                                     "W"),
             i64("idx", [2, 3]), numpy_helper.from_array(np.array(2.0, np.float32), "s"), i64("si", 2), i64("k", 3),
             i64("one", 1), i64("zero", [0, 0]), i64("two", 2), i64("z0", 0)]
    nodes = [helper.make_node("Shape", ["x"], ["sh"]), helper.make_node("Gather", ["sh", "idx"], ["hw"]),
             helper.make_node("Cast", ["hw"], ["hwf"], to=1), helper.make_node("Div", ["hwf", "s"], ["qf"]),
             helper.make_node("Ceil", ["qf"], ["qc"]), helper.make_node("Cast", ["qc"], ["q"], to=7),
             helper.make_node("Sub", ["q", "one"], ["q1"]), helper.make_node("Mul", ["q1", "si"], ["q2"]),
             helper.make_node("Add", ["q2", "k"], ["q3"]), helper.make_node("Sub", ["q3", "hw"], ["p0"]),
             helper.make_node("Max", ["p0", "z0"], ["p"]), helper.make_node("Div", ["p", "two"], ["pb"]),
             helper.make_node("Sub", ["p", "pb"], ["pe"]),
             helper.make_node("Concat", ["zero", "pb", "zero", "pe"], ["pads"], axis=0),
             helper.make_node("Pad", ["x", "pads"], ["xp"]),
             helper.make_node("Conv", ["xp", "W"], ["y"], strides=[2, 2], kernel_shape=[3, 3]),
             helper.make_node("Relu", ["y"], ["z"])]
    for i, n in enumerate(nodes):
        n.name = f"{n.op_type}_{i}"
    g = helper.make_graph(nodes, "pad", [helper.make_tensor_value_info("x", 1, [1, 8, height, width])],
                          [helper.make_tensor_value_info("z", 1, [1, 16, None, None])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_pads_computed_from_the_input_size_are_folded_at_the_pricing_sizes():
    """The pad amounts follow from H and W alone: at --dim sizes they are constants (ATC, compiling at those sizes,
    folds them too), so every shape is known and the model prices exactly as its static twin."""
    doc = npufuse.report(_computed_pad("height", "width"), dims={"height": 64, "width": 64}, verify=False)
    static = npufuse.report(_computed_pad(64, 64), verify=False)
    assert doc["summary"]["assumed_shapes"]["ops"] == 0 and "priced at size 1" not in doc.render("text")
    assert doc["summary"]["modeled_time_us"] == static["summary"]["modeled_time_us"]
    # a different size gives different pads and a different Conv: the fold is at the pricing sizes, not cached
    other = npufuse.report(_computed_pad("height", "width"), dims={"height": 128, "width": 96}, verify=False)
    assert other["summary"]["modeled_time_us"] == \
        npufuse.report(_computed_pad(128, 96), verify=False)["summary"]["modeled_time_us"]
    assert other["summary"]["modeled_time_us"]["before"] > doc["summary"]["modeled_time_us"]["before"]


def _data_dependent_pad() -> onnx.ModelProto:
    """x [1, 8, H, W] padded by amounts read from a second input at run time: no size of H, W fixes them."""
    m = _computed_pad(64, 64)
    g = m.graph
    pad = next(n for n in g.node if n.op_type == "Pad")
    pad.input[1] = "pads_in"
    g.input.append(helper.make_tensor_value_info("pads_in", onnx.TensorProto.INT64, [8]))
    keep = [n for n in g.node if n.op_type in ("Pad", "Conv", "Relu")]
    del g.node[:]
    g.node.extend(keep)
    return m


def test_a_time_priced_on_unknown_shapes_says_so():
    doc = npufuse.report(_data_dependent_pad(), verify=False)
    a = doc["summary"]["assumed_shapes"]
    assert a["ops"] >= 3 and a["share_pct"] > 50 and {"Pad_14", "Conv_15"} <= set(a["nodes"])
    for fmt in ("text", "markdown", "html"):
        assert "priced at size 1" in doc.render(fmt)
    # the same model with static input shapes: every shape is known, no warning
    static = npufuse.report(_computed_pad(64, 64))
    assert static["summary"]["assumed_shapes"]["ops"] == 0 and "priced at size 1" not in static.render("text")
