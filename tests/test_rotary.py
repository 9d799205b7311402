"""Rotary position embedding => npufuse.RotaryEmbedding: hand-built graphs of every form (fp32/fp16, static and
symbolic sequence), near-misses that must not fuse, reference kernel vs function body vs the original subgraph, a
wrong kernel rolled back, pricing, the Ascend kernel, and the Llama exports (attention still fused after)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import with_output_shapes
from onnx import TensorProto, helper, numpy_helper

import npufuse.patterns as patterns_registry
from npufuse.cost_model import FusionCandidate, OpWork, TensorInfo, decide
from npufuse.fusion.census import fusion_census
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import attributes
from npufuse.npu_model.ascend_kernels import region_kernel
from npufuse.npu_model.spec import load_profile
from npufuse.patterns import PATTERNS
from npufuse.patterns.rotary import ROTARY, RotaryPattern, rotary_reference
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

FIXTURES = Path(__file__).parent / "fixtures"
B, H, S, D = 2, 3, 5, 8
INT64_MAX = np.iinfo(np.int64).max


def _builders(inits: list, nodes: list):
    """const / node / sl (a Slice on the last axis), appending to `inits` and `nodes`: the graph builders' kit."""
    def const(name, value, np_type=np.int64):
        inits.append(numpy_helper.from_array(np.array(value, dtype=np_type), name))
        return name

    def node(op, ins, out, **kw):
        nodes.append(helper.make_node(op, ins, [out], name=out + "_n", **kw))
        return out

    def sl(x, start, end, out, step=1):
        return node("Slice", [x, const(out + "_s", [start]), const(out + "_e", [end]), const(out + "_a", [-1]),
                              const(out + "_st", [step])], out)

    return const, node, sl


