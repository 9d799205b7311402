"""Residual operands whose shapes are equal only symbolically (issue 23, "residual shapes"): `algebra.dims` follows
each dim back to where it comes from, so a Conv residual or an Add + norm fuses where shape inference named the two
sides differently (`batch` against `unk__16`, a dim it lost), and stays a near-miss where equality does not follow
from the graph (two input symbols, a strided window against an unstrided one, a Range whose bounds are unrelated).
Real exports: the TorchScript UNet's skip-Concat residuals, MobileNetV2's TorchScript inverted residuals (explicit
Pads), Whisper's merged decoder (positions Range(past, past + seq) inside an If) and a dynamically quantized BERT."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import with_output_shapes
from onnx import TensorProto, helper, numpy_helper

from npufuse.algebra.dims import dim_str, same_shape, value_dims
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import Graph
from npufuse.ir.modelio import load_model
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.prepare.normalize import normalize
from npufuse.verify.compare import compare

FIXTURES = Path(__file__).parent / "fixtures"
C, H = 4, 16


def _model(nodes, inputs, inits, outputs=("Y",), opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                               for o in outputs], inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                                                ir_version=IR_VERSION))


def _weight(name: str, shape, seed: int) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def _same_on_onnxruntime(model: onnx.ModelProto, optimized: onnx.ModelProto, feeds: dict) -> None:
    want, got = run(model, feeds), run(optimized, feeds)
    for name in want:
        c = compare(name, got[name], want[name])
        assert c.ok and c.min_passing_rtol <= 1e-4, c.detail


def _view(model: onnx.ModelProto) -> Graph:
    m, types = normalize(model)
    return Graph(m, value_types=types)


def _conv_reasons(res) -> set[str]:
    return {f.reason for f in res.refusals if f.pattern == "conv_bn_act"}


def _fused_residuals(model: onnx.ModelProto) -> int:
    return sum(1 for n in model.graph.node if n.op_type == "FusedConv" and
               any(a.name == "residual" and a.i == 1 for a in n.attribute))


# ---- Conv residuals --------------------------------------------------------------------------------------------

def _skip_concat_block(other_batch: str = "batch") -> onnx.ModelProto:
    """A diffusers up-block ResNet: X is upsampled (Resize by 2: inference loses the batch name), concatenated with
    the skip S, and the block adds conv2(relu(conv1(cat))) to a 1x1 conv_shortcut of the same Concat. The Concat's
    batch is the skip's (every input of a Concat has it); inference names it afresh on both sides."""
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", C, 4, 4]),
              helper.make_tensor_value_info("S", TensorProto.FLOAT, [other_batch, C, 8, 8])]
    inits = [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
             _weight("W1", (C, 2 * C, 3, 3), 1), _weight("W2", (C, C, 3, 3), 2), _weight("Ws", (C, 2 * C, 1, 1), 3)]
    nodes = [helper.make_node("Resize", ["X", "", "scales"], ["up"], name="up", mode="nearest"),
             helper.make_node("Concat", ["up", "S"], ["cat"], name="cat", axis=1),
             helper.make_node("Conv", ["cat", "W1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "W2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["cat", "Ws"], ["sc"], name="conv_shortcut"),
             helper.make_node("Add", ["sc", "c2"], ["Y"], name="add")]
    return _model(nodes, inputs, inits)


def test_skip_concat_residual_is_proven_through_the_concat() -> None:
    model = _skip_concat_block()
    g = _view(model)
    assert g.shape("c2")[0] != "batch"                       # what inference says: a name of its own (or none)
    assert value_dims(g, "c2") == value_dims(g, "sc") == (("sym", "batch"), C, 8, 8)
    res = optimize(model, options=OptimizeOptions(dims={"batch": 2}))
    assert _fused_residuals(res.model) == 1 and "residual-shape-unknown" not in _conv_reasons(res)
    assert res.model_check is not None and res.model_check.ok and not res.rolled_back
    rng = np.random.default_rng(5)
    feeds = {"X": rng.standard_normal((3, C, 4, 4)).astype(np.float32),
             "S": rng.standard_normal((3, C, 8, 8)).astype(np.float32)}
    _same_on_onnxruntime(model, res.model, feeds)


def _downsample_block(shortcut_stride: int = 2, shortcut_kernel: int = 1) -> onnx.ModelProto:
    """ResNet's downsample block on an image of symbolic height and width: conv 3x3 stride 2 pad 1 -> relu -> conv
    3x3 pad 1, added to a conv shortcut of the input. floor((h + 2 - 3) / 2) + 1 == floor((h - 1) / 2) + 1: the
    1x1 stride-2 shortcut has the main branch's size for every h; inference leaves both unknown."""
    k = shortcut_kernel
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", C, "h", "w"])]
    inits = [_weight("W1", (C, C, 3, 3), 1), _weight("W2", (C, C, 3, 3), 2), _weight("Ws", (C, C, k, k), 3)]
    nodes = [helper.make_node("Conv", ["X", "W1"], ["c1"], name="conv1", pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "W2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["X", "Ws"], ["sc"], name="conv_shortcut",
                              strides=[shortcut_stride, shortcut_stride]),
             helper.make_node("Add", ["c2", "sc"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["Y"], name="relu_out")]
    return _model(nodes, inputs, inits)


def test_strided_residual_windows_are_proven_equal() -> None:
    model = _downsample_block()
    g = _view(model)
    assert [dim_str(d) for d in value_dims(g, "c2")] == ["batch", str(C), "win(h, -1, 2)", "win(w, -1, 2)"]
    assert same_shape(g, "c2", "sc")
    res = optimize(model, options=OptimizeOptions(dims={"batch": 2, "h": 7, "w": 9}))
    assert _fused_residuals(res.model) == 1 and not res.rolled_back and res.model_check.ok
    rng = np.random.default_rng(6)
    for h, w in ((7, 9), (8, 5)):
        _same_on_onnxruntime(model, res.model, {"X": rng.standard_normal((2, C, h, w)).astype(np.float32)})


def test_a_stride_one_shortcut_against_a_strided_branch_is_not_proven() -> None:
    """conv_shortcut stride 1: h against floor((h - 1) / 2) + 1, equal only where h is 1; the Add broadcasts there
    and nowhere else runs. Not one shape: refused, and the followed dims say why."""
    res = optimize(_downsample_block(shortcut_stride=1), options=OptimizeOptions(verify=False))
    assert _fused_residuals(res.model) == 0
    ref = next(f for f in res.refusals if f.pattern == "conv_bn_act" and f.node == "add")
    assert ref.reason == "residual-shape-unknown" and "win(h, -1, 2)" in ref.detail


def test_two_batch_symbols_are_not_one_shape() -> None:
    """conv(X) + Z with X's batch `b1` and Z's `b2`, two graph inputs' own symbols: b2 may be 1 at run time (the
    Add broadcasts Z over the batch, which a residual FusedConv does not). Refused as unproven, and the model runs
    as it did on exactly such inputs."""
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["b1", C, 8, 8]),
              helper.make_tensor_value_info("Z", TensorProto.FLOAT, ["b2", C, 8, 8])]
    nodes = [helper.make_node("Conv", ["X", "W1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c1", "Z"], ["Y"], name="add")]
    model = _model(nodes, inputs, [_weight("W1", (C, C, 3, 3), 1)])
    res = optimize(model, options=OptimizeOptions(dims={"b1": 2, "b2": 2}))
    assert _fused_residuals(res.model) == 0 and "residual-shape-unknown" in _conv_reasons(res)
    # at run time b2 may be 1: the Add broadcasts Z, which a residual FusedConv does not
    rng = np.random.default_rng(7)
    feeds = {"X": rng.standard_normal((2, C, 8, 8)).astype(np.float32),
             "Z": rng.standard_normal((1, C, 8, 8)).astype(np.float32)}
    assert run(model, feeds)["Y"].shape == (2, C, 8, 8)
    _same_on_onnxruntime(model, res.model, feeds)


