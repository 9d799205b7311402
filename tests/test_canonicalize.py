"""The canonicaliser's rules (npufuse/canonicalize.py): each applies where it should, computes exactly what the
original computed (bit for bit, run in onnxruntime), and leaves alone the near-misses that would change a value."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from npufuse.normalize import normalize
from npufuse.runtime import session

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
    from npufuse.modelio import load_model

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
