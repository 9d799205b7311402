"""The models in examples/ do what the README shows: the MobileNetV2 fuses its Conv+BN+ReLU6 chains, the small BERT
(tools/make_examples.py) its attention, norms, GELU and MatMul epilogues, and both verify. No torch needed."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
import pytest
from onnx import helper

from npufuse.fusion.census import fusion_census
from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.modelio import load_model, model_dir
from npufuse.npu_model.spec import load_profile

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BERT = EXAMPLES / "bert_tiny.onnx"


@pytest.fixture(scope="module")
def bert_result():
    return optimize(load_model(BERT), model_dir(BERT), OptimizeOptions(spec=load_profile("Ascend910B2")))


def _epilogues(model: onnx.ModelProto) -> Counter:
    out: Counter = Counter()
    for n in model.graph.node:
        if n.op_type == "FusedMatMul":
            steps = next(helper.get_attribute_value(a) for a in n.attribute if a.name == "epilogue")
            out[",".join(s.decode() if isinstance(s, bytes) else s for s in steps)] += 1
    return out


def test_examples_are_small_enough_to_commit() -> None:
    for p in EXAMPLES.glob("*.onnx"):
        assert p.stat().st_size < 5 * 2**20, p


def test_bert_example_fuses_attention_norms_gelu_and_epilogues(bert_result) -> None:
    before = Counter(n.op_type for n in load_model(BERT).graph.node)
    assert before["Softmax"] == 2 and before["Erf"] == 2 and before["LayerNormalization"] == 5   # 2 layers + embeddings
    out = bert_result.model
    ops = Counter(n.op_type for n in out.graph.node)
    assert ops["FusedAttention"] == 2 and ops["Softmax"] == 0
    assert ops["AddLayerNorm"] == 4 and ops["LayerNormalization"] == 1   # the embeddings' norm: its Add broadcasts
    assert ops["Erf"] == 0 and ops["MatMul"] == 0
    # both FFN GELUs end in their MatMul's epilogue; the pooler's Tanh too
    assert _epilogues(out) == Counter({"bias": 10, "bias,gelu": 2, "bias,tanh": 1})
    census = fusion_census(out)
    assert census["attention"] == 2 and census["layernorm"] == 5 and census["gelu"] == 2
    assert [r.reason for r in bert_result.refusals] == ["operand-broadcast"]
    assert unaccounted(bert_result) == []


def test_bert_example_verifies(bert_result) -> None:
    assert bert_result.ok and bert_result.model_check is not None
    assert not bert_result.rolled_back
    assert {c.name for c in bert_result.model_check.comparisons} == {"last_hidden_state", "pooler_output"}
    assert all(c.ok for c in bert_result.model_check.comparisons)


def test_mobilenetv2_example_fuses_its_conv_chains() -> None:
    p = EXAMPLES / "mobilenetv2.onnx"
    res = optimize(load_model(p), model_dir(p), OptimizeOptions(spec=load_profile("Ascend910B2"), verify=False))
    ops = Counter(n.op_type for n in res.model.graph.node)
    # 35 Conv -> BN -> Clip and, since issue 23 (residual shapes followed through the explicit Pads), the 10
    # inverted residuals' Conv -> BN -> Add
    assert ops["BatchNormalization"] == 0 and ops["FusedConv"] == 45