def test_time_embedding_add_is_a_broadcast_once_the_batch_is_followed() -> None:
    """The UNet's conv1 output plus the [batch, C, 1, 1] time embedding: with the conv's batch followed through the
    skip Concat, the near-miss names the broadcast instead of an unknown shape."""
    model = _skip_concat_block()
    model.graph.input.append(helper.make_tensor_value_info("T", TensorProto.FLOAT, ["batch", C, 1, 1]))
    add = next(n for n in model.graph.node if n.name == "relu1")
    add.input[0] = "c1t"
    idx = [n.name for n in model.graph.node].index("relu1")
    model.graph.node.insert(idx, helper.make_node("Add", ["c1", "T"], ["c1t"], name="temb_add"))
    res = optimize(model, options=OptimizeOptions(dims={"batch": 2}))
    reasons = {f.node: f.reason for f in res.refusals if f.pattern == "conv_bn_act"}
    assert reasons.get("temb_add") == "residual-broadcast"
    assert _fused_residuals(res.model) == 1 and res.model_check.ok


@pytest.mark.parametrize("file", ["mobilenetv2_ts14.onnx", "mobilenetv2_ts17.onnx"])
def test_mobilenetv2_torchscript_inverted_residuals_fuse(file: str) -> None:
    """HF MobileNetV2's TorchScript export pads explicitly before every conv (zero Pads for the 1x1s, a Pad for the
    3x3 depthwise): inference names every batch, height and width afresh (unk__N); followed through Pad and the
    windows, the 10 inverted residuals are one shape (before: 0 fused, 10 residual-shape-unknown)."""
    res = optimize(load_model(FIXTURES / file), str(FIXTURES), OptimizeOptions())
    assert _fused_residuals(res.model) == 10 and "residual-shape-unknown" not in _conv_reasons(res)
    assert res.model_check is not None and res.model_check.ok and not res.rolled_back


