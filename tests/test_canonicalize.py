"""The canonicaliser's driver (npufuse/prepare/canonicalize.py): which phases run, and what a run leaves behind.
The rules' own tests sit beside them by name: test_rules_basic.py, test_rules_softmax_scale.py,
test_rules_merged_heads.py, test_static_values.py."""

from __future__ import annotations

import numpy as np
import onnx
from canon_helpers import (
    F32,
    _assert_exact,
    _c,
    _canonical,
    _model,
    _ops,
    _rotate_half,
    _vi,
)
from onnx import helper


def test_the_100k_shape_free_graph_skips_the_static_phase() -> None:
    """A graph without Shape or Size nodes has no static values beyond its constants: the phase costs one scan."""
    m = _rotate_half(16)
    nodes = [n for n in m.graph.node if n.op_type not in ("Shape", "Gather", "Div", "Unsqueeze")]
    m2 = _model(nodes, [_vi("x", F32, ["batch", 4, "seq", 16])], [_vi("y", F32, ["batch", 4, "seq", 16])],
                list(m.graph.initializer) + [_c("du", np.array([8], np.int64))])
    out, applied = _canonical(m2)
    assert not applied and _ops(out) == _ops(m2)


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
