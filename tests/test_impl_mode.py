"""ATC's operator implementation modes in the cost model: Sigmoid runs its high-precision kernel unless the
compile asks for the fast one (`--optypelist-for-implmode Sigmoid --op-select-implmode high_performance`, or
`high_performance_for_all`), and the profile's `vector.sigmoid_high_precision_factor` prices the difference."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

import npufuse
from npufuse.cli import main
from npufuse.cost_model import OpWork, TensorInfo, estimate_op
from npufuse.npu_model import load_profile
from npufuse.npu_model.impl_mode import ImplModeError, check_implmode, high_precision

F16 = "float16"


def test_which_kernel_each_mode_runs():
    assert high_precision("Sigmoid", *check_implmode(None))   # ATC's default list does not hold Sigmoid
    assert not high_precision("Sigmoid", *check_implmode("high_performance", ["Sigmoid"]))
    assert high_precision("Sigmoid", *check_implmode("high_performance", ["Gelu"]))    # another op listed
    assert not high_precision("Sigmoid", *check_implmode("high_performance_for_all"))
    assert high_precision("Sigmoid", *check_implmode("high_precision_for_all"))
    assert high_precision("Sigmoid", *check_implmode("high_precision", ["Sigmoid"]))


@pytest.mark.parametrize("mode, ops, says", [
    ("fast", (), "not an ATC --op_select_implmode value"),
    ("high_performance_for_all", ("Sigmoid",), "drop one of the two"),
    ("high_performance", ("Sig moid",), "not an operator type"),
    ("high_performance", ("",), "not an operator type"),
])
def test_values_atc_does_not_take_are_refused(mode, ops, says):
    with pytest.raises(ImplModeError, match=says):
        check_implmode(mode, ops)


def _sigmoid(n: int = 1 << 20) -> OpWork:
    return OpWork("s", "Sigmoid", "", (TensorInfo((n,), F16),), (TensorInfo((n,), F16),))


def test_the_factor_prices_the_vector_work_of_the_high_precision_kernel():
    spec = load_profile("Ascend310P3")
    assert spec.sigmoid_high_precision_factor > 1.0
    fast = spec.with_impl_mode("high_performance", ["Sigmoid"])
    slow = estimate_op(_sigmoid(), spec)
    quick = estimate_op(_sigmoid(), fast)
    assert slow.vector_cycles == pytest.approx(quick.vector_cycles * spec.sigmoid_high_precision_factor)
    assert estimate_op(_sigmoid(), spec.with_impl_mode("high_performance_for_all")).vector_cycles == \
        quick.vector_cycles
    # an op without two implementations is priced the same under every mode
    add = OpWork("a", "Add", "", (TensorInfo((1 << 20,), F16),) * 2, (TensorInfo((1 << 20,), F16),))
    assert estimate_op(add, spec).t_total_us == estimate_op(add, fast).t_total_us
    # a profile that states no factor prices one Sigmoid whatever the mode (the physics alone)
    plain = load_profile("Ascend910B2")
    assert plain.sigmoid_high_precision_factor == 1.0
    assert estimate_op(_sigmoid(), plain).t_total_us == \
        estimate_op(_sigmoid(), plain.with_impl_mode("high_performance", ["Sigmoid"])).t_total_us


def _conv_silu(path) -> str:
    """Conv -> x * Sigmoid(x): an EfficientNet / YOLO block, the SiLU a FusedConv epilogue once fused."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 32, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["y"])]
    graph = helper.make_graph(nodes, "conv_silu", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                 ["batch", 32, 56, 56])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64, 56, 56])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out = path / "conv_silu.onnx"
    out.write_bytes(model.SerializeToString())
    return str(out)


def test_report_prices_the_silu_epilogue_in_the_mode_and_says_which(tmp_path):
    model = _conv_silu(tmp_path)

    def time_us(**kw) -> tuple[float, dict]:
        doc = npufuse.report(model, target="Ascend310P3", verify=False, dims={"batch": 8}, **kw)
        return doc["summary"]["modeled_time_us"]["after"], doc["target"]

    default, target = time_us()
    assert target["op_select_implmode"] == "high_performance" and target["optypelist_for_implmode"] == []
    flagged, target = time_us(op_select_implmode="high_performance", optypelist_for_implmode="Sigmoid")
    assert target["optypelist_for_implmode"] == ["Sigmoid"]
    for_all, _ = time_us(op_select_implmode="high_performance_for_all")
    assert flagged == for_all < default
    # the fused and the unfused model both pay the Sigmoid: the mode does not decide whether SiLU fuses
    doc = npufuse.report(model, target="Ascend310P3", verify=False, dims={"batch": 8})
    assert doc["summary"]["applied_by_kind"] == npufuse.report(
        model, target="Ascend310P3", verify=False, dims={"batch": 8}, op_select_implmode="high_performance_for_all"
    )["summary"]["applied_by_kind"]


def test_the_cli_takes_atcs_spelling_and_refuses_in_one_line(tmp_path):
    model = _conv_silu(tmp_path)
    runner = CliRunner()
    ok = runner.invoke(main, ["report", model, "--target", "Ascend310P3", "--no-verify", "--dim", "batch=2",
                              "--format", "json", "--op-select-implmode", "high_performance",
                              "--optypelist-for-implmode", "Sigmoid,Gelu"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["target"]["optypelist_for_implmode"] == ["Sigmoid", "Gelu"]
    bad = runner.invoke(main, ["optimize", model, "--target", "Ascend310P3", "--no-verify",
                               "--op-select-implmode", "fastest", "-o", str(tmp_path / "o.onnx")])
    assert bad.exit_code == 2
    assert bad.output.count("\n") == 1 and "--op-select-implmode" in bad.output and "fastest" in bad.output
    assert not (tmp_path / "o.onnx").exists()


def test_the_report_says_what_the_fast_sigmoid_would_save(tmp_path):
    model = _conv_silu(tmp_path)
    kw = dict(target="Ascend310P3", verify=False, dims={"batch": 8})
    doc = npufuse.report(model, **kw)
    hint = doc["summary"]["sigmoid_high_precision"]
    flagged = npufuse.report(model, op_select_implmode="high_performance", optypelist_for_implmode=["Sigmoid"], **kw)
    assert flagged["summary"]["sigmoid_high_precision"] is None      # the compile already asks for the fast one
    after, fast = doc["summary"]["modeled_time_us"]["after"], flagged["summary"]["modeled_time_us"]["after"]
    assert hint["after_us_with_fast_sigmoid"] == pytest.approx(fast, abs=1e-3)
    assert hint["extra_us"] == pytest.approx(after - fast, abs=1e-2) and hint["extra_us"] > 0
    assert "--optypelist_for_implmode=Sigmoid --op_select_implmode=high_performance" in doc.render("text")
    # a profile that prices one Sigmoid, and a model without one, have nothing to say
    assert npufuse.report(model, target="Ascend910B2", verify=False)["summary"]["sigmoid_high_precision"] is None
