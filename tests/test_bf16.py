"""bfloat16 models are verified (issue 12, item 9), and 0-d bool inputs are generated.

onnxruntime's CPU provider has no bf16 kernels for most ops, so verification runs an fp32 copy of a bf16 model
(npufuse.ir.widen) and says so; inputs are generated in bf16 (onnx's ml_dtypes dtype). The bf16 models are
fp16 fixtures converted to bf16 (tests/builders.to_bfloat16) and a small LayerNorm + MatMul + GELU graph.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import IR, to_bfloat16
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from test_attention import attention_model

from npufuse.cli import main
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import Graph
from npufuse.guard import check_models
from npufuse.ir.modelio import load_model
from npufuse.ir import widen
from npufuse.verify.inputs import model_inputs, value_for

FIXTURES = Path(__file__).parent / "fixtures"
BF16 = np.dtype(helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16))


def _ln_matmul_gelu(dtype=np.float32) -> onnx.ModelProto:
    """x -> LayerNorm (decomposed) -> MatMul + bias -> GELU (erf form), in fp32; to_bfloat16 makes it bf16."""
    rng = np.random.default_rng(0)
    h, f = 16, 32
    c = {"gamma": rng.uniform(0.5, 1.5, h), "beta": rng.standard_normal(h) * 0.1, "w": rng.standard_normal((h, f)) * 0.3,
         "b": rng.standard_normal(f) * 0.1, "eps": np.array(1e-5), "two": np.array(2.0), "half": np.array(0.5),
         "one": np.array(1.0), "sqrt2": np.array(np.sqrt(2.0))}
    inits = [numpy_helper.from_array(v.astype(dtype), k) for k, v in c.items()]
    n = helper.make_node
    nodes = [n("ReduceMean", ["x"], ["mu"], axes=[-1]), n("Sub", ["x", "mu"], ["xc"]), n("Pow", ["xc", "two"], ["sq"]),
             n("ReduceMean", ["sq"], ["var"], axes=[-1]), n("Add", ["var", "eps"], ["ve"]), n("Sqrt", ["ve"], ["sd"]),
             n("Div", ["xc", "sd"], ["xn"]), n("Mul", ["xn", "gamma"], ["xg"]), n("Add", ["xg", "beta"], ["ln"]),
             n("MatMul", ["ln", "w"], ["mm"]), n("Add", ["mm", "b"], ["hb"]),
             n("Div", ["hb", "sqrt2"], ["hs"]), n("Erf", ["hs"], ["e"]), n("Add", ["e", "one"], ["e1"]),
             n("Mul", ["hb", "e1"], ["g0"]), n("Mul", ["g0", "half"], ["y"])]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    g = helper.make_graph(nodes, "ln_mm_gelu", [helper.make_tensor_value_info("x", elem, ["batch", "seq", h])],
                          [helper.make_tensor_value_info("y", elem, ["batch", "seq", f])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR)


def test_bf16_inputs_are_generated_as_bf16() -> None:
    arr = value_for(None, "x", (4, 8), BF16, np.random.default_rng(0))
    assert arr.dtype == BF16 and arr.shape == (4, 8)
    f = arr.astype(np.float32)
    assert np.all(np.isfinite(f)) and f.std() > 0.5 and len(np.unique(f)) > 16


def test_a_0d_bool_input_is_an_array() -> None:
    v = value_for(None, "flag", (), np.dtype(np.bool_), np.random.default_rng(0))
    assert isinstance(v, np.ndarray) and v.shape == () and v.dtype == np.bool_


def test_a_0d_bool_mask_is_verified_not_rolled_back() -> None:
    """Before: numpy drew the 0-d mask as a numpy.bool scalar, onnxruntime refused it as a feed, and the attention
    rewrite was rolled back ('Unable to handle object of type numpy.bool')."""
    m = attention_model(mask="bool_keep")
    mask = next(i for i in m.graph.input if i.name == "bool_mask")
    mask.type.tensor_type.shape.ClearField("dim")
    res = optimize(m, None, OptimizeOptions())
    assert [r.status for r in res.records] == ["applied"] and res.model_check.ok


def test_bf16_transformer_optimizes_and_verifies(tmp_path: Path) -> None:
    """A bf16 decoder (qwen2's fp16 export converted): before, verification refused it ('cannot generate inputs')."""
    path = tmp_path / "qwen2_bf16.onnx"
    onnx.save(to_bfloat16(onnx.load(FIXTURES / "qwen2_fp16_ts17.onnx")), path)
    res = optimize(load_model(path), str(tmp_path), OptimizeOptions())
    kinds = Counter(r.match.kind.split("[")[0] for r in res.applied)
    assert kinds["FusedAttention"] == 2 and kinds["GatedMLP"] == 2 and kinds["npufuse.RMSNorm"] >= 1
    assert all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok
    comp = res.model_check.comparisons[0]
    assert comp.rtol == 5e-2   # compared at bf16 tolerance: the output stayed bf16
    assert widen.NOTE in res.notes


def test_bf16_drift_is_caught(tmp_path: Path) -> None:
    """The fp32 copy still tells a wrong model from a right one: a bf16 weight changed is drift."""
    m = to_bfloat16(_ln_matmul_gelu(), TensorProto.FLOAT)
    bad = onnx.ModelProto()
    bad.CopyFrom(m)
    w = next(t for t in bad.graph.initializer if t.name == "w")
    w.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(w).astype(np.float32) * 1.5).astype(BF16), "w"))
    assert check_models(m, m).ok
    res = check_models(m, bad, attribute_drift=False)
    assert not res.ok and widen.NOTE in res.notes


