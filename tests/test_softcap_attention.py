"""Attention logit soft-capping (Gemma 2: `tanh(scores / cap) * cap` on the scaled scores, before the mask) fused
into npufuse.FusedAttention with a `softcap` attribute; refused on every Ascend chip (no shipped attention kernel
takes a softcap) with that reason; kept standard in the ATC form (`attention-softcap`). And Gemma 2's fp16 residual
Add -> Cast -> RMSNorm (normalised and scaled in float32): a precise near-miss, `norm-in-wider-type`."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from npufuse.emit.atc.regions import Namer, StaysStandard, Values, map_region
from npufuse.fusion.census import result_counts
from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.modelio import load_model
from npufuse.npu_model.spec import load_profile
from npufuse.patterns.attention_op import FUSED_ATTENTION, attention_reference

FIXTURES = Path(__file__).resolve().parent / "fixtures"
B, H, S, D = 2, 4, 6, 8
CAP = 5.0


@functools.lru_cache(maxsize=None)
def _optimized(file: str, profile: str | None = None):
    spec = load_profile(profile) if profile else None
    return optimize(load_model(FIXTURES / file), str(FIXTURES), OptimizeOptions(spec=spec, verify=spec is None))


def _attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "FusedAttention"]


def _attr(node: onnx.NodeProto, name: str):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


# ---- the Gemma 2 fixtures (both exporters) ---------------------------------------------------------------------

@pytest.mark.parametrize("file", ["gemma2_ts17.onnx", "gemma2_dynamo.onnx", "gemma2_fp16_ts17.onnx",
                                  "gemma2_fp16_dynamo.onnx"])
def test_gemma2_soft_capped_attention_fuses_with_the_cap(file: str) -> None:
    res = _optimized(file)
    nodes = _attention_nodes(res.model)
    assert len(nodes) == 2
    for n in nodes:
        assert _attr(n, "softcap") == pytest.approx(50.0)
        # Gemma scales by query_pre_attn_scalar ** -0.5 = 8 ** -0.5 before the cap: scale * cap / cap
        assert _attr(n, "scale") == pytest.approx(8 ** -0.5, rel=1e-3)   # fp16 constants in the fp16 exports
    assert not any(n.op_type == "Tanh" for n in res.model.graph.node)
    assert not res.rolled_back and all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok
    assert not unaccounted(res)


@pytest.mark.parametrize("profile", ["Ascend910B2", "Ascend310P3"])
def test_no_ascend_kernel_takes_the_cap_so_it_is_refused_with_that_reason(profile: str) -> None:
    res = _optimized("gemma2_ts17.onnx", profile)
    assert not _attention_nodes(res.model)
    att = [r for r in res.records if r.match.pattern == "attention"]
    assert len(att) == 2
    for r in att:
        assert r.status == "skipped-by-cost"
        assert "takes no logit soft-capping" in r.reason and "softcap 50" in r.reason
        assert r.ascend_kernel["problem"].startswith("PromptFlashAttention takes no logit soft-capping")
        assert "softcap" in r.match.kind
    # the Tanh of the cap is in the region the decision names: accounted for
    assert not unaccounted(res)


# ---- hand-built graphs ------------------------------------------------------------------------------------------

def _capped_model(*, mask_before_cap: bool = False, double_tanh: bool = False, cap: float = CAP,
                  opset: int = 17) -> onnx.ModelProto:
    """Q·Kᵀ * scale -> / cap -> Tanh -> * cap -> + mask -> Softmax -> ·V, on [B, H, S, D] heads."""
    f = TensorProto.FLOAT
    inits = [numpy_helper.from_array(np.array(D ** -0.5, np.float32), "scale"),
             numpy_helper.from_array(np.array(cap, np.float32), "cap")]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2], name="kt"),
             helper.make_node("MatMul", ["q", "kt"], ["qk"], name="qk"),
             helper.make_node("Mul", ["qk", "scale"], ["scaled"], name="scale_mul")]
    x = "scaled"
    if mask_before_cap:
        nodes.append(helper.make_node("Add", [x, "mask"], ["masked_early"], name="mask_early"))
        x = "masked_early"
    nodes += [helper.make_node("Div", [x, "cap"], ["divided"], name="cap_div"),
              helper.make_node("Tanh", ["divided"], ["t"], name="tanh")]
    x = "t"
    if double_tanh:
        nodes.append(helper.make_node("Tanh", [x], ["t2"], name="tanh2"))
        x = "t2"
    nodes.append(helper.make_node("Mul", [x, "cap"], ["capped"], name="cap_mul"))
    x = "capped"
    if not mask_before_cap:
        nodes.append(helper.make_node("Add", [x, "mask"], ["masked"], name="mask_add"))
        x = "masked"
    nodes += [helper.make_node("Softmax", [x], ["p"], axis=-1, name="softmax"),
              helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    g = helper.make_graph(
        nodes, "capped", [helper.make_tensor_value_info(n, f, [B, H, S, D]) for n in ("q", "k", "v")] +
        [helper.make_tensor_value_info("mask", f, [B, 1, S, S])], [helper.make_tensor_value_info("y", f, [B, H, S, D])],
        inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # scores of a few units against a cap of 5: tanh is far from linear there, so a dropped cap shows
    feeds = {n: (rng.standard_normal((B, H, S, D)) * 3).astype(np.float32) for n in ("q", "k", "v")}
    mask = np.where(np.tril(np.ones((S, S), bool)), 0.0, -1e9).astype(np.float32)
    feeds["mask"] = np.broadcast_to(mask, (B, 1, S, S)).copy()
    return feeds


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, feeds)[0]


@pytest.mark.parametrize("opset", [13, 17, 21])
def test_hand_built_cap_fuses_and_the_body_computes_it(opset: int) -> None:
    model = _capped_model(opset=opset)
    res = optimize(model, options=OptimizeOptions())
    (node,) = _attention_nodes(res.model)
    assert _attr(node, "softcap") == pytest.approx(CAP)
    assert _attr(node, "scale") == pytest.approx(D ** -0.5)
    assert _attr(node, "mask_order") == b"add"
    feeds = _feeds()
    want = _run(model, feeds)
    np.testing.assert_allclose(_run(res.model, feeds), want, rtol=1e-5, atol=1e-5)   # the function body
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    ref = attention_reference([feeds["q"], feeds["k"], feeds["v"], feeds["mask"]], attrs)[0]
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)                       # the reference kernel


def test_a_dropped_cap_would_be_caught() -> None:
    """The numeric check can fail: the same op without its softcap (or with another cap) is far off."""
    feeds = _feeds(1)
    want = _run(_capped_model(), feeds)
    ins = [feeds["q"], feeds["k"], feeds["v"], feeds["mask"]]
    attrs = {"scale": D ** -0.5, "mask_order": "add"}
    np.testing.assert_allclose(attention_reference(ins, {**attrs, "softcap": CAP})[0], want, rtol=1e-5, atol=1e-5)
    for wrong in ({}, {"softcap": 2 * CAP}):
        assert np.abs(attention_reference(ins, {**attrs, **wrong})[0] - want).max() > 1e-2


def test_negative_outer_factor_is_an_equal_cap() -> None:
    """a * tanh(b * s) with a < 0 is |a| * tanh(a * b * s / |a|): softcap |a|, scale a * b."""
    ins = [np.random.default_rng(2).standard_normal((1, 2, 3, 4)) for _ in range(3)]
    s = np.matmul(ins[0], np.swapaxes(ins[1], -1, -2))
    a, b = -3.0, 0.5
    e = np.exp(a * np.tanh(b * s))
    want = np.matmul(e / e.sum(-1, keepdims=True), ins[2])
    got = attention_reference(ins, {"softcap": abs(a), "scale": a * b})[0]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_body_without_cap_is_unchanged() -> None:
    """Attention without soft-capping keeps its body: no softcap attribute declared, no Tanh, same overload."""
    fn = FUSED_ATTENTION.body({"scale": 0.5}, 17, TensorProto.FLOAT)
    assert "softcap" not in fn.attribute and not any(n.op_type == "Tanh" for n in fn.node)
    assert "softcap" not in fn.overload
    capped = FUSED_ATTENTION.body({"scale": 0.5, "softcap": 30.0}, 17, TensorProto.FLOAT)
    assert "softcap" in capped.attribute and any(n.op_type == "Tanh" for n in capped.node)
    assert capped.overload != fn.overload


def test_mask_before_the_cap_is_a_near_miss() -> None:
    res = optimize(_capped_model(mask_before_cap=True), options=OptimizeOptions())
    assert not _attention_nodes(res.model)
    (r,) = [r for r in res.refusals if r.pattern == "attention"]
    assert (r.reason, r.node) == ("mask-before-softcap", "mask_early")
    assert not unaccounted(res)


def test_two_tanh_steps_are_a_near_miss() -> None:
    res = optimize(_capped_model(double_tanh=True), options=OptimizeOptions())
    assert not _attention_nodes(res.model)
    (r,) = [r for r in res.refusals if r.pattern == "attention"]
    assert (r.reason, r.node) == ("softcap-form", "tanh")
    assert not unaccounted(res)


# ---- the ATC form ----------------------------------------------------------------------------------------------

def test_atc_form_keeps_a_capped_region_standard() -> None:
    node = helper.make_node("FusedAttention", ["q", "k", "v"], ["o"], name="attn", domain="npufuse", num_heads=4,
                            kv_num_heads=4, scale=0.25, softcap=50.0)
    shapes = {"q": (2, 4, 8, 16), "k": (2, 4, 8, 16), "v": (2, 4, 8, 16)}
    out = map_region(node, Values(shapes, {v: TensorProto.FLOAT16 for v in shapes}, 17, "ascend910b"), Namer(set()))
    assert isinstance(out, StaysStandard) and out.reason == "attention-softcap", out


# ---- Gemma 2's fp16 residual RMSNorm -----------------------------------------------------------------------------

@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_gemma2_residual_rmsnorm_counts(exporter: str) -> None:
    fp32 = _optimized(f"gemma2_{exporter}.onnx")
    assert sum(n.op_type == "AddRMSNorm" for n in fp32.model.graph.node) == 4
    assert result_counts(fp32)["rmsnorm"] == 9
    fp16 = _optimized(f"gemma2_fp16_{exporter}.onnx")
    # fp16: the residual sum is cast to float32 and normalised and scaled by (1 + weight) there; no fused op rounds
    # as the model does, so each of the 4 residual norms stays a norm of its own, with a precise near-miss
    assert not any(n.op_type == "AddRMSNorm" for n in fp16.model.graph.node)
    assert result_counts(fp16)["rmsnorm"] == 9
    near = [r for r in fp16.refusals if r.pattern == "add_rmsnorm"]
    assert len(near) == 4 and {r.reason for r in near} == {"norm-in-wider-type"}
    assert all("float16" in r.detail and "gamma" in r.detail for r in near)
