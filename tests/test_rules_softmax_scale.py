"""`move_scale_to_matmul` (npufuse/prepare/rules/softmax_scale.py): a constant scalar Mul/Div before the K layout
moves to just before the MatMul, bit for bit; factors that are not a pure scale stay."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from canon_helpers import F32, _assert_exact, _c, _canonical, _model, _ops, _vi
from onnx import helper

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
    _out, applied = _canonical(m)
    assert "move_scale_to_matmul" not in applied
