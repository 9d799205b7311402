"""FusedAttention with additive position biases (T5's relative bias, ALiBi, DeBERTa's c2p/p2c, Swin/BEiT), keys
read through any transposition (DeepSeek-V3's slice-assigned key buffer), attention computed in a wider type
than its inputs (TorchScript's fp16 SDPA), and the near-misses every attention-like Softmax ends with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import ops
from onnx import TensorProto, helper
from test_attention import FMIN, B, D, H, S, _assert_fused_and_equal, _Builder, _feeds, _fused, _optimize

from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.candidates import Refusal
from npufuse.ir.graph import Graph, attributes
from npufuse.ir.modelio import load_model
from npufuse.patterns.attention import FusedAttentionPattern
from npufuse.patterns.attention_op import FUSED_ATTENTION, attention_reference
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

FIXTURES = Path(__file__).parent / "fixtures"


def _qkv(b: _Builder, dtype_elem: int | None = None):
    return (b.input("q", [B, H, S, D], dtype_elem), b.input("k", [B, H, S, D], dtype_elem),
            b.input("v", [B, H, S, D], dtype_elem))


def _scores(b: _Builder, q: str, k: str) -> str:
    return b.op("MatMul", [q, b.op("Transpose", [k], perm=[0, 1, 3, 2])], name="qk")


def _finish(b: _Builder, s: str, v: str) -> onnx.ModelProto:
    y = b.op("MatMul", [b.op("Softmax", [s], name="softmax", axis=-1), v], name="pv")
    return b.model([y])


def _biased(order: tuple[str, ...], scale: float | None = D ** -0.5, commuted: bool = False) -> onnx.ModelProto:
    """Q·Kᵀ with the steps of `order` applied in turn: "scale" (Mul), "pos" ([1, H, S, S] position bias), "alibi"
    ([B, H, 1, S]), "mask" (additive [B, 1, 1, S]), "where" (Where(keep, s, FMIN))."""
    b = _Builder(17)
    q, k, v = _qkv(b)
    s = _scores(b, q, k)
    terms = {"pos": lambda: b.input("position_bias", [1, H, S, S]), "alibi": lambda: b.input("alibi", [B, H, 1, S]),
             "mask": lambda: b.input("float_mask", [B, 1, 1, S])}
    for step in order:
        if step == "scale":
            s = b.op("Mul", [s, b.f(scale)], name="scale")
        elif step == "where":
            s = b.op("Where", [b.input("bool_mask", [B, 1, 1, S], TensorProto.BOOL), s, b.f(FMIN)], name="where")
        else:
            t = terms[step]()
            s = b.op("Add", [t, s] if commuted else [s, t], name=f"add_{step}")
    return _finish(b, s, v)


def _bias_feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    fm = np.where(rng.random((B, 1, 1, S)) < 0.7, 0.0, FMIN).astype(np.float32)
    fm[..., 0] = 0.0
    return _feeds(model, float_mask=fm)


# ---- several additive terms: one bias ---------------------------------------------------------------------

@pytest.mark.parametrize("order,commuted", [
    (("pos", "mask"), False),                 # T5: unscaled scores + position bias + mask
    (("pos", "mask"), True),
    (("mask", "pos"), False),
    (("scale", "alibi", "mask"), False),      # BLOOM (4-D after canonicalisation): scale, ALiBi, mask
    (("scale", "pos", "mask", "alibi"), False),
    (("where", "pos", "mask"), False),        # a boolean mask, then the additive terms
    (("pos", "mask", "where"), True),
])
def test_additive_terms_become_one_bias(order, commuted) -> None:
    model = _biased(order, commuted=commuted)
    res, a = _assert_fused_and_equal(model, _bias_feeds(model))
    adds = [t for t in order if t in ("pos", "alibi", "mask")]
    steps = [("add" if t in adds else t) for t in order if t != "scale"]
    want_order = [x for i, x in enumerate(steps) if i == 0 or x != steps[i - 1]]
    assert a["mask_order"] == ",".join(want_order)
    assert a["scale"] == pytest.approx(D ** -0.5 if "scale" in order else 1.0, rel=1e-6)
    fused = _fused(res)[0]
    # the terms are summed outside the op, in the model's order: the op's bias is the kernel's one pse_shift
    assert ops(res.model).count("Add") == len(adds) - 1
    (rec,) = [r for r in res.applied if r.match.pattern == "attention"]
    assert rec.match.kind.startswith("FusedAttention[") and "bias" in rec.match.kind
    kernel_inputs = {x["name"]: x.get("value") for x in rec.ascend_kernel["inputs"]}
    assert kernel_inputs["pse_shift"] == fused.input[3]


@pytest.mark.parametrize("factor,fuses", [(0.5, True), (2.0, True), (1.0, True), (D ** -0.5, False)])
def test_bias_before_the_scale_fuses_where_exact(factor, fuses) -> None:
    """(s + b) * c = s*c + b*c exactly for a power of two c: the bias is scaled outside the op. Otherwise the
    rewrite would round differently: a near-miss."""
    model = _biased(("pos", "mask", "scale"), scale=factor)
    if fuses:
        res, a = _assert_fused_and_equal(model, _bias_feeds(model))
        assert a["scale"] == pytest.approx(factor)
        assert ops(res.model).count("Mul") == (0 if factor == 1.0 else 2)
        return
    res = _optimize(model)
    assert not _fused(res)
    assert "scale-after-mask" in {f.reason for f in res.refusals if f.pattern == "attention"}


def test_where_before_a_power_of_two_scale_scales_the_fill() -> None:
    model = _biased(("where", "scale"), scale=0.25)
    _, a = _assert_fused_and_equal(model, _bias_feeds(model))
    assert a["mask_fill"] == pytest.approx(FMIN * 0.25) and a["scale"] == 0.25


def test_terms_on_both_sides_of_the_boolean_mask_are_a_near_miss() -> None:
    res = _optimize(_biased(("pos", "where", "mask")))
    assert not _fused(res)
    f = next(f for f in res.refusals if f.pattern == "attention")
    assert f.reason == "multiple-masks" and "softmax" in f.nodes


def test_deberta_disentangled_terms_and_inverted_mask() -> None:
    """DeBERTa-v2 (4-D after canonicalisation): Q·(Kᵀ/c) + (c2p/c + p2c/c), then masked_fill(~mask, min)."""
    b = _Builder(17)
    q, k, v = _qkv(b)
    c = float(np.sqrt(D * 3))
    s = b.op("MatMul", [q, b.op("Div", [b.op("Transpose", [k], perm=[0, 1, 3, 2]), b.f(c)])], name="qk")
    c2p = b.op("Div", [b.input("c2p", [B, H, S, S]), b.f(c)])
    p2c = b.op("Div", [b.op("Transpose", [b.input("p2c", [B, H, S, S])], perm=[0, 1, 3, 2]), b.f(c)])
    s = b.op("Add", [s, b.op("Add", [c2p, p2c])])
    keep = b.input("bool_mask", [B, 1, S, S], TensorProto.BOOL)
    s = b.op("Where", [b.op("Not", [keep]), b.f(FMIN), s], name="masked_fill")
    model = _finish(b, s, v)
    res, a = _assert_fused_and_equal(model)
    assert a["mask_order"] == "add,where" and a["bool_mask_mode"] == "drop" and a["scale"] == pytest.approx(1 / c)
    fused = _fused(res)[0]
    # Not(mask) stays the op's boolean input: the positions to drop, as Ascend's atten_mask takes them
    assert "Not" in ops(res.model) and fused.input[4]


# ---- keys through any transposition -------------------------------------------------------------------------

@pytest.mark.parametrize("perm", [(3, 1, 0, 2), (1, 0, 3, 2), (2, 0, 3, 1)])
def test_key_transposed_from_any_layout(perm) -> None:
    """Kᵀ = Transpose(X, perm) of a buffer in another layout (DeepSeek-V3's [D, H, S, B] slice-assigned key):
    the rewrite transposes X to [B, H, S, D] outside the op (perm with its last two axes swapped)."""
    b = _Builder(17)
    q, v = b.input("q", [B, H, S, D]), b.input("v", [B, H, S, D])
    kt_dims = [B, H, D, S]
    x_shape = [0] * 4
    for i, p in enumerate(perm):
        x_shape[p] = kt_dims[i]
    kbuf = b.op("Mul", [b.input("kx", x_shape), b.f(1.0)])  # an activation in X's layout
    s = b.op("Mul", [b.op("MatMul", [q, b.op("Transpose", [kbuf], perm=list(perm))], name="qk"), b.f(D ** -0.5)])
    s = b.op("Add", [s, b.input("float_mask", [B, 1, 1, S])])
    model = _finish(b, s, v)
    res, a = _assert_fused_and_equal(model, _bias_feeds(model))
    fused = _fused(res)[0]
    k_perm = list(perm[:2]) + [perm[3], perm[2]]
    (tr,) = [n for n in res.model.graph.node if n.op_type == "Transpose" and n.output[0] == fused.input[1]]
    assert attributes(tr)["perm"] == k_perm and a["k_layout"] == "BNSD"


def test_deepseek_v3_dynamo_fuses_with_its_key_buffer() -> None:
    res = optimize(load_model(FIXTURES / "deepseek_v3_dynamo.onnx"), str(FIXTURES),
                   OptimizeOptions(patterns=[FusedAttentionPattern()]))
    fused = _fused(res)
    assert len(fused) == 2 and res.model_check.ok and not res.rolled_back
    producers = {o: n for n in res.model.graph.node for o in n.output}
    for node in fused:
        k = producers[node.input[1]]
        assert k.op_type == "Transpose" and attributes(k)["perm"] == [3, 1, 2, 0]


# ---- attention computed in a wider type -----------------------------------------------------------------------

def test_fp16_attention_computed_in_fp32_with_v_cast_up() -> None:
    """TorchScript's SDPA export of an fp16 model: Cast(Q·Kᵀ) to float, Softmax in float, P·Cast(V, float)."""
    b = _Builder(17, np.float16)
    q, k, v = _qkv(b)
    s = b.op("Cast", [_scores(b, q, k)], to=TensorProto.FLOAT)
    s = b.op("Add", [b.op("Mul", [s, b.const(np.array(D ** -0.5, np.float32))]),
                     b.input("float_mask", [B, 1, 1, S], TensorProto.FLOAT)])
    p = b.op("Softmax", [s], axis=-1)
    p = b.op("Where", [b.op("IsNaN", [p]), b.const(np.array(0.0, np.float32)), p])
    y = b.op("MatMul", [p, b.op("Cast", [v], to=TensorProto.FLOAT)])
    model = b.model([y])
    res = _optimize(model)
    (fused,) = _fused(res)
    a = attributes(fused)
    assert res.applied[0].check.ok and not res.rolled_back
    # onnxruntime's CPU runs an fp16 MatMul in fp32 and may skip the fp16 rounding of Q·Kᵀ in one graph and not in
    # the other: compare at fp16's precision (the rewrite itself is checked against the float64 reference)
    feeds = _bias_feeds(model)
    got, want = run(res.model, feeds)[y], run(model, feeds)[y]
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    assert a["softmax_dtype"] == TensorProto.FLOAT and a["out_dtype"] == TensorProto.FLOAT
    assert ops(res.model) == ["FusedAttention"]   # V's Cast absorbed: the op reads fp16 Q, K, V
    (rec,) = res.applied
    assert any("wider type" in n for n in rec.ascend_kernel["notes"])


def test_probabilities_cast_up_for_v_cast_up() -> None:
    """Softmax in fp16, then P and V both cast to float for ·V: the op computes in fp16 and writes float."""
    b = _Builder(17, np.float16)
    q, k, v = _qkv(b)
    p = b.op("Softmax", [_scores(b, q, k)], axis=-1)
    y = b.op("MatMul", [b.op("Cast", [p], to=TensorProto.FLOAT), b.op("Cast", [v], to=TensorProto.FLOAT)])
    res = _optimize(b.model([y]))
    (fused,) = _fused(res)
    a = attributes(fused)
    assert "softmax_dtype" not in a and a["out_dtype"] == TensorProto.FLOAT and res.applied[0].check.ok


def test_v_of_another_type_is_mixed() -> None:
    """fp16 Q and K, V a float32 tensor of its own (not a Cast of an fp16 one): mixed-dtypes."""
    b = _Builder(17, np.float16)
    q, k = b.input("q", [B, H, S, D]), b.input("k", [B, H, S, D])
    v = b.input("v", [B, H, S, D], TensorProto.FLOAT)
    p = b.op("Cast", [b.op("Softmax", [_scores(b, q, k)], axis=-1)], to=TensorProto.FLOAT)
    res = _optimize(b.model([b.op("MatMul", [p, v])]))
    assert not _fused(res)
    assert "mixed-dtypes" in {f.reason for f in res.refusals if f.pattern == "attention"}


@pytest.mark.parametrize("file,wider", [("mistral_fp16_ts17.onnx", False), ("qwen2_fp16_ts17.onnx", False),
                                        ("mistral_sdpa_static_fp16_ts17.onnx", True)])
def test_fp16_torchscript_fixtures_record_their_dtypes(file, wider) -> None:
    """TorchScript's eager fp16 attention (softmax(dtype=float32).to(fp16) exports as an fp16 Softmax and a Cast
    round trip) computes in fp16: no softmax_dtype. Its SDPA export computes in fp32 and writes fp32."""
    res = optimize(load_model(FIXTURES / file), str(FIXTURES), OptimizeOptions(patterns=[FusedAttentionPattern()]))
    fused = _fused(res)
    assert len(fused) == 2 and res.model_check.ok and not res.rolled_back
    for node in fused:
        a = attributes(node)
        if wider:
            assert a["softmax_dtype"] == TensorProto.FLOAT and a["out_dtype"] == TensorProto.FLOAT
        else:
            assert "softmax_dtype" not in a and "out_dtype" not in a


# ---- the fused op: function body vs reference --------------------------------------------------------------

@pytest.mark.parametrize("out_dtype", [0, TensorProto.FLOAT])
def test_body_matches_reference_with_bias_and_out_dtype(out_dtype) -> None:
    rng = np.random.default_rng(4)
    dt = np.float16 if out_dtype else np.float32
    q, k, v = (rng.standard_normal((B, H, S, D)).astype(dt) for _ in range(3))
    bias = (rng.standard_normal((1, H, S, S)) + np.where(rng.random((B, 1, S, S)) < 0.3, -1e4, 0)).astype(
        np.float32 if out_dtype else dt)
    attrs = dict(scale=0.3, num_heads=H, kv_num_heads=H, mask_order="add", nan_guard=1,
                 softmax_dtype=TensorProto.FLOAT if out_dtype else 0, out_dtype=out_dtype)
    attrs = {k_: v_ for k_, v_ in attrs.items() if v_}
    want = attention_reference([q, k, v, bias], attrs)[0]
    assert want.dtype == (np.float32 if out_dtype else dt)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dt))
    node, fn = FUSED_ATTENTION.make_node(["q", "k", "v", "m"], ["y"], "fa", attrs, 17, elem)
    feeds = {"q": q, "k": k, "v": v, "m": bias}
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype),
                                                                          x.shape) for n, x in feeds.items()],
                              [helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(want.dtype),
                                                             want.shape)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("npufuse", 1)],
                          functions=[fn], ir_version=IR_VERSION)
    onnx.checker.check_model(m, full_check=True)
    got = run(m, feeds)["y"]
    assert got.dtype == want.dtype
    c = compare("y", got, want)
    assert c.ok, c.detail


