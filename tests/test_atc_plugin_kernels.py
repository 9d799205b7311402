"""The NumPy reference kernels of the CANN plugin ops against the standard-op decompositions they replace
(run with onnxruntime), the plugin contract check, and the ATC-form evaluator."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from npufuse.emit.atc.evaluator import normalise_domains, run_atc_model
from npufuse.emit.atc.plugins import (
    INT_MAX,
    PLUGINS,
    check_model,
    check_node,
    registered,
)
from npufuse.emit.atc.reference_kernels import KERNELS

F = TensorProto.FLOAT
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _ort(nodes: list[onnx.NodeProto], feeds: dict[str, np.ndarray], outputs: list[str],
         inits: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
    """Run a small standard-op graph on onnxruntime (opset 17)."""
    ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feeds.items()]
    outs = [helper.make_tensor_value_info(o, F, None) for o in outputs]
    init = [onnx.numpy_helper.from_array(v, k) for k, v in (inits or {}).items()]
    g = helper.make_graph(nodes, "g", ins, outs, initializer=init)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(outputs, feeds)


def _c(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(value), name))


def _attention_nodes(scale: float, with_bias: bool) -> list[onnx.NodeProto]:
    """q, k, v (B, N, S, D) [, bias (.., Sq, Skv)] -> out: MatMul / Mul / Add / Softmax / MatMul."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"]), _c("scale", np.float32(scale)),
             helper.make_node("Mul", ["qk", "scale"], ["s0"])]
    nodes.append(helper.make_node("Add", ["s0", "bias"], ["s"]) if with_bias else helper.make_node("Identity", ["s0"], ["s"]))
    return nodes + [helper.make_node("Softmax", ["s"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["out"])]


def _qkv(rng: np.random.Generator, b: int, n: int, nkv: int, sq: int, skv: int, d: int):
    return (rng.standard_normal((b, n, sq, d)).astype(np.float32),
            rng.standard_normal((b, nkv, skv, d)).astype(np.float32),
            rng.standard_normal((b, nkv, skv, d)).astype(np.float32))


PFA = KERNELS["NPUPromptFlashAttention"]
BASE = {"num_heads": 2, "input_layout": "BNSD", "scale_value": 0.125, "pre_tokens": INT_MAX, "next_tokens": INT_MAX}


def test_pfa_matches_decomposition() -> None:
    q, k, v = _qkv(np.random.default_rng(0), 2, 2, 2, 5, 7, 8)
    (ref,) = _ort(_attention_nodes(0.125, False), {"q": q, "k": k, "v": v}, ["out"])
    (got,) = PFA([q, k, v], BASE)
    np.testing.assert_allclose(got, ref, **TOL)
    # the plugin default scale 1.0 gives another result: scale_value must be set
    (unscaled,) = PFA([q, k, v], {**BASE, "scale_value": 1.0})
    assert np.abs(unscaled - ref).max() > 1e-2


def _causal_bias(sq: int, skv: int) -> np.ndarray:
    return np.where(np.triu(np.ones((sq, skv), bool), 1), np.float32(-1e9), np.float32(0))


def test_pfa_causal_by_next_tokens_and_by_mask() -> None:
    q, k, v = _qkv(np.random.default_rng(1), 1, 2, 2, 6, 6, 8)
    feeds = {"q": q, "k": k, "v": v, "bias": _causal_bias(6, 6)}
    (ref,) = _ort(_attention_nodes(0.125, True), feeds, ["out"])
    upper = np.triu(np.ones((6, 6), bool), 1)
    empty = np.empty((0,), np.float16)
    # a bool mask (1 = masked out) with the band wide open
    (by_mask,) = PFA([q, k, v, empty, upper], BASE)
    np.testing.assert_allclose(by_mask, ref, **TOL)
    # next_tokens=0 with an all-zero uint8 mask present: the band alone is causal
    (by_band,) = PFA([q, k, v, empty, np.zeros((1, 6, 6), np.uint8)], {**BASE, "next_tokens": 0})
    np.testing.assert_allclose(by_band, ref, **TOL)
    # next_tokens=0 without any mask is ignored by the kernel (sparse_mode 0): full attention
    (full,) = _ort(_attention_nodes(0.125, False), {"q": q, "k": k, "v": v}, ["out"])
    (no_mask,) = PFA([q, k, v, empty, np.empty((0,), bool)], {**BASE, "next_tokens": 0})
    np.testing.assert_allclose(no_mask, full, **TOL)
    # the plugin default pre_tokens=0 with a mask keeps only the diagonal: each row returns its own v
    (diag,) = PFA([q, k, v, empty, np.zeros((6, 6), bool)], {**BASE, "next_tokens": 0, "pre_tokens": 0})
    np.testing.assert_allclose(diag, v, **TOL)


def test_pfa_fully_masked_row_and_pse() -> None:
    q, k, v = _qkv(np.random.default_rng(2), 1, 2, 2, 4, 5, 8)
    mask = np.zeros((4, 5), bool)
    mask[1] = True
    (out,) = PFA([q, k, v, np.empty((0,), np.float16), mask], BASE)
    np.testing.assert_allclose(out[:, :, 1], v.mean(axis=2), **TOL)  # the lowest-float fill: mean of V
    (zeroed,) = PFA([q, k, v, np.empty((0,), np.float16), mask], {**BASE, "inner_precise": 2})
    assert np.all(zeroed[:, :, 1] == 0)
    pse = np.random.default_rng(3).standard_normal((1, 2, 4, 5)).astype(np.float32)
    (ref,) = _ort(_attention_nodes(0.125, True), {"q": q, "k": k, "v": v, "bias": pse}, ["out"])
    (got,) = PFA([q, k, v, pse, np.empty((0,), bool)], BASE)
    np.testing.assert_allclose(got, ref, **TOL)


def test_pfa_gqa() -> None:
    q, k, v = _qkv(np.random.default_rng(4), 2, 4, 2, 3, 5, 8)
    # repeat_kv in standard ops: (B, Nkv, S, D) -> (B, Nkv, 2, S, D) -> (B, N, S, D)
    rep = []
    for t in ("k", "v"):
        rep += [helper.make_node("Unsqueeze", [t, "ax2"], [t + "5"]),
                helper.make_node("Expand", [t + "5", "shp5"], [t + "e"]),
                helper.make_node("Reshape", [t + "e", "shp4"], [t + "r"])]
    body = _attention_nodes(0.125, False)
    for node in body:
        node.input[:] = [{"k": "kr", "v": "vr"}.get(i, i) for i in node.input]
    inits = {"ax2": np.array([2]), "shp5": np.array([2, 2, 2, 5, 8]), "shp4": np.array([2, 4, 5, 8])}
    (ref,) = _ort(rep + body, {"q": q, "k": k, "v": v}, ["out"], inits)
    (got,) = PFA([q, k, v], {**BASE, "num_heads": 4, "num_key_value_heads": 2})
    np.testing.assert_allclose(got, ref, **TOL)


def test_pfa_bsh_layout() -> None:
    q, k, v = _qkv(np.random.default_rng(5), 2, 2, 2, 4, 4, 8)
    to_bsh = lambda t: t.transpose(0, 2, 1, 3).reshape(t.shape[0], t.shape[2], -1)
    nodes = []
    for t in ("qs", "ks", "vs"):
        nodes += [helper.make_node("Reshape", [t, "bsnd"], [t + "4"]),
                  helper.make_node("Transpose", [t + "4"], [t[0]], perm=[0, 2, 1, 3])]
    nodes += _attention_nodes(0.125, False)
    nodes += [helper.make_node("Transpose", ["out"], ["o4"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["o4", "bsh"], ["o"])]
    inits = {"bsnd": np.array([2, 4, 2, 8]), "bsh": np.array([2, 4, 16])}
    (ref,) = _ort(nodes, {"qs": to_bsh(q), "ks": to_bsh(k), "vs": to_bsh(v)}, ["o"], inits)
    (got,) = PFA([to_bsh(q), to_bsh(k), to_bsh(v)], {**BASE, "input_layout": "BSH"})
    assert got.shape == (2, 4, 16)
    np.testing.assert_allclose(got, ref, **TOL)


def test_ifa_mqa_with_seq_lengths() -> None:
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, 2, 4, 1, 1, 6, 8)
    lens = np.array([4, 6], np.int64)
    bias = np.where(np.arange(6)[None, :] >= lens[:, None], np.float32(-1e9), np.float32(0)).reshape(2, 1, 1, 6)
    k4, v4 = np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1)
    (ref,) = _ort(_attention_nodes(0.25, True), {"q": q, "k": k4, "v": v4, "bias": bias}, ["out"])
    e = np.empty((0,), np.float16)
    # no num_key_value_heads: the plugin leaves the op default 1 (one KV head)
    (got,) = KERNELS["NPUIncreFlashAttention"]([q, k, v, e, np.empty((0,), bool), lens],
                                               {"num_heads": 4, "input_layout": "BNSD", "scale_value": 0.25})
    np.testing.assert_allclose(got, ref, **TOL)


