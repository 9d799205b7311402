"""The rules that drop what computes nothing (npufuse/prepare/rules/basic.py): Identity, Cast round trips,
Transpose and Reshape chains; each applies where it should, computes exactly what the original computed (bit for
bit, run in onnxruntime), and leaves alone the near-misses that would change a value or a value read elsewhere."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from canon_helpers import F16, F32, _assert_exact, _c, _canonical, _model, _ops, _vi
from onnx import TensorProto, helper

from npufuse.ir.runtime import session

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
