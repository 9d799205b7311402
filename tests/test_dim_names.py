"""Symbolic dim names get their default sizes by whole names and words, `past` first; a name no rule fits is
named in the run's notes with the sizes it was given (before: `past_sequence_length` matched `sequence` by
substring and was priced at 512; an unknown symbol silently became 1)."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from npufuse.fusion.costing import COST_DEFAULT_DIMS, COST_OTHER_DIM, CostShapes
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import Graph
from npufuse.npu_model import load_profile
from npufuse.verify.inputs import DEFAULT_DIMS, OTHER_DIM, concrete_shape, dim_default, unmatched_dims


@pytest.mark.parametrize("name", ["past_sequence_length", "past_key_values_length", "pastSeqLen", "past"])
def test_a_past_length_is_the_cache_length_not_the_sequence(name: str) -> None:
    assert dim_default(name, COST_DEFAULT_DIMS) == (COST_DEFAULT_DIMS["past"], "past")
    assert dim_default(name) == (DEFAULT_DIMS["past"], "past")
    assert concrete_shape(("batch_size", name, 64), None, COST_DEFAULT_DIMS, COST_OTHER_DIM) == (1, 0, 64)


@pytest.mark.parametrize("name, key", [("sequence_length", "seq"), ("total_sequence_length", "seq"),
                                       ("seqlen", "seq"), ("max_length", "len"), ("batch_size", "batch"),
                                       ("Width", "width"), ("sequence", "sequence")])
def test_known_words(name: str, key: str) -> None:
    assert dim_default(name, COST_DEFAULT_DIMS) == (COST_DEFAULT_DIMS[key], key)


@pytest.mark.parametrize("name", ["unk__3", "N", "num_tokens", "bandwidth", "encoder_hidden"])
def test_a_name_no_rule_fits_gets_the_other_size(name: str) -> None:
    assert dim_default(name) is None and dim_default(name, COST_DEFAULT_DIMS) is None
    assert concrete_shape((name,)) == (OTHER_DIM,)


def _relu(dims: list) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_cost_shapes_price_a_past_key_values_length_as_the_past() -> None:
    model = _relu(["batch", "past_key_values_length", 64])
    shapes = CostShapes(model, None)
    assert shapes.shape(Graph(model), "x") == (1, 0, 64)


def test_an_unmatched_input_symbol_is_named_with_the_sizes_it_was_given() -> None:
    model = _relu(["batch", "unk__7", 16])
    assert unmatched_dims(Graph(model), None) == ["unk__7"]
    assert unmatched_dims(Graph(model), {"unk__7": 3}) == []
    res = optimize(model, None, OptimizeOptions(spec=load_profile("Ascend910B2")))
    notes = [n for n in res.notes if "unk__7" in n]
    assert len(notes) == 1
    assert f"priced at {COST_OTHER_DIM}" in notes[0] and f"verified at {OTHER_DIM}" in notes[0]
    assert "--dim unk__7=INT" in notes[0]
    res = optimize(model, None, OptimizeOptions(spec=load_profile("Ascend910B2"), dims={"unk__7": 3}))
    assert not any("unk__7" in n for n in res.notes)
