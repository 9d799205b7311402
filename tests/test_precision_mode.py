"""ATC's precision modes in the cost model: every kernel is priced in the dtype ATC compiles it in, by default
force_fp16 (ATC's inference default), and `--precision-mode` takes ATC's own values."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper, numpy_helper

import npufuse
from npufuse.cli import main
from npufuse.cost_model import OpWork, TensorInfo, estimate_op
from npufuse.cost_model.precision import at_precision
from npufuse.npu_model import load_profile
from npufuse.npu_model.precision import PrecisionModeError, canonical, policy

F32, F16, BF16 = "float32", "float16", "bfloat16"


def _mm(dt: str = F32, out: str | None = None) -> OpWork:
    return OpWork("mm", "MatMul", "", (TensorInfo((256, 512), dt), TensorInfo((512, 128), dt, True)),
                  (TensorInfo((256, 128), out or dt),))


def _add(dt: str = F32) -> OpWork:
    return OpWork("add", "Add", "", (TensorInfo((256, 128), dt), TensorInfo((256, 128), dt)),
                  (TensorInfo((256, 128), dt),))


def _dtypes(op: OpWork) -> tuple[list[str], list[str]]:
    return [t.dtype for t in op.inputs], [t.dtype for t in op.outputs]


def test_the_modes_do_what_atc_documents():
    # force_fp16: everything that has fp16 runs in fp16
    assert _dtypes(at_precision(_mm(), policy("force_fp16"))) == ([F16, F16], [F16])
    assert _dtypes(at_precision(_add(), policy("fp16"))) == ([F16, F16], [F16])
    # allow_fp32_to_fp16: matrix kernels in fp16, vector kernels keep fp32
    assert _dtypes(at_precision(_mm(), policy("allow_fp32_to_fp16"))) == ([F16, F16], [F16])
    assert _dtypes(at_precision(_add(), policy("allow_fp32_to_fp16"))) == ([F32, F32], [F32])
    # origin: the graph's dtypes
    assert at_precision(_mm(), policy("must_keep_origin_dtype")) == _mm()
    assert at_precision(_add(F16), policy("origin")) == _add(F16)
    # force_fp32 / cube_fp16in_fp32out: fp16 in, fp32 out on the Cube; fp16 vector work in fp32
    assert _dtypes(at_precision(_mm(), policy("cube_fp16in_fp32out"))) == ([F16, F16], [F32])
    assert _dtypes(at_precision(_mm(F16), policy("force_fp32"))) == ([F16, F16], [F32])
    assert _dtypes(at_precision(_add(F16), policy("force_fp32"))) == ([F32, F32], [F32])
    # bf16 modes on a chip that has bf16
    assert _dtypes(at_precision(_mm(), policy("allow_fp32_to_bf16", "ascend910b"))) == ([BF16, BF16], [BF16])
    assert _dtypes(at_precision(_add(), policy("mixed_bfloat16", "ascend910b"))) == ([BF16, BF16], [BF16])
    # aliases of the v2 option and the newer names
    assert canonical("mixed_float16") == canonical("allow_mix_precision_fp16") == "allow_mix_precision"
    assert canonical("origin") == "must_keep_origin_dtype" and canonical("fp16") == "force_fp16"


def test_casts_and_integer_tensors_keep_their_types():
    cast = OpWork("c", "Cast", "", (TensorInfo((8,), F16),), (TensorInfo((8,), F32),), {"to": 1})
    assert at_precision(cast, policy("force_fp16")) == cast
    gather = OpWork("g", "Gather", "", (TensorInfo((100, 64), F32, True), TensorInfo((1, 8), "int64")),
                    (TensorInfo((1, 8, 64), F32),))
    assert _dtypes(at_precision(gather, policy("force_fp16"))) == ([F16, "int64"], [F16])


@pytest.mark.parametrize("mode, chip, words", [
    ("allow_fp32_to_bf16", "ascend310p", "does not have"),
    ("mixed_bfloat16", "ascend910", "does not have"),
    ("cube_hif8", None, "not modeled"),
    ("fp8", None, "unknown precision mode"),
])
def test_modes_npufuse_cannot_price_are_refused(mode, chip, words):
    with pytest.raises(PrecisionModeError, match=words):
        policy(mode, chip)


def test_a_profile_prices_in_atc_default_and_the_option_overrides():
    spec = load_profile("Ascend910B2")
    assert spec.precision_mode == "force_fp16"
    assert load_profile("CPU2Core").precision_mode == "must_keep_origin_dtype"   # onnxruntime on a CPU
    origin = spec.with_precision("origin")
    big = OpWork("mm", "MatMul", "", (TensorInfo((4096, 4096), F32), TensorInfo((4096, 4096), F32, True)),
                 (TensorInfo((4096, 4096), F32),))
    fp16, fp32 = estimate_op(big, spec), estimate_op(big, origin)
    # fp32 kept: twice the bytes and the fp32 Cube rate; under force_fp16 the same kernel as an fp16 MatMul
    assert fp32.gm_bytes == 2 * fp16.gm_bytes and fp32.t_total_us > 1.5 * fp16.t_total_us
    assert fp16.t_total_us == estimate_op(_retyped(big, F16), origin).t_total_us


def _retyped(op: OpWork, dt: str) -> OpWork:
    from dataclasses import replace

    return replace(op, inputs=tuple(replace(t, dtype=dt) for t in op.inputs),
                   outputs=tuple(replace(t, dtype=dt) for t in op.outputs))


def _mlp(dtype=np.float32) -> onnx.ModelProto:
    """x [B, 128, 256] -> MatMul W1 -> Add b1 -> Relu -> MatMul W2: every tensor float32 (or `dtype`)."""
    rng = np.random.default_rng(0)
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.05).astype(dtype), n)
             for n, s in (("W1", (256, 1024)), ("b1", (1024,)), ("W2", (1024, 256)))]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="bias"),
             helper.make_node("Relu", ["hb"], ["a"], name="relu"),
             helper.make_node("MatMul", ["a", "W2"], ["y"], name="mm2")]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", et, ["batch", 128, 256])],
                          [helper.make_tensor_value_info("y", et, ["batch", 128, 256])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_report_prices_an_fp32_export_as_atc_compiles_it():
    fp32 = npufuse.report(_mlp(), dims={"batch": 8}, verify=False)
    assert fp32["target"]["precision_mode"] == "force_fp16"
    # the same graph exported in fp16 is the same work under force_fp16
    fp16 = npufuse.report(_mlp(np.float16), dims={"batch": 8}, verify=False)
    assert fp32["summary"]["modeled_time_us"] == fp16["summary"]["modeled_time_us"]
    assert fp32["summary"]["gm_bytes"] == fp16["summary"]["gm_bytes"]
    kept = npufuse.report(_mlp(), dims={"batch": 8}, verify=False, precision_mode="must_keep_origin_dtype")
    assert kept["target"]["precision_mode"] == "must_keep_origin_dtype"
    assert kept["summary"]["gm_bytes"]["before"] == 2 * fp32["summary"]["gm_bytes"]["before"]
    assert kept["summary"]["modeled_time_us"]["before"] > fp32["summary"]["modeled_time_us"]["before"]
    for fmt, words in (("text", "priced in ATC precision mode force_fp16"), ("markdown", "`force_fp16`"),
                       ("html", "ATC precision mode <b>force_fp16</b>")):
        assert words in fp32.render(fmt)


def test_optimize_prices_the_model_as_report_does(tmp_path):
    model = _mlp()
    for mode in ("force_fp16", "allow_fp32_to_fp16"):
        rep = npufuse.report(model, dims={"batch": 8}, verify=False, precision_mode=mode)
        opt = npufuse.optimize(model, dims={"batch": 8}, verify=False, precision_mode=mode).report
        assert opt["precision_mode"] == mode
        assert opt["modeled_time_us"] == rep["summary"]["modeled_time_us"]


def test_cli_takes_atc_values_and_refuses_others_in_one_line(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(), path)
    r = CliRunner().invoke(main, ["report", str(path), "--no-verify", "-q", "--precision-mode", "mixed_float16",
                                  "--format", "json"])
    assert r.exit_code == 0, r.output
    assert '"precision_mode": "allow_mix_precision"' in r.output
    for mode, words in (("fp64", "unknown precision mode"), ("allow_fp32_to_bf16", "does not have")):
        r = CliRunner().invoke(main, ["optimize", str(path), "--no-verify", "-q", "--target", "Ascend310P3",
                                      "--precision-mode", mode, "-o", str(tmp_path / "o.onnx")])
        assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and words in r.output
        assert "Traceback" not in r.output and not (tmp_path / "o.onnx").exists()
