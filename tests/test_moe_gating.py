"""The MoE router (patterns/moe_gating.py): Softmax over the router logits -> TopK [-> w / sum(w)] as one
npufuse.MoeGatingTopKSoftmax, in both exporters' forms (the tiny Mixtral and Qwen2-MoE census fixtures, fp32 and
fp16; hand-built graphs at the opsets where TopK's k and ReduceSum's axes change from attribute to input); the
near-misses that must not fuse, each naming the router's Softmax so none is left unaccounted; numerics against
onnxruntime on the original graph (renormalised and not, so a rewrite that adds or drops the division is caught);
the Ascend kernel each becomes; and the ATC form, where the router is the NPUMoeGatingTopKSoftmax plugin (k written
as an INT, int32 indices cast back, the renormalisation after it in standard ops)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import with_output_shapes
from onnx import TensorProto, helper, numpy_helper

import npufuse
from npufuse.emit.atc.evaluator import run_atc_model
from npufuse.emit.atc.plugins import PLUGINS, check_node
from npufuse.emit.atc.reference_kernels import KERNELS
from npufuse.emit.atc.regions import Namer, PluginRegion, StaysStandard, Values, map_region
from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.modelio import load_model
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.npu_model import ascend_kernels as ak
from npufuse.npu_model.spec import load_profile
from npufuse.patterns import PATTERNS
from npufuse.patterns.moe_gating import MOE_GATING, moe_gating_reference
from npufuse.verify.compare import compare

FIXTURES = Path(__file__).parent / "fixtures"
T, E, K = 12, 8, 2      # tokens, experts, top k
F, H = TensorProto.FLOAT, TensorProto.FLOAT16


# ---- graphs ------------------------------------------------------------------------------------------------

def _router(*, opset: int = 17, k_form: str = "constant", renorm: bool = False, dtype=np.float32,
            casts: bool = False, softmax_axis: int | None = -1, topk_axis: int = -1, largest: int = 1,
            sorted_: int = 1, probs_reader: bool = False, values_reader: bool = False, shape=(T, E), k: int = K,
            indices_out: bool = True, axes_form: str | None = None) -> onnx.ModelProto:
    """logits [T, E] -> [Cast up] -> Softmax -> TopK -> [ReduceSum + Div] -> [Cast back] -> (weights, experts)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    outputs = []
    x = "logits"
    if casts:     # an fp16 model's router in float32, as `softmax(logits.float())` exports
        nodes.append(helper.make_node("Cast", [x], ["logits32"], to=F))
        x = "logits32"
    work = F if casts else elem
    sm = {} if softmax_axis is None else {"axis": softmax_axis}
    nodes.append(helper.make_node("Softmax", [x], ["probs"], **sm))
    flags = {"largest": largest, "sorted": sorted_} if opset >= 11 else {}
    topk_outs = ["top", "experts" if indices_out else "unread_experts"]
    if opset < 10:
        nodes.append(helper.make_node("TopK", ["probs"], topk_outs, axis=topk_axis, k=k))
    else:
        if k_form == "constant":
            nodes.append(helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array([k],
                                                                                                         np.int64))))
        elif k_form == "initializer":
            inits.append(numpy_helper.from_array(np.array([k], np.int64), "k"))
        nodes.append(helper.make_node("TopK", ["probs", "k"], topk_outs, axis=topk_axis, **flags))
    w = "top"
    if renorm:
        if (axes_form or ("input" if opset >= 13 else "attribute")) == "input":
            inits.append(numpy_helper.from_array(np.array([-1], np.int64), "axes"))
            nodes.append(helper.make_node("ReduceSum", ["top", "axes"], ["total"], keepdims=1))
        else:
            nodes.append(helper.make_node("ReduceSum", ["top"], ["total"], axes=[-1], keepdims=1))
        nodes.append(helper.make_node("Div", ["top", "total"], ["norm"]))
        w = "norm"
    if casts:
        nodes.append(helper.make_node("Cast", [w], ["weights"], to=elem))
    else:
        nodes.append(helper.make_node("Identity", [w], ["weights"]))
    if probs_reader:
        nodes.append(helper.make_node("Neg", ["probs"], ["aux"]))
        outputs.append(helper.make_tensor_value_info("aux", work, None))
    if values_reader:
        nodes.append(helper.make_node("Neg", ["top"], ["top_neg"]))
        outputs.append(helper.make_tensor_value_info("top_neg", work, None))
    for i, n in enumerate(nodes):
        n.name = f"{n.op_type}_{i}"
    inputs = [helper.make_tensor_value_info("logits", elem, list(shape))]
    if k_form == "input":
        inputs.append(helper.make_tensor_value_info("k", TensorProto.INT64, [1]))
    outs = [helper.make_tensor_value_info("weights", elem, None)]
    if indices_out:
        outs.append(helper.make_tensor_value_info("experts", TensorProto.INT64, None))
    graph = helper.make_graph(nodes, "router", inputs, outs + outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    return with_output_shapes(model)


def _feeds(model: onnx.ModelProto, seed: int = 3) -> dict[str, np.ndarray]:
    t = model.graph.input[0].type.tensor_type
    shape = [d.dim_value for d in t.shape.dim]
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2).astype(helper.tensor_dtype_to_np_dtype(t.elem_type))
    feeds = {"logits": x}
    if len(model.graph.input) > 1:
        feeds["k"] = np.array([K], np.int64)
    return feeds


