"""`--emit atc`: real exports come out in the form ATC's parser reads, reach the fused kernels through their
plugins where the plugin computes what the model does, stay standard ops (with a reason) where it does not, and
are verified against the original with reference kernels of the CANN ops."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

import npufuse
from npufuse.cli import main
from npufuse.emit.atc import reference_kernels
from npufuse.emit.atc.precheck import atc_problems
from npufuse.emit.atc.regions import Namer, Values, map_rms_norm
from npufuse.errors import DriftError, InputError

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).parent.parent


def _plugins(model: onnx.ModelProto) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in model.graph.node:
        if n.domain == "npu":
            out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def _assert_atc_readable(model: onnx.ModelProto) -> None:
    assert not model.functions
    assert all(n.domain != "npufuse" for n in model.graph.node)
    defaults = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    assert len(defaults) == 1 and 14 <= defaults[0].version <= 18
    assert [p for p in atc_problems(model, "released") if p.severity == "error"] == []


def test_fp16_decoder_reaches_flash_attention_rmsnorm_and_rotary(tmp_path):
    out = tmp_path / "m.atc.onnx"
    r = npufuse.optimize(str(FIXTURES / "mistral_fp16_ts17.onnx"), output=str(out), emit="atc",
                         report=str(tmp_path / "r.json"))
    model = onnx.load(str(out))
    _assert_atc_readable(model)
    got = _plugins(model)
    assert got.get("NPUPromptFlashAttention") == 2 and got.get("NPURmsNorm") == 1
    assert got.get("NPUAddRmsNorm") == 4 and got.get("NPURotaryMul") == 4
    # released GE: the literal ai.onnx import beside npu, every standard node's domain spelled out
    assert {o.domain for o in model.opset_import} == {"ai.onnx", "npu"}
    assert all(n.domain in ("ai.onnx", "npu") for n in model.graph.node)
    pfa = next(n for n in model.graph.node if n.op_type == "NPUPromptFlashAttention")
    attrs = {a.name: a for a in pfa.attribute}
    for name in ("num_heads", "input_layout", "scale_value", "pre_tokens", "next_tokens", "num_key_value_heads",
                 "sparse_mode", "inner_precise"):
        assert name in attrs, name
    assert attrs["scale_value"].type == onnx.AttributeProto.FLOAT
    assert attrs["pre_tokens"].i == 2147483647
    assert r.atc_check is not None and r.atc_check.ok
    assert r.report["atc"]["counts"]["plugin:PromptFlashAttention"] == 2


def test_a_wrong_plugin_kernel_is_drift_and_nothing_is_written(tmp_path, monkeypatch):
    """The verification can fail: a PromptFlashAttention kernel that forgets the scale is caught."""
    real = reference_kernels.KERNELS["NPUPromptFlashAttention"]

    def unscaled(inputs, attrs):
        return real(inputs, {**attrs, "scale_value": 1.0})

    monkeypatch.setitem(reference_kernels.KERNELS, "NPUPromptFlashAttention", unscaled)
    out = tmp_path / "m.atc.onnx"
    with pytest.raises(DriftError, match="ATC form drifts"):
        npufuse.optimize(str(FIXTURES / "mistral_fp16_ts17.onnx"), output=str(out), emit="atc")
    assert not out.exists()


def test_opset_20_dynamo_export_converts_down(tmp_path):
    src = FIXTURES / "llama_dynamo.onnx"
    assert [p for p in atc_problems(onnx.load(str(src), load_external_data=False)) if p.severity == "error"]
    out = tmp_path / "llama.atc.onnx"
    r = npufuse.optimize(str(src), output=str(out), emit="atc")
    model = onnx.load(str(out))
    _assert_atc_readable(model)
    assert r.atc_check.ok
    assert _plugins(model).get("NPURmsNorm", 0) >= 1


def test_fp32_attention_is_the_plugin_where_atc_lowers_it_and_stays_standard_where_it_keeps_fp32(tmp_path):
    """PromptFlashAttention on 910B takes fp16/bf16. Under ATC's default precision mode (force_fp16) and under
    allow_fp32_to_fp16 an fp32 Cube kernel runs in fp16, so an fp32 BERT's attention becomes the plugin; under
    must_keep_origin_dtype it would need an fp32 kernel there is none of: standard ops, and the reason says why."""
    for mode in ("force_fp16", "allow_fp32_to_fp16"):
        out = tmp_path / f"bert_{mode}.atc.onnx"
        r = npufuse.optimize(str(ROOT / "examples" / "bert_tiny.onnx"), output=str(out), emit="atc",
                             precision_mode=mode)
        model = onnx.load(str(out))
        _assert_atc_readable(model)
        assert _plugins(model).get("NPUPromptFlashAttention") == 2 and r.atc_check.ok
    out = tmp_path / "bert.atc.onnx"
    r = npufuse.optimize(str(ROOT / "examples" / "bert_tiny.onnx"), output=str(out), emit="atc",
                         precision_mode="must_keep_origin_dtype")
    model = onnx.load(str(out))
    _assert_atc_readable(model)
    assert [o.domain for o in model.opset_import] == [""]   # no plugin node: one plain import
    onnx.checker.check_model(model)
    regions = [reg for reg in r.report["atc"]["regions"] if reg["op_type"] == "FusedAttention"]
    assert {reg["reason"] for reg in regions} == {"plugin-constraint"}
    assert all("not float32" in reg["detail"] for reg in regions)
    assert r.atc_check.ok


def _rms_node(eps: float) -> onnx.NodeProto:
    return helper.make_node("RMSNorm", ["x", "g"], ["y"], name="rms", domain="npufuse", epsilon=eps, stash_type=1)


def test_rmsnorm_with_another_epsilon_is_not_the_plugin():
    values = Values({"x": (2, 8, 64), "g": (64,)}, {"x": TensorProto.FLOAT16, "g": TensorProto.FLOAT16}, 17,
                    "ascend910b")
    kept = map_rms_norm(_rms_node(1e-6), values, Namer(set()))
    assert kept.nodes[-1].op_type == "NPURmsNorm"
    refused = map_rms_norm(_rms_node(1e-5), values, Namer(set()))
    assert refused.reason == "rmsnorm-epsilon"
    # and that refusal matters: the kernel's fixed 1e-6 differs from 1e-5 on a small-variance row
    x = (np.random.default_rng(0).standard_normal((1, 64)) * 1e-3).astype(np.float32)
    g = np.ones(64, np.float32)
    fixed = reference_kernels.KERNELS["NPURmsNorm"]([x, g], {})[0]
    model_eps = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5)
    assert np.max(np.abs(fixed - model_eps)) > 1e-2


def test_a_loop_is_refused_in_one_line_and_nothing_written(tmp_path):
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["v_in", "one"], ["v_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [2])],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])
    g = helper.make_graph(
        [helper.make_node("Loop", ["n", "c", "x"], ["y"], body=body, name="the_loop")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [helper.make_tensor("n", TensorProto.INT64, [], [3]), helper.make_tensor("c", TensorProto.BOOL, [], [True])])
    src = tmp_path / "loop.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    before = src.read_bytes()
    out = tmp_path / "loop.atc.onnx"
    with pytest.raises(InputError) as exc:
        npufuse.optimize(str(src), output=str(out), emit="atc")
    line = str(exc.value)
    assert "\n" not in line and "the_loop" in line and "atc-check" in line
    assert not out.exists() and src.read_bytes() == before
    res = CliRunner().invoke(main, ["optimize", str(src), "-o", str(out), "--emit", "atc"])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_the_command_writes_and_atc_check_passes_it(tmp_path):
    out = tmp_path / "m.atc.onnx"
    res = CliRunner().invoke(main, ["optimize", str(FIXTURES / "qwen2_fp16_ts17.onnx"), "-o", str(out),
                                    "--emit", "atc", "-q"])
    assert res.exit_code == 0, res.output
    checked = CliRunner().invoke(main, ["atc-check", str(out)])
    assert checked.exit_code == 0, checked.output
    original = CliRunner().invoke(main, ["atc-check", str(FIXTURES / "llama_dynamo.onnx")])
    assert original.exit_code == 1 and "E13010" in original.output


# ---- decode steps: IncreFlashAttention where its plugin can say what the model computes --------------------------

def test_mqa_fp16_decode_step_reaches_incre_flash_attention(tmp_path):
    """A Llama decode step with one KV head in fp16 (tools/make_kvcache_fixture.py): the one form the
    NPUIncreFlashAttention plugin computes (it leaves num_key_value_heads at the op default 1)."""
    out = tmp_path / "m.atc.onnx"
    r = npufuse.optimize(str(FIXTURES / "kvcache" / "llama_mqa_fp16_decode_ts17.onnx"), output=str(out), emit="atc",
                         dims={"batch": 2, "past_sequence": 5})
    model = onnx.load(str(out))
    _assert_atc_readable(model)
    assert _plugins(model).get("NPUIncreFlashAttention") == 2 and "NPUPromptFlashAttention" not in _plugins(model)
    ifa = next(n for n in model.graph.node if n.op_type == "NPUIncreFlashAttention")
    assert len(ifa.input) == 6 and all(ifa.input)          # q, k, v, pse, mask, lengths: all connected
    attrs = {a.name: helper.get_attribute_value(a) for a in ifa.attribute}
    assert attrs["num_heads"] == 4 and attrs["scale_value"] == pytest.approx(0.25)
    assert "num_key_value_heads" not in attrs              # the plugin would ignore it; one kv head is its default
    assert r.atc_check is not None and r.atc_check.ok
    regions = [g for g in r.report["atc"]["regions"] if g["op_type"] == "FusedAttention"]
    assert {(g["plugin"], g["kernel"]) for g in regions} == {("NPUIncreFlashAttention", "IncreFlashAttention")}


def _decode_attention(kv_heads: int) -> tuple[onnx.NodeProto, Values]:
    node = helper.make_node("FusedAttention", ["q", "k", "v"], ["o"], name="attn", domain="npufuse", num_heads=4,
                            kv_num_heads=kv_heads, scale=0.25, causal=1, mask_order="where")
    shapes = {"q": (2, 4, 1, 16), "k": (2, kv_heads, "total", 16), "v": (2, kv_heads, "total", 16)}
    return node, Values(shapes, {v: TensorProto.FLOAT16 for v in shapes}, 17, "ascend910b")


def test_gqa_decode_step_stays_on_prompt_flash_attention():
    """Two KV heads: IncreFlashAttention's plugin would compute one; PromptFlashAttention with S = 1 says two."""
    from npufuse.emit.atc.regions import PluginRegion, map_region
    node, values = _decode_attention(2)
    got = map_region(node, values, Namer(set()))
    assert isinstance(got, PluginRegion) and got.kernel == "PromptFlashAttention"
    pfa = got.nodes[-1]
    assert {a.name: helper.get_attribute_value(a) for a in pfa.attribute}["num_key_value_heads"] == 2
    node, values = _decode_attention(1)
    got = map_region(node, values, Namer(set()))
    assert isinstance(got, PluginRegion) and got.kernel == "IncreFlashAttention"
    # a causal single query row sees every key: no mask is written, even over a symbolic key length
    assert got.nodes[-1].input[4] in {t.name for t in got.initializers if list(t.dims) == [0]}