def _rms_nodes(eps: float) -> list[onnx.NodeProto]:
    return [_c("two", np.float32(2)), _c("eps", np.float32(eps)),
            helper.make_node("Pow", ["x", "two"], ["xsq"]),
            helper.make_node("ReduceMean", ["xsq"], ["ms"], axes=[-1], keepdims=1),
            helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rms"]),
            helper.make_node("Div", ["x", "rms"], ["xn"]), helper.make_node("Mul", ["xn", "g"], ["y"])]


def test_rms_norm_eps_is_1e6() -> None:
    rng = np.random.default_rng(7)
    x = (1e-3 * rng.standard_normal((3, 16))).astype(np.float32)  # small variance: eps dominates
    g = rng.standard_normal(16).astype(np.float32)
    y, rstd = KERNELS["NPURmsNorm"]([x, g], {"epsilon": 1e-5})  # the node's epsilon is ignored, as ATC does
    (ref6,) = _ort(_rms_nodes(1e-6), {"x": x, "g": g}, ["y"])
    (ref5,) = _ort(_rms_nodes(1e-5), {"x": x, "g": g}, ["y"])
    np.testing.assert_allclose(y, ref6, rtol=1e-4, atol=1e-6)
    assert np.abs(y - ref5).max() > 0.1 * np.abs(ref5).max()
    assert rstd.shape == (3, 1) and rstd.dtype == np.float32
    np.testing.assert_allclose(rstd[:, 0], 1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1) + 1e-6), rtol=1e-6)