# ---- Add + norm ------------------------------------------------------------------------------------------------

def _positions_from_the_cache(limit_from: str = "past") -> onnx.ModelProto:
    """Token embeddings plus position embeddings at arange(past, past + seq) (a decoder step with a cache, as
    Whisper's decoder computes them), then LayerNorm. The positions' length is limit - start: seq when the limit is
    past + seq; with limit_from='other' the limit is another tensor's dim plus seq, unrelated to the start."""
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("cache", TensorProto.FLOAT, ["batch", 2, "past", 4]),
              helper.make_tensor_value_info("other", TensorProto.FLOAT, ["batch", "other_len"])]
    i64 = lambda v, name: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    inits = [_weight("tokens", (50, H), 1), _weight("positions", (64, H), 2), i64(0, "i0"), i64(1, "i1"),
             i64(2, "i2"), i64([0], "ax0"), i64([1], "one"),
             numpy_helper.from_array(np.ones(H, np.float32), "gamma"),
             numpy_helper.from_array(np.zeros(H, np.float32), "beta")]
    limit_base = "past_len" if limit_from == "past" else "other_len"
    nodes = [helper.make_node("Gather", ["tokens", "ids"], ["emb"], name="embed"),
             helper.make_node("Shape", ["ids"], ["ids_shape"], name="ids_shape"),
             helper.make_node("Gather", ["ids_shape", "i0"], ["batch_n"], name="batch_n", axis=0),
             helper.make_node("Gather", ["ids_shape", "i1"], ["seq_n"], name="seq_n", axis=0),
             helper.make_node("Shape", ["cache"], ["cache_shape"], name="cache_shape"),
             helper.make_node("Gather", ["cache_shape", "i2"], ["past_len"], name="past_len", axis=0),
             helper.make_node("Shape", ["other"], ["other_shape"], name="other_shape"),
             helper.make_node("Gather", ["other_shape", "i1"], ["other_len"], name="other_len", axis=0),
             helper.make_node("Add", [limit_base, "seq_n"], ["limit"], name="limit"),
             helper.make_node("Range", ["past_len", "limit", "i1"], ["pos"], name="range"),
             helper.make_node("Unsqueeze", ["pos", "ax0"], ["pos2"], name="pos2"),
             helper.make_node("Unsqueeze", ["batch_n", "ax0"], ["batch_v"], name="batch_v"),
             helper.make_node("Concat", ["batch_v", "one"], ["reps"], name="reps", axis=0),
             helper.make_node("Tile", ["pos2", "reps"], ["pos_ids"], name="tile"),
             helper.make_node("Gather", ["positions", "pos_ids"], ["pos_emb"], name="embed_positions"),
             helper.make_node("Add", ["emb", "pos_emb"], ["h"], name="add"),
             helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["Y"], name="ln", axis=-1)]
    return _model(nodes, inputs, inits, outputs=("Y", "h"))