def test_unet_group_norm_silu_reaches_its_plugin(tmp_path):
    out = tmp_path / "m.atc.onnx"
    r = npufuse.optimize(str(FIXTURES / "unet_ts17.onnx"), output=str(out), emit="atc")
    model = onnx.load(str(out))
    _assert_atc_readable(model)
    assert _plugins(model).get("NPUGroupNormSilu") == 17
    assert r.report["atc"]["counts"].get("standard:groupnorm-no-silu") == 4
    assert r.atc_check is not None and r.atc_check.ok


@pytest.mark.parametrize("fmt, marker", [("text", "ATC form (literal-ai.onnx+npu"), ("markdown", "### ATC form"),
                                         ("html", "<section id='atc'>")])
def test_report_shows_what_each_region_becomes_in_the_atc_form(fmt, marker):
    doc = npufuse.report(str(FIXTURES / "mistral_fp16_ts17.onnx"), emit="atc")
    regions = doc["atc"]["regions"]
    assert {r["kernel"] for r in regions if r["plugin"]} == {"PromptFlashAttention", "RmsNorm", "AddRmsNorm",
                                                             "RotaryMul"}
    assert {r["reason"] for r in regions if not r["plugin"]} == {"no-onnx-plugin"}   # the GatedMLPs
    text = doc.render(fmt)
    assert marker in text and "NPUPromptFlashAttention" in text and "no-onnx-plugin" in text
    assert "atc" not in npufuse.report(str(FIXTURES / "mistral_fp16_ts17.onnx"))   # only when asked for


