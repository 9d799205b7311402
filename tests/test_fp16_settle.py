"""A float16 model's whole-model difference, settled against an fp32 run of the original (verify/precision.py):
rounding passes, drift does not.

The fixture is a diffusers VAE decoder exported in fp16 (tools/fixtures/diffusion.py): its GroupNorm+SiLU, attention
and Conv epilogues fused, the output moves by an fp16 step or two where it is small next to the features behind it,
beyond the plain fp16 tolerance on some seeds, while the optimized model is as close to the exact result as fp16
allows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import npufuse
from npufuse.verify import precision
from npufuse.verify.compare import Verdict, compare

FIXTURES = Path(__file__).parent / "fixtures"
VAE = FIXTURES / "vae_decoder_fp16_ts17.onnx"


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _fp16_model() -> onnx.ModelProto:
    """y = Cast<fp16>(Cast<fp32>(x) * 3) + w + c, x and w fp16, c an fp16 Constant: every way fp16 enters a graph."""
    w = numpy_helper.from_array(np.array([0.1, -0.2, 0.3], np.float16), "w")
    c = numpy_helper.from_array(np.array([1.5, 2.5, -3.5], np.float16), "c_value")
    nodes = [helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x32", "three"], ["m"]),
             helper.make_node("Cast", ["m"], ["m16"], to=TensorProto.FLOAT16),
             helper.make_node("Constant", [], ["c"], value=c),
             helper.make_node("Add", ["m16", "w"], ["a"]), helper.make_node("Add", ["a", "c"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [3])],
                          [w, numpy_helper.from_array(np.array(3.0, np.float32), "three")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_fp32_copy_computes_the_same_function_in_float32():
    model = _fp16_model()
    wide = precision.fp32_copy(model)
    assert wide is not None and wide.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert not [t for t in wide.graph.initializer if t.data_type == TensorProto.FLOAT16 and t.name == "w"]
    x = np.array([0.25, -1.0, 2.0], np.float16)
    (y32,) = _run(wide, precision.widen_feeds({"x": x}))
    assert y32.dtype == np.float32
    want = x.astype(np.float32) * 3 + np.array([0.1, -0.2, 0.3], np.float16).astype(np.float32) + \
        np.array([1.5, 2.5, -3.5], np.float32)
    np.testing.assert_allclose(y32, want, rtol=1e-6)
    (y16,) = _run(model, {"x": x})
    assert np.abs(y16.astype(np.float32) - y32).max() <= np.spacing(np.float16(4.0))   # the fp16 model, one step off
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16   # the input is not changed


def test_an_fp16_initializer_that_is_also_an_input_is_not_widened():
    model = _fp16_model()
    model.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT16, [3]))
    assert precision.fp32_copy(model) is None


def _arrays(seed: int = 0):
    """An exact output with large and small elements, the original's fp16 rounding of it, and the fp16 step."""
    rng = np.random.default_rng(seed)
    exact = rng.uniform(-1.5, 1.5, 256)
    exact[8] = 1.49                            # the output's magnitude: an fp16 step of 2**-10 there
    exact[:8] = rng.uniform(-0.01, 0.01, 8)   # small next to it: where plain tolerance is tight
    want = exact.astype(np.float16)
    return exact, want, float(np.spacing(np.float16(np.abs(exact).max())))


def test_rounding_beyond_plain_tolerance_is_settled():
    exact, want, step = _arrays()
    got = want.copy()
    got[:8] = (exact[:8] + 1.7 * step).astype(np.float16)   # 1.7 steps where the output is small
    plain = Verdict.of([compare("y", got, want)])
    assert not plain.ok   # plain fp16 tolerance calls it drift
    calls = []
    out = precision.settle(plain, {"y": got}, {"y": want}, lambda: calls.append(1) or {"y": exact.astype(np.float32)})
    assert out.ok and calls == [1]
    assert out.comparisons[0].detail.startswith(precision.SETTLED)
    assert "the original" in out.comparisons[0].detail


def test_a_wrong_scale_stays_drift_with_both_distances():
    exact, want, _ = _arrays()
    got = (exact * 1.05).astype(np.float16)   # a rewrite 5% off everywhere: 75 fp16 steps at the largest elements
    plain = Verdict.of([compare("y", got, want)])
    out = precision.settle(plain, {"y": got}, {"y": want}, lambda: {"y": exact.astype(np.float32)})
    assert not out.ok and not out.inconclusive
    assert "further from the exact result than the original" in out.reason


def test_nothing_to_settle_asks_for_no_exact_run():
    exact, want, _ = _arrays()
    ok = Verdict.of([compare("y", want.copy(), want)])
    assert precision.settle(ok, {"y": want}, {"y": want}, lambda: pytest.fail("not needed")) is ok
    w32 = exact.astype(np.float32)   # a float32 output: its own tolerance, nothing to settle
    bad = Verdict.of([compare("y", w32 * 1.01, w32)])
    assert precision.settle(bad, {"y": w32 * 1.01}, {"y": w32}, lambda: pytest.fail("not asked")) is bad


def test_no_exact_result_leaves_the_plain_verdict():
    exact, want, step = _arrays()
    got = want.copy()
    got[:8] = (exact[:8] + 1.7 * step).astype(np.float16)
    plain = Verdict.of([compare("y", got, want)])
    assert precision.settle(plain, {"y": got}, {"y": want}, lambda: None) is plain


@pytest.mark.parametrize("seed", [0, 1])
def test_fp16_vae_decoder_optimizes_where_plain_tolerance_called_it_drift(tmp_path, seed):
    out = tmp_path / "vae.onnx"
    r = npufuse.optimize(str(VAE), output=str(out), seed=seed)
    assert r.ok and out.exists()
    assert r.fused["npufuse.GroupNormSilu"] == 13, r.fused   # the fused bodies whose rounding differs
    settled = [c for c in r.details.model_check.comparisons if c.detail.startswith(precision.SETTLED)]
    assert settled, "this seed no longer needs settling: pick one the plain tolerance fails"
    assert any("fp32 run of the original" in n for n in r.details.notes), r.details.notes


def test_a_corrupted_fp16_vae_decoder_is_still_drift():
    """The optimized VAE with its last Conv's weights 2% off: the settle check sees it further from the exact result
    than the original and keeps the verdict."""
    original = onnx.load(str(VAE))
    optimized = npufuse.optimize(str(VAE), verify=False).model
    conv = [n for n in optimized.graph.node if n.op_type == "Conv"][-1]
    inits = {t.name: t for t in optimized.graph.initializer}
    w = inits[conv.input[1]]
    w.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(w).astype(np.float32) * 1.02).astype(np.float16), w.name))
    z = np.random.default_rng(0).standard_normal((1, 4, 16, 16)).astype(np.float16)
    name = original.graph.input[0].name
    (want,), (got,) = _run(original, {name: z}), _run(optimized, {name: z})
    plain = Verdict.of([compare("y", got, want)])
    assert not plain.ok
    out = precision.settle(plain, {"y": got}, {"y": want},
                           lambda: {"y": _run(precision.fp32_copy(original), precision.widen_feeds({name: z}))[0]})
    assert not out.ok and "further from the exact result" in out.reason


def test_the_atc_form_of_the_fp16_vae_decoder_is_judged_the_same_way(tmp_path):
    out = tmp_path / "vae.atc.onnx"
    r = npufuse.optimize(str(VAE), output=str(out), emit="atc", target="Ascend310P3", seed=0)
    assert r.atc_check.ok and out.exists()
    assert any(c.detail.startswith(precision.SETTLED) for c in r.atc_check.comparisons)
