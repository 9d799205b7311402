"""Scaled dot-product attention -> FusedAttention: exporter forms, near-misses, numerics, real exports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import ops, with_output_shapes
from onnx import TensorProto, helper, numpy_helper

from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import attributes
from npufuse.patterns.attention import FusedAttentionPattern
from npufuse.patterns.attention_op import FUSED_ATTENTION, attention_reference, causal_keep
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare
from npufuse.verify.reference import run_reference

B, S, H, G, D = 2, 6, 4, 2, 8
FMIN = float(np.finfo(np.float32).min)
FIXTURES = Path(__file__).parent / "fixtures"


# ---- a small builder for attention graphs ----------------------------------------------------------------

class _Builder:
    def __init__(self, opset: int, dtype=np.float32) -> None:
        self.opset, self.dtype = opset, np.dtype(dtype)
        self.elem = helper.np_dtype_to_tensor_dtype(self.dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.n = 0

    def input(self, name: str, shape, elem: int | None = None) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, self.elem if elem is None else elem, list(shape)))
        return name

    def const(self, arr, name: str | None = None) -> str:
        self.n += 1
        name = name or f"c{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def f(self, value: float) -> str:
        return self.const(np.array(value, dtype=self.dtype))

    def ints(self, *vals: int) -> str:
        return self.const(np.array(vals, dtype=np.int64))

    def op(self, op_type: str, inputs, name: str | None = None, n_out: int = 1, **attrs):
        self.n += 1
        name = name or f"{op_type.lower()}{self.n}"
        outs = [f"{name}_out{i}" if i else f"{name}_out" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs[0] if n_out == 1 else outs

    def unsqueeze(self, x: str, axis: int) -> str:
        if self.opset >= 13:
            return self.op("Unsqueeze", [x, self.ints(axis)])
        return self.op("Unsqueeze", [x], axes=[axis])

    def model(self, outputs: list[str]) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, "attention", self.inputs,
                              [helper.make_empty_tensor_value_info(o) for o in outputs], self.inits)
        return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)],
                                                    ir_version=IR_VERSION))


def attention_model(*, scale: str = "div", mask: str | None = None, mask_shape: str = "b11s", guard: bool = False,
                    dropout: bool = False, cast: bool = False, layout: str = "bsh", k_form: str = "0231",
                    gqa: str | None = None, merge: bool = True, opset: int = 17, probs_output: bool = False,
                    scores_output: bool = False, softmax_axis: int = -1, v_first: bool = False,
                    const_k: bool = False, mask_rank5: bool = False, scale_after_mask: bool = False,
                    add_commuted: bool = False, dtype=np.float32, upcast: bool = False,
                    softcap: bool = False, training_dropout: bool = False, second_mask: bool = False,
                    fill_input: bool = False, bias_first: bool = False) -> onnx.ModelProto:
    """One attention block the way exporters write it; each keyword switches one form."""
    b = _Builder(opset, dtype)
    kv = G if gqa else H
    if layout == "bsh":
        xq, xk, xv = b.input("xq", [B, S, H * D]), b.input("xk", [B, S, kv * D]), b.input("xv", [B, S, kv * D])
        q = b.op("Transpose", [b.op("Reshape", [xq, b.ints(0, 0, H, D)])], perm=[0, 2, 1, 3])
        k_bsnd = b.op("Reshape", [xk, b.ints(0, 0, -1, D)])
        v = b.op("Transpose", [b.op("Reshape", [xv, b.ints(B, S, kv, D)])], perm=[0, 2, 1, 3])
        use_0231 = k_form == "0231" and not gqa and not const_k
        k = None if use_0231 else b.op("Transpose", [k_bsnd], perm=[0, 2, 1, 3])
    else:
        q, k, v = b.input("q", [B, H, S, D]), b.input("k", [B, kv, S, D]), b.input("v", [B, kv, S, D])
        k_bsnd = None
    if gqa:
        k, v = _repeat(b, k, gqa), _repeat(b, v, gqa)
    if const_k:
        kt = b.const(np.random.default_rng(0).standard_normal((1, H, D, S)).astype(dtype))
    elif k is None:
        kt = b.op("Transpose", [k_bsnd], perm=[0, 2, 3, 1])
    else:
        kt = b.op("Transpose", [k], perm=[0, 1, 3, 2])
    if scale == "qk_sqrt":
        q, kt = b.op("Mul", [q, b.f(D ** -0.25)]), b.op("Mul", [kt, b.f(D ** -0.25)])
    elif scale == "q_only":
        q = b.op("Div", [q, b.f(D ** 0.5)])
    s = b.op("MatMul", [q, kt], name="qk")
    scale_node = {"div": lambda x: b.op("Div", [x, b.f(D ** 0.5)], name="scale"),
                  "mul": lambda x: b.op("Mul", [x, b.f(D ** -0.5)], name="scale"),
                  "mul_commuted": lambda x: b.op("Mul", [b.f(D ** -0.5), x], name="scale"),
                  "input": lambda x: b.op("Div", [x, b.input("temperature", [])], name="scale")}.get(scale)
    if scale_node is not None and not scale_after_mask:
        s = scale_node(s)
    if softcap:  # Gemma-2: cap * tanh(scores / cap)
        s = b.op("Mul", [b.op("Tanh", [b.op("Div", [s, b.f(50.0)])], name="tanh"), b.f(50.0)])
    if scores_output:
        scores_out = s
    if bias_first:    # a relative-position bias added before the masks
        s = b.op("Add", [s, b.input("position_bias", [1, H, S, S])])
    if mask is not None:
        s = _apply_mask(b, s, mask, mask_shape, q, add_commuted, mask_rank5)
    if second_mask:   # e.g. a relative-position bias added on top of the padding mask
        s = b.op("Add", [s, b.input("position_bias", [1, H, S, S])])
    if fill_input:
        s = b.op("Where", [b.input("keep", [B, 1, 1, S], TensorProto.BOOL), s, b.input("fill", [])])
    if scale_after_mask:
        s = scale_node(s)
    if cast or upcast:
        s = b.op("Cast", [s], to=TensorProto.FLOAT)
    p = b.op("Softmax", [s], name="softmax", axis=softmax_axis)
    if cast or upcast:
        p = b.op("Cast", [p], to=b.elem)
    if probs_output:
        probs = p
    if dropout or training_dropout:
        p = b.op("Dropout", [p, b.f(0.1), b.const(np.array(training_dropout))], name="dropout") if opset >= 12 \
            else b.op("Dropout", [p], name="dropout")
    if guard:
        p = b.op("Where", [b.op("IsNaN", [p]), b.f(0.0), p], name="guard")
    if v_first:
        o = b.op("Transpose", [b.op("MatMul", [b.op("Transpose", [v], perm=[0, 1, 3, 2]), p], name="pv")],
                 perm=[0, 1, 3, 2])
    else:
        o = b.op("MatMul", [p, v], name="pv")
    if merge:
        o = b.op("Reshape", [b.op("Transpose", [o], perm=[0, 2, 1, 3]), b.ints(0, 0, H * D)], name="merge")
    outputs = [o] + ([probs] if probs_output else []) + ([scores_out] if scores_output else [])
    return b.model(outputs)


def _repeat(b: _Builder, x: str, form: str) -> str:
    """K/V [B, G, S, D] -> [B, H, S, D]: llama's repeat_kv (interleave) or a head-axis Tile/Concat (tile)."""
    n = H // G
    if form in ("expand", "tile5", "concat5"):
        u = b.unsqueeze(x, 2)
        if form == "expand":
            e = b.op("Expand", [u, b.ints(B, G, n, S, D)])
        elif form == "tile5":
            e = b.op("Tile", [u, b.ints(1, 1, n, 1, 1)])
        else:
            e = b.op("Concat", [u] * n, axis=2)
        return b.op("Reshape", [e, b.ints(B, H, S, D)])
    if form == "tile4":
        return b.op("Tile", [x, b.ints(1, n, 1, 1)])
    return b.op("Concat", [x] * n, axis=1)