def _l2_normalized(op: str, opset: int) -> onnx.ModelProto:
    """x / (Reduce{L2,SumSquare}(x over H, W) + eps): ConvNeXt-V2's GRN norm, as the dynamo exporter writes it at
    opset 18 (axes an input)."""
    nodes = [helper.make_node(op, ["x", "axes"], ["r"], keepdims=1, name="the_norm"),
             helper.make_node("Add", ["r", "eps"], ["d"]), helper.make_node("Div", ["x", "d"], ["y"])]
    g = helper.make_graph(nodes, "grn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 3, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 3, 3])],
                          [helper.make_tensor("axes", TensorProto.INT64, [2], [2, 3]),
                           helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-6])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_an_op_atc_registers_below_the_models_opset_only_moves_the_form_down(tmp_path):
    # ATC has keys for ReduceL2 at ai.onnx 8..17, not 18: the form of an opset-18 export goes to 17, and verifies
    src = tmp_path / "grn.onnx"
    onnx.save(_l2_normalized("ReduceL2", 18), str(src))
    assert [p.node for p in atc_problems(onnx.load(str(src))) if p.severity == "error"] == ["the_norm"]
    out = tmp_path / "grn.atc.onnx"
    r = npufuse.optimize(str(src), output=str(out), emit="atc", verify=True)
    model = onnx.load(str(out))
    _assert_atc_readable(model)
    assert r.atc.opset == 17 and r.atc_check.ok
    assert [n.op_type for n in model.graph.node if n.op_type.startswith("Reduce")] == ["ReduceL2"]
    assert sorted(a.name for a in model.graph.node[0].attribute) == ["axes", "keepdims"]   # opset 17's form


