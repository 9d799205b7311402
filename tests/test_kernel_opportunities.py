"""Kernel opportunities (issue 24): candidates refused only because no shipped kernel runs them, priced as if one
did, in every report format; kernel briefs with test vectors from the model's activations; the user's own kernels
(`--kernels FILE`) fused, verified, and written as their ATC plugin's node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper, numpy_helper

import npufuse
from npufuse.cli import main
from npufuse.emit.atc.precheck import atc_problems
from npufuse.errors import InputError
from npufuse.patterns import fused_op_defs

FIXTURES = Path(__file__).parent / "fixtures"
BERT_MLM = FIXTURES / "bert_mlm_ts17.onnx"
MLM_CHAIN = "FusedMatMul[bias,gelu,layernorm] float32"
KERNELS_TOML = """
[[kernel]]
name = "MatMulGeluLayerNorm"
implements = "FusedMatMul"
epilogue = ["bias", "gelu", "layernorm"]
chips = ["ascend910b"]
"""


def _opportunities(doc) -> dict[str, dict]:
    return {o["signature"]: o for o in doc["opportunities"]["kernels"]}


@pytest.fixture(scope="module")
def mlm_report():
    return npufuse.report(str(BERT_MLM), target="Ascend910B2")


@pytest.mark.parametrize("file", ["bert_mlm_ts17.onnx", "bert_mlm_dynamo.onnx"])
def test_bert_mlm_head_is_an_opportunity_with_a_positive_gain(file):
    doc = npufuse.report(str(FIXTURES / file), target="Ascend910B2", verify=False)
    opp = _opportunities(doc)[MLM_CHAIN]
    assert opp["gain_us"] > 0 and opp["count"] == 1
    r = opp["regions"][0]
    assert r["t_fused_us"] < r["t_unfused_us"] and r["tile"]
    assert "row norm" in opp["unsupported"]
    # the same candidate in the report's list: refused, with the reason the opportunity quotes
    cand = doc["candidates"][r["candidate"]]
    assert cand["status"] == "skipped-by-cost" and cand["decision"]["unsupported"] == opp["unsupported"]


def _wide_row_model(width: int) -> onnx.ModelProto:
    """x [1, 4, 64] -> MatMul [64, width] -> + bias -> LayerNorm over `width`."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((64, width)) * 0.05).astype(np.float32), "W"),
             numpy_helper.from_array(np.zeros(width, np.float32), "b"),
             numpy_helper.from_array(np.ones(width, np.float32), "g"),
             numpy_helper.from_array(np.zeros(width, np.float32), "be")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"], name="mm"),
             helper.make_node("Add", ["mm", "b"], ["ab"], name="bias"),
             helper.make_node("LayerNormalization", ["ab", "g", "be"], ["y"], name="ln", epsilon=1e-5)]
    g = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("x", 1, [1, 4, 64])],
                          [helper.make_tensor_value_info("y", 1, [1, 4, width])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_a_row_that_cannot_fit_ub_is_no_opportunity_and_says_why():
    small = npufuse.report(_wide_row_model(1024), target="Ascend910B2", verify=False)
    assert "FusedMatMul[bias,layernorm] float32" in _opportunities(small)
    wide = npufuse.report(_wide_row_model(131072), target="Ascend910B2", verify=False)
    assert wide["opportunities"]["kernels"] == []
    [left] = wide["opportunities"]["left_out"]
    assert left["why_not"].startswith("would not fit:") and "UB" in left["why_not"]


def test_qk_norm_matmul_rmsnorm_and_small_head_rotary_pair_appear():
    doc = npufuse.report(str(FIXTURES / "olmo2_ts17.onnx"), target="Ascend910B2", verify=False)
    opps = _opportunities(doc)
    assert opps["FusedMatMul[rmsnorm] float32"]["count"] == 8       # q_norm, k_norm, post-attn, post-MLP x 2
    pair = opps["RotaryEmbeddingPair[half] float32"]
    assert "head dim of 64 or 128 (this region: 16)" in pair["unsupported"]


@pytest.mark.parametrize("fmt, marker", [("text", "kernel opportunities: 1 kernel"),
                                         ("markdown", "### Kernel opportunities (1)"),
                                         ("html", "<section id='opportunities'>")])
def test_every_format_lists_the_opportunities(mlm_report, fmt, marker):
    text = mlm_report.render(fmt)
    assert marker in text and "layernorm" in text[text.find(marker):] and "9.06" in text[text.find(marker):]


# ---- kernel briefs -------------------------------------------------------------------------------------------

def test_brief_vectors_reproduce_the_reference_bit_for_bit_and_times_equal_the_report(tmp_path):
    out = tmp_path / "briefs"
    doc = npufuse.report(str(BERT_MLM), target="Ascend910B2", kernel_briefs=str(out))
    [folder] = sorted(out.iterdir())
    brief = json.loads((folder / "brief.json").read_text())
    opp = _opportunities(doc)[MLM_CHAIN]
    assert brief["signature"] == MLM_CHAIN and brief["gain_us"] == opp["gain_us"]
    for mine, theirs in zip(brief["regions"], opp["regions"]):
        assert mine["modeled"]["t_fused_us"] == theirs["t_fused_us"]
        assert mine["modeled"]["t_unfused_us"] == theirs["t_unfused_us"]
    region = brief["regions"][0]
    assert region["fused_node"]["attributes"]["epilogue"] == ["bias", "gelu", "layernorm"]
    vec = region["vectors"]
    assert vec["written"] and vec["reference_vs_model_max_abs"] < 1e-4
    op = fused_op_defs()[("npufuse", "FusedMatMul")]
    vdir = folder / vec["folder"]
    by_slot = {int(f.name[:2]): np.load(f) for f in sorted((vdir / "inputs").glob("*.npy"))}
    inputs = [by_slot.get(i) for i in range(len(region["fused_node"]["inputs"]))]
    assert inputs[0].shape[-1] == 32 and not np.all(inputs[0] == 0)       # a real activation, not a placeholder
    got = op.reference(inputs, region["fused_node"]["attributes"])
    want = [np.load(f) for f in sorted((vdir / "outputs").glob("*.npy"))]
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))
    # the brief's own script says the same
    run = subprocess.run([sys.executable, "check.py"], cwd=folder, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "bit for bit" in run.stdout
    assert "## The NumPy reference kernel" in (folder / "README.md").read_text()


def test_briefs_need_a_new_folder(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(InputError, match="new or empty folder"):
        npufuse.report(str(BERT_MLM), target="Ascend910B2", kernel_briefs=str(tmp_path / "full"), verify=False)
    assert (tmp_path / "full" / "x").read_text() == "keep"


# ---- the user's kernels --------------------------------------------------------------------------------------

def test_a_declared_kernel_is_fused_and_verified(tmp_path):
    k = tmp_path / "kernels.toml"
    k.write_text(KERNELS_TOML)
    r = npufuse.optimize(str(BERT_MLM), output=str(tmp_path / "o.onnx"), kernels=str(k),
                         report=str(tmp_path / "r.json"))
    assert r.ok
    rep = json.loads((tmp_path / "r.json").read_text())
    fused = [f for f in rep["fusions"] if f["kind"] == "FusedMatMul[bias,gelu,layernorm]"]
    assert [f["status"] for f in fused] == ["applied"]
    assert fused[0]["ascend_kernel"]["op"] == "MatMulGeluLayerNorm" and fused[0]["ascend_kernel"]["user_kernel"]
    assert fused[0]["check"]["ok"]
    # without the file the same region stays an opportunity
    assert MLM_CHAIN in _opportunities(npufuse.report(str(BERT_MLM), target="Ascend910B2", verify=False))
    # a kernel for another chip does not apply
    k.write_text(KERNELS_TOML.replace('"ascend910b"', '"ascend310p"'))
    r = npufuse.optimize(str(BERT_MLM), output=str(tmp_path / "o2.onnx"), kernels=str(k), verify=False)
    assert "FusedMatMul[bias,gelu,layernorm]" not in r.fused


def test_a_measured_time_replaces_the_modeled_one(tmp_path):
    base = npufuse.report(str(BERT_MLM), target="Ascend910B2", verify=False)
    shape = _opportunities(base)[MLM_CHAIN]["regions"][0]["values"]
    first = next(iter(shape.values()))
    priced = first.get("priced_shape") or first["shape"]
    k = tmp_path / "kernels.toml"
    k.write_text(KERNELS_TOML + f"[[kernel.measured]]\nshape = {json.dumps(priced)}\ntime_us = 1000.0\n")
    doc = npufuse.report(str(BERT_MLM), target="Ascend910B2", verify=False, kernels=str(k))
    cand = next(c for c in doc["candidates"] if c["kind"] == "FusedMatMul[bias,gelu,layernorm]")
    assert cand["decision"]["t_fused_us"] == 1000.0 and cand["status"] == "skipped-by-cost"   # too slow: not fused


@pytest.mark.parametrize("body, words", [
    ('name = "A"\nimplements = "FusedMatMul"\nchips = ["ascend910b"]\ncolour = "red"', "unknown field 'colour'"),
    ('name = "A"\nimplements = "Softmax"\nchips = ["ascend910b"]', "no npufuse fused op"),
    ('name = "A"\nimplements = "FusedMatMul"\nchips = ["ascend910b"]\nmax_last_dim = 8\nlast_dim_multiple = 16',
     "no shape satisfies both"),
    ('name = "A"\nimplements = "FusedMatMul"\nepilogue = ["bias", "softmax"]\nchips = ["ascend910b"]',
     "epilogue step 'softmax'"),
    ('name = "A"\nimplements = "FusedMatMul"\nchips = []', "needs chips"),
])
def test_a_bad_kernels_file_is_one_line_and_exit_2(tmp_path, body, words):
    k = tmp_path / "k.toml"
    k.write_text(f"[[kernel]]\n{body}\n")
    res = CliRunner().invoke(main, ["optimize", str(BERT_MLM), "--kernels", str(k), "-o", str(tmp_path / "o.onnx")])
    assert res.exit_code == 2
    assert words in res.output and len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output
    assert not (tmp_path / "o.onnx").exists()


def test_the_atc_form_writes_the_users_plugin_node(tmp_path):
    k = tmp_path / "kernels.toml"
    k.write_text(KERNELS_TOML + '[kernel.atc]\nop_type = "NPUMatMulGeluLayerNorm"\n'
                                'attributes = { epsilon = "epsilon" }\n')
    out = tmp_path / "m.atc.onnx"
    r = npufuse.optimize(str(BERT_MLM), output=str(out), kernels=str(k), emit="atc")
    assert r.atc_check is not None and r.atc_check.ok          # verified with the reference kernel of FusedMatMul
    model = onnx.load(str(out))
    [node] = [n for n in model.graph.node if n.op_type == "NPUMatMulGeluLayerNorm"]
    assert node.domain == "npu" and [a.name for a in node.attribute] == ["epsilon"]
    assert r.report["atc"]["counts"]["plugin:MatMulGeluLayerNorm"] == 1
    # ATC's own table has no such key: the user's plugin registers it, and atc-check takes the file to know it
    assert any(p.code == "E13010" for p in atc_problems(model, "released"))
    res = CliRunner().invoke(main, ["atc-check", str(out), "--kernels", str(k)])
    assert res.exit_code == 0, res.output