def _apply_mask(b: _Builder, s: str, mask: str, mask_shape: str, q: str, add_commuted: bool, rank5: bool) -> str:
    add = (lambda x, m: b.op("Add", [m, x] if add_commuted else [x, m], name="add_mask"))
    if mask == "additive":          # HF: (1 - attention_mask) * finfo.min, broadcast over heads (and queries)
        am = b.input("attention_mask", [B, S], TensorProto.INT64)
        inv = b.op("Sub", [b.f(1.0), b.op("Cast", [am], to=b.elem)])
        m = b.op("Mul", [inv, b.f(float(np.finfo(b.dtype).min))])
        m = b.op("Reshape", [m, b.ints(B, 1, 1, S)])
        if mask_shape == "b1ss":
            m = b.op("Expand", [m, b.ints(B, 1, S, S)])
        return add(s, m)
    if mask == "additive_input":    # a ready-made float mask, e.g. with -inf entries
        shape = {"b11s": [B, 1, 1, S], "b1ss": [B, 1, S, S], "11ss": [1, 1, S, S]}[mask_shape]
        return add(s, b.input("float_mask", [1, 1, 1, 1, S] if rank5 else shape))
    if mask == "additive_causal":   # llama-style additive causal bias, a constant here
        tri = np.where(causal_keep(S, S), 0.0, -1e9).astype(b.dtype).reshape(1, 1, S, S)
        return add(s, b.const(tri))
    if mask == "bool_keep":         # Where(mask, scores, -inf)
        m = b.input("bool_mask", [B, 1, 1, S], TensorProto.BOOL)
        return b.op("Where", [m, s, b.f(-np.inf)], name="where_mask")
    if mask == "bool_drop":         # scores.masked_fill(mask == 0, -1e9)
        am = b.input("attention_mask", [B, S], TensorProto.INT64)
        eq = b.op("Reshape", [b.op("Equal", [am, b.const(np.array(0, np.int64))]), b.ints(B, 1, 1, S)])
        return b.op("Where", [eq, b.f(-1e9), s], name="where_mask")
    if mask == "causal_const":      # GPT-2 with a static causal buffer
        tri = causal_keep(S, S).reshape(1, 1, S, S)
        return b.op("Where", [b.const(tri), s, b.f(float(np.finfo(b.dtype).min))], name="where_mask")
    if mask == "causal_sliced":     # GPT-2 (transformers 4.x): bias[:, :, k-q:k, :k], then + attention_mask
        m_pos = 16
        buf = b.const(np.tril(np.ones((m_pos, m_pos), dtype=bool)).reshape(1, 1, m_pos, m_pos), "bias")
        shape_q = b.op("Shape", [q])
        sq = b.op("Gather", [shape_q, b.ints(2)])
        sk = sq
        start = b.op("Sub", [sk, sq])
        rows = b.op("Slice", [buf, start, sk, b.ints(2)])
        causal = b.op("Slice", [rows, b.ints(0), sk, b.ints(3)])
        s = b.op("Where", [causal, s, b.f(float(np.finfo(b.dtype).min))], name="where_mask")
        return _apply_mask(b, s, "additive", "b11s", q, add_commuted, rank5)
    raise ValueError(mask)


