"""The TopK-first router (GPT-OSS, Aria, Cohere2-MoE): `values, experts = topk(logits, k); weights =
softmax(values)` -> npufuse.MoeGatingTopKSoftmax with topk_first=1; near-misses that must not fuse; numerics
against onnxruntime; the kernel (MoeGatingTopKSoftmaxV2 renorm=1, 910B only) and the ATC form."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from builders import with_output_shapes
from onnx import TensorProto, helper, numpy_helper

from npufuse.emit.atc.evaluator import run_atc_model
from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.npu_model.spec import load_profile
from npufuse.patterns.moe_gating import MOE_GATING, moe_gating_reference, moe_gating_topk_first_reference
from npufuse.verify.compare import compare

T, E, K = 12, 8, 2
F = TensorProto.FLOAT


def _router(*, opset: int = 17, dtype=np.float32, softmax_axis: int = -1, largest: int = 1, sorted_: int = 1,
            values_reader: bool = False, k_const: bool = True, shape=(T, E)) -> onnx.ModelProto:
    """logits [T, E] -> TopK(k) -> (values, experts); Softmax(values) -> weights."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [numpy_helper.from_array(np.array([K], np.int64), "k")] if k_const else []
    nodes = [helper.make_node("TopK", ["logits", "k"], ["top", "experts"], axis=-1, largest=largest,
                              sorted=sorted_),
             helper.make_node("Softmax", ["top"], ["weights"], axis=softmax_axis)]
    outs = [helper.make_tensor_value_info("weights", elem, None),
            helper.make_tensor_value_info("experts", TensorProto.INT64, None)]
    if values_reader:
        nodes.append(helper.make_node("Neg", ["top"], ["top_neg"]))
        outs.append(helper.make_tensor_value_info("top_neg", elem, None))
    for i, n in enumerate(nodes):
        n.name = f"{n.op_type}_{i}"
    inputs = [helper.make_tensor_value_info("logits", elem, list(shape))]
    if not k_const:
        inputs.append(helper.make_tensor_value_info("k", TensorProto.INT64, [1]))
    g = helper.make_graph(nodes, "router", inputs, outs, inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                                                ir_version=IR_VERSION))


def _feeds(model: onnx.ModelProto, seed: int = 3) -> dict[str, np.ndarray]:
    t = model.graph.input[0].type.tensor_type
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal([d.dim_value for d in t.shape.dim]) * 2).astype(
        helper.tensor_dtype_to_np_dtype(t.elem_type))
    feeds = {"logits": x}
    if len(model.graph.input) > 1:
        feeds["k"] = np.array([K], np.int64)
    return feeds


def _gating(res) -> list[onnx.NodeProto]:
    return [n for n in res.model.graph.node if n.domain == "npufuse" and n.op_type == "MoeGatingTopKSoftmax"]


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("opset", [11, 13, 17, 20])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_topk_first_router_fuses_and_computes_what_the_model_does(opset, dtype):
    model = _router(opset=opset, dtype=dtype)
    res = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend910B2")))
    assert not res.rolled_back and all(r.check is not None and r.check.ok for r in res.applied)
    [node] = _gating(res)
    assert _attrs(node) == {"k": K, "renormalize": 0, "topk_first": 1}
    assert [r.match.kind for r in res.applied] == ["npufuse.MoeGatingTopKSoftmax[topk_first]"]
    assert not unaccounted(res)
    for seed in range(3):
        feeds = _feeds(model, seed)
        want, got = run(model, feeds), run(res.model, feeds)
        assert compare("weights", got["weights"], want["weights"]).ok
        np.testing.assert_array_equal(got["experts"], want["experts"])


@pytest.mark.parametrize("kw, reason", [
    ({"softmax_axis": 0}, "softmax-axis"),
    ({"largest": 0}, "topk-smallest"),
    ({"sorted_": 0}, "topk-unsorted"),
    ({"values_reader": True}, "values-read-elsewhere"),
    ({"k_const": False}, "k-not-constant"),
])
def test_near_misses_do_not_fuse_and_name_the_softmax(kw, reason):
    model = _router(**kw)
    res = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend910B2")))
    assert not _gating(res)
    refusals = {r.reason: r for r in res.refusals if r.pattern == "moe_gating"}
    assert reason in refusals and "Softmax_1" in refusals[reason].nodes
    assert not unaccounted(res)


def test_reference_is_the_decomposition_and_differs_from_the_other_order():
    model = _router()
    for seed in range(4):
        feeds = _feeds(model, seed)
        want = run(model, feeds)
        got = moe_gating_topk_first_reference(feeds["logits"], K)
        assert compare("weights", got[0], want["weights"]).ok
        np.testing.assert_array_equal(got[1], want["experts"])
        # the softmax-first router without renormalisation gives other weights: a mix-up would be caught
        other = moe_gating_reference(feeds["logits"], K, False)
        assert not compare("weights", other[0], want["weights"]).ok
    # the function body onnxruntime runs is the same computation
    x = _feeds(model)["logits"]
    node, fn = MOE_GATING.make_node(["logits"], ["weights", "experts"], "g", {"k": K, "renormalize": 0,
                                                                            "topk_first": 1}, 17, F)
    g = helper.make_graph([node], "f", [helper.make_tensor_value_info("logits", F, [T, E])],
                          [helper.make_tensor_value_info("weights", F, None),
                           helper.make_tensor_value_info("experts", TensorProto.INT64, None)])
    fm = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("npufuse", 1)],
                           functions=[fn], ir_version=IR_VERSION)
    body = run(fm, {"logits": x})
    assert compare("weights", body["weights"], moe_gating_topk_first_reference(x, K)[0]).ok


def test_kernel_is_v2_renorm_on_910b_and_refused_on_310p():
    model = _router(dtype=np.float16, shape=(T, 16))
    b = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend910B2"), verify=False))
    [rec] = [r for r in b.records if r.match.pattern == "moe_gating"]
    kernel = rec.to_dict()["ascend_kernel"]
    assert kernel["op"] == "MoeGatingTopKSoftmaxV2" and kernel["attrs"]["renorm"] == 1
    p = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend310P3"), verify=False))
    [rec] = [r for r in p.records if r.match.pattern == "moe_gating"]
    assert rec.status != "applied" and "MoeGatingTopKSoftmaxV2" in (rec.to_dict().get("reason") or "")


def test_atc_form_is_the_plugin_then_the_renormalisation(tmp_path):
    import npufuse

    model = _router(dtype=np.float16, shape=(T, 16))
    res = npufuse.optimize(model, target="Ascend910B2", emit="atc", verify=True)
    ops = [n.op_type for n in res.atc.model.graph.node]
    assert "NPUMoeGatingTopKSoftmax" in ops and "Div" in ops and "TopK" not in ops
    feeds = _feeds(model)
    want = run(model, feeds)
    got = dict(zip([o.name for o in res.atc.model.graph.output], run_atc_model(res.atc.model, feeds)))
    assert compare("weights", got["weights"], want["weights"]).ok
    np.testing.assert_array_equal(got["experts"], want["experts"])