def test_add_rms_norm() -> None:
    rng = np.random.default_rng(8)
    x1, x2 = rng.standard_normal((2, 3, 16)).astype(np.float32), rng.standard_normal((2, 3, 16)).astype(np.float32)
    g = rng.standard_normal(16).astype(np.float32)
    nodes = [helper.make_node("Add", ["x1", "x2"], ["x"])] + _rms_nodes(1e-6)
    ref_y, ref_x = _ort(nodes, {"x1": x1, "x2": x2, "g": g}, ["y", "x"])
    y, rstd, x = KERNELS["NPUAddRmsNorm"]([x1, x2, g], {})
    np.testing.assert_allclose(y, ref_y, **TOL)
    np.testing.assert_allclose(x, ref_x, **TOL)
    assert rstd.shape == (2, 3, 1)


def test_group_norm_silu() -> None:
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 6, 4, 4)).astype(np.float32)
    gamma, beta = rng.standard_normal(6).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    nodes = [helper.make_node("Reshape", ["x", "gshape"], ["xg"]),
             helper.make_node("InstanceNormalization", ["xg", "ones", "zeros"], ["xn"], epsilon=1e-5),
             helper.make_node("Reshape", ["xn", "xshape"], ["xr"]),
             helper.make_node("Mul", ["xr", "gam"], ["xm"]), helper.make_node("Add", ["xm", "bet"], ["z"]),
             helper.make_node("Sigmoid", ["z"], ["sz"]), helper.make_node("Mul", ["z", "sz"], ["y"])]
    inits = {"gshape": np.array([2, 3, -1]), "xshape": np.array([2, 6, 4, 4]), "ones": np.ones(3, np.float32),
             "zeros": np.zeros(3, np.float32), "gam": gamma.reshape(6, 1, 1), "bet": beta.reshape(6, 1, 1)}
    (ref,) = _ort(nodes, {"x": x}, ["y"], inits)
    y, mean, rstd = KERNELS["NPUGroupNormSilu"]([x, gamma, beta], {"group": 3})
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
    xg = x.reshape(2, 3, -1).astype(np.float64)
    assert mean.shape == rstd.shape == (2, 3)
    np.testing.assert_allclose(mean, xg.mean(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(xg.var(-1) + 1e-5), rtol=1e-5)


def test_rotary_mul_and_rope() -> None:
    rng = np.random.default_rng(10)
    x = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    ang = rng.uniform(0, 3, (1, 1, 3, 4))
    cos = np.cos(np.concatenate([ang, ang], -1)).astype(np.float32)
    sin = np.sin(np.concatenate([ang, ang], -1)).astype(np.float32)
    nodes = [helper.make_node("Split", ["x", "halves"], ["x1", "x2"], axis=-1), helper.make_node("Neg", ["x2"], ["nx2"]),
             helper.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1), helper.make_node("Mul", ["x", "c"], ["a"]),
             helper.make_node("Mul", ["rot", "s"], ["b"]), helper.make_node("Add", ["a", "b"], ["y"])]
    (ref,) = _ort(nodes, {"x": x, "c": cos, "s": sin}, ["y"], {"halves": np.array([4, 4])})
    (got,) = KERNELS["NPURotaryMul"]([x, cos, sin], {})
    np.testing.assert_allclose(got, ref, **TOL)
    (half,) = KERNELS["NPURotaryPositionEmbedding"]([x, cos, sin], {"mode": 0})
    np.testing.assert_allclose(half, ref, **TOL)
    # mode 1 rotates adjacent pairs: with cos/sin repeated per pair it is a rotation of each (x0, x1)
    ci, si = np.cos(np.repeat(ang, 2, -1)), np.sin(np.repeat(ang, 2, -1))
    (inter,) = KERNELS["NPURotaryPositionEmbedding"]([x, ci.astype(np.float32), si.astype(np.float32)], {"mode": 1})
    a, b, t = x[..., ::2], x[..., 1::2], ang
    np.testing.assert_allclose(inter[..., ::2], a * np.cos(t) - b * np.sin(t), **TOL)
    np.testing.assert_allclose(inter[..., 1::2], b * np.cos(t) + a * np.sin(t), **TOL)