def _optimize(model: onnx.ModelProto, **kw):
    res = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend910B2"), **kw))
    assert not res.rolled_back, [(r.match.kind, r.reason) for r in res.rolled_back]
    assert all(r.check is not None and r.check.ok for r in res.applied)
    feeds = _feeds(model)
    want, got = run(model, feeds), run(res.model, feeds)
    for name in want:
        c = compare(name, got[name], want[name])
        assert c.ok, f"{name}: {c.detail}"
    return res


def _gating(res) -> list[onnx.NodeProto]:
    return [n for n in res.model.graph.node if n.domain == "npufuse" and n.op_type == "MoeGatingTopKSoftmax"]


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _near_misses(res) -> dict[str, str]:
    return {r.reason: r.node for r in res.refusals if r.pattern == "moe_gating"}


# ---- real exports ------------------------------------------------------------------------------------------

EXPORTS = [f"{fam}_{exp}.onnx" for fam in ("mixtral", "qwen2_moe", "mixtral_fp16") for exp in ("ts17", "dynamo")]


@pytest.mark.parametrize("file", EXPORTS)
def test_both_exporters_routers_fuse_with_the_whole_model_verified(file: str) -> None:
    res = optimize(load_model(FIXTURES / file), str(FIXTURES), OptimizeOptions(spec=load_profile("Ascend910B2")))
    assert not res.rolled_back and res.model_check is not None and res.model_check.ok
    fused = _gating(res)
    assert len(fused) == 2                                          # one router per layer
    g = {v.name: v.type.tensor_type.elem_type for v in (*res.model.graph.value_info, *res.model.graph.input)}
    producers = {o: n for n in res.model.graph.node for o in n.output}
    for node in fused:
        a = _attrs(node)
        assert a["k"] == 2 and a["renormalize"] == (0 if "qwen2_moe" in file else 1)    # Mixtral renormalises
        if "fp16" in file:   # the router in float32: the fused op reads the exporter's Cast up, which stays
            assert producers[node.input[0]].op_type == "Cast" and g.get(node.input[0], F) == F
    rec = next(r for r in res.applied if r.match.pattern == "moe_gating")
    assert rec.decision is not None and rec.decision.fuse and rec.decision.gain_us > 0
    assert rec.ascend_kernel["op"] == ("MoeGatingTopKSoftmax" if "qwen2_moe" in file else "MoeGatingTopKSoftmaxV2")
    assert rec.ascend_kernel["available"] and rec.ascend_kernel["problem"] is None
    # no router Softmax left, and none unaccounted
    assert not [n for n in res.model.graph.node if n.op_type == "Softmax"
                and any(c.op_type == "TopK" for c in res.model.graph.node if n.output[0] in c.input)]
    assert not [a for a in unaccounted(res) if a.op_type == "Softmax"]


