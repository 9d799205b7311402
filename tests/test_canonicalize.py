"""The canonicaliser's rules (npufuse/prepare/canonicalize.py): each applies where it should, computes exactly what the
original computed (bit for bit, run in onnxruntime), and leaves alone the near-misses that would change a value."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from npufuse.prepare.normalize import normalize
from npufuse.ir.runtime import session

FIXTURES = Path(__file__).parent / "fixtures"
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(m)
    return m


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _c(name, arr) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr), name)


def _canonical(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Counter]:
    applied: Counter = Counter()
    out, _ = normalize(model, None, applied)
    return out, applied


def _feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in model.graph.input:
        t = i.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        feeds[i.name] = rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" else \
            rng.integers(0, 4, shape).astype(dtype)
    return feeds


def _assert_exact(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    feeds = _feeds(before)
    names = [o.name for o in before.graph.output]
    want = session(before).run(names, feeds)
    got = session(after).run(names, feeds)
    for n, w, o in zip(names, want, got):
        assert w.shape == o.shape and w.dtype == o.dtype, n
        np.testing.assert_array_equal(o, w, err_msg=n)


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


# ---- Identity and Cast -------------------------------------------------------------------------------------

def test_identity_is_dropped_but_a_graph_output_keeps_its_producer() -> None:
    m = _model([helper.make_node("Identity", ["x"], ["i"]), helper.make_node("Relu", ["i"], ["r"]),
                helper.make_node("Identity", ["r"], ["y"])],
               [_vi("x", F32, [2, 3])], [_vi("y", F32, [2, 3])])
    out, applied = _canonical(m)
    assert applied == Counter(drop_identity=1)
    assert _ops(out) == ["Relu", "Identity"]      # y is a graph output: its Identity stays
    _assert_exact(m, out)


def test_cast_round_trip_through_a_wider_type_is_dropped() -> None:
    m = _model([helper.make_node("Cast", ["x"], ["up"], to=F32), helper.make_node("Cast", ["up"], ["down"], to=F16),
                helper.make_node("Relu", ["down"], ["y"])],
               [_vi("x", F16, [2, 3])], [_vi("y", F16, [2, 3])])
    out, applied = _canonical(m)
    assert applied == Counter(drop_cast_round_trip=1)
    assert _ops(out) == ["Relu"] and out.graph.node[0].input[0] == "x"
    _assert_exact(m, out)


def test_cast_to_the_type_a_value_has_is_dropped() -> None:
    m = _model([helper.make_node("Cast", ["x"], ["c"], to=F32), helper.make_node("Relu", ["c"], ["y"])],
               [_vi("x", F32, [4])], [_vi("y", F32, [4])])
    out, applied = _canonical(m)
    assert applied == Counter(drop_cast_round_trip=1) and _ops(out) == ["Relu"]
    _assert_exact(m, out)


def test_narrowing_round_trip_is_kept() -> None:
    """fp32 -> fp16 -> fp32 rounds: dropping it would change the values."""
    m = _model([helper.make_node("Cast", ["x"], ["down"], to=F16), helper.make_node("Cast", ["down"], ["up"], to=F32),
                helper.make_node("Relu", ["up"], ["y"])],
               [_vi("x", F32, [2, 3])], [_vi("y", F32, [2, 3])])
    out, applied = _canonical(m)
    assert not applied and _ops(out) == ["Cast", "Cast", "Relu"]


def test_a_value_read_inside_a_subgraph_is_not_renamed() -> None:
    """An If branch reads the Identity's output from the outer scope: renaming it would need the body edited."""
    then = helper.make_graph([helper.make_node("Relu", ["i"], ["t"])], "then", [], [_vi("t", F32, [3])])
    other = helper.make_graph([helper.make_node("Neg", ["i"], ["e"])], "else", [], [_vi("e", F32, [3])])
    m = _model([helper.make_node("Identity", ["x"], ["i"]),
                helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
               [_vi("x", F32, [3]), _vi("cond", TensorProto.BOOL, [])], [_vi("y", F32, [3])])
    out, applied = _canonical(m)
    assert not applied and _ops(out) == ["Identity", "If"]


# ---- Transpose and Reshape ---------------------------------------------------------------------------------

def test_consecutive_transposes_fold_into_one() -> None:
    m = _model([helper.make_node("Transpose", ["x"], ["t1"], perm=[0, 2, 1, 3]),
                helper.make_node("Transpose", ["t1"], ["y"], perm=[0, 1, 3, 2])],
               [_vi("x", F32, [2, 3, 4, 5])], [_vi("y", F32, [2, 4, 5, 3])])
    out, applied = _canonical(m)
    assert applied == Counter(fold_transposes=1) and _ops(out) == ["Transpose"]
    assert list(out.graph.node[0].attribute[0].ints) == [0, 2, 3, 1]
    _assert_exact(m, out)


def test_transposes_that_cancel_leave_nothing_and_a_shared_one_stays() -> None:
    m = _model([helper.make_node("Transpose", ["x"], ["t1"], perm=[1, 0]),
                helper.make_node("Transpose", ["t1"], ["t2"], perm=[1, 0]),
                helper.make_node("Relu", ["t2"], ["y"]), helper.make_node("Neg", ["t1"], ["z"])],
               [_vi("x", F32, [2, 3])], [_vi("y", F32, [2, 3]), _vi("z", F32, [3, 2])])
    out, applied = _canonical(m)
    assert applied == Counter(fold_transposes=1)
    assert sorted(_ops(out)) == ["Neg", "Relu", "Transpose"]   # t1 is still read by Neg
    assert next(n for n in out.graph.node if n.op_type == "Relu").input[0] == "x"
    _assert_exact(m, out)


def test_reshape_of_a_reshape_folds_when_the_target_copies_no_dim() -> None:
    m = _model([helper.make_node("Reshape", ["x", "s1"], ["r1"]), helper.make_node("Reshape", ["r1", "s2"], ["y"])],
               [_vi("x", F32, [2, 3, 4])], [_vi("y", F32, [6, 4])],
               [_c("s1", np.array([2, 12], np.int64)), _c("s2", np.array([6, -1], np.int64))])
    out, applied = _canonical(m)
    assert applied == Counter(fold_reshapes=1) and _ops(out) == ["Reshape"]
    assert out.graph.node[0].input[0] == "x"
    _assert_exact(m, out)


def test_reshape_whose_target_copies_a_dim_of_the_intermediate_is_kept() -> None:
    """A 0 in the target copies that dim of the input: of r1 ([6, 4]) here, not of x ([2, 3, 4])."""
    m = _model([helper.make_node("Reshape", ["x", "s1"], ["r1"]), helper.make_node("Reshape", ["r1", "s2"], ["y"])],
               [_vi("x", F32, [2, 3, 4])], [_vi("y", F32, [6, 4])],
               [_c("s1", np.array([6, 4], np.int64)), _c("s2", np.array([0, -1], np.int64))])
    out, applied = _canonical(m)
    assert "fold_reshapes" not in applied and _ops(out) == ["Reshape", "Reshape"]


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


# ---- scales move to their MatMul ---------------------------------------------------------------------------

def _scaled_k(scale_const, chain=("Reshape", "Transpose"), op="Mul", scale_first=False):
    nodes = [helper.make_node(op, ["c", "k"] if scale_first else ["k", "c"], ["ks"])]
    cur = "ks"
    for i, step in enumerate(chain):
        if step == "Reshape":
            nodes.append(helper.make_node("Reshape", [cur, "shape"], [f"s{i}"]))
        elif step == "Transpose":
            nodes.append(helper.make_node("Transpose", [cur], [f"s{i}"], perm=[0, 2, 3, 1]))
        elif step == "Relu":
            nodes.append(helper.make_node("Relu", [cur], [f"s{i}"]))
        cur = f"s{i}"
    nodes.append(helper.make_node("MatMul", ["q", cur], ["y"]))
    return _model(nodes, [_vi("k", F32, [2, 5, 32]), _vi("q", F32, [2, 4, 5, 8])], [_vi("y", F32, [2, 4, 5, 5])],
                  [_c("c", scale_const), _c("shape", np.array([2, 5, 4, 8], np.int64))])


@pytest.mark.parametrize("op,scale_first", [("Mul", False), ("Mul", True), ("Div", False)])
def test_scale_before_the_k_layout_moves_to_the_matmul(op, scale_first) -> None:
    m = _scaled_k(np.array(0.35355339, np.float32), op=op, scale_first=scale_first)
    out, applied = _canonical(m)
    assert applied == Counter(move_scale_to_matmul=1)
    assert _ops(out) == ["Reshape", "Transpose", op, "MatMul"]
    _assert_exact(m, out)


@pytest.mark.parametrize("case", ["tensor-scale", "broadcasting-scale", "no-matmul", "other-step"])
def test_scales_that_are_not_pure_stay(case) -> None:
    if case == "tensor-scale":       # a per-element factor is not a scale
        m = _scaled_k(np.linspace(0.1, 1, 32, dtype=np.float32))
    elif case == "broadcasting-scale":   # a [1,1,1,1] factor makes the 3-D k 4-D: not a pure scale
        m = _scaled_k(np.full((1, 1, 1, 1), 0.5, np.float32))
    elif case == "no-matmul":
        m = _scaled_k(np.array(0.5, np.float32), chain=("Reshape", "Transpose", "Relu"))
    else:
        m = _scaled_k(np.array(0.5, np.float32), chain=("Relu", "Reshape", "Transpose"))
    out, applied = _canonical(m)
    assert "move_scale_to_matmul" not in applied


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


# ---- static values: shape arithmetic the graph fixes becomes a constant ------------------------------------

def _run_both(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    names = [o.name for o in before.graph.output]
    for n, w, o in zip(names, session(before).run(names, feeds), session(after).run(names, feeds)):
        assert w.shape == o.shape and w.dtype == o.dtype, n
        np.testing.assert_array_equal(o, w, err_msg=n)


def _dims_of(types, value):
    return [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in types[value].tensor_type.shape.dim]


def _rotate_half(last: str | int) -> onnx.ModelProto:
    """TorchScript's rotate_half: x[..., d:], x[..., :d] with d = Shape(x)[-1] // 2, x's batch symbolic."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "minus1"], ["w"], axis=0),
             helper.make_node("Div", ["w", "two"], ["d"]), helper.make_node("Unsqueeze", ["d", "ax0"], ["du"]),
             helper.make_node("Slice", ["x", "zero", "du", "minus1u"], ["lo"]),
             helper.make_node("Slice", ["x", "du", "big", "minus1u"], ["hi"]),
             helper.make_node("Neg", ["hi"], ["nhi"]), helper.make_node("Concat", ["nhi", "lo"], ["y"], axis=-1)]
    return _model(nodes, [_vi("x", F32, ["batch", 4, "seq", last])], [_vi("y", F32, ["batch", 4, "seq", last])],
                  [_c("minus1", np.array(-1, np.int64)), _c("two", np.array(2, np.int64)),
                   _c("ax0", np.array([0], np.int64)), _c("zero", np.array([0], np.int64)),
                   _c("minus1u", np.array([-1], np.int64)), _c("big", np.array([2 ** 62], np.int64))])


def test_slice_bounds_from_a_static_dim_of_a_symbolic_tensor_become_constants() -> None:
    m = _rotate_half(16)
    applied: Counter = Counter()
    out, types = normalize(m, None, applied)
    assert applied["fold_static_value"] == 1
    assert _ops(out) == ["Slice", "Slice", "Neg", "Concat"]
    bound = next(t for t in out.graph.initializer if t.name == "du")
    assert numpy_helper.to_array(bound).tolist() == [8]
    assert _dims_of(types, "lo") == ["batch", 4, "seq", 8]     # shape inference ran again on the constant bound
    _run_both(m, out, {"x": np.random.default_rng(0).standard_normal((3, 4, 5, 16)).astype(np.float32)})


def test_slice_bounds_from_a_symbolic_dim_stay() -> None:
    out, applied = _canonical(_rotate_half("d"))
    assert "fold_static_value" not in applied and "Shape" in _ops(out)


def _softmax_scale(op: str) -> onnx.ModelProto:
    """DeBERTa's scale: scores / Sqrt(Cast(Shape(q)[-1]) * factor), q [batch, seq, 8] (or Pow(., 0.5))."""
    root = [helper.make_node("Sqrt", ["f"], ["r"])] if op == "Sqrt" else [helper.make_node("Pow", ["f", "half"], ["r"])]
    nodes = [helper.make_node("Shape", ["q"], ["s"]), helper.make_node("Slice", ["s", "minus1u", "big"], ["last"]),
             helper.make_node("Squeeze", ["last", "ax0"], ["d"]), helper.make_node("Cast", ["d"], ["df"], to=F32),
             helper.make_node("Mul", ["df", "three"], ["f"]), *root,
             helper.make_node("Transpose", ["q"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"]), helper.make_node("Div", ["qk", "r"], ["y"])]
    return _model(nodes, [_vi("q", F32, ["batch", "seq", 8])], [_vi("y", F32, ["batch", "seq", "seq"])],
                  [_c("minus1u", np.array([-1], np.int64)), _c("big", np.array([2 ** 62], np.int64)),
                   _c("ax0", np.array([0], np.int64)), _c("three", np.array(3.0, np.float32)),
                   _c("half", np.array(0.5, np.float32))])


def test_a_softmax_scale_computed_from_a_static_dim_becomes_a_constant_bit_for_bit() -> None:
    m = _softmax_scale("Sqrt")
    applied: Counter = Counter()
    out, _ = normalize(m, None, applied)
    assert applied["fold_static_value"] == 1
    assert "Sqrt" not in _ops(out) and "Shape" not in _ops(out)
    r = numpy_helper.to_array(next(t for t in out.graph.initializer if t.name == "r"))
    assert r.dtype == np.float32 and r == np.sqrt(np.float32(24.0))
    _run_both(m, out, {"q": np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)})


def test_a_transcendental_of_a_static_dim_is_not_folded() -> None:
    """Pow may round differently in numpy and onnxruntime: only correctly rounded ops are folded. The Mul before
    it is exact, and is folded (the frontier of what is folded moves to the Pow's input)."""
    m = _softmax_scale("Pow")
    out, applied = _canonical(m)
    assert applied["fold_static_value"] == 1 and "Pow" in _ops(out) and "Shape" not in _ops(out)
    _run_both(m, out, {"q": np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)})


def _heads_of_a_minus_one_reshape() -> onnx.ModelProto:
    """x [batch, 1, 64] -> Reshape [Shape(x)[0], Shape(x)[1], -1, 16]: onnx leaves the -1 symbolic (batch is), the
    element count proves it is 4; a Range over the query length (1) and a Shape of the heads read them."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Slice", ["s", "zero", "two"], ["bs"]),
             helper.make_node("Concat", ["bs", "tail"], ["t"], axis=0), helper.make_node("Reshape", ["x", "t"], ["r"]),
             helper.make_node("Shape", ["r"], ["sr"]), helper.make_node("Gather", ["sr", "two_s"], ["h"], axis=0),
             helper.make_node("Gather", ["s", "one_s"], ["q_len"], axis=0),
             helper.make_node("Range", ["zero_s", "q_len", "one_s"], ["pos"]),
             helper.make_node("Cast", ["pos"], ["posf"], to=F32), helper.make_node("Cast", ["h"], ["hf"], to=F32),
             helper.make_node("Add", ["posf", "hf"], ["ph"]), helper.make_node("Add", ["r", "ph"], ["y"])]
    return _model(nodes, [_vi("x", F32, ["batch", 1, 64])], [_vi("y", F32, ["batch", 1, "h", 16])],
                  [_c("zero", np.array([0], np.int64)), _c("two", np.array([2], np.int64)),
                   _c("tail", np.array([-1, 16], np.int64)), _c("two_s", np.array(2, np.int64)),
                   _c("one_s", np.array(1, np.int64)), _c("zero_s", np.array(0, np.int64))])


def test_a_dim_shape_inference_leaves_symbolic_is_proven_and_read_statically() -> None:
    m = _heads_of_a_minus_one_reshape()
    applied: Counter = Counter()
    out, types = normalize(m, None, applied)
    assert applied["fold_static_value"] == 1      # Range(0, q_len = 1) + Cast(h = 4): [4.0]
    assert _dims_of(types, "r") == ["batch", 1, 4, 16]
    assert sorted(_ops(out)) == ["Add", "Concat", "Reshape", "Shape", "Slice"]
    assert numpy_helper.to_array(next(t for t in out.graph.initializer if t.name == "ph")).tolist() == [4.0]
    _run_both(m, out, {"x": np.random.default_rng(2).standard_normal((3, 1, 64)).astype(np.float32)})


def test_a_symbolic_dim_is_proven_by_its_symbol_and_recorded() -> None:
    """Range(0, Shape(x)[0]) has `batch` elements (inference names it afresh), and so has the Expand of it to
    [Shape(x)[0], 3] (inference loses it); nothing is folded."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero_s"], ["b"], axis=0),
             helper.make_node("Range", ["zero_s", "b", "one_s"], ["ids"]),
             helper.make_node("Unsqueeze", ["b", "zero"], ["bu"]), helper.make_node("Concat", ["bu", "three"], ["t"],
                                                                                    axis=0),
             helper.make_node("Cast", ["ids"], ["idsf"], to=F32), helper.make_node("Unsqueeze", ["idsf", "one"], ["col"]),
             helper.make_node("Expand", ["col", "t"], ["e"]), helper.make_node("Add", ["e", "x"], ["y"])]
    m = _model(nodes, [_vi("x", F32, ["batch", 3])], [_vi("y", F32, ["n", "m"])],
               [_c("zero_s", np.array(0, np.int64)), _c("one_s", np.array(1, np.int64)),
                _c("zero", np.array([0], np.int64)), _c("one", np.array([1], np.int64)),
                _c("three", np.array([3], np.int64))])
    applied: Counter = Counter()
    out, types = normalize(m, None, applied)
    assert "fold_static_value" not in applied
    assert _dims_of(types, "ids") == ["batch"] and _dims_of(types, "e") == ["batch", 3]
    _run_both(m, out, {"x": np.random.default_rng(3).standard_normal((5, 3)).astype(np.float32)})