def _feeds(model: onnx.ModelProto, seed: int = 1, **special: np.ndarray) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        dt = np.dtype(helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
        if i.name in special:
            feeds[i.name] = special[i.name]
        elif i.name == "attention_mask":
            m = (rng.random(shape) < 0.7).astype(dt)
            m[:, 0] = 1
            feeds[i.name] = m
        elif dt == np.bool_:
            m = rng.random(shape) < 0.7
            m[..., 0] = True
            feeds[i.name] = m
        elif i.name == "temperature":
            feeds[i.name] = np.array(2.5, dt)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(dt)
    return feeds


def _optimize(model: onnx.ModelProto, **kw):
    return optimize(model, options=OptimizeOptions(patterns=[FusedAttentionPattern()], **kw))


def _fused(res) -> list[onnx.NodeProto]:
    return [n for n in res.model.graph.node if n.op_type == "FusedAttention"]


def _attrs(node: onnx.NodeProto) -> dict:
    return attributes(node)


def _assert_fused_and_equal(model: onnx.ModelProto, feeds: dict | None = None, rtol: float = 1e-4):
    res = _optimize(model)
    fused = _fused(res)
    assert len(fused) == 1, (ops(res.model), [(f.reason, f.detail) for f in res.refusals])
    assert "Softmax" not in ops(res.model)
    assert fused[0].domain == "npufuse"
    assert res.applied and all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok
    onnx.checker.check_model(res.model, full_check=True)
    feeds = feeds or _feeds(model)
    want, got = run(model, feeds), run(res.model, feeds)
    for name in want:
        c = compare(name, got[name], want[name])
        assert c.ok, c.detail
        assert c.min_passing_rtol <= rtol
    return res, _attrs(fused[0])


# ---- positives -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale,expected", [("div", D ** -0.5), ("mul", D ** -0.5), ("mul_commuted", D ** -0.5),
                                            ("qk_sqrt", D ** -0.5), ("q_only", D ** -0.5), (None, 1.0)])