def test_fixture_routers_reach_the_plugin_in_the_atc_form(tmp_path) -> None:
    out = tmp_path / "m.atc.onnx"
    r = npufuse.optimize(str(FIXTURES / "mixtral_ts17.onnx"), output=str(out), emit="atc")
    model = onnx.load(str(out))
    plugins = [n for n in model.graph.node if n.op_type == "NPUMoeGatingTopKSoftmax"]
    assert len(plugins) == 2 and all(n.domain == "npu" for n in plugins)
    assert r.report["atc"]["counts"].get("plugin:MoeGatingTopKSoftmax") == 2
    assert r.atc_check is not None and r.atc_check.ok


# ---- hand-built forms --------------------------------------------------------------------------------------

@pytest.mark.parametrize("opset, k_form, renorm", [(17, "constant", True), (17, "constant", False),
                                                   (20, "initializer", True), (13, "initializer", False),
                                                   (11, "constant", True), (9, "attribute", True),
                                                   (7, "attribute", False)])
def test_router_fuses_at_every_opset_form(opset: int, k_form: str, renorm: bool) -> None:
    res = _optimize(_router(opset=opset, k_form=k_form, renorm=renorm))
    (node,) = _gating(res)
    assert _attrs(node) == {"k": K, "renormalize": int(renorm)}
    left = {n.op_type for n in res.model.graph.node}
    assert not left & {"Softmax", "TopK", "ReduceSum", "Div"}
    assert node.input[0] == "logits" and list(node.output) == ["norm" if renorm else "top", "experts"]


def test_renormalisation_with_its_axes_as_an_attribute_at_opset_11() -> None:
    (node,) = _gating(_optimize(_router(opset=11, renorm=True, axes_form="attribute")))
    assert _attrs(node)["renormalize"] == 1


def test_fp16_router_computed_in_float32_keeps_its_casts() -> None:
    res = _optimize(_router(dtype=np.float16, casts=True, renorm=True))
    (node,) = _gating(res)
    assert node.input[0] == "logits32"                      # the Cast up stays outside, the op runs in float32
    assert [n.op_type for n in res.model.graph.node if n.domain == ""] == ["Cast", "Cast"]


def test_fp16_router_without_casts() -> None:
    (node,) = _gating(_optimize(_router(dtype=np.float16, renorm=True)))
    assert _attrs(node)["renormalize"] == 1


def test_3d_logits_and_unread_indices() -> None:
    res = _optimize(_router(shape=(2, 6, E), indices_out=False, k=3))
    (node,) = _gating(res)
    assert list(node.output) == ["top", "unread_experts"]   # the op always writes its indices
    assert _attrs(node)["k"] == 3


def test_top_values_read_elsewhere_leave_the_renormalisation_outside() -> None:
    res = _optimize(_router(renorm=True, values_reader=True))
    (node,) = _gating(res)
    assert _attrs(node)["renormalize"] == 0 and node.output[0] == "top"
    assert {"ReduceSum", "Div"} <= {n.op_type for n in res.model.graph.node}


