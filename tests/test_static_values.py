"""`fold_static_value` (npufuse/prepare/static_values.py): shape arithmetic whose value the graph fixes becomes a
constant, bit for bit, with the dims it proves recorded; what could round differently or is not fixed stays."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from canon_helpers import F32, _c, _canonical, _model, _ops, _rotate_half, _vi
from onnx import helper, numpy_helper

from npufuse.ir.runtime import session
from npufuse.prepare.normalize import normalize

# ---- static values: shape arithmetic the graph fixes becomes a constant ------------------------------------

def _run_both(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    names = [o.name for o in before.graph.output]
    for n, w, o in zip(names, session(before).run(names, feeds), session(after).run(names, feeds)):
        assert w.shape == o.shape and w.dtype == o.dtype, n
        np.testing.assert_array_equal(o, w, err_msg=n)


def _dims_of(types, value):
    return [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in types[value].tensor_type.shape.dim]


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


# ---- ops of torch's F.pad arithmetic (Swin's window padding): exactly as onnxruntime computes them ---------------

def _ort_one(node: onnx.NodeProto, ins: list[np.ndarray]) -> np.ndarray:
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
              for n, a in zip(node.input, ins) if n]
    model = helper.make_model(helper.make_graph([node], "one", inputs, []), opset_imports=[helper.make_opsetid("", 17)])
    model = onnx.shape_inference.infer_shapes(model)
    model.graph.output.extend(model.graph.value_info)
    return session(model).run(None, {n: a for n, a in zip(node.input, ins) if n})[0]


def _static(node: onnx.NodeProto, ins: list[np.ndarray]) -> np.ndarray | None:
    from npufuse.algebra.shapes import _compute
    from npufuse.ir.graph import attributes

    return _compute(node, attributes(node), ins, 17)


def test_reversing_slices_compute_as_onnxruntime_does() -> None:
    """Negative steps, with starts and ends anywhere (INT64_MIN as torch writes 'to the start'), on a [4, 2] pad
    table, as torch's F.pad export flips it."""
    x = np.arange(8, dtype=np.int64).reshape(4, 2)
    node = helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"])
    cases = [(-1, -(2 ** 63) + 1, -1), (-1, -(2 ** 63), -1), (3, 0, -1), (10, -10, -2), (2, -1, -1), (-5, 5, -1),
             (0, -1, -1), (1, 1, -1), (3, 1, -3), (-1, -3, -1)]
    for s, e, st in cases:
        ins = [x, np.array([s]), np.array([e]), np.array([0]), np.array([st])]
        got = _static(node, ins)
        assert got is not None, (s, e, st)
        np.testing.assert_array_equal(got, _ort_one(node, ins), err_msg=str((s, e, st)))


def test_integer_mod_and_transpose_compute_as_onnxruntime_does() -> None:
    a = np.array([56, 28, 7, 0, 13, -13, 5, -5], dtype=np.int64)
    b = np.array([7, 7, 7, 7, 4, 4, -3, -3], dtype=np.int64)
    for fmod in (0, 1):
        node = helper.make_node("Mod", ["a", "b"], ["y"], fmod=fmod)
        np.testing.assert_array_equal(_static(node, [a, b]), _ort_one(node, [a, b]))
    zero = helper.make_node("Mod", ["a", "b"], ["y"])
    assert _static(zero, [a, np.zeros_like(b)]) is None          # onnxruntime's error, not a value
    floats = helper.make_node("Mod", ["a", "b"], ["y"], fmod=1)
    assert _static(floats, [a.astype(np.float32), b.astype(np.float32)]) is None   # left to onnxruntime
    v = np.array([-7, -1, 0, 3, 9], dtype=np.int64)
    for lo, hi in ((0, None), (None, 4), (-2, 5), (3, 1)):
        node = helper.make_node("Clip", ["v", "lo" if lo is not None else "", "hi" if hi is not None else ""], ["y"])
        ins = [v, None if lo is None else np.array(lo, np.int64), None if hi is None else np.array(hi, np.int64)]
        np.testing.assert_array_equal(_static(node, ins), _ort_one(node, ins), err_msg=str((lo, hi)))
        fins = [None if a is None else a.astype(np.float32) for a in ins]
        fins[0] = fins[0] - np.float32(0.5)
        np.testing.assert_array_equal(_static(node, fins), _ort_one(node, fins), err_msg=str((lo, hi, "float")))
    nan = helper.make_node("Clip", ["v", "lo"], ["y"])
    assert _static(nan, [np.array([np.nan, 1.0], np.float32), np.array(0.0, np.float32)]) is None
    x = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
    for perm in ([1, 0, 2], [2, 0, 1], None):
        node = helper.make_node("Transpose", ["x"], ["y"], **({"perm": perm} if perm else {}))
        np.testing.assert_array_equal(_static(node, [x]), _ort_one(node, [x]))


def test_swin_window_padding_folds_to_a_constant_pad() -> None:
    """HF Swin pads each stage's map to a multiple of the window: pads = flip((0, 0, 0, (w - W % w) % w, ...))
    through Mod, a reversing Slice and a Transpose; at fixed sizes that is a constant, and the Pad's output
    shape is known (it was priced on made-up dims before)."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "one"], ["w"], axis=0),
             helper.make_node("Mod", ["w", "win"], ["r"]), helper.make_node("Sub", ["win", "r"], ["d"]),
             helper.make_node("Mod", ["d", "win"], ["p"]), helper.make_node("Unsqueeze", ["p", "ax0"], ["pu"]),
             helper.make_node("Concat", ["zero", "pu", "zero", "zero"], ["pads4"], axis=0),
             helper.make_node("Reshape", ["pads4", "shape22"], ["t"]),
             helper.make_node("Slice", ["t", "m1", "minint", "ax0", "m1"], ["flip"]),
             helper.make_node("Transpose", ["flip"], ["ft"], perm=[1, 0]),
             helper.make_node("Reshape", ["ft", "m1"], ["pads"]),
             helper.make_node("Pad", ["x", "pads"], ["y"])]
    m = _model(nodes, [_vi("x", F32, ["batch", 10])], [_vi("y", F32, ["batch", "w"])],
               [_c("one", np.array(1, np.int64)), _c("win", np.array(7, np.int64)), _c("ax0", np.array([0], np.int64)),
                _c("zero", np.array([0], np.int64)), _c("shape22", np.array([2, 2], np.int64)),
                _c("m1", np.array([-1], np.int64)), _c("minint", np.array([-(2 ** 63)], np.int64))])
    applied: Counter = Counter()
    out, types = normalize(m, None, applied)
    assert applied["fold_static_value"] >= 1
    assert _ops(out) == ["Pad"]
    assert _dims_of(types, "y") == ["batch", 14]
    _run_both(m, out, {"x": np.random.default_rng(2).standard_normal((2, 10)).astype(np.float32)})