def test_positions_of_a_cache_step_are_proven_the_sequence() -> None:
    model = _positions_from_the_cache()
    g = _view(model)
    assert value_dims(g, "pos_emb") == value_dims(g, "emb") == (("sym", "batch"), ("sym", "seq"), H)
    res = optimize(model, options=OptimizeOptions(dims={"batch": 2, "seq": 3, "past": 5, "other_len": 4}))
    assert Counter(n.op_type for n in res.model.graph.node if n.domain == "npufuse")["AddLayerNorm"] == 1
    assert res.model_check is not None and res.model_check.ok and not res.rolled_back
    rng = np.random.default_rng(8)
    feeds = {"ids": rng.integers(0, 50, (3, 2)).astype(np.int64),
             "cache": rng.standard_normal((3, 2, 6, 4)).astype(np.float32),
             "other": rng.standard_normal((3, 7)).astype(np.float32)}
    _same_on_onnxruntime(model, res.model, feeds)


def test_positions_up_to_an_unrelated_limit_are_unproven() -> None:
    """arange(past, other_len + seq): seq elements only where other_len == past; with seq = 1 and the lengths
    unequal by one, onnxruntime broadcasts a [B, 1, H] embedding against [B, 2, H]-long positions... not one shape:
    refused, and the norm is fused alone."""
    res = optimize(_positions_from_the_cache("other"), options=OptimizeOptions(verify=False))
    assert not [n for n in res.model.graph.node if n.op_type == "AddLayerNorm"]
    assert "residual-shape-unproven" in {f.reason for f in res.refusals if f.pattern == "add_layernorm"}


def test_whisper_merged_decoder_fuses_every_residual_layernorm() -> None:
    """optimum's merged Whisper decoder: both If branches compute positions with Range / Tile (the cached branch
    from past to past + seq); each branch is fused as a model of its own, where no static phase names the dims.
    Before: 6 AddLayerNorm and 2 residual-shape-unproven (the embeddings Add of each branch); now 8."""
    path = FIXTURES / "optimum" / "whisper_decoder_merged.onnx"
    res = optimize(load_model(path), str(path.parent), OptimizeOptions())
    kinds = Counter(r.match.kind for r in res.applied)
    assert kinds["AddLayerNorm"] + kinds["AddLayerNorm[sum]"] == 8
    assert "residual-shape-unproven" not in {f.reason for f in res.refusals}
    assert res.model_check is not None and res.model_check.ok and not res.rolled_back


def test_dynamic_quantized_bert_residuals_fuse_and_the_position_table_is_a_broadcast() -> None:
    """quantize_dynamic's BERT: the MatMulInteger chains keep the batch and sequence (DynamicQuantizeLinear keeps
    its input's shape); before: 2 AddLayerNorm and 3 residual-shape-unproven, now 4 and the embeddings' [1, S, H]
    position table named as the broadcast it is."""
    path = FIXTURES / "qdq" / "bert_dynamic_quant.onnx"
    res = optimize(load_model(path), str(path.parent), OptimizeOptions())
    assert Counter(r.match.kind for r in res.applied)["AddLayerNorm"] == 4
    reasons = Counter(f.reason for f in res.refusals if f.pattern == "add_layernorm")
    assert reasons == Counter({"operand-broadcast": 1})
    assert res.model_check is not None and res.model_check.ok and not res.rolled_back