@pytest.mark.parametrize("kw, reason", [
    ({"softmax_axis": 0}, "softmax-axis"),
    ({"opset": 11, "softmax_axis": None, "shape": (2, 6, E)}, "softmax-axis"),    # opset < 13: default axis 1
    ({"topk_axis": 0}, "topk-axis"),
    ({"largest": 0}, "topk-smallest"),
    ({"sorted_": 0}, "topk-unsorted"),
    ({"k_form": "input"}, "k-not-constant"),
    ({"probs_reader": True}, "probs-read-elsewhere"),
])
def test_near_misses_do_not_fuse_and_name_the_router(kw: dict, reason: str) -> None:
    model = _router(**kw)
    res = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend910B2")))
    assert not _gating(res)
    assert reason in _near_misses(res), [r.to_dict() for r in res.refusals]
    refusal = next(r for r in res.refusals if r.pattern == "moe_gating")
    assert "Softmax_" + str(1 if kw.get("casts") else 0) in refusal.nodes     # the router's Softmax is named
    assert not [a for a in unaccounted(res) if a.op_type == "Softmax"]


def test_opset_below_13_softmax_over_the_last_of_two_axes_fuses() -> None:
    """Softmax-11's default axis 1 on [T, E] is the last axis: the router."""
    (node,) = _gating(_optimize(_router(opset=11, softmax_axis=None)))
    assert _attrs(node)["k"] == K