# ---- near-misses: every attention-like Softmax ends fused or with a reason -----------------------------------

def _near_miss(model: onnx.ModelProto) -> tuple[str, str, tuple[str, ...]]:
    res = _optimize(model)
    assert not _fused(res) and "Softmax" in ops(res.model)
    (f,) = [f for f in res.refusals if f.pattern == "attention"]
    assert f.node and f.detail
    return f.reason, f.node, f.nodes


def test_heads_merged_into_the_batch_is_a_near_miss() -> None:
    """Softmax on [B, H, S, S] whose probabilities are reshaped to [B*H, S, S] for a rank-3 ·V (bloom's TorchScript
    export, where the canonicaliser cannot bring it to 4-D): refused at the Reshape, the Softmax named. Matched on
    the graph as written (the canonical rules would bring this small form to 4-D)."""
    b = _Builder(17)
    q, k, v = _qkv(b)
    p = b.op("Softmax", [b.op("Mul", [_scores(b, q, k), b.f(0.5)])], name="softmax", axis=-1)
    p3 = b.op("Reshape", [p, b.ints(B * H, S, S)], name="merge_heads")
    y = b.op("MatMul", [p3, b.op("Reshape", [v, b.ints(B * H, S, D)])])
    model = onnx.shape_inference.infer_shapes(b.model([y]))
    types = {vi.name: vi.type for vi in list(model.graph.value_info) + list(model.graph.input) +
             list(model.graph.output)}
    g = Graph(model, None, types)
    r = FusedAttentionPattern().match(g, g.node("softmax"))
    assert isinstance(r, Refusal) and (r.reason, r.node) == ("probs-chain", "merge_heads") and "softmax" in r.nodes
    assert "heads merged into the batch" in r.detail