def test_scale_forms(scale, expected) -> None:
    res, a = _assert_fused_and_equal(attention_model(scale=scale))
    assert a["scale"] == pytest.approx(expected, rel=1e-6)
    assert ops(res.model) == ["FusedAttention"]   # head split and merge absorbed too
    assert (a["q_layout"], a["k_layout"], a["v_layout"], a["out_layout"]) == ("BSH",) * 4
    assert (a["num_heads"], a["kv_num_heads"], a["causal"]) == (H, H, 0)


@pytest.mark.parametrize("mask,mask_shape,commuted", [
    ("additive", "b11s", False), ("additive", "b11s", True), ("additive", "b1ss", False),
    ("additive_causal", "11ss", False), ("additive_input", "11ss", False), ("bool_keep", "b11s", False),
    ("bool_drop", "b11s", False), ("causal_const", "11ss", False), ("causal_sliced", "11ss", False)])
def test_mask_forms(mask, mask_shape, commuted) -> None:
    res, a = _assert_fused_and_equal(attention_model(mask=mask, mask_shape=mask_shape, add_commuted=commuted))
    fused = _fused(res)[0]
    if mask == "causal_const":
        assert a["causal"] == 1 and a["mask_order"] == "where" and len(fused.input) == 3  # no mask tensor at all
        assert a["mask_fill"] == pytest.approx(FMIN)
    elif mask == "causal_sliced":
        # the sliced buffer's bounds come from the queries' shape, which is static here: normalisation folds
        # the slice to a constant triangle, so the fused op knows it is causal and absorbs the Q head split
        assert a["causal"] == 1 and a["mask_order"] == "where,add" and a["q_layout"] == "BSH"
        assert len(fused.input) == 4 and fused.input[3]  # the additive mask stays an input
    elif mask in ("bool_keep", "bool_drop"):
        assert a["mask_order"] == "where" and fused.input[3] == "" and fused.input[4]
        assert a["bool_mask_mode"] == ("keep" if mask == "bool_keep" else "drop")
    else:
        assert a["mask_order"] == "add" and len(fused.input) == 4 and a["causal"] == 0


@pytest.mark.parametrize("form,mode", [("expand", "interleave"), ("tile5", "interleave"), ("concat5", "interleave"),
                                       ("tile4", "tile"), ("concat4", "tile")])
@pytest.mark.parametrize("layout", ["bsh", "bnsd"])
def test_grouped_query_attention_absorbs_the_repeat(form, mode, layout) -> None:
    model = attention_model(gqa=form, layout=layout, mask="additive")
    res, a = _assert_fused_and_equal(model)
    assert (a["num_heads"], a["kv_num_heads"], a["kv_repeat"]) == (H, G, mode)
    fused = _fused(res)[0]
    k_in = next(i for i in res.model.graph.input if i.name == fused.input[1])
    assert k_in.type.tensor_type.shape.dim[-1].dim_value == (G * D if layout == "bsh" else D)


@pytest.mark.parametrize("expand", [False, True])
def test_multi_query_attention(expand) -> None:
    """One K/V head, broadcast by the MatMuls or expanded to H heads first."""
    b = _Builder(17)
    q, k, v = b.input("q", [B, H, S, D]), b.input("k", [B, 1, S, D]), b.input("v", [B, 1, S, D])
    if expand:
        k, v = (b.op("Expand", [x, b.ints(B, H, S, D)]) for x in (k, v))
    s = b.op("Div", [b.op("MatMul", [q, b.op("Transpose", [k], perm=[0, 1, 3, 2])]), b.f(D ** 0.5)])
    y = b.op("MatMul", [b.op("Softmax", [s], axis=-1), v])
    res, a = _assert_fused_and_equal(b.model([y]))
    assert (a["num_heads"], a["kv_num_heads"]) == (H, 1)
    assert ops(res.model) == ["FusedAttention"]


@pytest.mark.parametrize("layout,merge,expected", [("bsh", True, ("BSH", "BSH")), ("bsh", False, ("BSH", "BNSD")),
                                                   ("bnsd", True, ("BNSD", "BSH")), ("bnsd", False, ("BNSD", "BNSD"))])
