"""Attention with the heads merged into the batch (npufuse/prepare/rules/merged_heads.py): the dynamo exporter's
3-D K transpose unflattened, torch's bmm / baddbmm attention and nn.MultiheadAttention's sequence-first head split
lifted to 4-D, and the Reshapes the lifts leave cancelled; bit for bit, with the near-misses left alone."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from canon_helpers import (
    F32,
    FIXTURES,
    _assert_exact,
    _c,
    _canonical,
    _model,
    _ops,
    _vi,
)
from onnx import helper, numpy_helper

from npufuse.ir.runtime import session
from npufuse.prepare.normalize import normalize

# ---- the dynamo exporter's K transpose in 3-D --------------------------------------------------------------

def _flattened_kt(y_shape, t1, t2, tr_perm=(0, 2, 1)):
    """Reshape(Transpose(Reshape(y, t1), tr_perm), t2) followed by a MatMul with Q."""
    b, h, s, d = 2, 4, 5, 8
    nodes = [helper.make_node("Reshape", ["y", "t1"], ["flat"]),
             helper.make_node("Transpose", ["flat"], ["flat_t"], perm=list(tr_perm)),
             helper.make_node("Reshape", ["flat_t", "t2"], ["kt"]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"])]
    return _model(nodes, [_vi("y", F32, list(y_shape)), _vi("q", F32, [b, h, s, d])], [_vi("scores", F32, [b, h, s, s])],
                  [_c("t1", np.array(t1, np.int64)), _c("t2", np.array(t2, np.int64))])


def test_k_transpose_flattened_to_3d_becomes_a_4d_transpose() -> None:
    m = _flattened_kt([2, 4, 5, 8], [-1, 5, 8], [2, 4, 8, 5])
    out, applied = _canonical(m)
    assert applied == Counter(unflatten_k_transpose=1)
    assert _ops(out) == ["Transpose", "MatMul"]
    assert list(out.graph.node[0].attribute[0].ints) == [0, 1, 3, 2] and out.graph.node[0].input[0] == "y"
    _assert_exact(m, out)


def test_gqa_repeat_flattened_to_3d_becomes_the_repeat_kv_reshape() -> None:
    """K's head repeat [B, G, n_rep, S, D] flattened straight to [B·H, S, D] (dynamo, static shapes)."""
    m = _flattened_kt([2, 2, 2, 5, 8], [8, 5, 8], [2, 4, 8, 5])
    out, applied = _canonical(m)
    assert applied == Counter(unflatten_k_transpose=1)
    assert _ops(out) == ["Reshape", "Transpose", "MatMul"]
    reshape = out.graph.node[0]
    target = next(numpy_helper.to_array(t) for t in out.graph.initializer if t.name == reshape.input[1])
    assert target.tolist() == [2, 4, 5, 8]
    _assert_exact(m, out)


@pytest.mark.parametrize("t1,t2,perm", [
    ([-1, 5, 8], [2, 4, 5, 8], (0, 2, 1)),     # the transposed buffer reinterpreted, not unflattened as [B,H,D,S]
    ([-1, 5, 8], [2, 4, 8, 5], (2, 1, 0)),     # a different 3-D permutation
    ([-1, 5, 8], [2, 4, 0, 5], (0, 2, 1)),     # a 0 that copies a dim of the intermediate
])
def test_flattened_near_misses_are_left_alone(t1, t2, perm) -> None:
    out, applied = _canonical(_flattened_kt([2, 4, 5, 8], t1, t2, perm))
    assert "unflatten_k_transpose" not in applied and "Reshape" in _ops(out)


def test_dynamo_sdpa_export_canonicalises_its_k_transposes() -> None:
    """The real llama dynamo SDPA export: each layer's K transpose is written in 3-D over the GQA repeat."""
    from npufuse.ir.modelio import load_model

    m = load_model(FIXTURES / "llama_sdpa_dynamo.onnx")
    applied: Counter = Counter()
    normalize(m, str(FIXTURES), applied)
    assert applied["unflatten_k_transpose"] == 2


# ---- attention with the heads merged into the batch (torch's bmm / baddbmm) --------------------------------

B, H, S, D = 2, 4, 5, 8