def test_a_dim_of_unknown_sign_does_not_decide_the_expand_idiom() -> None:
    """Equal(Shape(x)[0] - 2, -1) is not decided (the difference may be -1); Equal(Shape(x)[0] + 2, -1) is."""
    def model(op: str) -> onnx.ModelProto:
        nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node(op, ["s", "two"], ["d"]),
                 helper.make_node("Equal", ["d", "minus1"], ["eq"]), helper.make_node("Not", ["eq"], ["ne"]),
                 helper.make_node("Cast", ["ne"], ["nf"], to=F32), helper.make_node("Mul", ["x", "nf"], ["y"])]
        return _model(nodes, [_vi("x", F32, ["n"])], [_vi("y", F32, ["n"])],
                      [_c("two", np.array([2], np.int64)), _c("minus1", np.array([-1], np.int64))])

    for op, folds in (("Sub", False), ("Add", True)):
        m = model(op)
        out, applied = _canonical(m)
        assert ("fold_static_value" in applied) == folds, op
        _run_both(m, out, {"x": np.arange(1, dtype=np.float32)})


def test_the_100k_shape_free_graph_skips_the_static_phase() -> None:
    """A graph without Shape or Size nodes has no static values beyond its constants: the phase costs one scan."""
    m = _rotate_half(16)
    nodes = [n for n in m.graph.node if n.op_type not in ("Shape", "Gather", "Div", "Unsqueeze")]
    m2 = _model(nodes, [_vi("x", F32, ["batch", 4, "seq", 16])], [_vi("y", F32, ["batch", 4, "seq", 16])],
                list(m.graph.initializer) + [_c("du", np.array([8], np.int64))])
    out, applied = _canonical(m2)
    assert not applied and _ops(out) == _ops(m2)