def test_bf16_cli_optimize_check_and_golden(tmp_path: Path) -> None:
    src = tmp_path / "bf16.onnx"
    onnx.save(to_bfloat16(_ln_matmul_gelu(), TensorProto.FLOAT), src)
    out, golden = tmp_path / "bf16.opt.onnx", tmp_path / "golden.npz"
    runner = CliRunner()
    r = runner.invoke(main, ["optimize", str(src), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "fp32 copy" in r.output and "FusedMatMul" in r.output
    optimized = onnx.load(out)
    assert {i.type.tensor_type.elem_type for i in optimized.graph.input} == {TensorProto.BFLOAT16}
    r = runner.invoke(main, ["check", str(src), str(out)])
    assert r.exit_code == 0 and "PASS" in r.output and "fp32 copy" in r.output, r.output
    r = runner.invoke(main, ["check", str(src), "--save-golden", str(golden)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["check", str(out), "--golden", str(golden)])
    assert r.exit_code == 0 and "PASS" in r.output, r.output   # bf16 arrays survive the .npz round trip


def test_bf16_segmented_verification_hands_weights_in_memory(tmp_path: Path) -> None:
    """With a tiny memory budget every segment is its own session over widened in-memory weights."""
    m = to_bfloat16(_ln_matmul_gelu(), TensorProto.FLOAT)
    res = optimize(m, None, OptimizeOptions(verify_memory_bytes=256))
    assert res.verify_segments > 1 and res.applied and res.model_check.ok


def test_widened_copy_computes_what_the_fp32_model_computes() -> None:
    fp32 = _ln_matmul_gelu()
    bf16 = to_bfloat16(fp32, TensorProto.FLOAT)
    assert widen.mentions_bf16(bf16) and not widen.mentions_bf16(fp32)
    copy, weights = widen.widen(bf16, None)
    assert not widen.mentions_bf16(copy) and set(weights) == {"gamma", "beta", "w", "b", "eps", "two", "half",
                                                               "one", "sqrt2"}
    feeds = model_inputs(Graph(bf16), seed=0)
    assert feeds["x"].dtype == BF16
    from npufuse.ir.runtime import run

    got = run(bf16, feeds)["y"]
    want = run(fp32, {"x": feeds["x"].astype(np.float32)})["y"]
    assert got.dtype == BF16
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("to", [TensorProto.BFLOAT16])
def test_a_cast_to_bf16_inside_a_float_model_runs(to: int) -> None:
    g = helper.make_graph([helper.make_node("Cast", ["x"], ["c"], to=to), helper.make_node("Relu", ["c"], ["r"]),
                           helper.make_node("Cast", ["r"], ["y"], to=TensorProto.FLOAT)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR)
    from npufuse.ir.runtime import run

    y = run(m, {"x": np.array([-1.0, 0.5, 2.0], np.float32)})["y"]
    assert y.dtype == np.float32 and list(y) == [0.0, 0.5, 2.0]