def _bmm_attention(k_split=(B, H, S, D), bias: str = "merged", softmax_axis: int = -1, opset: int = 17):
    """BLOOM-style: q, k, v [B, H, S, D] merged to [B·H, S, D]; scores·c + bias [B·H, 1, S]; Softmax; ·v; split."""
    bh = B * H
    nodes = [helper.make_node("Reshape", ["q", "t3"], ["q3"]),
             helper.make_node("Reshape", ["k", "t3k"], ["k3"]),
             helper.make_node("Transpose", ["k3"], ["kt3"], perm=[0, 2, 1]),
             helper.make_node("Reshape", ["v", "t3"], ["v3"]),
             helper.make_node("MatMul", ["q3", "kt3"], ["s3"]),
             helper.make_node("Mul", ["s3", "scale"], ["ss3"])]
    inputs = [_vi("q", F32, [B, H, S, D]), _vi("k", F32, list(k_split)), _vi("v", F32, [B, H, S, D])]
    inits = [_c("t3", np.array([bh, S, D], np.int64)), _c("t3k", np.array([bh, S, D], np.int64)),
             _c("scale", np.array(0.35355339, np.float32)), _c("t4", np.array([B, H, S, D], np.int64))]
    if bias == "merged":        # ALiBi [B, H, S] -> [B·H, 1, S]
        nodes.append(helper.make_node("Reshape", ["alibi", "tb"], ["bias3"]))
        inputs.append(_vi("alibi", F32, [B, H, S]))
        inits.append(_c("tb", np.array([bh, 1, S], np.int64)))
    else:                       # a [B·H, S, S] input (DeBERTa's relative terms), or one of another batch
        inputs.append(_vi("bias3", F32, [bh if bias == "input" else 1, S, S]))
    nodes += [helper.make_node("Add", ["ss3", "bias3"], ["a3"]),
              helper.make_node("Softmax", ["a3"], ["p3"], axis=softmax_axis),
              helper.make_node("MatMul", ["p3", "v3"], ["o3"]),
              helper.make_node("Reshape", ["o3", "t4"], ["y"])]
    return _model(nodes, inputs, [_vi("y", F32, [B, H, S, D])], inits, opset=opset)


def _rank_of(model: onnx.ModelProto, op: str) -> list[int]:
    from npufuse.ir.graph import Graph

    g = Graph(model, value_types={})
    out = []
    for n in model.graph.node:
        if n.op_type == op:
            shape = g.shape(n.input[0])
            out.append(len(shape) if shape is not None else -1)
    return out


@pytest.mark.parametrize("bias", ["merged", "input"])
def test_bmm_attention_is_lifted_to_4d(bias) -> None:
    m = _bmm_attention(bias=bias)
    out, applied = _canonical(m)
    assert applied["unmerge_matmul"] == 2 and applied["sink_transpose_merge"] == 1
    assert applied["unmerge_elementwise"] == 2 and applied["unmerge_unary"] == 1
    assert applied["fold_reshapes"] >= 1              # the final split folds into the merge of ·V's result
    ops = _ops(out)
    assert ops.count("MatMul") == 2 and ops.count("Softmax") == 1
    from npufuse.prepare.infer import infer_value_types
    types = infer_value_types(out)
    ranks = {n.op_type: len(types[n.input[0]].tensor_type.shape.dim) for n in out.graph.node
             if n.op_type in ("MatMul", "Softmax", "Add")}
    assert ranks == {"MatMul": 4, "Softmax": 4, "Add": 4}
    assert out.graph.output[0].name == "y"
    _assert_exact(m, out)


@pytest.mark.parametrize("case", ["heads-swapped", "softmax-axis", "bias-batch-unproven"])
def test_bmm_attention_near_misses_stay_3d(case) -> None:
    if case == "heads-swapped":      # k is [H, B, S, D]: it merges to B·H too, but its heads are not q's
        m = _bmm_attention(k_split=(H, B, S, D))
        out, applied = _canonical(m)
        assert "unmerge_matmul" not in applied
    elif case == "softmax-axis":     # Softmax over the queries: not the last axis
        m = _bmm_attention(softmax_axis=1)
        out, applied = _canonical(m)
        assert "unmerge_unary" not in applied and applied["unmerge_matmul"] == 1
    else:                            # a [1, S, S] bias: its batch is not B·H
        m = _bmm_attention(bias="other")
        out, applied = _canonical(m)
        assert applied["unmerge_matmul"] == 1 and "unmerge_unary" not in applied
    _assert_exact(m, out)


def _mha_seq_first(e_split=(H, D), perm_q=(1, 0, 2)):
    """nn.MultiheadAttention: x [S, B, E] -> [S, B·H, D] -> Transpose (1,0,2) / (1,2,0) -> bmm -> Softmax -> bmm."""
    h, d = e_split
    nodes = [helper.make_node("Reshape", ["x", "t"], ["x3"]),
             helper.make_node("Transpose", ["x3"], ["q3"], perm=list(perm_q)),
             helper.make_node("Reshape", ["kx", "t"], ["kx3"]),
             helper.make_node("Transpose", ["kx3"], ["kt3"], perm=[1, 2, 0]),
             helper.make_node("MatMul", ["q3", "kt3"], ["s3"]),
             helper.make_node("Softmax", ["s3"], ["p3"], axis=-1),
             helper.make_node("MatMul", ["p3", "q3"], ["o3"]),
             helper.make_node("Transpose", ["o3"], ["y"], perm=[1, 0, 2])]
    return _model(nodes, [_vi("x", F32, [S, B, H * D]), _vi("kx", F32, [S, B, H * D])], [_vi("y", F32, [S, B * h, d])],
                  [_c("t", np.array([S, B * h, d], np.int64))])