def test_head_split_and_merge(layout, merge, expected) -> None:
    res, a = _assert_fused_and_equal(attention_model(layout=layout, merge=merge, k_form="0132"))
    assert (a["q_layout"], a["out_layout"]) == expected
    assert ops(res.model) == ["FusedAttention"]


def test_transpose_0231_of_the_split_key() -> None:
    _, a = _assert_fused_and_equal(attention_model(k_form="0231"))
    assert a["k_layout"] == "BSH"


def test_guard_dropout_and_casts_are_absorbed() -> None:
    res, a = _assert_fused_and_equal(attention_model(mask="bool_keep", guard=True, dropout=True, cast=True))
    assert a["nan_guard"] == 1 and "softmax_dtype" not in a
    assert ops(res.model) == ["FusedAttention"]


def test_fp16_with_softmax_upcast() -> None:
    model = attention_model(dtype=np.float16, upcast=True, mask="additive")
    res = _optimize(model)
    (fused,) = _fused(res)
    assert _attrs(fused)["softmax_dtype"] == TensorProto.FLOAT
    assert res.model_check.ok and all(r.check.ok for r in res.applied)


@pytest.mark.parametrize("opset", [13, 14, 18, 21])
def test_opsets(opset) -> None:
    _assert_fused_and_equal(attention_model(opset=opset, mask="additive", gqa="expand", guard=True))


# ---- fully masked rows: the fused op reproduces what the original gives -------------------------------

@pytest.mark.parametrize("mask,fill,guard,expect", [
    ("additive_input", -np.inf, True, "zeros"),      # SDPA export: -inf mask + IsNaN guard -> 0
    ("additive_input", FMIN, False, "mean"),         # HF eager: finfo.min mask -> uniform average of V
    ("additive_input", FMIN, True, "mean"),          # guard present, nothing NaN: still the average
    ("additive_input", -np.inf, False, "nan"),       # no guard: NaN, as onnx Softmax gives
    ("bool_keep", None, False, "nan"),               # Where(mask, s, -inf) with a row all False
    ("bool_keep", None, True, "zeros"),
])
def test_fully_masked_rows(mask, fill, guard, expect) -> None:
    model = attention_model(mask=mask, mask_shape="b1ss", guard=guard, merge=False, layout="bnsd", k_form="0132")
    res = _optimize(model)
    (fused,) = _fused(res)
    assert ops(res.model) == ["FusedAttention"]
    rng = np.random.default_rng(5)
    special = {}
    if mask == "additive_input":
        fm = np.where(rng.random((B, 1, S, S)) < 0.7, 0.0, fill).astype(np.float32)
        fm[:, :, :, 0] = 0.0
        fm[0, 0, 2, :] = fill                    # batch 0, query 2: every key masked
        special["float_mask"] = fm
    else:
        bm = rng.random((B, 1, 1, S)) < 0.7
        bm[0] = False                            # batch 0: every key masked for every query
        special["bool_mask"] = bm
    feeds = _feeds(model, **special)
    want = run(model, feeds)[model.graph.output[0].name]
    got_ort = run(res.model, feeds)[model.graph.output[0].name]
    got_ref = run_reference(list(res.model.graph.node), feeds, 17, [model.graph.output[0].name])[
        model.graph.output[0].name]
    row = want[0, :, 2, :]
    if expect == "zeros":
        assert np.all(row == 0.0)
    elif expect == "nan":
        assert np.all(np.isnan(row))
    else:
        np.testing.assert_allclose(row, np.broadcast_to(feeds["v"][0].mean(axis=1), row.shape), rtol=1e-5)
    for got in (got_ort, got_ref):
        c = compare("y", got, want)
        assert c.ok, c.detail