def test_a_value_an_if_reads_directly_and_in_a_branch_is_not_renamed() -> None:
    """The Identity's output is the If's condition and is read inside the else branch too: renaming the direct
    input alone would leave the branch reading a value nobody produces (an invalid model)."""
    b = TensorProto.BOOL
    then = helper.make_graph([helper.make_node("Cast", ["i"], ["t"], to=F32)], "then", [], [_vi("t", F32, [])])
    other = helper.make_graph([helper.make_node("Not", ["i"], ["nb"]), helper.make_node("Cast", ["nb"], ["e"], to=F32)],
                              "else", [], [_vi("e", F32, [])])
    m = _model([helper.make_node("Identity", ["x"], ["i"]),
                helper.make_node("If", ["i"], ["y"], then_branch=then, else_branch=other)],
               [_vi("x", b, [])], [_vi("y", F32, [])])
    out, applied = _canonical(m)
    assert not applied and _ops(out) == ["Identity", "If"]
    onnx.checker.check_model(out, full_check=True)
    for cond in (True, False):   # then: float(i) = 1; else: float(not i) = 1: both branches read i
        assert session(out).run(["y"], {"x": np.array(cond)})[0] == np.float32(1.0)


def _unread(model: onnx.ModelProto) -> set[str]:
    read = {v for n in model.graph.node for v in n.input} | {o.name for o in model.graph.output}
    return {t.name for t in model.graph.initializer if t.name not in read}