def test_bloom_torchscript_names_each_softmax() -> None:
    res = optimize(load_model(FIXTURES / "bloom_ts17.onnx"), str(FIXTURES),
                   OptimizeOptions(patterns=[FusedAttentionPattern()]))
    softmaxes = [n.name for n in res.model.graph.node if n.op_type == "Softmax"]
    named = {n for f in res.refusals if f.pattern == "attention" for n in (f.node, *f.nodes)}
    assert not _fused(res) or not softmaxes        # the day the canonicaliser brings it to 4-D, it fuses
    assert set(softmaxes) <= named


def test_probabilities_without_v_are_a_near_miss() -> None:
    b = _Builder(17)
    q, k, _ = _qkv(b)
    p = b.op("Softmax", [_scores(b, q, k)], name="softmax", axis=-1)
    reason, node, _ = _near_miss(b.model([b.op("ReduceSum", [p, b.ints(-1)], name="rsum")]))
    assert reason == "probs-chain" and node == "rsum"


def test_rank3_scores_reshaped_to_4d_is_a_near_miss() -> None:
    """Scores computed on [B*H, S, S] and reshaped to 4-D before the Softmax, ·V in 4-D: the walk up stops at the
    Reshape."""
    b = _Builder(17)
    q3, k3 = b.input("q", [B * H, S, D]), b.input("k", [B * H, S, D])
    v = b.input("v", [B, H, S, D])
    s3 = b.op("MatMul", [q3, b.op("Transpose", [k3], perm=[0, 2, 1])])
    s = b.op("Reshape", [s3, b.ints(B, H, S, S)], name="split_heads")
    reason, node, nodes = _near_miss(_finish(b, s, v))
    assert (reason, node) == ("score-chain", "split_heads") and "softmax" in nodes


