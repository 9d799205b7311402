"""GPT-OSS's learned attention sinks: Softmax([scores, sinks] - max) with the sink column sliced off before ·V is
FusedAttention with a `sinks` input; the kernel is FusedInferAttentionScore's learnable_sink (910B), refused on 310P;
the ATC form keeps it standard (no plugin takes sinks). Near-misses and a numeric check that fails without them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from builders import with_output_shapes
from onnx import TensorProto, helper, numpy_helper

from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.npu_model.spec import load_profile
from npufuse.patterns.attention_op import attention_reference
from npufuse.verify.compare import compare

B, H, S, D = 2, 4, 6, 8
F = TensorProto.FLOAT


def _model(*, stabilise: bool = True, keep: tuple[int, int] = (0, -1), column: int = 1) -> onnx.ModelProto:
    """q, k, v [B, H, S, D] -> scores·scale -> cat(scores, expand(sinks [1, H, 1, 1])) [- max] -> Softmax ->
    [..., :-1] -> ·v."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((1, H, 1, column)) * 2).astype(np.float32), "sinks"),
             numpy_helper.from_array(np.array(D ** -0.5, np.float32), "scale"),
             numpy_helper.from_array(np.array([B, H, S, column], np.int64), "col_shape"),
             numpy_helper.from_array(np.array([keep[0]], np.int64), "s0"),
             numpy_helper.from_array(np.array([keep[1]], np.int64), "s1"),
             numpy_helper.from_array(np.array([-1], np.int64), "ax")]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"]), helper.make_node("Mul", ["qk", "scale"], ["s"]),
             helper.make_node("Expand", ["sinks", "col_shape"], ["col"]),
             helper.make_node("Concat", ["s", "col"], ["c"], axis=-1)]
    x = "c"
    if stabilise:
        nodes += [helper.make_node("ReduceMax", ["c"], ["mx"], axes=[-1], keepdims=1),
                  helper.make_node("Sub", ["c", "mx"], ["cs"])]
        x = "cs"
    nodes.append(helper.make_node("Softmax", [x], ["p"], axis=-1))
    nodes += [helper.make_node("Slice", ["p", "s0", "s1", "ax"], ["ps"]), helper.make_node("MatMul", ["ps", "v"], ["y"])]
    for i, n in enumerate(nodes):
        n.name = f"{n.op_type}_{i}"
    ins = [helper.make_tensor_value_info(n, F, [B, H, S, D]) for n in ("q", "k", "v")]
    g = helper.make_graph(nodes, "sinks", ins, [helper.make_tensor_value_info("y", F, None)], inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION))


def _feeds(seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((B, H, S, D)).astype(np.float32) for n in ("q", "k", "v")}


@pytest.mark.parametrize("stabilise", [True, False])
def test_sink_attention_fuses_and_computes_what_the_model_does(stabilise):
    model = _model(stabilise=stabilise)
    res = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend910B2")))
    assert [r.match.kind for r in res.applied] == ["FusedAttention[sinks]"]
    assert not res.rolled_back and res.model_check.ok and not unaccounted(res)
    [rec] = [r for r in res.records if r.match.pattern == "attention"]
    assert rec.to_dict()["ascend_kernel"]["op"] == "FusedInferAttentionScore"
    for seed in range(3):
        f = _feeds(seed)
        assert compare("y", run(res.model, f)["y"], run(model, f)["y"]).ok


def test_the_reference_needs_the_sinks():
    """The kernel without its sink column is far from the model: the numeric check would catch a lost input."""
    model = _model()
    f = _feeds()
    want = run(model, f)["y"]
    sinks = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "sinks"))
    attrs = {"scale": D ** -0.5, "num_heads": H, "sinks": 1}
    assert compare("y", attention_reference([f["q"], f["k"], f["v"], None, None, sinks], attrs)[0], want).ok
    assert not compare("y", attention_reference([f["q"], f["k"], f["v"]], attrs)[0], want).ok


@pytest.mark.parametrize("kw", [{"keep": (1, 2 ** 62)},               # the sink column first: another computation
                                {"column": 2, "keep": (0, -2)}])     # two sink columns: not the op's one
def test_near_misses_do_not_fuse(kw):
    model = _model(**kw)
    res = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend910B2")))
    assert not any(r.match.pattern == "attention" for r in res.applied)
    assert not unaccounted(res)


def test_on_310p_no_kernel_takes_sinks():
    res = optimize(_model(), options=OptimizeOptions(spec=load_profile("Ascend310P3"), verify=False))
    [rec] = [r for r in res.records if r.match.pattern == "attention"]
    assert rec.status != "applied" and "FusedInferAttentionScore has no kernel for ascend310p" in rec.reason