def test_sequence_first_head_split_becomes_batch_first_4d() -> None:
    m = _mha_seq_first()
    out, applied = _canonical(m)
    assert applied["split_heads_transpose"] == 2 and applied["unmerge_matmul"] == 2
    perms = [list(n.attribute[0].ints) for n in out.graph.node if n.op_type == "Transpose"]
    assert [0, 2, 1, 3] in perms and [0, 2, 3, 1] in perms      # Q and Kᵀ as the attention matcher knows them
    _assert_exact(m, out)


def test_sequence_first_reshape_that_is_no_head_split_is_left_alone() -> None:
    """[S, B, E] -> [S, B·E/16, 16] with 16 not dividing... E/D heads of 16 here: D = 16 does not match [S, B·H, D]
    of the transposes' reading (the target's first dim is not S)."""
    nodes = [helper.make_node("Reshape", ["x", "t"], ["x3"]), helper.make_node("Transpose", ["x3"], ["y"], perm=[1, 0, 2])]
    m = _model(nodes, [_vi("x", F32, [S, B, H * D])], [_vi("y", F32, [B * H * S // 10, 10, D])],
               [_c("t", np.array([10, B * H * S // 10, D], np.int64))])
    out, applied = _canonical(m)
    assert "split_heads_transpose" not in applied and _ops(out) == ["Reshape", "Transpose"]


def test_reshape_back_to_the_shape_it_came_from_cancels() -> None:
    m = _model([helper.make_node("Reshape", ["x", "s1"], ["r1"]), helper.make_node("Reshape", ["r1", "s2"], ["r2"]),
                helper.make_node("Relu", ["r2"], ["y"])],
               [_vi("x", F32, [2, 3, 4])], [_vi("y", F32, [2, 3, 4])],
               [_c("s1", np.array([6, 4], np.int64)), _c("s2", np.array([2, 3, -1], np.int64))])
    out, applied = _canonical(m)
    assert applied["cancel_reshapes"] == 1 and _ops(out) == ["Relu"] and out.graph.node[0].input[0] == "x"
    _assert_exact(m, out)


def test_reshape_to_another_shape_does_not_cancel() -> None:
    m = _model([helper.make_node("Reshape", ["x", "s1"], ["r1"]), helper.make_node("Reshape", ["r1", "s2"], ["r2"]),
                helper.make_node("Relu", ["r2"], ["y"])],
               [_vi("x", F32, [2, 3, 4])], [_vi("y", F32, [3, 2, 4])],
               [_c("s1", np.array([6, 4], np.int64)), _c("s2", np.array([3, 2, -1], np.int64))])
    out, applied = _canonical(m)
    assert "cancel_reshapes" not in applied and "Reshape" in _ops(out)
    _assert_exact(m, out)


@pytest.mark.parametrize("allowzero", [1, 0])
def test_shape_of_a_literal_reshape_is_its_target(allowzero) -> None:
    """Shape(Reshape(x, t)) is t when t is literal; with allowzero=0 a run-time 0 in t would copy a dim of x."""
    nodes = [helper.make_node("Shape", ["x"], ["sx"], start=0, end=1),
             helper.make_node("Concat", ["sx", "twelve"], ["t"], axis=0),
             helper.make_node("Reshape", ["x", "t"], ["r"], allowzero=allowzero),
             helper.make_node("Shape", ["r"], ["s"]), helper.make_node("Reshape", ["z", "s"], ["y"])]
    m = _model(nodes, [_vi("x", F32, ["n", 3, 4]), _vi("z", F32, ["m"])], [_vi("y", F32, ["n", 12])],
               [_c("twelve", np.array([12], np.int64))])
    out, applied = _canonical(m)
    assert ("shape_of_reshape" in applied) == bool(allowzero)
    feeds = {"x": np.arange(24, dtype=np.float32).reshape(2, 3, 4), "z": np.arange(24, dtype=np.float32)}
    np.testing.assert_array_equal(session(out).run(["y"], feeds)[0], session(m).run(["y"], feeds)[0])


@pytest.mark.parametrize("fixture", ["mha_torch_ts17.onnx", "mha_torch_dynamo.onnx", "bloom_dynamo.onnx",
                                     "deberta_v2_dynamo.onnx", "bloom_ts17.onnx"])
def test_bmm_attention_exports_reach_4d_scores(fixture) -> None:
    """The census fixtures with the heads merged into the batch: the Q·Kᵀ MatMul runs on 4-D heads."""
    from npufuse.ir.modelio import load_model
    from npufuse.prepare.normalize import normalize_with_view

    n = normalize_with_view(load_model(FIXTURES / fixture), str(FIXTURES))
    g = n.view
    qk = [x for x in g.nodes if x.op_type == "MatMul" and not g.is_constant(x.input[1])
          and any(c.op_type in ("Mul", "Div", "Add") for c in g.consumers_of(x.output[0]))
          and g.rank(x.input[0]) == 4]
    assert len(qk) == 2, fixture
    assert all(g.rank(x.input[1]) == 4 for x in qk)