def test_fast_gelu_is_not_erf_gelu() -> None:
    x = np.linspace(-6, 6, 241, dtype=np.float32)
    (got,) = KERNELS["NPUFastGelu"]([x], {})
    sig = [_c("k", np.float32(1.702)), helper.make_node("Mul", ["x", "k"], ["kx"]),
           helper.make_node("Sigmoid", ["kx"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    (ref,) = _ort(sig, {"x": x}, ["y"])
    np.testing.assert_allclose(got, ref, **TOL)
    erf = [_c("r2", np.float32(np.sqrt(0.5))), _c("one", np.float32(1)), _c("half", np.float32(0.5)),
           helper.make_node("Mul", ["x", "r2"], ["xs"]), helper.make_node("Erf", ["xs"], ["e"]),
           helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["x", "e1"], ["xe"]),
           helper.make_node("Mul", ["xe", "half"], ["y"])]
    (gelu,) = _ort(erf, {"x": x}, ["y"])
    assert np.abs(got - gelu).max() > 1e-2


# ------------------------------------------------------------ contract

def _pfa_node(**over) -> onnx.NodeProto:
    attrs = {"num_heads": 4, "input_layout": "BNSD", "scale_value": 0.125, "pre_tokens": INT_MAX, "next_tokens": 0}
    attrs.update(over)
    attrs = {k: v for k, v in attrs.items() if v is not None}
    return helper.make_node("NPUPromptFlashAttention", ["q", "k", "v", "pse", "mask"], ["o"], name="pfa",
                            domain="npu", **attrs)


def test_check_node_flags_pfa_problems() -> None:
    assert check_node(_pfa_node(), "ascend910b") == []
    assert any("scale_value" in p for p in check_node(_pfa_node(scale_value=None), "ascend910b"))
    wrong = _pfa_node(scale_value=None)
    wrong.attribute.append(helper.make_attribute("scale_value", 1))
    assert any("scale_value" in p and "INT" in p and "ignores" in p for p in check_node(wrong, "ascend910b"))
    four = _pfa_node()
    del four.input[4]
    assert any("4 inputs" in p for p in check_node(four, "ascend910b"))
    gqa = check_node(_pfa_node(num_key_value_heads=2), "ascend310p")
    assert any("num_key_value_heads" in p and "310P" in p for p in gqa)
    assert check_node(_pfa_node(num_key_value_heads=2), "ascend910b") == []
    empty = _pfa_node()
    empty.input[3] = ""
    assert any("empty string" in p for p in check_node(empty, "ascend910b"))
    assert any("pre_tokens" in p for p in check_node(_pfa_node(pre_tokens=None), "ascend910b"))


def test_check_node_other_ops() -> None:
    rms = helper.make_node("NPURmsNorm", ["x", "g"], ["y"], domain="npu", epsilon=1e-5)
    assert any("epsilon" in p for p in check_node(rms, "ascend910b"))
    assert check_node(helper.make_node("NPURmsNorm", ["x", "g"], ["y", "r"], domain="npu"), "ascend310p") == []
    assert any("required" in p for p in check_node(helper.make_node("NPUGroupNormSilu", ["x", "g", "b"], ["y"]),
                                                   "ascend910b"))
    assert check_node(helper.make_node("NPUGroupNormSilu", ["x", "g", "b"], ["y"], num_groups=4), "ascend910b") == []
    assert any("no kernel" in p for p in check_node(helper.make_node("NPUFastGelu", ["x"], ["y"]), "ascend310p"))
    ifa = helper.make_node("NPUIncreFlashAttention", ["q", "k", "v", "p", "m"], ["o"], num_heads=2,
                           input_layout="BSH", scale_value=0.5)
    assert any("5 inputs" in p for p in check_node(ifa, "ascend910b"))
    assert registered("NPUPromptFlashAttention", "", 16) and not registered("NPUPromptFlashAttention", "", 17)
    assert registered("NPURmsNorm", "npu", 1) and registered("NPURmsNorm", "ai.onnx", 18)
    assert set(KERNELS) == set(PLUGINS)


def test_check_node_uses_graph_shapes() -> None:
    def graph(d: int) -> onnx.GraphProto:
        return helper.make_graph([], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 8, 4, d])], [])

    rope = helper.make_node("NPURotaryPositionEmbedding", ["x", "c", "s"], ["y"], mode=0)
    assert check_node(rope, "ascend310p", graph(64)) == []
    assert any("multiple of 32" in p for p in check_node(rope, "ascend310p", graph(48)))
    # IncreFlashAttention: the plugin leaves num_key_value_heads at 1, so a 4-head key is flagged
    ins = [helper.make_tensor_value_info("q", TensorProto.FLOAT16, [2, 4, 1, 64]),
           helper.make_tensor_value_info("k", TensorProto.FLOAT16, [2, 4, 16, 64])]
    inits = [onnx.numpy_helper.from_array(np.empty((0,), np.float16), "none")]
    ifa = helper.make_node("NPUIncreFlashAttention", ["q", "k", "k", "none", "none", "none"], ["o"], num_heads=4,
                           input_layout="BNSD", scale_value=0.125)
    g = helper.make_graph([ifa], "g", ins, [], initializer=inits)
    assert any("num_key_value_heads" in p for p in check_node(ifa, "ascend910b", g))


