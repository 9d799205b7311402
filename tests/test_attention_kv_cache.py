"""Attention with a KV cache: past K/V concatenated with the new K/V (prefill, chunked prefill, decode)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import ops, with_output_shapes
from onnx import TensorProto, helper, numpy_helper

from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import attributes
from npufuse.patterns.attention import FusedAttentionPattern
from npufuse.patterns.attention_op import causal_keep
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.verify.compare import compare

B, H, D = 2, 4, 8
FMIN = float(np.finfo(np.float32).min)
KVCACHE = Path(__file__).parent / "fixtures" / "kvcache"


class _B:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.n = 0

    def input(self, name: str, shape, elem: int = TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
        return name

    def const(self, arr) -> str:
        self.n += 1
        name = f"c{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def ints(self, *vals: int) -> str:
        return self.const(np.array(vals, dtype=np.int64))

    def op(self, op_type: str, inputs, name: str | None = None, out: str | None = None, **attrs) -> str:
        self.n += 1
        name = name or f"{op_type.lower()}{self.n}"
        o = out or f"{name}_out"
        self.nodes.append(helper.make_node(op_type, list(inputs), [o], name=name, **attrs))
        return o

    def model(self, outputs: list[str]) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, "kv_attention", self.inputs,
                              [helper.make_empty_tensor_value_info(o) for o in outputs], self.inits)
        return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                                    ir_version=IR_VERSION))


def kv_model(*, sq: int | str = 1, past: int | str = "past_len", kv: int = H, mask: str | None = "additive",
             axis: int = 2, kt_output: bool = False, present_side_use: bool = False) -> onnx.ModelProto:
    """One decoder attention with a KV cache, the way HF eager exports it: the new K/V are split into heads,
    concatenated after past_key_values.0.key/value on the sequence axis (the results are present.0.key/value,
    graph outputs), repeated for GQA, and attended to by the queries."""
    b = _B()
    total: int | str = sq + past if isinstance(sq, int) and isinstance(past, int) else "total_len"
    xq = b.input("xq", [B, sq, H * D])
    xk, xv = b.input("xk", [B, sq, kv * D]), b.input("xv", [B, sq, kv * D])
    # axis 1 (the wrong axis): the "past" holds more heads for the same positions
    past_shape = [B, kv, past, D] if axis in (2, -2) else [B, H - kv, sq, D]
    pk, pv = b.input("past_key_values.0.key", past_shape), b.input("past_key_values.0.value", past_shape)
    q = b.op("Transpose", [b.op("Reshape", [xq, b.ints(0, 0, H, D)])], perm=[0, 2, 1, 3])
    k = b.op("Transpose", [b.op("Reshape", [xk, b.ints(0, 0, kv, D)])], perm=[0, 2, 1, 3])
    v = b.op("Transpose", [b.op("Reshape", [xv, b.ints(0, 0, kv, D)])], perm=[0, 2, 1, 3])
    k = b.op("Concat", [pk, k], name="cat_k", out="present.0.key", axis=axis)
    v = b.op("Concat", [pv, v], name="cat_v", out="present.0.value", axis=axis)
    if kv != H and axis in (2, -2):   # llama repeat_kv: Unsqueeze(2) -> Expand -> Reshape, targets from Shape
        def repeat(x: str) -> str:
            shape = b.op("Shape", [x])
            target5 = b.op("Concat", [b.op("Slice", [shape, b.ints(0), b.ints(2)]), b.ints(H // kv),
                                      b.op("Slice", [shape, b.ints(2), b.ints(4)])], axis=0)
            e = b.op("Expand", [b.op("Unsqueeze", [x, b.ints(2)]), target5])
            target4 = b.op("Concat", [b.op("Slice", [shape, b.ints(0), b.ints(1)]), b.ints(H),
                                      b.op("Slice", [shape, b.ints(2), b.ints(4)])], axis=0)
            return b.op("Reshape", [e, target4])
        k, v = repeat(k), repeat(v)
    kt = b.op("Transpose", [k], name="kt", perm=[0, 1, 3, 2])
    s = b.op("Div", [b.op("MatMul", [q, kt], name="qk"), b.const(np.array(D ** 0.5, np.float32))])
    if mask == "additive":          # HF eager: a [B, 1, q, kv] float mask built outside (causal + padding)
        s = b.op("Add", [s, b.input("attention_mask", [B, 1, sq, total])])
    elif mask == "bool":
        s = b.op("Where", [b.input("keep", [B, 1, sq, total], TensorProto.BOOL), s, b.const(np.float32(FMIN))])
    elif mask in ("causal", "causal_topleft"):   # a constant triangle: bottom-right aligned (HF) or not
        assert isinstance(sq, int) and isinstance(total, int)
        tri = causal_keep(sq, total) if mask == "causal" else np.tril(np.ones((sq, total), bool))
        s = b.op("Where", [b.const(tri.reshape(1, 1, sq, total)), s, b.const(np.float32(FMIN))])
    y = b.op("MatMul", [b.op("Softmax", [s], axis=-1), v], name="pv")
    y = b.op("Reshape", [b.op("Transpose", [y], perm=[0, 2, 1, 3]), b.ints(0, 0, H * D)], name="merge", out="y")
    outputs = ["y", "present.0.key", "present.0.value"]
    if kt_output:
        outputs.append(kt)
    if present_side_use:   # the cache also feeds something that is not this attention
        outputs.append(b.op("ReduceSum", ["present.0.key"], out="key_sum", keepdims=0))
    return b.model(outputs)


def _feeds(model: onnx.ModelProto, dims: dict[str, int], seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else dims[d.dim_param] for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == TensorProto.BOOL:
            m = rng.random(shape) < 0.7
            m[..., 0] = True
            feeds[i.name] = m
        elif i.name == "attention_mask":
            sq, total = shape[2], shape[3]
            keep = causal_keep(sq, total)[None, None] & (rng.random((shape[0], 1, 1, total)) < 0.8)
            keep[..., 0] = True
            feeds[i.name] = np.where(keep, 0.0, FMIN).astype(np.float32)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _optimize(model: onnx.ModelProto, dims: dict[str, int] | None = None):
    return optimize(model, options=OptimizeOptions(patterns=[FusedAttentionPattern()], dims=dims))


def _check_fused(model: onnx.ModelProto, run_dims: list[dict[str, int]], verify_dims: dict[str, int] | None = None):
    symbols = {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param}
    dims = verify_dims if verify_dims is not None else run_dims[0]
    res = _optimize(model, {k: v for k, v in dims.items() if k in symbols} or None)
    fused = [n for n in res.model.graph.node if n.op_type == "FusedAttention"]
    assert len(fused) == 1, (ops(res.model), [(f.reason, f.detail) for f in res.refusals])
    assert "Softmax" not in ops(res.model)
    assert res.applied and all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok
    onnx.checker.check_model(res.model, full_check=True)
    # the present outputs are still the graph's outputs, made by the Concat outside the fused op
    assert [o.name for o in res.model.graph.output] == [o.name for o in model.graph.output]
    assert sorted(n.op_type for n in res.model.graph.node if n.output[0].startswith("present")) == ["Concat"] * 2
    assert list(fused[0].input[1:3]) == ["present.0.key", "present.0.value"]
    for dims in run_dims:
        feeds = _feeds(model, dims)
        want, got = run(model, feeds), run(res.model, feeds)
        for name in want:
            c = compare(name, got[name], want[name])
            assert c.ok, (name, dims, c.detail)
        np.testing.assert_array_equal(got["present.0.key"], want["present.0.key"])
        np.testing.assert_array_equal(got["present.0.value"], want["present.0.value"])
    (rec,) = [r for r in res.records if r.status == "applied"]
    return res, fused[0], attributes(fused[0]), rec


# ---- positives -------------------------------------------------------------------------------------------

def test_prefill_with_empty_past() -> None:
    """Symbolic past length (the verifier's default for a `past` dim is 0), run with past 0 and past 5."""
    model = kv_model(sq="seq_len", past="past_len")
    res, node, a, rec = _check_fused(model, [{"seq_len": 6, "past_len": 0, "total_len": 6},
                                             {"seq_len": 6, "past_len": 5, "total_len": 11}])
    assert rec.match.kind == "FusedAttention[mask,kvcache]"   # a cache, the query length not fixed
    assert (a["q_layout"], a["k_layout"], a["out_layout"]) == ("BSH", "BNSD", "BSH")
    assert list(node.input[1:3]) == ["present.0.key", "present.0.value"]


@pytest.mark.parametrize("mask", ["additive", "bool", None])
def test_decode(mask) -> None:
    model = kv_model(sq=1, past="past_len", mask=mask)
    _, node, a, rec = _check_fused(model, [{"past_len": 7, "total_len": 8}, {"past_len": 0, "total_len": 1}])
    assert rec.match.kind == "FusedAttention" + ("[mask,decode]" if mask else "[decode]")
    assert rec.ascend_kernel is None or rec.ascend_kernel["op"] == "IncreFlashAttention"


def test_decode_with_a_causal_triangle() -> None:
    """One query after a past of 8: the bottom-right causal row sees every key (causal=1, nothing to mask)."""
    _, node, a, rec = _check_fused(kv_model(sq=1, past=8, mask="causal"), [{}])
    assert a["causal"] == 1 and len(node.input) == 3 and rec.match.kind == "FusedAttention[causal,decode]"
    assert rec.ascend_kernel["op"] == "IncreFlashAttention" and "atten_mask" not in \
        {i["name"] for i in rec.ascend_kernel["inputs"]}


@pytest.mark.parametrize("mask", ["additive", "causal", "bool"])
def test_chunked_prefill(mask) -> None:
    """q_len 4 after a past of 8: the causal triangle is aligned to the last key (bottom-right, as HF)."""
    model = kv_model(sq=4, past=8, mask=mask)
    _, node, a, rec = _check_fused(model, [{}])
    if mask == "causal":
        assert a["causal"] == 1 and len(node.input) == 3
        assert rec.match.kind == "FusedAttention[causal,prefill]"
    else:
        assert a["causal"] == 0


def test_top_left_triangle_is_not_taken_for_causal() -> None:
    """A constant triangle aligned to the first key is not the causal attribute's: it stays a boolean mask."""
    model = kv_model(sq=4, past=8, mask="causal_topleft")
    _, node, a, _ = _check_fused(model, [{}])
    assert a["causal"] == 0 and node.input[4]


@pytest.mark.parametrize("sq,past", [(1, "past_len"), (4, 8), ("seq_len", "past_len")])
def test_grouped_query_attention_with_cache(sq, past) -> None:
    model = kv_model(sq=sq, past=past, kv=2)
    dims = {"past_len": 5, "seq_len": 3, "total_len": 5 + (sq if isinstance(sq, int) else 3)}
    _, node, a, _ = _check_fused(model, [dims])
    assert (a["num_heads"], a["kv_num_heads"], a["kv_repeat"]) == (H, 2, "interleave")
    assert list(node.input[1:3]) == ["present.0.key", "present.0.value"]   # the repeat absorbed, not the cache


def test_present_with_another_consumer() -> None:
    model = kv_model(sq=1, past=6, present_side_use=True)
    _check_fused(model, [{}])


@pytest.mark.parametrize("sq,past,op", [
    (1, 8, "IncreFlashAttention"), (1, "past_len", "IncreFlashAttention"), (4, 8, "PromptFlashAttention"),
    ("seq_len", "past_len", "PromptFlashAttention")])
def test_kernel_mapping_prefill_and_decode(sq, past, op) -> None:
    dims = {"seq_len": 3, "past_len": 5, "total_len": 5 + (sq if isinstance(sq, int) else 3)}
    model = kv_model(sq=sq, past=past, kv=2)
    symbols = {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param}
    res = _optimize(model, {k: v for k, v in dims.items() if k in symbols} or None)
    (rec,) = [r for r in res.records if r.status == "applied"]
    assert rec.ascend_kernel["op"] == op
    assert rec.ascend_kernel["attrs"]["num_key_value_heads"] == 2


# ---- near-misses -----------------------------------------------------------------------------------------

def test_transposed_key_used_elsewhere_is_refused() -> None:
    res = _optimize(kv_model(sq=1, past=6, kt_output=True))
    assert "FusedAttention" not in ops(res.model)
    assert "shared-intermediate" in {f.reason for f in res.refusals if f.pattern == "attention"}


def test_concat_on_the_wrong_axis_is_no_cache() -> None:
    """Concatenated along the head dim, the past is not a KV cache: not tagged prefill/decode, and the
    attention over the concatenated tensor is still exact (the Concat stays outside)."""
    model = kv_model(sq=4, past=8, axis=1, kv=2, mask=None)
    res, node, a, rec = _check_fused(model, [{}])
    assert "prefill" not in rec.match.kind and "decode" not in rec.match.kind
    assert list(node.input[1:3]) == ["present.0.key", "present.0.value"] and a["kv_num_heads"] == H


# ---- real exports: a tiny HF Llama decode step with DynamicCache (tools/make_kvcache_fixture.py) ------------

@pytest.mark.parametrize("file,dims,decode", [
    ("llama_decode_dynamo.onnx", {"batch": 2, "past_sequence": 5, "past_sequence + 1": 6}, True),
    ("llama_decode_dynamo.onnx", {"batch": 2, "past_sequence": 0, "past_sequence + 1": 1}, True),
    ("llama_decode_ts17.onnx", {"batch": 2, "past_sequence": 5, "total_sequence": 6}, True),
    ("llama_decode_ts17.onnx", {"batch": 1, "past_sequence": 0, "total_sequence": 1}, True),
])
def test_real_llama_decode_with_cache(file: str, dims: dict, decode: bool) -> None:
    model = onnx.load(str(KVCACHE / file))
    assert ops(model).count("Softmax") == 2
    res = optimize(model, str(KVCACHE), OptimizeOptions(patterns=[FusedAttentionPattern()], dims=dims))
    fused = [n for n in res.model.graph.node if n.op_type == "FusedAttention"]
    assert len(fused) == 2, [(f.reason, f.detail) for f in res.refusals]
    assert "Softmax" not in ops(res.model)
    assert len(res.applied) == 2 and all(r.check is not None and r.check.ok for r in res.applied)
    assert not res.rolled_back and res.model_check is not None and res.model_check.ok
    assert [o.name for o in res.model.graph.output] == [o.name for o in model.graph.output]
    for i, node in enumerate(fused):
        a = attributes(node)
        assert list(node.input[1:3]) == [f"present.{i}.key", f"present.{i}.value"]   # the cache stays outside
        assert (a["num_heads"], a["kv_num_heads"], a["kv_repeat"], a["mask_order"]) == (4, 2, "interleave", "add")
        assert a["scale"] == pytest.approx(16 ** -0.5, rel=1e-6)
    for rec in res.applied:
        # dynamo keeps the query length 1 in its shapes; in the TorchScript export shape inference loses it through
        # the rotary embedding's rotate_half (Slice bounds computed from shapes), which the canonical phase folds
        # (fold_static_value), so the query length 1 is proven there too
        assert rec.match.kind == ("FusedAttention[gqa,mask,decode]" if decode else "FusedAttention[gqa,mask,kvcache]")
        assert rec.ascend_kernel["op"] == ("IncreFlashAttention" if decode else "PromptFlashAttention")
    rng = np.random.default_rng(0)
    batch, past = dims["batch"], dims["past_sequence"]
    feeds = {"input_ids": rng.integers(0, 100, (batch, 1)), "attention_mask": np.ones((batch, past + 1), np.int64)}
    feeds.update({i.name: rng.standard_normal((batch, 2, past, 16)).astype(np.float32)
                  for i in model.graph.input if i.name.startswith("past_key_values")})
    want, got = run(model, feeds), run(res.model, feeds)
    for name in want:
        if name.startswith("present"):
            np.testing.assert_array_equal(got[name], want[name])
        c = compare(name, got[name], want[name])
        assert c.ok, (name, c.detail)
