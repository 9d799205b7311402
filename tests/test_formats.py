"""Format conversions in pricing (npufuse/cost_model/formats.py): on Ascend310P3, whose MatMul kernels take B in
FRACTAL_NZ only, a B computed at run time whose last two dims are not multiples of 16 goes through a TransData
kernel first; aligned, constant, or on a chip that takes B in ND, it does not."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from npufuse import api
from npufuse.cost_model import estimate_op, estimate_ops
from npufuse.cost_model.decide import decide
from npufuse.cost_model.formats import conversions
from npufuse.cost_model.workload import FusionCandidate, OpWork, TensorInfo
from npufuse.npu_model import ProfileError, load_profile
from npufuse.npu_model import spec as spec_module

P310 = load_profile("Ascend310P3")
P910B = load_profile("Ascend910B2")


def _bmm(b_shape, *, b_const=False, dtype="float16", op_type="MatMul"):
    a = TensorInfo((2, 6, b_shape[-1], 64), dtype)
    b = TensorInfo(tuple(b_shape), dtype, is_constant=b_const)
    y = TensorInfo((2, 6, b_shape[-1], b_shape[-1]), dtype)
    return OpWork("qk", op_type, "" if op_type == "MatMul" else "npufuse", (a, b), (y,))


def test_an_unaligned_run_time_b_is_converted_to_the_padded_fractal_layout():
    (td,) = conversions(_bmm((2, 6, 64, 197)), P310)
    assert td.op_type == "TransData"
    assert td.inputs[0].shape == (2, 6, 64, 197)
    assert td.outputs[0].shape == (2, 6, 64, 208)     # 197 rounded up to the 16-wide fractal
    k = estimate_op(td, P310)
    assert k.kind == "move" and k.launches == 1
    assert "FRACTAL_NZ" in k.notes[0]   # the report says why the kernel is there
    assert k.gm_bytes_read == 2 * 6 * 64 * 197 * 2 and k.gm_bytes_written == 2 * 6 * 64 * 208 * 2


def test_rows_and_int8_columns_round_to_their_own_fractal():
    (td,) = conversions(_bmm((2, 6, 50, 64)), P310)               # V of a 50-token attention: rows unaligned
    assert td.outputs[0].shape == (2, 6, 64, 64)
    (td8,) = conversions(_bmm((2, 6, 64, 48), dtype="int8"), P310)   # int8's fractal is 16 x 32
    assert td8.outputs[0].shape == (2, 6, 64, 64)


@pytest.mark.parametrize("why, op, spec", [
    ("aligned (BERT's 384 tokens)", _bmm((2, 12, 64, 384)), P310),
    ("a weight: converted once while ATC compiles", _bmm((64, 197), b_const=True), P310),
    ("a chip whose MatMul takes B in ND", _bmm((2, 6, 64, 197)), P910B),
    ("not a MatMul", dataclasses.replace(_bmm((2, 6, 64, 197)), op_type="Add"), P310),
])
def test_no_conversion(why, op, spec):
    assert conversions(op, spec) == (), why


def test_a_model_estimate_adds_the_conversion_kernel_before_its_matmul():
    op = _bmm((2, 6, 64, 197))
    est = estimate_ops([op], P310)
    assert [k.op_type for k in est.kernels] == ["TransData", "MatMul"]
    assert est.op_count == 1 and est.launches == 2
    td = estimate_op(conversions(op, P310)[0], P310)
    assert est.time_us == pytest.approx(estimate_op(op, P310).t_total_us + td.t_total_us)
    assert estimate_ops([op], P910B).launches == 1


def test_a_fusion_decision_counts_the_conversions_of_both_sides():
    mm = _bmm((2, 6, 64, 197), op_type="FusedMatMul")
    d = decide(FusionCandidate("p", unfused=(mm,), fused=(dataclasses.replace(mm, name="f"),)), P310)
    assert [k.op_type for k in d.unfused] == ["FusedMatMul", "TransData"]   # conversions last: renamed by position
    assert [k.op_type for k in d.fused] == ["FusedMatMul", "TransData"]
    assert d.t_unfused_us == pytest.approx(sum(k.t_total_us for k in d.unfused))


def test_the_profile_key_must_be_a_bool(tmp_path):
    text = (Path(spec_module.__file__).parent / "profiles" / "Ascend310P3.toml").read_text()
    assert "matmul_b_fractal_only = true" in text
    bad = tmp_path / "mine.toml"
    bad.write_text(text.replace("matmul_b_fractal_only = true", 'matmul_b_fractal_only = "yes"'))
    with pytest.raises(ProfileError, match="'cube.matmul_b_fractal_only' is 'yes'; it must be true"):
        load_profile(str(bad))
    bad.write_text(re.sub(r"(?m)^matmul_b_fractal_only = true.*\n", "", text))
    assert load_profile(str(bad)).cube_matmul_b_fractal_only is False   # optional: a profile of your own


def _attention(tokens: int):
    """One head-split attention layer over `tokens` tokens, as exporters write it (Q·Kᵀ, Softmax, ·V)."""
    rng = np.random.default_rng(0)
    d, h = 64, 2
    w = [numpy_helper.from_array(rng.standard_normal((d * h, d * h)).astype(np.float32) * 0.05, f"w{i}")
         for i in range(3)]
    shape = numpy_helper.from_array(np.array([0, tokens, h, d], dtype=np.int64), "hs")
    nodes = []
    for i, n in enumerate("qkv"):
        nodes += [helper.make_node("MatMul", ["x", f"w{i}"], [f"{n}0"]),
                  helper.make_node("Reshape", [f"{n}0", "hs"], [f"{n}1"]),
                  helper.make_node("Transpose", [f"{n}1"], [n], perm=[0, 2, 3, 1] if n == "k" else [0, 2, 1, 3])]
    nodes += [helper.make_node("MatMul", ["q", "k"], ["s"]),
              helper.make_node("Softmax", ["s"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["y"])]
    graph = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                            [1, tokens, d * h])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, h, tokens, d])], w + [shape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("tokens, expected", [(50, 2), (64, 0)])
def test_report_prices_kt_and_v_conversions_only_for_an_unaligned_sequence(tmp_path, tokens, expected):
    path = tmp_path / f"attn{tokens}.onnx"
    onnx.save(_attention(tokens), path)
    doc = api.report(path, target="Ascend310P3", format="json", verify=False, disable=("attention",))
    d = doc if isinstance(doc, dict) else json.loads(doc.render("json"))
    by = d["model_estimate"]["after"]["by_op_type"]
    assert by.get("TransData", {}).get("count", 0) == expected



@pytest.mark.parametrize("shape", [(None, "s"), (0, 197), (64, -1)])
def test_no_conversion_without_a_size_to_convert(shape):
    op = _bmm((2, 6, 64, 197))
    op = dataclasses.replace(op, inputs=(op.inputs[0], TensorInfo(shape, "float16")))
    assert conversions(op, P310) == ()   # never raises, and charges nothing for an empty or unknown B
    if all(isinstance(d, int) for d in shape):
        assert [k.op_type for k in estimate_ops([op], P310).kernels] == ["MatMul"]


def test_a_decision_reused_for_another_layer_names_the_conversions_after_that_layer():
    doc = api.report(Path(__file__).parent / "fixtures" / "vit_ts17.onnx", target="Ascend310P3", format="json",
                     verify=False)
    d = doc if isinstance(doc, dict) else json.loads(doc.render("json"))
    seen = 0
    for c in d["candidates"]:
        for k in (c.get("decision") or {}).get("unfused", []):
            if k["name"].endswith("/transdata_b"):
                seen += 1
                assert k["name"].rpartition("/")[0] in c["nodes"], (k["name"], c["nodes"])
    assert seen >= 4   # two layers' attention, K and V each


# ---- LayerNorm between Cube kernels: FRACTAL_NZ only with 16-aligned rows (TBE layer_norm.py _division_sixteen)

def _layernorm(shape, op_type="LayerNormalization"):
    x = TensorInfo(tuple(shape), "float16")
    gamma = TensorInfo((shape[-1],), "float16", is_constant=True)
    ins = (x, x, gamma, gamma) if op_type == "AddLayerNorm" else (x, gamma, gamma)
    outs = (x, x) if op_type == "AddLayerNorm" else (x,)
    return OpWork("ln", op_type, "" if op_type == "LayerNormalization" else "npufuse", ins, outs, {"axis": -1})


@pytest.mark.parametrize("op_type", ["LayerNormalization", "LayerNorm", "AddLayerNorm"])
def test_a_layernorm_on_unaligned_rows_runs_between_two_conversions(op_type):
    x_in, y_out = conversions(_layernorm((8, 197, 384), op_type), P310)
    # x arrives in the padded fractal layout a MatMul wrote, y leaves in it for the next MatMul
    assert x_in.inputs[0].shape == (8, 208, 384) and x_in.outputs[0].shape == (8, 197, 384)
    assert y_out.inputs[0].shape == (8, 197, 384) and y_out.outputs[0].shape == (8, 208, 384)
    assert {x_in.name, y_out.name} == {"ln/transdata_x", "ln/transdata_y"}   # renamed with their norm per layer
    k = estimate_op(x_in, P310)
    assert k.kind == "move" and k.launches == 1 and "LayerNorm" in k.notes[0]
    # the MatMul-B rule's note is not this one's
    assert "LayerNorm" not in estimate_op(conversions(_bmm((2, 6, 64, 197)), P310)[0], P310).notes[0]


def test_a_norm_dim_of_4096_or_more_is_converted_even_on_aligned_rows():
    assert len(conversions(_layernorm((4, 128, 4096)), P310)) == 2
    assert conversions(_layernorm((4, 128, 4080)), P310) == ()


@pytest.mark.parametrize("why, op, spec", [
    ("aligned rows (BERT's 128 tokens, ViT padded to 208)", _layernorm((8, 208, 768)), P310),
    ("a chip whose LayerNorm takes ND and NZ alike", _layernorm((8, 197, 384)), P910B),
    ("rank 1: no rows", _layernorm((384,)), P310),
    ("an unknown row count", _layernorm((8, None, 384)), P310),
])
def test_no_layernorm_conversion(why, op, spec):
    assert conversions(op, spec) == ()


def test_fusing_a_residual_norm_keeps_the_same_two_conversions():
    # Add + LayerNormalization unfused and AddLayerNorm fused pay the same TransData: the decision is unmoved by them
    unfused = [OpWork("add", "Add", "", (TensorInfo((8, 197, 384), "float16"),) * 2,
                      (TensorInfo((8, 197, 384), "float16"),)), _layernorm((8, 197, 384))]
    fused = [_layernorm((8, 197, 384), "AddLayerNorm")]

    def td(ops):
        return [k for k in estimate_ops(ops, P310).kernels if k.op_type == "TransData"]

    assert len(td(unfused)) == len(td(fused)) == 2
    assert sum(k.t_total_us for k in td(unfused)) == pytest.approx(sum(k.t_total_us for k in td(fused)))


def test_the_conversions_both_sides_run_are_not_at_stake():
    # a fused residual norm runs the same two TransData as the Add + LayerNorm it replaces: their time (and its error)
    # is common to both sides, so the margin is taken of the rest (docs/cost-model.md, "The margin")
    x = TensorInfo((8, 197, 384), "float16")
    unfused = (OpWork("add", "Add", "", (x, x), (x,)), _layernorm((8, 197, 384)))
    d = decide(FusionCandidate("add_layernorm", unfused=unfused, fused=(_layernorm((8, 197, 384), "AddLayerNorm"),)),
               P310)
    converted = sum(k.t_total_us for k in d.unfused if k.op_type == "TransData")
    assert converted > 0 and d.t_at_stake_us == pytest.approx(d.t_unfused_us - converted)
    assert "format conversions both sides share" in d.reason
    # aligned rows: nothing converted, nothing taken off, the reason as before
    x208 = TensorInfo((8, 208, 384), "float16")
    aligned = decide(FusionCandidate("add_layernorm", unfused=(OpWork("add", "Add", "", (x208, x208), (x208,)),
                                                               _layernorm((8, 208, 384))),
                                     fused=(_layernorm((8, 208, 384), "AddLayerNorm"),)), P310)
    assert aligned.t_at_stake_us == aligned.t_unfused_us and "conversions" not in aligned.reason


def _mlp_block(tokens: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    d = 64
    w = [numpy_helper.from_array(rng.standard_normal((d, d)).astype(np.float32), f"w{i}") for i in range(2)]
    g = [numpy_helper.from_array(np.ones(d, np.float32), "g"), numpy_helper.from_array(np.zeros(d, np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["n"], axis=-1),
             helper.make_node("MatMul", ["n", "w1"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, tokens, d])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, tokens, d])], w + g)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("tokens, expected", [(197, 2), (208, 0)])
def test_report_prices_the_layernorm_conversions_only_for_unaligned_rows(tmp_path, tokens, expected):
    path = tmp_path / f"mlp{tokens}.onnx"
    onnx.save(_mlp_block(tokens), path)
    d = api.report(path, target="Ascend310P3", format="json", verify=False)
    for side in ("before", "after"):
        by = d["model_estimate"][side]["by_op_type"]
        assert by.get("TransData", {}).get("count", 0) == expected


def test_a_norm_over_more_than_the_last_axis_takes_nz_only_with_a_16_aligned_last_dim():
    # _division_sixteen: aligned rows suffice for a norm over the last axis alone; a norm from an earlier axis needs
    # the last dim aligned too
    over_two = _layernorm((8, 64, 49))
    over_two = OpWork(over_two.name, over_two.op_type, over_two.domain, over_two.inputs, over_two.outputs, {"axis": 1})
    assert len(conversions(over_two, P310)) == 2
    assert conversions(_layernorm((8, 64, 49)), P310) == ()            # the last axis alone: NZ taken
    aligned = _layernorm((8, 64, 48))
    aligned = OpWork(aligned.name, aligned.op_type, aligned.domain, aligned.inputs, aligned.outputs, {"axis": 1})
    assert conversions(aligned, P310) == ()


def test_a_gamma_of_rank_2_keeps_the_norm_in_nd():
    x = TensorInfo((8, 64, 384), "float16")
    gamma = TensorInfo((64, 384), "float16", is_constant=True)
    op = OpWork("ln", "LayerNormalization", "", (x, gamma, gamma), (x,), {"axis": 1})
    assert len(conversions(op, P310)) == 2
    # the residual forms read gamma third: a rank-1 gamma there is no reason to convert
    skip = OpWork("ln", "SkipLayerNormalization", "com.microsoft",
                  (x, x, TensorInfo((384,), "float16", is_constant=True)), (x,), {})
    assert conversions(skip, P310) == ()
