"""GPT-OSS's rotation on the halves (`prepare.rules.rotary_halves.rotate_halves`): cat(x1·cos - x2·sin,
x2·cos + x1·sin) with half-width tables is canonicalised, bit for bit, to the rotate_half form, which the rotary
pattern fuses; q and k then read one widened table each (`rotary_pair` sees them as the same). Spellings that are
not that rotation are left alone. On the GPT-OSS fixtures, with their attention (learned sinks) fused as well."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import with_output_shapes
from onnx import TensorProto, helper, numpy_helper

from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.npu_model.spec import load_profile
from npufuse.prepare.normalize import normalize

FIXTURES = Path(__file__).parent / "fixtures"
B, H, S, D = 2, 4, 6, 16
F = TensorProto.FLOAT


def _rotation(x: str, cos: str, sin: str, tag: str, *, split: bool, swap_mul: bool = False, wrong: str = "",
              opset: int = 18) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    """x1, x2 = halves(x); y = cat(x1*cos - x2*sin, x2*cos + x1*sin) (or a wrong variant)."""
    nodes, inits = [], []
    x1, x2 = f"{tag}_x1", f"{tag}_x2"
    if split:
        kw = {"num_outputs": 2} if opset >= 18 else {}
        nodes.append(helper.make_node("Split", [x], [x1, x2], axis=-1, **kw))
    else:
        for nm, a in ((f"{tag}_0", 0), (f"{tag}_h", D // 2), (f"{tag}_e", D), (f"{tag}_ax", -1)):
            inits.append(numpy_helper.from_array(np.array([a], np.int64), nm))
        nodes += [helper.make_node("Slice", [x, f"{tag}_0", f"{tag}_h", f"{tag}_ax"], [x1]),
                  helper.make_node("Slice", [x, f"{tag}_h", f"{tag}_e", f"{tag}_ax"], [x2])]
    a, b = (x2, x1) if wrong == "halves-swapped" else (x1, x2)
    s2 = cos if wrong == "sin-is-cos" else sin

    def mul(p, q, out):
        return helper.make_node("Mul", [q, p] if swap_mul else [p, q], [out])

    nodes += [mul(a, cos, f"{tag}_ac"), mul(b, s2, f"{tag}_bs"), mul(b, cos, f"{tag}_bc"), mul(a, sin, f"{tag}_as"),
              helper.make_node("Sub", [f"{tag}_ac", f"{tag}_bs"], [f"{tag}_first"]),
              helper.make_node("Add", [f"{tag}_as", f"{tag}_bc"] if swap_mul else [f"{tag}_bc", f"{tag}_as"],
                               [f"{tag}_second"]),
              helper.make_node("Concat", [f"{tag}_first", f"{tag}_second"], [f"{tag}_y"], axis=-1)]
    return nodes, inits, f"{tag}_y"


def _model(*, split: bool = True, swap_mul: bool = False, wrong: str = "", opset: int = 18,
           pair: bool = False) -> onnx.ModelProto:
    """q [B, H, S, D] (and k) rotated on the halves by cos/sin [S, D/2] from positions; outputs the rotated values
    (or their scores q·kᵀ when `pair`)."""
    nodes, inits = [], []
    inv = (1.0 / (10000 ** (np.arange(0, D, 2) / D))).astype(np.float32)
    inits.append(numpy_helper.from_array(inv.reshape(1, D // 2), "inv_freq"))
    nodes += [helper.make_node("MatMul", ["pos", "inv_freq"], ["freqs"]),
              helper.make_node("Cos", ["freqs"], ["cos"]), helper.make_node("Sin", ["freqs"], ["sin"])]
    outs = []
    for t in (("q", "k") if pair else ("q",)):
        n, i, y = _rotation(t, "cos", "sin", t, split=split, swap_mul=swap_mul, wrong=wrong, opset=opset)
        nodes += n
        inits += i
        outs.append(y)
    if pair:
        nodes += [helper.make_node("Transpose", ["k_y"], ["kt"], perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", ["q_y", "kt"], ["scores"])]
        outs = ["scores"]
    for j, nd in enumerate(nodes):
        nd.name = f"{nd.op_type}_{j}"
    inputs = [helper.make_tensor_value_info("pos", F, [S, 1])] + \
        [helper.make_tensor_value_info(t, F, [B, H, S, D]) for t in (("q", "k") if pair else ("q",))]
    g = helper.make_graph(nodes, "rot", inputs, [helper.make_tensor_value_info(o, F, None) for o in outs], inits)
    return with_output_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                                                ir_version=IR_VERSION))


def _feeds(model, seed=0):
    rng = np.random.default_rng(seed)
    f = {"pos": np.arange(S, dtype=np.float32).reshape(S, 1) * 3.0}
    for vi in model.graph.input[1:]:
        f[vi.name] = rng.standard_normal((B, H, S, D)).astype(np.float32)
    return f


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("swap_mul", [False, True])
@pytest.mark.parametrize("opset", [13, 18])
def test_the_halves_form_is_canonicalised_bit_for_bit_and_fuses(split, swap_mul, opset):
    model = _model(split=split, swap_mul=swap_mul, opset=opset)
    canon, _ = normalize(model, None)
    assert not any(n.op_type == "Sub" for n in canon.graph.node)
    feeds = _feeds(model)
    want, got = run(model, feeds), run(canon, feeds)
    np.testing.assert_array_equal(got["q_y"], want["q_y"])      # exact: a - b is a + (-b)
    res = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend910B2")))
    assert [r.match.kind for r in res.applied] == ["RotaryEmbedding[half]"]
    assert not res.rolled_back and res.model_check.ok and not unaccounted(res)
    np.testing.assert_array_equal(run(res.model, feeds)["q_y"], want["q_y"])


@pytest.mark.parametrize("wrong", ["halves-swapped", "sin-is-cos"])
def test_other_spellings_are_left_alone(wrong):
    model = _model(wrong=wrong)
    canon, _ = normalize(model, None)
    assert any(n.op_type == "Sub" for n in canon.graph.node)
    res = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend910B2")))
    assert not any(r.match.pattern == "rotary" for r in res.applied)
    feeds = _feeds(model)
    np.testing.assert_allclose(run(res.model, feeds)["q_y"], run(model, feeds)["q_y"], rtol=1e-6, atol=1e-6)


def test_q_and_k_read_tables_rotary_pair_sees_as_one():
    """Each rotation gets its own Concat(cos, cos): the pair pattern must see them as one table (same op, same
    inputs), not refuse the pair as pair-different-cos-sin."""
    model = _model(pair=True)
    res = optimize(model, options=OptimizeOptions(spec=load_profile("Ascend310P3"), force_fuse=True))
    reasons = {r.reason for r in res.refusals if r.pattern == "rotary_pair"}
    assert "pair-different-cos-sin" not in reasons and "RotaryEmbeddingPair[half]" in res.applied_by_kind()
    feeds = _feeds(model)
    np.testing.assert_allclose(run(res.model, feeds)["scores"], run(model, feeds)["scores"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("file", ["gpt_oss_ts17.onnx", "gpt_oss_dynamo.onnx"])
def test_gpt_oss_rotations_and_sink_attention_fuse(file):
    res = optimize(onnx.load(str(FIXTURES / file)), str(FIXTURES), OptimizeOptions(spec=load_profile("Ascend910B2")))
    kinds = res.applied_by_kind()
    assert kinds.get("RotaryEmbedding[half]") == 4 and kinds.get("npufuse.MoeGatingTopKSoftmax[topk_first]") == 2
    assert kinds.get("FusedAttention[gqa,sinks,mask]") == 2     # its learned sinks fused too
    assert not unaccounted(res) and res.model_check.ok