# ---- near-misses: must not fuse ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,reason", [
    ({"probs_output": True}, "shared-intermediate"),        # a model that outputs attention probabilities
    ({"scores_output": True}, "shared-intermediate"),
    ({"softmax_axis": 2}, "softmax-axis"),
    ({"scale": "input"}, "nonconstant-scale"),
    ({"mask": "additive_input", "mask_rank5": True, "merge": False}, "mask-shape"),
    ({"v_first": True, "merge": False}, "pv-structure"),
    ({"const_k": True}, "qk-structure"),
    ({"opset": 12}, "opset"),
    ({"mask": "additive", "scale_after_mask": True}, "scale-after-mask"),
    ({"training_dropout": True}, "dropout-training"),
    ({"mask": "causal_sliced", "bias_first": True}, "multiple-masks"),   # a bias before the mask, one after
    ({"fill_input": True}, "mask-fill"),
])
def test_near_misses_do_not_fuse(kwargs, reason) -> None:
    model = attention_model(**kwargs)
    res = _optimize(model)
    assert "FusedAttention" not in ops(res.model)
    assert "Softmax" in ops(res.model)
    refusals = [f for f in res.refusals if f.pattern == "attention"]
    assert reason in {f.reason for f in refusals}, [(f.reason, f.detail) for f in refusals]
    f = next(f for f in refusals if f.reason == reason)
    assert f.node and f.detail


def test_softcap_fuses() -> None:
    """Gemma 2's cap * tanh(scores / cap), a score-chain near-miss before issue 23, is FusedAttention's softcap."""
    res = _optimize(attention_model(softcap=True))
    assert "FusedAttention" in ops(res.model) and "Tanh" not in ops(res.model)


def test_mask_not_broadcastable_to_the_scores_is_refused() -> None:
    """A [B, 1, Sq, Sk] mask with Sk=S+1 cannot be added to [B, H, Sq, Sk] scores as the op needs."""
    model = attention_model(mask="additive_input", mask_shape="b1ss", merge=False)
    inp = next(i for i in model.graph.input if i.name == "float_mask")
    inp.type.tensor_type.shape.dim[1].dim_value = 3     # 3 is neither 1 nor H
    g = FusedAttentionPattern()
    from npufuse.ir.graph import Graph
    from npufuse.prepare.normalize import normalize
    cur, types = normalize(model)
    graph = Graph(cur, None, types)
    r = g.match(graph, next(n for n in graph.nodes if n.op_type == "Softmax"))
    assert r is not None and getattr(r, "reason", None) == "mask-shape", r


def test_softmax_without_attention_is_not_a_candidate() -> None:
    """A classifier's Softmax(x·W): no MatMul of two activations feeds it and none reads it, so it is provably not
    attention; its only refusal says so (so that coverage accounting still names every Softmax)."""
    b = _Builder(17)
    x = b.input("x", [2, 10])
    y = b.op("Softmax", [b.op("MatMul", [x, b.const(np.ones((10, 5), np.float32))])], axis=-1)
    res = _optimize(b.model([y]))
    assert ops(res.model) == ["MatMul", "Softmax"]
    assert [f.reason for f in res.refusals if f.pattern == "attention"] == ["not-attention"]


# ---- the fused op: reference kernel vs function body -------------------------------------------------------

def _layout(x: np.ndarray, layout: str) -> np.ndarray:
    if layout == "BNSD":
        return x
    x = x.transpose(0, 2, 1, 3)
    return x if layout == "BSND" else x.reshape(x.shape[0], x.shape[1], -1)


