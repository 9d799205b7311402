"""DeepSeek MLA prolog => npufuse.MlaProlog: a hand-built block (decomposed RMSNorms, rotate_half ropes, Splits and
head split as the exporters write them) fuses and runs as the original did; near-misses that must not fuse; the
function body against the reference kernel; pricing; the Ascend kernel and its chips; the DeepSeek-V3 fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import with_output_shapes
from onnx import TensorProto, helper, numpy_helper

from npufuse.cost_model import FusionCandidate, OpWork, TensorInfo, decide
from npufuse.fusion.census import fusion_census
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.npu_model.ascend_kernels import region_kernel
from npufuse.npu_model.spec import load_profile
from npufuse.patterns import PATTERNS
from npufuse.patterns.mla_prolog import MLA_PROLOG, mla_prolog_reference
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

FIXTURES = Path(__file__).parent / "fixtures"
B, S, HID, N, DN, DR, RQ, RKV = 2, 5, 32, 4, 8, 4, 16, 12
OUTS = ("q_nope", "q_rope", "ckv", "k_rope")


def mla_model(*, q_norm: bool = True, kv_norm: bool = True, k_rope_width: int = DR, opset: int = 17,
              shared_q: bool = False) -> onnx.ModelProto:
    """x [B, S, HID] -> q_nope, q_rope, ckv, k_rope as DeepseekV3Attention computes them."""
    rng = np.random.default_rng(0)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def const(name, value, dtype=np.int64):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def weight(name, shape):
        return const(name, rng.standard_normal(shape) / np.sqrt(shape[0]), np.float32)

    def node(op, ins, out, n_out=1, **kw):
        outs = [out] if n_out == 1 else [f"{out}_{i}" for i in range(n_out)]
        nodes.append(helper.make_node(op, ins, outs, name=out + "_n", **kw))
        return outs[0] if n_out == 1 else outs

    def rms(x, prefix, width):
        sq = node("Pow", [x, const(prefix + "_two", 2.0, np.float32)], prefix + "_sq")
        mean = node("ReduceMean", [sq], prefix + "_mean", axes=[-1], keepdims=1) if opset < 18 else node(
            "ReduceMean", [sq, const(prefix + "_axes", [-1])], prefix + "_mean", keepdims=1)
        var = node("Add", [mean, const(prefix + "_eps", 1e-6, np.float32)], prefix + "_var")
        inv = node("Reciprocal", [node("Sqrt", [var], prefix + "_std")], prefix + "_inv")
        normed = node("Mul", [x, inv], prefix + "_normed")
        gamma = const(prefix + "_w", 1.0 + 0.1 * rng.standard_normal(width), np.float32)
        return node("Mul", [gamma, normed], prefix + "_out")

    def rope(x, cos, sin, prefix, width):
        h = width // 2
        x1 = node("Slice", [x, const(prefix + "_s0", [0]), const(prefix + "_e0", [h]), const(prefix + "_a0", [-1])],
                  prefix + "_x1")
        x2 = node("Slice", [x, const(prefix + "_s1", [h]), const(prefix + "_e1", [width]),
                            const(prefix + "_a1", [-1])], prefix + "_x2")
        rot = node("Concat", [node("Neg", [x2], prefix + "_neg"), x1], prefix + "_rot", axis=-1)
        return node("Add", [node("Mul", [x, cos], prefix + "_xc"), node("Mul", [rot, sin], prefix + "_rs")],
                    prefix + "_y")

    # cos/sin [1, 1, S, DR] from positions (emb = cat(freqs, freqs))
    inv = 1.0 / (10000 ** (np.arange(0, DR, 2) / DR))
    freqs = np.arange(S)[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], -1)[None, None].astype(np.float32)
    cos, sin = const("cos", np.cos(emb), np.float32), const("sin", np.sin(emb), np.float32)

    cq = node("MatMul", ["x", weight("w_dq", (HID, RQ))], "q_a")
    if q_norm:
        cq = rms(cq, "q_a_ln", RQ)
    q = node("MatMul", [cq, weight("w_uq", (RQ, N * (DN + DR)))], "q_b")
    q = node("Transpose", [node("Reshape", [q, const("q_shape", [B, S, N, DN + DR])], "q_view")], "q_t",
             perm=[0, 2, 1, 3])
    q_nope, q_pe = node("Split", [q, const("q_split", [DN, DR])], "q_split", 2, axis=-1)
    q_rope = rope(q_pe, cos, sin, "q_rope", DR)
    ckv_kr = node("MatMul", ["x", weight("w_dkv", (HID, RKV + DR))], "kv_a")
    c, k_pe = node("Split", [ckv_kr, const("kv_split", [RKV + DR - k_rope_width, k_rope_width])], "kv_split", 2,
                   axis=-1)
    ckv = rms(c, "kv_a_ln", RKV + DR - k_rope_width) if kv_norm else node("Identity", [c], "ckv_id")
    k_pe = node("Reshape", [k_pe, const("k_shape", [B, 1, S, k_rope_width])], "k_view")
    if k_rope_width == DR:
        k_rope = rope(k_pe, cos, sin, "k_rope", DR)
    else:
        emb_k = np.concatenate([freqs[:, :k_rope_width // 2]] * 2, -1)[None, None].astype(np.float32)
        k_rope = rope(k_pe, const("cos_k", np.cos(emb_k), np.float32), const("sin_k", np.sin(emb_k), np.float32),
                      "k_rope", k_rope_width)
    for src, dst in zip((q_nope, q_rope, ckv, k_rope), OUTS):
        nodes.append(helper.make_node("Identity", [src], [dst], name=dst + "_out"))
    outputs = list(OUTS)
    if shared_q:   # the q up projection read elsewhere too
        outputs.append(node("Neg", ["q_b"], "side"))
    g = helper.make_graph(nodes, "mla", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, HID])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                                                ir_version=IR_VERSION))


def _optimize(model, **kw):
    return optimize(model, None, OptimizeOptions(force_fuse=True, **kw))


def _mla_nodes(model):
    return [n for n in model.graph.node if n.op_type == "MlaProlog" and n.domain == "npufuse"]


def _feeds():
    return {"x": np.random.default_rng(3).standard_normal((B, S, HID)).astype(np.float32)}


@pytest.mark.parametrize("opset", [17, 18])
def test_mla_block_fuses_and_runs_as_before(opset) -> None:
    model = mla_model(opset=opset)
    res = _optimize(model)
    mla = _mla_nodes(res.model)
    assert len(mla) == 1, [(f.pattern, f.reason, f.detail) for f in res.refusals]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in mla[0].attribute}
    assert (attrs["num_heads"], attrs["qk_nope_head_dim"], attrs["qk_rope_head_dim"], attrs["kv_lora_rank"]) == (
        N, DN, DR, RKV)
    assert abs(attrs["epsilon_cq"] - 1e-6) < 1e-12 and attrs["interleaved"] == 0
    assert all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok, res.model_check
    # the norms and ropes fused first (phase 0), then the prolog took them: nothing of them is left
    left = {n.op_type for n in res.model.graph.node}
    assert not left & {"MatMul", "Split", "RotaryEmbedding", "RMSNorm", "Transpose", "Neg"}, left
    assert fusion_census(res.model)["mla_prolog"] == 1 and fusion_census(res.model)["rmsnorm"] == 2
    feeds = _feeds()
    got, want = run(res.model, feeds), run(model, feeds)
    for o in OUTS:
        c = compare(o, got[o], want[o])
        assert c.ok, (o, c.detail)


@pytest.mark.parametrize("kw,reason", [
    ({"q_norm": False}, "no-q-norm"),          # no RMSNorm between the q down and up projections
    ({"kv_norm": False}, "no-kv-norm"),
    ({"k_rope_width": 2}, "rope-width-mismatch"),   # the kv split's rope part is narrower than q's
    ({"shared_q": True}, "shared-intermediate"),
])
def test_near_miss_does_not_fuse(kw, reason) -> None:
    res = _optimize(mla_model(**kw))
    assert not _mla_nodes(res.model)
    reasons = [f.reason for f in res.refusals if f.pattern == "mla_prolog"]
    assert reason in reasons, [(f.pattern, f.reason, f.detail) for f in res.refusals]
    # the parts still fuse on their own (the q and k ropes, sharing cos/sin, as one RotaryEmbeddingPair where no
    # target prices it), and the model still runs as before
    assert {n.op_type for n in res.model.graph.node} & {"RotaryEmbedding", "RotaryEmbeddingPair"}
    assert res.model_check is not None and res.model_check.ok


def test_function_body_matches_reference_kernel() -> None:
    attrs = {"num_heads": N, "qk_nope_head_dim": DN, "qk_rope_head_dim": DR, "kv_lora_rank": RKV,
             "epsilon_cq": 1e-6, "epsilon_ckv": 1e-5, "interleaved": 0}
    rng = np.random.default_rng(1)
    shapes = {"X": (B, S, HID), "W_dq": (HID, RQ), "gamma_cq": (RQ,), "W_uq_qr": (RQ, N * (DN + DR)),
              "W_dkv_kr": (HID, RKV + DR), "gamma_ckv": (RKV,), "cos": (1, 1, S, DR), "sin": (1, 1, S, DR)}
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    for opset in (17, 18):
        node, fn = MLA_PROLOG.make_node(list(shapes), list(OUTS), "mla", attrs, opset, TensorProto.FLOAT)
        g = helper.make_graph([node], "t", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v)
                                            for k, v in shapes.items()],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in OUTS])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("npufuse", 1)],
                                  ir_version=IR_VERSION, functions=[fn])
        got = run(model, feeds)
        want = mla_prolog_reference([feeds[k] for k in shapes], attrs)
        assert [w.shape for w in want] == [(B, N, S, DN), (B, N, S, DR), (B, S, RKV), (B, 1, S, DR)]
        for o, w in zip(OUTS, want):
            c = compare(o, got[o], w)
            assert c.ok, (opset, o, c.detail)


@pytest.mark.parametrize("profile", ["Ascend910B2", "Ascend310P3"])
def test_priced_as_one_kernel_and_mapped_to_mla_prolog(profile) -> None:
    spec = load_profile(profile)
    b, s, hid, rq, rkv, n, dn, dr = 1, 512, 7168, 1536, 512, 32, 128, 64
    f16 = "float16"

    def t(*shape, const=False):
        return TensorInfo(shape, f16, const)

    x = t(b, s, hid)
    unfused = (
        OpWork("dq", "MatMul", "", (x, t(hid, rq, const=True)), (t(b, s, rq),)),
        OpWork("ncq", "RMSNormalization", "", (t(b, s, rq), t(rq, const=True)), (t(b, s, rq),), {"axis": -1}),
        OpWork("uq", "MatMul", "", (t(b, s, rq), t(rq, n * (dn + dr), const=True)), (t(b, s, n * (dn + dr)),)),
        OpWork("tr", "Transpose", "", (t(b, s, n, dn + dr),), (t(b, n, s, dn + dr),), {"perm": [0, 2, 1, 3]}),
        OpWork("sq", "Split", "", (t(b, n, s, dn + dr),), (t(b, n, s, dn), t(b, n, s, dr)), {"axis": -1}),
        OpWork("rq", "RotaryEmbedding", "npufuse", (t(b, n, s, dr), t(1, 1, s, dr), t(1, 1, s, dr)),
               (t(b, n, s, dr),)),
        OpWork("dkv", "MatMul", "", (x, t(hid, rkv + dr, const=True)), (t(b, s, rkv + dr),)),
        OpWork("skv", "Split", "", (t(b, s, rkv + dr),), (t(b, s, rkv), t(b, s, dr)), {"axis": -1}),
        OpWork("nkv", "RMSNormalization", "", (t(b, s, rkv), t(rkv, const=True)), (t(b, s, rkv),), {"axis": -1}),
        OpWork("rk", "RotaryEmbedding", "npufuse", (t(b, 1, s, dr), t(1, 1, s, dr), t(1, 1, s, dr)),
               (t(b, 1, s, dr),)),
    )
    attrs = {"num_heads": n, "qk_nope_head_dim": dn, "qk_rope_head_dim": dr, "kv_lora_rank": rkv,
             "epsilon_cq": 1e-6, "epsilon_ckv": 1e-6, "interleaved": 0}
    fused = OpWork("mla", "MlaProlog", "npufuse", (x, t(hid, rq, const=True), t(rq, const=True),
                                                   t(rq, n * (dn + dr), const=True), t(hid, rkv + dr, const=True),
                                                   t(rkv, const=True), t(1, 1, s, dr), t(1, 1, s, dr)),
                   (t(b, n, s, dn), t(b, n, s, dr), t(b, s, rkv), t(b, 1, s, dr)), attrs)
    node = helper.make_node("MlaProlog", ["x", "wdq", "gcq", "wuq", "wdkv", "gckv", "cos", "sin"], list(OUTS),
                            domain="npufuse", name="mla", **attrs)
    rec = region_kernel([node], chip=spec.chip, profile=profile)
    assert rec["op"] == "MlaProlog"
    assert {i["name"]: i["value"] for i in rec["inputs"] if i["value"]} == {
        "token_x": "x", "weight_dq": "wdq", "weight_uq_qr": "wuq", "weight_dkv_kr": "wdkv", "rmsnorm_gamma_cq": "gcq",
        "rmsnorm_gamma_ckv": "gckv", "rope_sin": "sin", "rope_cos": "cos"}
    assert [o["name"] for o in rec["outputs"]] == ["query", "query_rope", "kv_cache", "kr_cache"]
    d = decide(FusionCandidate("mla_prolog", unfused, (fused,)), spec, unsupported=rec["problem"])
    if profile == "Ascend910B2":
        assert rec["available"] and rec["problem"] is None
        assert d.fuse and d.gain_us > 0
    else:   # MlaProlog ships for Atlas A2/A3 only: the 310P keeps the region unfused, with that reason
        assert not rec["available"] and rec["problem"] == "MlaProlog has no kernel for ascend310p (Ascend310P3)"
        assert not d.fuse


def test_310p_target_keeps_the_block_unfused_with_the_reason() -> None:
    res = optimize(mla_model(), None, OptimizeOptions(spec=load_profile("Ascend310P3")))
    assert not _mla_nodes(res.model)
    res = optimize(mla_model(), None, OptimizeOptions(spec=load_profile("Ascend910B2")))
    assert len(_mla_nodes(res.model)) == 1


_LLM = {e["file"]: e for e in json.loads((FIXTURES / "manifest.json").read_text())["llm_fixtures"]}


@pytest.mark.parametrize("fixture", sorted(f for f, e in _LLM.items() if e["family"] == "deepseek_v3"))
def test_every_deepseek_layer_is_one_mla_prolog(fixture) -> None:
    from npufuse.ir.modelio import load_model

    res = optimize(load_model(FIXTURES / fixture), str(FIXTURES), OptimizeOptions(spec=load_profile("Ascend910B2")))
    layers = _LLM[fixture]["config"]["num_layers"]
    assert len(_mla_nodes(res.model)) == layers == _LLM[fixture]["expected"]["mla_prolog"], [
        (f.reason, f.detail) for f in res.refusals if f.pattern == "mla_prolog"]
    assert res.model_check is not None and res.model_check.ok
    # every rotation was fused first (and counted) before the prolog took it
    assert sum(1 for r in res.applied if r.match.pattern == "rotary") == 2 * layers
    assert [r.ascend_kernel["op"] for r in res.applied if r.match.pattern == "mla_prolog"] == ["MlaProlog"] * layers


def test_pattern_is_registered_after_rotary_and_norms() -> None:
    phases = {p.name: p.phase for p in PATTERNS}
    assert phases["rotary"] < phases["mla_prolog"] < phases["matmul_epilogue"]
    assert phases["rmsnorm"] < phases["mla_prolog"]