# ----------------------------------------------------------- evaluator

def test_run_atc_model_with_plugin_node() -> None:
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, 1, 2, 2, 4, 4, 8)
    mask = np.triu(np.ones((4, 4), bool), 1)
    nodes = [helper.make_node("Identity", ["q"], ["qi"], domain="ai.onnx"),
             helper.make_node("NPUPromptFlashAttention", ["qi", "k", "v", "pse", "mask"], ["o"], domain="npu",
                              **{**BASE, "next_tokens": 0}),
             helper.make_node("Relu", ["o"], ["y"], domain="ai.onnx")]
    ins = [helper.make_tensor_value_info(n, F, t.shape) for n, t in (("q", q), ("k", k), ("v", v))]
    inits = [onnx.numpy_helper.from_array(np.empty((0,), np.float16), "pse"), onnx.numpy_helper.from_array(mask, "mask")]
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", F, [1, 2, 4, 8])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("ai.onnx", 17), helper.make_opsetid("npu", 1)])
    assert {o.domain for o in normalise_domains(m).opset_import} == {"", "npu"}
    assert check_model(m, "ascend910b") == []
    assert any("pse_shift" in p for p in check_model(m, "ascend310p")) is False  # a 0-element pse is absent
    (y,) = run_atc_model(m, {"q": q, "k": k, "v": v})
    (direct,) = PFA([q, k, v, None, mask], {**BASE, "next_tokens": 0})
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, np.maximum(direct, 0), **TOL)
