"""The silu pattern (patterns/silu.py): a SiLU no larger fusion took becomes one npufuse.Silu; one an epilogue or a
gate can take stays theirs; a gate x * sigmoid(y) or a Swish with its own beta is no SiLU. On a chip with no Swish
kernel the region is refused with that reason, which still names the Sigmoid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import with_output_shapes
from onnx import helper, numpy_helper

from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.ir.modelio import load_model
from npufuse.npu_model.spec import load_profile
from npufuse.patterns.silu import SILU
from npufuse.verify.compare import compare

FIXTURES = Path(__file__).parent / "fixtures"


def _model(form: str = "silu", dtype=np.float32) -> onnx.ModelProto:
    """a + b -> [SiLU] -> y: a SiLU after an Add, which no epilogue takes."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [numpy_helper.from_array(np.array(1.5, dtype), "beta")]
    nodes = [helper.make_node("Add", ["a", "b"], ["x"], name="add")]
    if form == "silu":
        nodes += [helper.make_node("Sigmoid", ["x"], ["s"], name="sig"), helper.make_node("Mul", ["x", "s"], ["y"],
                                                                                           name="mul")]
    elif form == "gate":      # x * sigmoid(b): a gate, not a SiLU
        nodes += [helper.make_node("Sigmoid", ["b"], ["s"], name="sig"), helper.make_node("Mul", ["x", "s"], ["y"],
                                                                                           name="mul")]
    elif form == "swish":     # x * sigmoid(1.5 x): a Swish with its own beta
        nodes += [helper.make_node("Mul", ["x", "beta"], ["bx"], name="scale"),
                  helper.make_node("Sigmoid", ["bx"], ["s"], name="sig"), helper.make_node("Mul", ["x", "s"], ["y"],
                                                                                            name="mul")]
    elif form == "shared":    # the sigmoid is read elsewhere too
        nodes += [helper.make_node("Sigmoid", ["x"], ["s"], name="sig"), helper.make_node("Mul", ["x", "s"], ["y"],
                                                                                           name="mul")]
    vi = [helper.make_tensor_value_info(n, elem, [2, 5, 8]) for n in ("a", "b")]
    outs = [helper.make_tensor_value_info("y", elem, [2, 5, 8])]
    if form == "shared":
        outs.append(helper.make_tensor_value_info("s", elem, [2, 5, 8]))
    g = helper.make_graph(nodes, "silu", vi, outs, inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                                ir_version=IR_VERSION))


def _feeds():
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((2, 5, 8)).astype(np.float32) * 3,
            "b": rng.standard_normal((2, 5, 8)).astype(np.float32)}


def _fused(res) -> list[str]:
    return [n.op_type for n in res.model.graph.node if n.domain == "npufuse"]


def test_a_silu_no_epilogue_takes_is_one_op_and_computes_the_same():
    model = _model()
    res = optimize(model, options=OptimizeOptions())
    assert _fused(res) == ["Silu"] and all(r.check.ok for r in res.applied)
    want, got = run(model, _feeds()), run(res.model, _feeds())
    assert compare("y", got["y"], want["y"]).ok
    x = _feeds()["a"] + _feeds()["b"]
    ref = SILU.reference([x], {})[0]
    assert compare("y", ref, want["y"]).ok and not compare("y", x / (1 + np.exp(-x)) * 0.5, want["y"]).ok


@pytest.mark.parametrize("form", ["gate", "swish", "shared"])
def test_what_is_not_a_lone_silu_does_not_fuse(form):
    res = optimize(_model(form), options=OptimizeOptions())
    assert "Silu" not in _fused(res)


def test_on_a_chip_without_swish_it_is_refused_with_the_reason_and_accounted():
    res = optimize(_model(), options=OptimizeOptions(spec=load_profile("Ascend910B2")))
    [rec] = [r for r in res.records if r.match.pattern == "silu"]
    assert rec.status == "skipped-by-cost" and "Swish has no kernel for ascend910b" in rec.reason
    assert unaccounted(res) == []


def test_epilogues_keep_their_silu():
    """A Conv -> SiLU stays FusedConv[Silu], an MoE expert's batched SiLU (no epilogue) becomes npufuse.Silu."""
    from builders import conv_chain

    res = optimize(conv_chain(act="Silu", bn=True), options=OptimizeOptions())
    assert "Silu" not in _fused(res) and "FusedConv" in _fused(res)
    res = optimize(load_model(FIXTURES / "mixtral_ts17.onnx"), str(FIXTURES), OptimizeOptions(verify=False))
    assert _fused(res).count("Silu") == 2 and unaccounted(res) == []