def test_initializers_the_canonical_rules_leave_unread_are_dropped_and_the_inputs_own_stay() -> None:
    """Cancelled Reshapes leave their targets unread: the optimized model would carry them (onnxruntime warns of each
    at load; 59 in llama_ts17). One the input itself never read is not ours to drop."""
    m = _model([helper.make_node("Reshape", ["x", "s1"], ["r1"]), helper.make_node("Reshape", ["r1", "s2"], ["r2"]),
                helper.make_node("Relu", ["r2"], ["y"])],
               [_vi("x", F32, [2, 3, 4])], [_vi("y", F32, [2, 3, 4])],
               [_c("s1", np.array([6, 4], np.int64)), _c("s2", np.array([2, 3, -1], np.int64)),
                _c("spare", np.array([1.0], np.float32))])
    out, applied = _canonical(m)
    assert applied["cancel_reshapes"] == 1
    assert _unread(out) == {"spare"}
    assert {t.name for t in m.graph.initializer} == {"s1", "s2", "spare"}   # the input is not modified
    _assert_exact(m, out)


def test_a_shape_folded_into_a_later_constant_leaves_no_initializer() -> None:
    """Shape(x) of a static x, read only through Gather -> Unsqueeze -> Concat into a Reshape target (TorchScript's
    view arithmetic): the target becomes one initializer, and the Shape's value, read by nothing, is not kept."""
    nodes = [helper.make_node("Shape", ["x"], ["sx"]),
             helper.make_node("Gather", ["sx", "zero"], ["b"], axis=0),
             helper.make_node("Unsqueeze", ["b", "axes"], ["bu"]),
             helper.make_node("Concat", ["bu", "minus1"], ["t"], axis=0),
             helper.make_node("Reshape", ["x", "t"], ["y"])]
    m = _model(nodes, [_vi("x", F32, [2, 3, 4])], [_vi("y", F32, [2, 12])],
               [_c("zero", np.array(0, np.int64)), _c("axes", np.array([0], np.int64)),
                _c("minus1", np.array([-1], np.int64))])
    out, _ = _canonical(m)
    assert _ops(out) == ["Reshape"]
    assert not _unread(out), _unread(out)
    _assert_exact(m, out)