def test_a_model_atc_reads_at_its_own_opset_keeps_it(tmp_path):
    # near miss: ReduceSumSquare has a key at 18, so the same norm with it stays at the export's opset
    src = tmp_path / "grn_ss.onnx"
    onnx.save(_l2_normalized("ReduceSumSquare", 18), str(src))
    r = npufuse.optimize(str(src), output=str(tmp_path / "o.onnx"), emit="atc")
    assert r.atc.opset == 18 and r.atc_check.ok


def test_an_onnxruntime_contrib_op_is_refused_for_what_it_is(tmp_path):
    # the input imports com.microsoft and uses its FastGelu: ATC has no plugin for that key, and the refusal says so
    # (not that the domain has no import, which the form used to drop)
    g = helper.make_graph([helper.make_node("FastGelu", ["x"], ["y"], domain="com.microsoft", name="ort_gelu")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    src = tmp_path / "ort.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]),
              str(src))
    with pytest.raises(InputError) as exc:
        npufuse.optimize(str(src), output=str(tmp_path / "o.onnx"), emit="atc", verify=False)
    line = str(exc.value)
    assert "ort_gelu" in line and "E13010" in line and "no-opset-import" not in line, line


def test_fused_regions_inside_if_branches_are_counted_as_standard_ops(tmp_path):
    # optimum's merged decoder holds its decoder in an If's branches: those regions are written back as standard ops
    # (no plugin node in a subgraph) and the form's summary counts them
    r = npufuse.optimize(str(FIXTURES / "optimum" / "whisper_decoder_merged.onnx"), output=str(tmp_path / "w.onnx"),
                         emit="atc", target="Ascend310P3", verify=False)
    inside = [x for x in r.atc.regions if x.reason == "in-subgraph"]
    assert inside and all(x.plugin is None for x in inside)
    assert f"{len([x for x in r.atc.regions if not x.plugin])} fused regions" in r.atc.summary_line()
    assert not [n for g in [onnx.load(str(tmp_path / "w.onnx")).graph] for n in g.node if n.domain == "npufuse"]
