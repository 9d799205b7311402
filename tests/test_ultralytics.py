"""Ultralytics' own exports (issue 23, "the exports people actually run"): YOLOv8n and YOLO11n written by
`model.export(format="onnx")` (tools/fixtures/ultralytics_yolo.py), and the two forms they brought:

- YOLO11's C2PSA attention, q, k, v split out of one [B, H, 2·Dk + Dv, N] tensor: Softmax(qᵀ·k·scale), then
  v·Pᵀ, plus a depthwise Conv over v (positional encoding) added after. Kᵀ is the split k as computed (no Transpose)
  and the probabilities come transposed: FusedAttention reads K = kᵀ and V = vᵀ made outside and writes P·V, which a
  Transpose turns back into v·Pᵀ. Pᵀ·V (summing over the queries) is no attention.
- the Detect head's plain Sigmoid over the Concat of the class scores: no epilogue can take it, so the silu pattern
  names it (`lone-sigmoid`) instead of leaving it unaccounted.

The census counts (FusedConv per Conv-SiLU, the attention, the PSABlock's residual Convs) are asserted with the
other census fixtures in tests/test_census_fixtures.py; here the near-misses each fixture leaves, by reason."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import ops, with_output_shapes
from onnx import TensorProto, helper, numpy_helper

from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import attributes
from npufuse.ir.modelio import load_model
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

FIXTURES = Path(__file__).parent / "fixtures"
F32 = TensorProto.FLOAT
HEADS, DK, DV, H, W = 2, 8, 16, 4, 5
N, C = H * W, HEADS * DV


def _c(name: str, a: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(a, name)


def c2psa_attention(form: str = "exported") -> onnx.ModelProto:
    """ultralytics' Attention: qkv 1x1 Conv -> [B, H, 2·Dk + Dv, N] -> split q, k, v; Softmax(qᵀ·k·scale) over the
    keys; v·Pᵀ -> [B, C, H, W] + pe(v) (a depthwise 3x3 Conv). `form`: "exported" (the scale on q before its
    Transpose, as the export writes it), "scale_after" (on the scores), "probs_shared" (Pᵀ also an output),
    "probs_first" (Pᵀ·v': sums over the queries), "softmax_axis" (over the queries)."""
    rng = np.random.default_rng(0)
    scale = np.array(DK ** -0.5, np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w_qkv", "b_qkv"], ["qkv"], name="qkv", kernel_shape=[1, 1]),
        helper.make_node("Reshape", ["qkv", "heads_shape"], ["qkv_h"], name="split_heads"),
        helper.make_node("Split", ["qkv_h", "sizes"], ["q", "k", "v"], name="split", axis=2),
    ]
    if form == "scale_after":
        nodes += [helper.make_node("Transpose", ["q"], ["qt"], name="q_t", perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", ["qt", "k"], ["s0"], name="qk"),
                  helper.make_node("Mul", ["s0", "scale"], ["s"], name="scale_mul")]
    else:
        nodes += [helper.make_node("Mul", ["q", "scale"], ["qs"], name="scale_mul"),
                  helper.make_node("Transpose", ["qs"], ["qt"], name="q_t", perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", ["qt", "k"], ["s"], name="qk")]
    nodes.append(helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=2 if form == "softmax_axis" else -1))
    nodes.append(helper.make_node("Transpose", ["p"], ["pt"], name="p_t", perm=[0, 1, 3, 2]))
    if form == "probs_first":
        nodes += [helper.make_node("Transpose", ["v"], ["vt"], name="v_t", perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", ["pt", "vt"], ["o_t"], name="pv"),
                  helper.make_node("Transpose", ["o_t"], ["o"], name="o_t", perm=[0, 1, 3, 2])]
    else:
        nodes.append(helper.make_node("MatMul", ["v", "pt"], ["o"], name="pv"))
    nodes += [
        helper.make_node("Reshape", ["o", "image_shape"], ["o_img"], name="merge"),
        helper.make_node("Reshape", ["v", "image_shape"], ["v_img"], name="v_img"),
        helper.make_node("Conv", ["v_img", "w_pe", "b_pe"], ["pe"], name="pe", kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                         group=C),
        helper.make_node("Add", ["o_img", "pe"], ["y"], name="add_pe"),
    ]
    inits = [_c("w_qkv", (rng.standard_normal((HEADS * (2 * DK + DV), C, 1, 1)) * 0.3).astype(np.float32)),
             _c("b_qkv", (rng.standard_normal(HEADS * (2 * DK + DV)) * 0.1).astype(np.float32)),
             _c("heads_shape", np.array([1, HEADS, 2 * DK + DV, N], np.int64)),
             _c("sizes", np.array([DK, DK, DV], np.int64)), _c("scale", scale),
             _c("image_shape", np.array([1, C, H, W], np.int64)),
             _c("w_pe", (rng.standard_normal((C, 1, 3, 3)) * 0.3).astype(np.float32)),
             _c("b_pe", (rng.standard_normal(C) * 0.1).astype(np.float32))]
    outs = [helper.make_tensor_value_info("y", F32, [1, C, H, W])]
    if form == "probs_shared":
        outs.append(helper.make_tensor_value_info("pt", F32, [1, HEADS, N, N]))
    g = helper.make_graph(nodes, "c2psa", [helper.make_tensor_value_info("x", F32, [1, C, H, W])], outs, inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                                ir_version=IR_VERSION))


def _feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((1, C, H, W)).astype(np.float32)}


@pytest.mark.parametrize("form", ["exported", "scale_after"])
def test_c2psa_attention_fuses_and_computes_the_same(form: str) -> None:
    model = c2psa_attention(form)
    res = optimize(model, options=OptimizeOptions())
    fused = [n for n in res.model.graph.node if n.op_type == "FusedAttention"]
    assert len(fused) == 1, (ops(res.model), [(r.reason, r.detail) for r in res.refusals])
    assert "Softmax" not in ops(res.model) and "MatMul" not in ops(res.model)
    a = attributes(fused[0])
    assert (a["num_heads"], a["kv_num_heads"]) == (HEADS, HEADS)
    assert a["scale"] == pytest.approx(DK ** -0.5, rel=1e-6)
    # K = kᵀ and V = vᵀ made outside, P·V transposed back to v·Pᵀ after
    producers = {o: n for n in res.model.graph.node for o in n.output}
    assert [producers[v].op_type for v in fused[0].input[1:3]] == ["Transpose", "Transpose"]
    readers = [n for n in res.model.graph.node if fused[0].output[0] in n.input]
    assert [(n.op_type, list(attributes(n)["perm"])) for n in readers] == [("Transpose", [0, 1, 3, 2])]
    # the positional encoding's depthwise Conv takes the Add after the attention
    assert "FusedConv" in ops(res.model)
    assert res.applied and all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok
    onnx.checker.check_model(res.model, full_check=True)
    want, got = run(model, _feeds()), run(res.model, _feeds())
    c = compare("y", got["y"], want["y"])
    assert c.ok and c.min_passing_rtol <= 1e-4, c.detail


@pytest.mark.parametrize("form,reason", [
    ("probs_shared", "shared-intermediate"),   # Pᵀ is read outside the attention
    ("probs_first", "probs-chain"),            # Pᵀ·vᵀ sums over the queries: no attention
    ("softmax_axis", "softmax-axis"),          # normalised over the queries
])
def test_c2psa_near_misses_do_not_fuse(form: str, reason: str) -> None:
    res = optimize(c2psa_attention(form), options=OptimizeOptions())
    assert "FusedAttention" not in ops(res.model)
    assert reason in {r.reason for r in res.refusals if r.pattern == "attention"}, \
        [(r.reason, r.detail) for r in res.refusals]
    assert not unaccounted(res)
    want, got = run(c2psa_attention(form), _feeds()), run(res.model, _feeds())
    assert compare("y", got["y"], want["y"]).ok


# ---- the lone Sigmoid --------------------------------------------------------------------------------------

def _sigmoid_after(producer: str) -> onnx.ModelProto:
    """Sigmoid over the output of `producer`: "concat" (the Detect head's class scores), "add" (a sum of two
    activations, RT-DETR's bbox refinement), "conv" (an epilogue the conv family takes), "silu" (x·sigmoid(x))."""
    rng = np.random.default_rng(2)
    nodes, inits = [], []
    if producer == "concat":
        nodes.append(helper.make_node("Concat", ["a", "b"], ["x"], name="gather_levels", axis=2))
    elif producer == "add":
        nodes.append(helper.make_node("Add", ["a", "b"], ["x"], name="refine"))
    else:
        nodes.append(helper.make_node("Conv", ["a", "w"], ["x"], name="conv", kernel_shape=[1, 1]))
        inits.append(_c("w", rng.standard_normal((4, 4, 1, 1)).astype(np.float32)))
    nodes.append(helper.make_node("Sigmoid", ["x"], ["s"], name="sigmoid"))
    out = "s"
    if producer == "silu":
        nodes.append(helper.make_node("Mul", ["x", "s"], ["y"], name="mul"))
        out = "y"
    g = helper.make_graph(nodes, "sig", [helper.make_tensor_value_info(n, F32, [1, 4, 3, 3]) for n in ("a", "b")],
                          [helper.make_tensor_value_info(out, F32, None)], inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                                ir_version=IR_VERSION))


@pytest.mark.parametrize("producer", ["concat", "add"])
def test_a_sigmoid_no_epilogue_can_take_is_named(producer: str) -> None:
    res = optimize(_sigmoid_after(producer), options=OptimizeOptions(verify=False))
    assert ops(res.model).count("Sigmoid") == 1
    named = [r for r in res.refusals if r.reason == "lone-sigmoid"]
    assert [(r.pattern, r.node) for r in named] == [("silu", "sigmoid")]
    assert ("data movement" if producer == "concat" else "two computed values") in named[0].detail
    assert not unaccounted(res)


@pytest.mark.parametrize("producer", ["conv", "silu"])
def test_a_sigmoid_a_family_takes_is_not_named_lone(producer: str) -> None:
    res = optimize(_sigmoid_after(producer), options=OptimizeOptions())
    assert "Sigmoid" not in ops(res.model)
    assert not [r for r in res.refusals if r.reason == "lone-sigmoid"]


# ---- the real exports ----------------------------------------------------------------------------------------

_MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
EXPORTS = {e["file"]: e for e in _MANIFEST["census_fixtures"] if e["exporter"] == "ultralytics"}
# near-misses each export leaves, by reason: the Detect head's Sigmoid (lone-sigmoid) and DFL's Softmax over 16
# bins, whose output a 1x1 Conv holding 0..15 reads (not-attention)
NEAR_MISSES = {"yolov8n_ultralytics.onnx": {"lone-sigmoid": 1, "not-attention": 1},
               "yolo11n_ultralytics.onnx": {"lone-sigmoid": 1, "not-attention": 1}}


def test_the_exports_are_ultralytics_own() -> None:
    assert sorted(EXPORTS) == sorted(NEAR_MISSES)
    for e in EXPORTS.values():
        assert e["export_kwargs"] == {"format": "onnx", "imgsz": 128} and e["exporter_versions"]["ultralytics"]
        assert (FIXTURES / e["file"]).stat().st_size < 1_600_000
        assert "BatchNormalization" not in e["op_counts"]   # ultralytics folds BN before tracing


@pytest.mark.parametrize("file", sorted(NEAR_MISSES))
def test_every_anchor_of_the_export_is_fused_or_named(file: str) -> None:
    res = optimize(load_model(FIXTURES / file), str(FIXTURES), OptimizeOptions(verify=False))
    assert not unaccounted(res)
    assert Counter(r.reason for r in res.refusals) == Counter(NEAR_MISSES[file])
    sig = next(r for r in res.refusals if r.reason == "lone-sigmoid")
    assert "Concat" in sig.detail
    # every Conv -> SiLU is one FusedConv; what stays: the Detect head's last Conv2d of each branch, DFL's Conv
    # (no activation) and, in YOLO11, the attention's qkv Conv (a Reshape reads it)
    fused = Counter(n.op_type for n in res.model.graph.node)
    want = EXPORTS[file]["expected"]
    assert fused["FusedConv"] == want["conv_epilogue"] + want["conv_residual"]
    assert fused["Sigmoid"] == 1 and fused["Softmax"] == 1