# ---- the algebra on its own ------------------------------------------------------------------------------------

def test_two_unknowns_broadcast_to_a_fresh_dim_never_to_either() -> None:
    """[a] + [b]: either may be 1 at run time, so the sum's dim is neither a nor b."""
    inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["a", H]),
              helper.make_tensor_value_info("B", TensorProto.FLOAT, ["b", H])]
    model = _model([helper.make_node("Add", ["A", "B"], ["Y"], name="add")], inputs, [])
    g = _view(model)
    d = value_dims(g, "Y")
    assert d[1] == H and d[0] not in (("sym", "a"), ("sym", "b"))
    assert not same_shape(g, "Y", "A") and not same_shape(g, "Y", "B")


def _t5_bias_slice(start_from_seq: bool) -> tuple[Graph, str, str]:
    """T5's `position_bias[:, :, -S:, :]`: the starts are -Shape(x)[1] (Neg of the sequence length), the end unbounded.
    Near miss: the start is -(S - 1), which keeps S - 1 rows."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "seq", H])
    bias = helper.make_tensor_value_info("B", TensorProto.FLOAT, [1, "seq", H])
    nodes = [helper.make_node("Shape", ["X"], ["xs"]),
             helper.make_node("Gather", ["xs", "one"], ["s"], axis=0),
             helper.make_node("Sub" if not start_from_seq else "Identity",
                              ["s", "one"] if not start_from_seq else ["s"], ["n"]),
             helper.make_node("Neg", ["n"], ["neg"]),
             helper.make_node("Slice", ["B", "neg", "big", "one"], ["Bs"]),
             helper.make_node("Add", ["X", "Bs"], ["Y"])]
    inits = [numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([2**62], np.int64), "big")]
    model = _model(nodes, [x, bias], inits)
    norm, types = normalize(model)
    return Graph(norm, None, types), "B", "Bs"


def test_a_slice_from_minus_the_axis_length_keeps_the_whole_axis() -> None:
    g, b, bs = _t5_bias_slice(start_from_seq=True)
    assert [dim_str(d) for d in value_dims(g, bs)] == [dim_str(d) for d in value_dims(g, b)] == ["1", "seq", str(H)]


def test_a_slice_from_minus_one_less_is_not_the_whole_axis() -> None:
    g, b, bs = _t5_bias_slice(start_from_seq=False)
    assert value_dims(g, bs)[1] != value_dims(g, b)[1]


def test_dims_follow_through_a_gated_mlp() -> None:
    # x [batch, seq, H] -> GatedMLP (width 2H inside) -> [batch, seq, H]: the rows are the input's (T5's residual
    # after its gated FFN was fused), whatever name inference gave the output
    from npufuse import FUSED_DOMAIN

    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "seq", H])
    node = helper.make_node("GatedMLP", ["X", "Wg", "Wu", "Wd"], ["Y"], domain=FUSED_DOMAIN, activation="silu")
    inits = [_weight("Wg", (H, 2 * H), 1), _weight("Wu", (H, 2 * H), 2), _weight("Wd", (2 * H, H), 3)]
    g_proto = helper.make_graph([node], "g", [x], [helper.make_tensor_value_info("Y", TensorProto.FLOAT,
                                                                                    ["unk__1", "unk__2", H])], inits)
    m = helper.make_model(g_proto, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(FUSED_DOMAIN, 1)],
                          ir_version=IR_VERSION)
    g = Graph(m)
    assert [dim_str(d) for d in value_dims(g, "Y")] == ["batch", "seq", str(H)]
    assert same_shape(g, "X", "Y")