@pytest.mark.parametrize("opset", [13, 17, 21])
@pytest.mark.parametrize("case", [
    dict(q_layout="BNSD", k_layout="BNSD", out_layout="BNSD", kv=H, mask_order="add", fill=-np.inf),
    dict(q_layout="BSH", k_layout="BSH", out_layout="BSH", kv=G, mask_order="add,where", nan_guard=1, fill=-np.inf),
    dict(q_layout="BSND", k_layout="BSND", out_layout="BSND", kv=G, mask_order="where", causal=1, fill=FMIN,
         kv_repeat="tile"),
    dict(q_layout="BSH", k_layout="BNSD", out_layout="BSH", kv=1, mask_order="where,add", bool_mask_mode="drop",
         fill=FMIN),
    dict(q_layout="BNSD", k_layout="BSH", out_layout="BSND", kv=G, mask_order="", sq=3),
    dict(q_layout="BNSD", k_layout="BNSD", out_layout="BNSD", kv=H, mask_order="where", causal=1, sq=3, fill=-1e9),
], ids=["plain", "gqa-bsh-guard", "causal-tile", "mqa-drop", "cross-lengths", "causal-kvcache"])
def test_function_body_matches_reference_kernel(case, opset) -> None:
    rng = np.random.default_rng(11)
    sq, sk, kv = case.get("sq", S), S, case["kv"]
    q = _layout(rng.standard_normal((B, H, sq, D)).astype(np.float32), case["q_layout"])
    k = _layout(rng.standard_normal((B, kv, sk, D)).astype(np.float32), case["k_layout"])
    v = _layout(rng.standard_normal((B, kv, sk, D)).astype(np.float32), case["k_layout"])
    mask = np.where(rng.random((B, 1, sq, sk)) < 0.7, 0.0, case.get("fill", FMIN)).astype(np.float32)
    mask[1, 0, 0, :] = case.get("fill", FMIN)        # a fully masked row
    bool_mask = rng.random((B, 1, 1, sk)) < 0.6
    bool_mask[0] = case.get("bool_mask_mode") == "drop"   # batch 0: every key masked
    attrs = dict(scale=0.37, causal=case.get("causal", 0), num_heads=H, kv_num_heads=kv,
                 q_layout=case["q_layout"], k_layout=case["k_layout"], v_layout=case["k_layout"],
                 out_layout=case["out_layout"], kv_repeat=case.get("kv_repeat", "interleave"),
                 mask_order=case["mask_order"], bool_mask_mode=case.get("bool_mask_mode", "keep"),
                 mask_fill=float(case.get("fill", FMIN)), nan_guard=case.get("nan_guard", 0))
    steps = case["mask_order"].split(",")
    names, arrays = ["q", "k", "v"], [q, k, v]
    if "add" in steps:
        names.append("m")
        arrays.append(mask)
    if "where" in steps and not attrs["causal"]:
        names += ([""] if len(names) == 3 else []) + ["bm"]
        arrays.append(bool_mask)
    feeds = dict(zip([n for n in names if n], arrays))
    want = attention_reference([q, k, v, mask, bool_mask], attrs)[0]
    node, fn = FUSED_ATTENTION.make_node(names, ["y"], "fa", attrs, opset, TensorProto.FLOAT)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                      for n, a in feeds.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, want.shape)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("npufuse", 1)],
                          functions=[fn], ir_version=IR_VERSION)
    onnx.checker.check_model(m, full_check=True)
    got = run(m, feeds)["y"]
    c = compare("y", got, want)
    assert c.ok, c.detail
    if case["mask_order"] and "nan_guard" not in case and case.get("fill") == -np.inf:
        assert np.isnan(want).any()   # the fully masked row really is NaN without the guard
    if case.get("nan_guard"):
        assert not np.isnan(want).any()


def test_reference_kernel_is_attention() -> None:
    """Against a plain per-head loop, GQA interleave and causal included."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, H, S, D)), rng.standard_normal((1, G, S, D)), rng.standard_normal((1, G, S, D)))
    got = attention_reference([q, k, v], dict(scale=0.5, num_heads=H, kv_num_heads=G, mask_order="where", causal=1,
                                              mask_fill=-np.inf))[0]
    for h in range(H):
        kh, vh = k[0, h // (H // G)], v[0, h // (H // G)]
        for i in range(S):
            s = q[0, h, i] @ kh[: i + 1].T * 0.5
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[0, h, i], (p / p.sum()) @ vh[: i + 1], rtol=1e-12)


# ---- real exporter output ----------------------------------------------------------------------------------

def _transformer_fixtures() -> list[tuple[str, int]]:
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    return [(f["file"], int(f["config"]["num_layers"])) for f in manifest["fixtures"]
            if "num_layers" in f.get("config", {})]


@pytest.mark.parametrize("file,layers", _transformer_fixtures())
def test_real_exports(file: str, layers: int) -> None:
    model = onnx.load(str(FIXTURES / file))
    softmax_before = ops(model).count("Softmax")
    assert softmax_before == layers
    res = optimize(model, str(FIXTURES), OptimizeOptions(patterns=[FusedAttentionPattern()]))
    fused = _fused(res)
    assert len(fused) == layers, [(f.reason, f.detail) for f in res.refusals]
    assert "Softmax" not in ops(res.model)
    assert len(res.applied) == layers and all(r.check is not None and r.check.ok for r in res.applied)
    assert not res.rolled_back
    assert res.model_check is not None and res.model_check.ok
    for node in fused:
        a = _attrs(node)
        assert a["num_heads"] == 4 and a["scale"] == pytest.approx(8 ** -0.5, rel=1e-6)
        if file.startswith("llama"):
            assert a["kv_num_heads"] == 2 and a["kv_repeat"] == "interleave"
        if "sdpa" in file:
            assert a["nan_guard"] == 1