def rotary_model(*, form: str = "half", dtype=np.float32, symbolic: bool = False, rotary_dim: int = 0,
                 opset: int = 17, halves: tuple | None = None, neg_first_half: bool = False,
                 cos_width: int | None = None, shared: bool = False, shape_bounds: bool = False,
                 swap_add: bool = False) -> onnx.ModelProto:
    """X [B, H, S, D] -> (partial) rotary with cos/sin computed from position ids (inv_freq x pos -> Cos/Sin)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    seq = "seq" if symbolic else S
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    outputs = ["Y"]
    r = rotary_dim or D
    width = cos_width or r

    const, node, sl = _builders(inits, nodes)

    # cos/sin: [1, 1, S, width] from positions [S, 1] x inv_freq [1, width/2], duplicated (half) or interleaved
    inv = 1.0 / (10000 ** (np.arange(0, max(width, 2), 2) / max(width, 2)))
    pos = node("Cast", ["pos"], "pos_f", to=TensorProto.FLOAT)
    freqs = node("Mul", [node("Unsqueeze", [pos, const("ax1", [1])], "pos2"),
                         const("inv_freq", inv[None, :], np.float32)], "freqs")
    if form == "interleaved":
        emb = node("Reshape", [node("Concat", [node("Unsqueeze", [freqs, const("axm", [-1])], "fa"),
                                               node("Unsqueeze", [freqs, const("axm2", [-1])], "fb")], "fab", axis=-1),
                               const("emb_shape", [-1, width])], "emb")
    elif width == 1:    # one angle per position: [S, 1] broadcasts along the head but is not a rotary table
        emb = freqs
    else:
        emb = node("Concat", [freqs, freqs], "emb", axis=-1)
    tables = []
    for fn in ("Cos", "Sin"):
        t = node(fn, [emb], fn.lower() + "_raw")
        if dtype != np.float32:
            t = node("Cast", [t], fn.lower() + "_cast", to=elem)
        tables.append(node("Unsqueeze", [t, const(fn + "_ax", [0, 1])], fn.lower()))
    cos, sin = tables
    x = "X"
    if rotary_dim:
        x = sl("X", 0, rotary_dim, "x_rot")
        passed = sl("X", rotary_dim, INT64_MAX, "x_pass")
    h = r // 2
    if form == "half":
        (s0, e0), (s1, e1) = halves or ((0, h), (h, INT64_MAX))
        if shape_bounds:
            d = node("Gather", [node("Shape", [x], "x_shape"), const("gidx", 3)], "x_dim")
            mid = node("Unsqueeze", [node("Div", [d, const("two", 2)], "x_half"), const("ax0", [0])], "x_mid")
            x1 = node("Slice", [x, const("z", [0]), mid, const("a1", [-1]), const("o1", [1])], "x1")
            x2 = node("Slice", [x, mid, const("big", [INT64_MAX]), const("a2", [-1]), const("o2", [1])], "x2")
        else:
            x1, x2 = sl(x, s0, e0, "x1"), sl(x, s1, e1, "x2")
        if neg_first_half:
            rot = node("Concat", [x2, node("Neg", [x1], "neg")], "rot", axis=-1)
        else:
            rot = node("Concat", [node("Neg", [x2], "neg"), x1], "rot", axis=-1)
    else:
        even, odd = sl(x, 0, INT64_MAX, "x_even", 2), sl(x, 1, INT64_MAX, "x_odd", 2)
        a, b = (even, odd) if neg_first_half else (odd, even)
        st = node("Concat", [node("Unsqueeze", [node("Neg", [a], "neg"), const("u0", [-1])], "ua"),
                             node("Unsqueeze", [b, const("u1", [-1])], "ub")], "stack", axis=-1)
        rot = node("Reshape", [st, const("flat", [0, 0, 0, -1])], "rot")
    mc, ms = node("Mul", [x, cos], "xc"), node("Mul", [sin, rot], "rs")
    y = node("Add", [ms, mc] if swap_add else [mc, ms], "y_rot" if rotary_dim else "Y")
    if rotary_dim:
        node("Concat", [y, passed], "Y", axis=-1)
    if shared == "output":
        outputs.append("rot")
    elif shared:
        outputs.append(node("Neg", ["rot"], "side"))
    inputs = [helper.make_tensor_value_info("X", elem, [B, H, seq, D]),
              helper.make_tensor_value_info("pos", TensorProto.INT64, [seq])]
    g = helper.make_graph(nodes, "rotary", inputs, [helper.make_tensor_value_info(o, elem, None) for o in outputs],
                          inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION))


def _optimize(model, **kw):
    return optimize(model, None, OptimizeOptions(force_fuse=True, **kw))


def _rotary_nodes(model):
    return [n for n in model.graph.node if n.op_type == "RotaryEmbedding" and n.domain == "npufuse"]


def _feeds(model, seed=0):
    rng = np.random.default_rng(seed)
    dt = helper.tensor_dtype_to_np_dtype(model.graph.input[0].type.tensor_type.elem_type)
    return {"X": rng.standard_normal((B, H, S, D)).astype(dt), "pos": np.arange(3, 3 + S, dtype=np.int64)}


def _assert_fused(model, kind, interleaved, rotary_dim):
    res = _optimize(model)
    nodes = _rotary_nodes(res.model)
    assert len(nodes) == 1, [(f.reason, f.detail) for f in res.refusals]
    assert attributes(nodes[0]) == {"interleaved": interleaved, "rotary_dim": rotary_dim}
    assert [r.match.kind for r in res.applied if r.match.pattern == "rotary"] == [kind]
    assert all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok, res.model_check
    assert "Neg" not in {n.op_type for n in res.model.graph.node}
    feeds = _feeds(model)
    c = compare("Y", run(res.model, feeds)["Y"], run(model, feeds)["Y"])
    assert c.ok, c.detail
    return res


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("opset", [14, 17, 18])
def test_rotate_half_fuses(dtype, symbolic, opset) -> None:
    _assert_fused(rotary_model(dtype=dtype, symbolic=symbolic, opset=opset), "RotaryEmbedding[half]", 0, 0)


@pytest.mark.parametrize("case", [dict(shape_bounds=True), dict(swap_add=True), dict(halves=((0, 4), (4, 8))),
                                  dict(halves=((0, 4), (-4, INT64_MAX)))])
def test_rotate_half_variants(case) -> None:
    _assert_fused(rotary_model(**case), "RotaryEmbedding[half]", 0, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("symbolic", [False, True])
def test_interleaved_and_partial_fuse(dtype, symbolic) -> None:
    _assert_fused(rotary_model(form="interleaved", dtype=dtype, symbolic=symbolic), "RotaryEmbedding[interleaved]",
                  1, 0)
    _assert_fused(rotary_model(rotary_dim=4, dtype=dtype, symbolic=symbolic), "RotaryEmbedding[half,partial]", 0, 4)
    _assert_fused(rotary_model(form="interleaved", rotary_dim=4, dtype=dtype, symbolic=symbolic),
                  "RotaryEmbedding[interleaved,partial]", 1, 4)


@pytest.mark.parametrize("case,reason", [
    (dict(halves=((0, 3), (3, INT64_MAX))), "uneven-halves"),
    (dict(halves=((1, 5), (4, INT64_MAX))), "uneven-halves"),
    (dict(neg_first_half=True), "neg-wrong-half"),
    (dict(form="interleaved", neg_first_half=True), "neg-wrong-half"),
    (dict(cos_width=1), "cos-sin-shape"),
    (dict(shared=True), "shared-intermediate"),
    (dict(shared="output"), "intermediate-is-output"),
])
def test_near_miss_does_not_fuse(case, reason) -> None:
    try:
        model = rotary_model(**case)
    except Exception as exc:   # pragma: no cover - the builder must make a valid model
        pytest.fail(f"builder: {exc}")
    res = _optimize(model)
    assert not _rotary_nodes(res.model)
    assert [f.reason for f in res.refusals if f.pattern == "rotary"] == [reason], res.refusals
    assert res.model_check is None or res.model_check.ok


@pytest.mark.parametrize("attrs", [{"interleaved": i, "rotary_dim": r} for i in (0, 1) for r in (0, 4)])
@pytest.mark.parametrize("opset", [14, 17, 18, 23])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_function_body_matches_reference_kernel(attrs, opset, dtype) -> None:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    fn = ROTARY.body(attrs, opset, elem)
    r = attrs["rotary_dim"] or D
    node = helper.make_node("RotaryEmbedding", ["X", "cos", "sin"], ["Y"], domain="npufuse", **attrs)
    node.overload = fn.overload
    g = helper.make_graph([node], "t", [helper.make_tensor_value_info("X", elem, [B, H, S, D]),
                                        helper.make_tensor_value_info("cos", elem, [1, 1, S, r]),
                                        helper.make_tensor_value_info("sin", elem, [1, 1, S, r])],
                          [helper.make_tensor_value_info("Y", elem, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("npufuse", 1)],
                              ir_version=IR_VERSION, functions=[fn])
    rng = np.random.default_rng(1)
    feeds = {"X": rng.standard_normal((B, H, S, D)).astype(dtype),
             "cos": rng.standard_normal((1, 1, S, r)).astype(dtype), "sin": rng.standard_normal((1, 1, S, r)).astype(dtype)}
    got = run(model, feeds)["Y"]
    want = rotary_reference([feeds["X"], feeds["cos"], feeds["sin"]], attrs)[0]
    c = compare("Y", got, want)
    assert c.ok, c.detail


def test_reference_kernel_is_the_textbook_math() -> None:
    rng = np.random.default_rng(0)
    x, cos, sin = rng.standard_normal((2, 6)), rng.standard_normal((1, 6)), rng.standard_normal((1, 6))
    half = np.concatenate([-x[:, 3:], x[:, :3]], -1)
    np.testing.assert_allclose(rotary_reference([x, cos, sin], {})[0], x * cos + half * sin, rtol=1e-12)
    pairs = np.stack([-x[:, 1::2], x[:, 0::2]], -1).reshape(2, 6)
    np.testing.assert_allclose(rotary_reference([x, cos, sin], {"interleaved": 1})[0], x * cos + pairs * sin,
                               rtol=1e-12)
    got = rotary_reference([x, cos[:, :4], sin[:, :4]], {"rotary_dim": 4})[0]
    xr = x[:, :4]
    want = np.concatenate([xr * cos[:, :4] + np.concatenate([-xr[:, 2:], xr[:, :2]], -1) * sin[:, :4], x[:, 4:]], -1)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_a_wrong_reference_kernel_is_rolled_back(monkeypatch) -> None:
    real = ROTARY.reference

    def wrong_sign(inputs, attrs):     # the inverse rotation: sin negated
        x, cos, sin = inputs[:3]
        return real([x, cos, -sin], attrs)

    defs = dict(patterns_registry.fused_op_defs())
    defs[("npufuse", "RotaryEmbedding")] = dataclasses.replace(ROTARY, reference=wrong_sign)
    monkeypatch.setattr(patterns_registry, "fused_op_defs", lambda: defs)
    res = _optimize(rotary_model())
    rolled = [r for r in res.rolled_back if r.match.pattern == "rotary"]
    assert len(rolled) == 1 and rolled[0].check is not None and not rolled[0].check.ok
    assert not _rotary_nodes(res.model)
    assert res.model_check is None or res.model_check.ok


@pytest.mark.parametrize("profile", ["Ascend910B2", "Ascend310P3"])
def test_priced_as_one_vector_kernel_and_mapped_to_the_ascend_kernel(profile) -> None:
    spec = load_profile(profile)
    x, t = TensorInfo((1, 32, 512, 128), "float16"), TensorInfo((1, 1, 512, 128), "float16")
    half = TensorInfo((1, 32, 512, 64), "float16")
    unfused = (OpWork("s1", "Slice", "", (x,), (half,)), OpWork("s2", "Slice", "", (x,), (half,)),
               OpWork("neg", "Neg", "", (half,), (half,)), OpWork("cat", "Concat", "", (half, half), (x,)),
               OpWork("xc", "Mul", "", (x, t), (x,)), OpWork("rs", "Mul", "", (x, t), (x,)),
               OpWork("add", "Add", "", (x, x), (x,)))
    fused = OpWork("rope", "RotaryEmbedding", "npufuse", (x, t, t), (x,), {"interleaved": 0, "rotary_dim": 0})
    d = decide(FusionCandidate("rotary", unfused, (fused,)), spec)
    assert d.fuse and d.gain_us > 0
    node = helper.make_node("RotaryEmbedding", ["q", "cos", "sin"], ["y"], domain="npufuse", name="rope",
                            interleaved=1, rotary_dim=0)
    rec = region_kernel([node], chip=spec.chip, profile=profile)
    assert rec["op"] == "RotaryPositionEmbedding" and rec["attrs"] == {"mode": 1}
    assert [i["name"] for i in rec["inputs"]] == ["x", "cos", "sin"]
    assert rec["available"] == (profile == "Ascend910B2")


_MANIFEST = {f["file"]: f for f in json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]}
LLAMA_FIXTURES = sorted(f for f, e in _MANIFEST.items() if e["base_family"] == "llama")


@pytest.mark.parametrize("fixture", LLAMA_FIXTURES)
def test_every_llama_rotary_fuses_and_attention_still_does(fixture) -> None:
    entry = _MANIFEST[fixture]
    n_layers = entry["config"]["num_layers"]
    assert entry["expected"]["rotary_applications"] == 2 * n_layers
    model = onnx.load(str(FIXTURES / fixture), load_external_data=False)
    res = optimize(model, str(FIXTURES), OptimizeOptions())
    rot = [r for r in res.records if r.match.pattern == "rotary"]
    assert [r.status for r in rot] == ["applied"] * 2 * n_layers, [(r.status, r.reason) for r in rot]
    assert all(r.check is not None and r.check.ok for r in rot)
    assert {r.match.kind for r in rot} == {"RotaryEmbedding[half]"}
    assert all(r.ascend_kernel and r.ascend_kernel["op"] == "RotaryPositionEmbedding" for r in rot)
    # with no target every legal candidate fuses: phase 1 then joins each layer's q and k into one pair
    assert not _rotary_nodes(res.model) and "Neg" not in {n.op_type for n in res.model.graph.node}
    pairs = _pair_nodes(res.model)
    assert len(pairs) == n_layers
    assert [r.status for r in res.records if r.match.pattern == "rotary_pair"] == ["applied"] * n_layers
    census = fusion_census(res.model)
    assert census["attention"] == entry["expected"]["attention"] == n_layers
    assert census["rotary"] == entry["expected"]["rotary_applications"] == 2 * n_layers   # two per pair
    # every fused attention reads the pair's rotated q and k
    att = [n for n in res.model.graph.node if n.op_type == "FusedAttention"]
    assert len(att) == n_layers and sorted((n.input[0], n.input[1]) for n in att) == sorted(
        (p.output[0], p.output[1]) for p in pairs)
    assert not [f for f in res.refusals if f.pattern in ("rotary", "rotary_pair")]
    assert res.model_check is not None and res.model_check.ok, res.model_check


def test_pattern_is_registered_before_attention() -> None:
    p = next(p for p in PATTERNS if p.name == "rotary")
    att = next(p for p in PATTERNS if p.name == "attention")
    assert isinstance(p, RotaryPattern) and p.phase < att.phase and p.anchor_ops == {"Add"}
    assert ("npufuse", "RotaryEmbedding") in patterns_registry.fused_op_defs()


# ---- the q/k pair: npufuse.RotaryEmbeddingPair (Ascend ApplyRotaryPosEmb) ------------------------------------------

PN, PNK, PS = 4, 2, 5


def qk_model(*, d: int = 8, form: str = "half", k_form: str | None = None, rotary_dim: int = 0,
             k_rotary_dim: int | None = None, k_tables: str = "same", layout: str = "BNSD", scores: bool = True,
             dtype=np.float32) -> onnx.ModelProto:
    """An attention's q [B, N, S, D] and k [B, NK, S, D] (or BSND) rotated, then softmax(q·kᵀ)·v (GQA: k and v
    repeated to N heads). k_tables: "same" (q's cos/sin), "copy" (equal constants of another name), "other"
    (another base)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    k_form = k_form or form
    k_rotary_dim = rotary_dim if k_rotary_dim is None else k_rotary_dim
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    bnsd = layout == "BNSD"

    const, node, sl = _builders(inits, nodes)

    def tables(width, base, form_, p, as_const=False):
        inv = 1.0 / (base ** (np.arange(0, width, 2) / width))
        freqs = np.arange(3, 3 + PS)[:, None] * inv[None, :]
        emb = np.repeat(freqs, 2, axis=-1) if form_ == "interleaved" else np.concatenate([freqs, freqs], -1)
        shape = (1, 1, PS, width) if bnsd else (1, PS, 1, width)
        return (const(p + "cos", np.cos(emb).reshape(shape), dtype), const(p + "sin", np.sin(emb).reshape(shape), dtype))

    def rotate(x, form_, r, cos, sin, p, out):
        if r:
            xr, passed = sl(x, 0, r, p + "x_rot"), sl(x, r, INT64_MAX, p + "x_pass")
        else:
            xr = x
        width = r or d
        if form_ == "half":
            rot = node("Concat", [node("Neg", [sl(xr, width // 2, INT64_MAX, p + "x2")], p + "neg"),
                                  sl(xr, 0, width // 2, p + "x1")], p + "rot", axis=-1)
        else:
            even, odd = sl(xr, 0, INT64_MAX, p + "even", 2), sl(xr, 1, INT64_MAX, p + "odd", 2)
            st = node("Concat", [node("Unsqueeze", [node("Neg", [odd], p + "neg"), const(p + "u0", [-1])], p + "ua"),
                                 node("Unsqueeze", [even, const(p + "u1", [-1])], p + "ub")], p + "stack", axis=-1)
            rot = node("Reshape", [st, const(p + "flat", [0, 0, 0, -1])], p + "rot")
        y = node("Add", [node("Mul", [xr, cos], p + "xc"), node("Mul", [rot, sin], p + "rs")],
                 p + "y" if r else out)
        if r:
            node("Concat", [y, passed], out, axis=-1)
        return out

    q_cos, q_sin = tables(rotary_dim or d, 10000.0, form, "q_")
    if k_tables == "same" and (k_rotary_dim or d) == (rotary_dim or d) and k_form == form:
        k_cos, k_sin = q_cos, q_sin
    else:
        k_cos, k_sin = tables(k_rotary_dim or d, 500.0 if k_tables == "other" else 10000.0, k_form, "k_")
    q = rotate("Q", form, rotary_dim, q_cos, q_sin, "q_", "q_rope")
    k = rotate("K", k_form, k_rotary_dim, k_cos, k_sin, "k_", "k_rope")
    outputs = ["Y"]
    if scores:
        if not bnsd:
            q = node("Transpose", [q], "q_bnsd", perm=[0, 2, 1, 3])
            k = node("Transpose", [k], "k_bnsd", perm=[0, 2, 1, 3])
        rep = PN // PNK
        kr = node("Reshape", [node("Expand", [node("Unsqueeze", [k, const("k_ax", [2])], "k_u"),
                                              const("k_rep", [1, PNK, rep, PS, d])], "k_e"),
                              const("kv_flat", [1, PN, PS, d])], "k_rep_heads")
        v = node("Reshape", [node("Expand", [node("Unsqueeze", ["V", const("v_ax", [2])], "v_u"),
                                             const("v_rep", [1, PNK, rep, PS, d])], "v_e"),
                             const("v_flat", [1, PN, PS, d])], "v_rep_heads")
        sc = node("Div", [node("MatMul", [q, node("Transpose", [kr], "k_t", perm=[0, 1, 3, 2])], "qk"),
                          const("scale", np.sqrt(d), dtype)], "scores")
        node("MatMul", [node("Softmax", [sc], "probs", axis=-1), v], "Y")
    else:
        outputs = [q, k]
    qs, ks = ([1, PN, PS, d], [1, PNK, PS, d]) if bnsd else ([1, PS, PN, d], [1, PS, PNK, d])
    inputs = [helper.make_tensor_value_info("Q", elem, qs), helper.make_tensor_value_info("K", elem, ks)]
    if scores:
        inputs.append(helper.make_tensor_value_info("V", elem, [1, PNK, PS, d]))
    out_shapes = {"Y": [1, PN, PS, d], q: qs, k: ks}
    g = helper.make_graph(nodes, "qk_rotary", inputs, [helper.make_tensor_value_info(o, elem, out_shapes[o])
                                                        for o in outputs], inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION))


def _pair_nodes(model):
    return [n for n in model.graph.node if n.op_type == "RotaryEmbeddingPair" and n.domain == "npufuse"]


@pytest.mark.parametrize("kw,kind", [
    ({}, "RotaryEmbeddingPair[half]"),
    ({"form": "interleaved"}, "RotaryEmbeddingPair[interleaved]"),
    ({"rotary_dim": 4}, "RotaryEmbeddingPair[half,partial]"),
    ({"k_tables": "copy"}, "RotaryEmbeddingPair[half]"),        # equal constants under another name
    ({"layout": "BSND"}, "RotaryEmbeddingPair[half]"),
    ({"scores": False}, "RotaryEmbeddingPair[half]"),           # no attention: the two rotations of one cos/sin
])
def test_qk_pair_fuses_and_attention_still_does(kw, kind) -> None:
    model = qk_model(**kw)
    res = optimize(model, None, OptimizeOptions())
    pairs = _pair_nodes(res.model)
    assert len(pairs) == 1, [(f.pattern, f.reason, f.detail) for f in res.refusals]
    (rec,) = [r for r in res.applied if r.match.pattern == "rotary_pair"]
    assert rec.match.kind == kind and rec.check is not None and rec.check.ok
    a = attributes(pairs[0])
    assert a["interleaved"] == int(kw.get("form") == "interleaved") and a["rotary_dim"] == kw.get("rotary_dim", 0)
    assert not _rotary_nodes(res.model) and "Neg" not in {n.op_type for n in res.model.graph.node}
    assert list(pairs[0].input[:2]) == ["Q", "K"]
    if kw.get("scores", True):
        (att,) = [n for n in res.model.graph.node if n.op_type == "FusedAttention"]
        assert att.input[0] == pairs[0].output[0] or "q_bnsd" in att.input[0] or kw.get("layout") == "BSND"
    assert res.model_check is not None and res.model_check.ok, res.model_check
    rng = np.random.default_rng(3)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in model.graph.input}
    got, want = run(res.model, feeds), run(model, feeds)
    for o in want:
        c = compare(o, got[o], want[o])
        assert c.ok, (o, c.detail)


@pytest.mark.parametrize("kw,reason", [
    ({"k_tables": "other"}, "pair-different-cos-sin"),
    ({"k_form": "interleaved"}, "pair-different-form"),
    ({"rotary_dim": 4, "k_rotary_dim": 0}, "pair-different-rotary-dim"),
])
def test_qk_pair_near_miss_keeps_the_per_tensor_form(kw, reason) -> None:
    res = optimize(qk_model(**kw), None, OptimizeOptions())
    assert not _pair_nodes(res.model)
    near = [f for f in res.refusals if f.pattern == "rotary_pair"]
    assert [f.reason for f in near] == [reason], [(f.reason, f.detail) for f in res.refusals]
    assert "each is rotated on its own" in near[0].detail
    assert len(_rotary_nodes(res.model)) == 2                    # each still fuses per tensor
    assert sum(n.op_type == "FusedAttention" for n in res.model.graph.node) == 1
    assert res.model_check is not None and res.model_check.ok


def test_a_lone_rotation_stays_per_tensor() -> None:
    res = optimize(rotary_model(), None, OptimizeOptions())
    assert len(_rotary_nodes(res.model)) == 1 and not _pair_nodes(res.model)
    assert not [f for f in res.refusals if f.pattern == "rotary_pair"]


@pytest.mark.parametrize("interleaved,rotary_dim", [(0, 0), (1, 0), (0, 4)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pair_function_body_matches_reference_kernel(interleaved, rotary_dim, dtype) -> None:
    from npufuse.patterns.rotary_pair import ROTARY_PAIR, rotary_pair_reference

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    attrs = {"interleaved": interleaved, "rotary_dim": rotary_dim}
    r = rotary_dim or D
    for opset in (13, 17, 18):
        node, fn = ROTARY_PAIR.make_node(["Q", "K", "cos", "sin"], ["QO", "KO"], "pair", attrs, opset, elem)
        shapes = {"Q": [B, H, S, D], "K": [B, 1, S, D], "cos": [1, 1, S, r], "sin": [1, 1, S, r]}
        g = helper.make_graph([node], "t", [helper.make_tensor_value_info(k, elem, v) for k, v in shapes.items()],
                              [helper.make_tensor_value_info(o, elem, None) for o in ("QO", "KO")])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("npufuse", 1)],
                                  ir_version=IR_VERSION, functions=[fn])
        rng = np.random.default_rng(1)
        feeds = {k: rng.standard_normal(v).astype(dtype) for k, v in shapes.items()}
        got = run(model, feeds)
        want = rotary_pair_reference([feeds[k] for k in shapes], attrs)
        for o, w in zip(("QO", "KO"), want):
            single = rotary_reference([feeds["Q" if o == "QO" else "K"], feeds["cos"], feeds["sin"]], attrs)[0]
            np.testing.assert_array_equal(w, single)
            c = compare(o, got[o], w)
            assert c.ok, (o, c.detail)


def _pair_record(spec, **kw):
    res = optimize(qk_model(**kw), None, OptimizeOptions(spec=spec, verify=False))
    recs = {r.match.pattern: r for r in res.records if r.match.pattern in ("rotary", "rotary_pair")}
    return res, recs


@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
def test_pair_on_310p_fuses_where_apply_rotary_pos_emb_takes_it(layout) -> None:
    """310P has no RotaryPositionEmbedding (the per-tensor form stays unfused) but has ApplyRotaryPosEmb: the pair is
    the rotation's only fused form there, priced with the transposes BNSD needs (layout 1 = BSND only)."""
    spec = load_profile("Ascend310P3")
    res, recs = _pair_record(spec, d=128, layout=layout)
    assert recs["rotary"].status == "skipped-by-cost"
    assert "RotaryPositionEmbedding has no kernel for ascend310p" in recs["rotary"].reason
    pair = recs["rotary_pair"]
    assert pair.status == "applied", pair.reason
    k = pair.ascend_kernel
    assert k["op"] == "ApplyRotaryPosEmb" and k["available"] and k["problem"] is None
    assert k["attrs"] == {"layout": 1, "rotary_mode": "half"}
    assert [b["name"] for b in k["inputs"]] == ["query", "key", "cos", "sin"]
    assert [b["value"] for b in k["inputs"][:2]] == ["Q", "K"]
    moves = k.get("layout_transposes", [])
    assert len(moves) == (4 if layout == "BNSD" else 0)
    fused_ops = [f.op_type for f in pair.decision.fused]
    assert fused_ops == ["RotaryEmbeddingPair"] + ["Transpose"] * len(moves)
    assert len(_pair_nodes(res.model)) == 1


@pytest.mark.parametrize("kw,problem", [
    ({"d": 128, "form": "interleaved"}, "takes rotary_mode 'half' only"),
    ({"d": 128, "rotary_dim": 64}, "partial rotary"),
    ({"d": 32}, "takes a head dim of 64 or 128"),
])
def test_pair_on_310p_refused_outside_the_kernel_constraints(kw, problem) -> None:
    _, recs = _pair_record(load_profile("Ascend310P3"), **kw)
    pair = recs["rotary_pair"]
    assert pair.status == "skipped-by-cost" and problem in pair.reason, pair.reason
    assert pair.ascend_kernel["problem"] and problem in pair.ascend_kernel["problem"]


@pytest.mark.parametrize("layout,winner", [("BNSD", "rotary"), ("BSND", "rotary_pair")])
def test_pair_vs_per_tensor_on_910b_by_the_cost_model(layout, winner) -> None:
    """910B has both kernels: phase 0 fuses each rotation (RotaryPositionEmbedding), phase 1 prices the pair
    against those two kernels. BNSD q/k need four Transposes around ApplyRotaryPosEmb (layout 1 only): the two
    per-tensor kernels win. BSND: one launch reading cos/sin once beats two."""
    spec = load_profile("Ascend910B2")
    res, recs = _pair_record(spec, d=128, layout=layout)
    assert recs["rotary"].status == "applied"
    pair = recs["rotary_pair"]
    assert pair.status == ("applied" if winner == "rotary_pair" else "skipped-by-cost"), pair.reason
    assert pair.ascend_kernel["problem"] is None
    assert [n.op_type for n in pair.decision.unfused] == ["RotaryEmbedding", "RotaryEmbedding"]
    if winner == "rotary":
        assert pair.reason.startswith("not fused: the fused kernel would take")
        assert len(_rotary_nodes(res.model)) == 2 and not _pair_nodes(res.model)
    else:
        assert len(_pair_nodes(res.model)) == 1 and not _rotary_nodes(res.model)


def test_pair_is_priced_as_one_launch_reading_cos_sin_once() -> None:
    spec = load_profile("Ascend910B2")
    q, k = TensorInfo((1, 2048, 32, 128), "float16"), TensorInfo((1, 2048, 8, 128), "float16")
    t = TensorInfo((1, 2048, 1, 128), "float16")
    singles = (OpWork("rq", "RotaryEmbedding", "npufuse", (q, t, t), (q,)),
               OpWork("rk", "RotaryEmbedding", "npufuse", (k, t, t), (k,)))
    pair = OpWork("pair", "RotaryEmbeddingPair", "npufuse", (q, k, t, t), (q, k))
    d = decide(FusionCandidate("rotary_pair", singles, (pair,)), spec)
    assert d.fuse and d.launches_saved == 1 and d.gm_bytes_saved == 2 * t.nbytes
    assert d.fused[0].gm_bytes_read == q.nbytes + k.nbytes + 2 * t.nbytes


def test_pair_chip_limits() -> None:
    node = helper.make_node("RotaryEmbeddingPair", ["q", "k", "cos", "sin"], ["qo", "ko"], domain="npufuse",
                            name="pair", interleaved=0, rotary_dim=0)
    shapes = {"q": (1, 32, "seq", 128), "k": (1, 8, "seq", 128), "cos": (1, 1, "seq", 128), "qo": (1, 32, "seq", 128),
              "ko": (1, 8, "seq", 128)}
    for chip, available, problem in [("ascend310p", True, None), ("ascend910b", True, None),
                                     ("ascend910", True, "Atlas training series")]:
        rec = region_kernel([node], shapes.get, chip=chip)
        assert rec["op"] == "ApplyRotaryPosEmb" and rec["available"] is available
        assert (rec["problem"] is None) if problem is None else (problem in rec["problem"])
        assert rec["attrs"]["layout"] == 1 and len(rec["layout_transposes"]) == 4
    # 950 takes BNSD itself (layout 3): no transposes
    rec = region_kernel([node], shapes.get, chip="ascend910_95")
    assert rec["attrs"]["layout"] == 3 and "layout_transposes" not in rec and rec["problem"] is None
    # a UB too small for the heads: refused with the documented bound
    rec = region_kernel([node], shapes.get, chip="ascend310p", ub_bytes=32 * 1024)
    assert "UB" in rec["problem"]


def test_pair_pattern_is_registered_after_attention_and_mla_prolog() -> None:
    from npufuse.patterns.rotary_pair import RotaryPairPattern

    names = [p.name for p in PATTERNS]
    p = next(p for p in PATTERNS if p.name == "rotary_pair")
    assert isinstance(p, RotaryPairPattern) and p.phase == 1
    assert names.index("mla_prolog") < names.index("rotary_pair")
    assert ("npufuse", "RotaryEmbeddingPair") in patterns_registry.fused_op_defs()
