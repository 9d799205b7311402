"""GE's concat/split optimize in whole-model pricing (npufuse/fusion/inplace.py): a channel Concat of 4-D tensors
whose inputs but the last have C a multiple of 16, made by different kernels, is no kernel; near-misses stay one."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from npufuse.cost_model import estimate_ops
from npufuse.fusion.costing import CostShapes, model_ops
from npufuse.ir.graph import Graph
from npufuse.npu_model import load_profile
from npufuse.prepare.normalize import normalize


def _two_convs(c1: int, c2: int, *, axis: int = 1, same_producer: bool = False, concat_is_output: bool = False,
               graph_input: bool = False):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((c, 8, 3, 3)).astype(np.float32), f"w{i}")
             for i, c in enumerate((c1, c2))]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "w1"], ["b"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["ra"]), helper.make_node("Relu", ["b"], ["rb"])]
    ins = ["ra", "ra"] if same_producer else (["z", "rb"] if graph_input else ["ra", "rb"])
    nodes.append(helper.make_node("Concat", ins, ["cat"], axis=axis))
    outputs = ["cat"] if concat_is_output else ["y"]
    if not concat_is_output:
        nodes.append(helper.make_node("Relu", ["cat"], ["y"]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 16, 16])]
    if graph_input:
        inputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 16, 16, 16]))
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _concat_kernel(model):
    m, types = normalize(model, None)
    g = Graph(m, None, types)
    ops = model_ops(g, CostShapes(m, {}))
    est = estimate_ops(ops, load_profile("Ascend310P3"))
    return next(k for k in est.kernels if k.op_type == "Concat"), est


def test_an_aligned_channel_concat_of_two_kernels_is_no_kernel():
    k, _ = _concat_kernel(_two_convs(32, 24))      # the last input need not be aligned
    assert k.launches == 0 and k.t_total_us == 0 and k.gm_bytes == 0
    assert "concat optimize" in k.notes[0]


@pytest.mark.parametrize("case", [
    dict(c1=24, c2=32),                      # a first input's C not a multiple of 16
    dict(c1=32, c2=32, axis=2),              # not the channel axis
    dict(c1=32, c2=32, same_producer=True),  # every input from one node
    dict(c1=32, c2=32, concat_is_output=True),
    dict(c1=32, c2=32, graph_input=True),    # an input (C 16, aligned) is a graph input
])
def test_near_misses_stay_a_kernel(case):
    k, _ = _concat_kernel(_two_convs(**case))
    assert k.launches == 1 and k.t_total_us > 0