def test_a_sigmoid_router_is_named_not_fused() -> None:
    """DeepSeek-style: TopK over sigmoid scores plus a correction bias. Named (sigmoid-scores) with its Sigmoid, so
    the Sigmoid is accounted for."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Sigmoid", ["logits"], ["scores"], name="sigmoid"),
             helper.make_node("Add", ["scores", "bias"], ["choice"], name="bias_add"),
             helper.make_node("TopK", ["choice", "k"], ["top", "experts"], name="topk", axis=-1)]
    inits = [numpy_helper.from_array(rng.standard_normal(E).astype(np.float32), "bias"),
             numpy_helper.from_array(np.array([K], np.int64), "k")]
    g = helper.make_graph(nodes, "r", [helper.make_tensor_value_info("logits", F, [T, E])],
                          [helper.make_tensor_value_info("experts", TensorProto.INT64, None)], inits)
    model = with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                                 ir_version=IR_VERSION))
    res = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend910B2")))
    assert not _gating(res)
    assert _near_misses(res).get("sigmoid-scores") == "sigmoid"
    assert not unaccounted(res)


def test_a_topk_not_over_a_softmax_is_not_a_router() -> None:
    nodes = [helper.make_node("TopK", ["logits", "k"], ["top", "experts"], name="topk", axis=-1)]
    g = helper.make_graph(nodes, "r", [helper.make_tensor_value_info("logits", F, [T, E])],
                          [helper.make_tensor_value_info("top", F, None)],
                          [numpy_helper.from_array(np.array([K], np.int64), "k")])
    model = with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                                 ir_version=IR_VERSION))
    res = optimize(model, options=OptimizeOptions(verify=False))
    assert not _gating(res) and not _near_misses(res)


def test_pattern_is_registered_in_phase_zero() -> None:
    p = next(p for p in PATTERNS if p.name == "moe_gating")
    assert p.phase == 0 and p.anchor_ops == {"TopK"} and p.fused_ops == (MOE_GATING,)


# ---- numerics ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_reference_kernel_matches_onnxruntime_on_the_decomposition(renorm: bool, dtype) -> None:
    model = _router(renorm=renorm, dtype=dtype)
    for seed in range(4):
        feeds = _feeds(model, seed)
        want = run(model, feeds)
        got = moe_gating_reference(feeds["logits"], K, renorm)
        assert compare("weights", got[0], want["weights"]).ok
        np.testing.assert_array_equal(got[1], want["experts"])


def test_the_numeric_check_catches_a_wrong_renormalisation() -> None:
    """The per-rewrite comparison can fail: the kernel with renormalisation flipped is far outside tolerance on
    the renormalised router, and the body run by onnxruntime agrees with the kernel, not with the flip."""
    model = _router(renorm=True)
    feeds = _feeds(model)
    want = run(model, feeds)
    right = moe_gating_reference(feeds["logits"], K, True)
    wrong = moe_gating_reference(feeds["logits"], K, False)
    assert compare("weights", right[0], want["weights"]).ok
    assert not compare("weights", wrong[0], want["weights"]).ok
    # the fused model's function body, built with renormalize=0, would differ too
    node, fn = MOE_GATING.make_node(["logits"], ["weights", "experts"], "n", {"k": K, "renormalize": 0}, 17, F)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("logits", F, [T, E])],
                          [helper.make_tensor_value_info("weights", F, [T, K]),
                           helper.make_tensor_value_info("experts", TensorProto.INT64, [T, K])])
    flipped = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("npufuse", 1)],
                                functions=[fn], ir_version=IR_VERSION)
    assert not compare("weights", run(flipped, feeds)["weights"], want["weights"]).ok


def test_ties_go_to_the_lower_index_as_onnx_topk() -> None:
    x = np.array([[0.0, 1.0, 1.0, 0.5], [2.0, 2.0, 2.0, 2.0]], np.float32)
    model = _router(shape=x.shape)
    want = run(model, {"logits": x})
    got = moe_gating_reference(x, K, False)
    np.testing.assert_array_equal(got[1], want["experts"])
    np.testing.assert_array_equal(got[1], [[1, 2], [0, 1]])


# ---- the Ascend kernel -------------------------------------------------------------------------------------

def _gating_node(k: int = K, renorm: int = 0) -> onnx.NodeProto:
    return helper.make_node("MoeGatingTopKSoftmax", ["x"], ["y", "i"], name="router", domain="npufuse", k=k,
                            renormalize=renorm)


@pytest.mark.parametrize("renorm, chip, experts, op, problem", [
    (0, "ascend910b", 8, "MoeGatingTopKSoftmax", None),
    (1, "ascend910b", 8, "MoeGatingTopKSoftmaxV2", None),
    (1, "ascend310p", 16, "MoeGatingTopKSoftmaxV2", "no kernel for ascend310p"),
    (0, "ascend310p", 16, "MoeGatingTopKSoftmax", None),
    (0, "ascend310p", 8, "MoeGatingTopKSoftmax", "multiple of 16"),
    (0, "ascend950", 4096, "MoeGatingTopKSoftmax", "at most 2048"),
])
def test_kernel_record_per_chip(renorm: int, chip: str, experts: int, op: str, problem: str | None) -> None:
    rec = ak.region_kernel([_gating_node(renorm=renorm)], lambda v: (T, experts) if v == "x" else None, chip=chip)
    assert rec["op"] == op and rec["attrs"]["k"] == K
    assert (rec["attrs"].get("renorm") == 1) == bool(renorm)
    if problem is None:
        assert rec["available"] and rec["problem"] is None
    else:
        assert problem in rec["problem"]
    row = ak.catalogue()[op]
    assert set(rec["attrs"]) <= set(row.attributes)
    assert {b["name"] for b in rec["outputs"]} == {"y", "expert_idx"}


# ---- the ATC form ------------------------------------------------------------------------------------------

def _values(shape=(T, E), elem=F, chip: str | None = "ascend910b", opset: int = 17) -> Values:
    return Values({"x": shape}, {"x": elem}, opset, chip)


@pytest.mark.parametrize("renorm", [0, 1])
def test_plugin_node_writes_k_as_an_int_and_casts_the_indices(renorm: int) -> None:
    got = map_region(_gating_node(renorm=renorm), _values(), Namer(set()))
    assert isinstance(got, PluginRegion) and got.kernel == "MoeGatingTopKSoftmax"
    plugin = got.nodes[0]
    assert plugin.op_type == "NPUMoeGatingTopKSoftmax" and plugin.domain == "npu"
    assert list(plugin.input) == ["x"] and len(plugin.output) == 3
    (k_attr,) = plugin.attribute
    assert k_attr.name == "k" and k_attr.type == onnx.AttributeProto.INT and k_attr.i == K
    assert check_node(plugin, "ascend910b") == []
    cast = next(n for n in got.nodes if n.op_type == "Cast")
    assert list(cast.input) == [plugin.output[1]] and list(cast.output) == ["i"]
    assert _attrs(cast)["to"] == TensorProto.INT64
    after = [n.op_type for n in got.nodes[1:]]
    if renorm:
        assert after == ["Cast", "ReduceSum", "Div"] and got.nodes[-1].output[0] == "y"
        assert plugin.output[0] != "y"
    else:
        assert after == ["Cast"] and plugin.output[0] == "y"


@pytest.mark.parametrize("values, reason", [
    (_values(elem=F, chip="ascend310p", shape=(T, 16)), "plugin-constraint"),     # 310P: fp16 only
    (_values(elem=H, chip="ascend310p", shape=(T, 8)), "plugin-constraint"),      # 310P: E % 16 == 0
    (_values(shape=(2, 2, 3, E)), "moe-gating-rank"),
    (_values(shape=None), "moe-gating-rank"),
])
def test_atc_form_stays_standard_where_the_kernel_cannot_take_it(values: Values, reason: str) -> None:
    got = map_region(_gating_node(), values, Namer(set()))
    assert isinstance(got, StaysStandard) and got.reason == reason, got


def test_atc_form_on_310p_fp16_with_16_experts() -> None:
    got = map_region(_gating_node(), _values(elem=H, chip="ascend310p", shape=(T, 16)), Namer(set()))
    assert isinstance(got, PluginRegion)


def test_plugin_contract_and_kernel_registered() -> None:
    spec = PLUGINS["NPUMoeGatingTopKSoftmax"]
    assert spec.cann_op == "MoeGatingTopKSoftmax" and spec.attr("k").required
    assert ("npu", 1) in spec.keys and ("ai.onnx", 17) in spec.keys
    bad = helper.make_node("NPUMoeGatingTopKSoftmax", ["x"], ["y", "e", "r"], domain="npu", k=2.0)
    assert any("FLOAT" in p for p in check_node(bad, "ascend910b"))        # a float k is ignored: k stays -1
    missing = helper.make_node("NPUMoeGatingTopKSoftmax", ["x"], ["y", "e", "r"], domain="npu")
    assert any("required attribute 'k'" in p for p in check_node(missing, "ascend910b"))


@pytest.mark.parametrize("shape", [(T, E), (2, 5, E)])
def test_plugin_reference_kernel_matches_the_decomposition(shape) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    want = run(_router(shape=shape), {"logits": x})
    y, idx, row = KERNELS["NPUMoeGatingTopKSoftmax"]([x], {"k": K})
    assert compare("y", y, want["weights"]).ok and idx.dtype == np.int32
    np.testing.assert_array_equal(idx, want["experts"])
    rows = int(np.prod(shape[:-1]))
    flat = row.reshape(rows, K)
    np.testing.assert_array_equal(flat[:, 0], np.arange(rows))                 # row_idx[i, j] = j * rows + i
    np.testing.assert_array_equal(flat[:, 1], np.arange(rows) + rows)


def test_atc_region_with_renormalisation_computes_what_the_model_does() -> None:
    """The plugin node and the standard ops after it, run by the ATC evaluator (the plugin's reference kernel),
    against onnxruntime on the original renormalised router."""
    model = _router(renorm=True)
    feeds = _feeds(model)
    want = run(model, feeds)
    got = map_region(_gating_node(renorm=1), _values(), Namer(set()))
    assert isinstance(got, PluginRegion)
    g = helper.make_graph(got.nodes, "atc", [helper.make_tensor_value_info("x", F, [T, E])],
                          [helper.make_tensor_value_info("y", F, None),
                           helper.make_tensor_value_info("i", TensorProto.INT64, None)], got.initializers)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("npu", 1)],
                          ir_version=IR_VERSION)
    y, i = run_atc_model(m, {"x": feeds["logits"]})
    assert compare("y", y, want["weights"]).ok
    np.testing.assert_array_equal(i, want["experts"])