def test_scores_from_an_input_are_a_near_miss() -> None:
    b = _Builder(17)
    v = b.input("v", [B, H, S, D])
    reason, _, nodes = _near_miss(_finish(b, b.input("scores", [B, H, S, S]), v))
    assert reason == "score-chain" and "softmax" in nodes


def test_softcap_is_fused_with_its_cap() -> None:
    """Gemma 2's logit soft-capping, once a score-chain near-miss at the Tanh: FusedAttention's softcap (issue 23;
    tests/test_softcap_attention.py has the rest)."""
    b = _Builder(17)
    q, k, v = _qkv(b)
    s = b.op("Mul", [b.op("Tanh", [b.op("Div", [_scores(b, q, k), b.f(50.0)])], name="tanh"), b.f(50.0)])
    res = _optimize(_finish(b, s, v))
    (node,) = _fused(res)
    assert next(helper.get_attribute_value(a) for a in node.attribute if a.name == "softcap") == pytest.approx(50.0)


@pytest.mark.parametrize("verify", [True, False])
def test_bias_terms_of_different_types_are_a_near_miss(verify: bool) -> None:
    """A bias added in fp16, a Cast up, a mask added in fp32: one summed bias would be an ill-typed Add (onnxruntime
    refuses the model) or a sum rounded where the model did not round. Refused, named, even unverified."""
    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Add", ["ss", "pb"], ["a1"]),
             helper.make_node("Cast", ["a1"], ["a1f"], to=f32),
             helper.make_node("Add", ["a1f", "mask"], ["a2"]),
             helper.make_node("Softmax", ["a2"], ["p"], axis=-1, name="softmax"),
             helper.make_node("Cast", ["p"], ["p16"], to=f16),
             helper.make_node("MatMul", ["p16", "v"], ["y"])]
    g = helper.make_graph(nodes, "mixed_bias", [vi(n, f16, [2, 4, 8, 16]) for n in "qkv"] +
                          [vi("pb", f16, [1, 4, 8, 8]), vi("mask", f32, [2, 1, 1, 8])], [vi("y", f16, [2, 4, 8, 16])],
                          [onnx.numpy_helper.from_array(np.array(0.25, np.float16), "scale")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    res = optimize(model, options=OptimizeOptions(verify=verify))
    assert not _fused(res) and "Softmax" in ops(res.model)
    [r] = [r for r in res.refusals if r.pattern == "attention"]
    assert (r.node, r.reason) == ("softmax", "mixed-dtypes") and "'pb' (float16)" in r.detail
