"""A whole-model difference that is only a selection's tie-break (verify/selection.py): TopK over near-tied scores
picks another of two values equal within tolerance, and everything gathered after it comes out in another order.
Settled when the selection's input matches the original and, with the original's selection fed in, every output
does; drift where either does not."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from npufuse.verify import selection
from npufuse.verify.compare import Verdict, compare

N, K = 8, 3


def _detector(tweak: float = 0.0, after_scale: float = 1.0) -> onnx.ModelProto:
    """scores [1, N] -> + `tweak` on score 2 -> TopK(K) -> gather the rows of `feats` [1, N, 4] by the indices ->
    * after_scale."""
    nodes = [helper.make_node("Add", ["scores", "tweak"], ["s"]),
             helper.make_node("TopK", ["s", "k"], ["top_v", "top_i"], axis=1, name="the_topk"),
             helper.make_node("Unsqueeze", ["top_i", "axis2"], ["idx3"]),
             helper.make_node("Expand", ["idx3", "shape"], ["idx"]),
             helper.make_node("GatherElements", ["feats", "idx"], ["picked"], axis=1),
             helper.make_node("Mul", ["picked", "scale"], ["boxes"])]
    inits = [numpy_helper.from_array(np.array([K], np.int64), "k"), numpy_helper.from_array(np.array([2], np.int64), "axis2"),
             numpy_helper.from_array(np.array([1, K, 4], np.int64), "shape"),
             numpy_helper.from_array(np.array(after_scale, np.float32), "scale")]
    added = np.zeros((1, N), np.float32)
    added[0, 2] = tweak
    inits.append(numpy_helper.from_array(added, "tweak"))
    g = helper.make_graph(nodes, "det", [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, N]),
                                         helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, N, 4])],
                          [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, K, 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds: dict) -> dict:
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))


def _values(model: onnx.ModelProto, feeds: dict) -> dict:
    """Every value of `model` on `feeds` (the verifier's captured activations of the original)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    outs = {o.name for o in m.graph.output}
    for n in m.graph.node:
        m.graph.output.extend(helper.make_empty_tensor_value_info(o) for o in n.output if o not in outs)
    return _run(m, feeds)


FEEDS = {"scores": np.array([[0.1, 0.9, 0.5 - 1e-7, 0.3, 0.5, 0.2, 0.95, 0.0]], np.float32),   # two near-tied at 0.5
         "feats": np.arange(N * 4, dtype=np.float32).reshape(1, N, 4)}


def _settle(optimized: onnx.ModelProto):
    original = _detector()
    want = _run(original, FEEDS)
    got = _run(optimized, FEEDS)
    plain = Verdict.of([compare(n, got[n], w) for n, w in want.items()])
    acts = _values(original, FEEDS)
    return plain, selection.settle(plain, optimized, FEEDS, want, acts.get, _run)


def test_a_tie_flipped_by_rounding_is_settled():
    plain, (verdict, note) = _settle(_detector(2e-7))   # +2e-7 on one of the near-tied scores: the tie flips
    assert not plain.ok   # the gathered rows come out swapped: elementwise, drift
    assert verdict.ok and "TopK 'the_topk'" in note
    assert verdict.comparisons[0].detail.startswith(selection.SETTLED)


def test_a_wrong_op_before_the_selection_stays_drift():
    plain, (verdict, note) = _settle(_detector(0.3))   # score 2 raised by 0.3: it wins where it should not
    assert not plain.ok and not verdict.ok and note == ""


def test_a_wrong_op_after_the_selection_stays_drift():
    optimized = _detector(2e-7, after_scale=1.05)   # the tie flips and the gathered rows are scaled 5%
    plain, (verdict, note) = _settle(optimized)
    assert not plain.ok and not verdict.ok and note == ""


def test_a_model_without_a_selection_is_left_as_it_is():
    plain = Verdict.of([compare("y", np.ones(3, np.float32), np.zeros(3, np.float32))])
    m = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                                            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])]))
    assert selection.settle(plain, m, {}, {}, lambda n: None, _run) == (plain, "")


def _detector_on_fixed_scores(tweak: float) -> onnx.ModelProto:
    """`_detector`, its near-tied scores an initializer (x * 0 + scores): the ATC form's check makes its own inputs."""
    m = _detector(tweak)
    g = m.graph
    scores = numpy_helper.from_array(FEEDS["scores"], "fixed_scores")
    zero = numpy_helper.from_array(np.zeros((1, N), np.float32), "zero")
    g.initializer.extend([scores, zero])
    g.input[0].name = "x"
    g.node.insert(0, helper.make_node("Mul", ["x", "zero"], ["x0"]))
    g.node.insert(1, helper.make_node("Add", ["x0", "fixed_scores"], ["scores"]))
    return m


def test_the_atc_form_check_settles_the_same_tie_and_keeps_a_real_drift():
    from npufuse.emit.atc.verify import verify_atc

    original = _detector_on_fixed_scores(0.0)
    tie = verify_atc(original, _detector_on_fixed_scores(2e-7), None)
    assert tie.ok and tie.comparisons[0].detail.startswith(selection.SETTLED)
    assert not verify_atc(original, _detector_on_fixed_scores(0.3), None).ok
