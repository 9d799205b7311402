"""The offline ATC pre-check (npufuse.emit.atc): the parser's key rule on released GE and head, If/Loop handling,
model-local functions, and the `atc-check` command's exit codes and formats."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from npufuse.emit.atc import keys
from npufuse.emit.atc.check_cli import atc_check
from npufuse.emit.atc.precheck import atc_problems, format_text, refused, summarize, to_json

FIXTURES = Path(__file__).parent / "fixtures"
EXAMPLES = Path(__file__).parent.parent / "examples"


def _vi(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4])


def _model(nodes: list[onnx.NodeProto], opsets: dict[str, int], inputs=("x",), outputs=("y",),
           initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [_vi(i) for i in inputs], [_vi(o) for o in outputs],
                              initializer=list(initializers))
    # No onnx.checker: the literal `ai.onnx` domain, the form released GE needs, is one it rejects.
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])


def _codes(problems) -> list[str]:
    return [p.code for p in problems]


# --- the key table -------------------------------------------------------------------------------------------

def test_key_table_lookups():
    assert keys.is_registered("", 17, "Add") and keys.is_registered("ai.onnx", 17, "Add")
    assert not keys.is_registered("", 19, "Add")  # nothing standard above 18
    assert keys.registered_versions("LayerNormalization") == (17, 18)
    assert keys.registered_versions("NPUPromptFlashAttention", "npu") == (1,)
    assert keys.registered_versions("Gelu") == () and keys.registered_domains("Gelu") == {}
    assert keys.cann_op("npu", 1, "NPURmsNorm") == "RmsNorm"
    assert keys.format_versions((11, 12, 13, 14, 15, 16, 19)) == "11-16, 19"


# --- fixtures and an npufuse-optimized model ------------------------------------------------------------------

@pytest.mark.parametrize("ge", ["released", "head"])
def test_bert_ts17_has_no_problems(ge):
    model = onnx.load(str(FIXTURES / "bert_ts17.onnx"), load_external_data=False)
    assert atc_problems(model, ge=ge) == []


def test_llama_dynamo_opset20_misses_every_key():
    model = onnx.load(str(FIXTURES / "llama_dynamo.onnx"), load_external_data=False)
    problems = atc_problems(model)
    looked_up = [n for n in model.graph.node if n.op_type not in ("Constant", "FileConstant")]
    assert _codes(problems) == ["E13010"] * len(looked_up) and problems
    assert {p.key.split("::")[1] for p in problems} == {"20"}
    assert problems[0].key == f"ai.onnx::20::{looked_up[0].op_type}"
    assert "nothing is registered above ai.onnx 18" in problems[0].fix


@pytest.fixture(scope="module")
def optimized(tmp_path_factory) -> Path:
    from npufuse.api import optimize

    out = tmp_path_factory.mktemp("atc") / "bert_tiny.npufuse.onnx"
    optimize(str(EXAMPLES / "bert_tiny.onnx"), output=out, verify=False)
    return out


def test_npufuse_optimized_model(optimized):
    model = onnx.load(str(optimized), load_external_data=False)
    assert {o.domain for o in model.opset_import} == {"", "npufuse"} and model.functions
    fused = [n for n in model.graph.node if n.domain.startswith("npufuse")]
    standard = [n for n in model.graph.node if not n.domain and n.op_type != "Constant"]
    assert fused and standard

    released = atc_problems(model, ge="released")
    counts = summarize(released)
    assert counts == {"E16005": len(standard), "E13010": len(fused), "functions-dropped": 1}
    e13010 = [p for p in released if p.code == "E13010"]
    assert {p.key.split("::", 2)[0] for p in e13010} == {"npufuse"}
    assert all("npufuse optimize --emit atc" in p.fix for p in e13010)

    head = summarize(atc_problems(model, ge="head"))
    assert "E16005" not in head and head["E13010"] == len(fused) and head["functions-dropped"] == 1


# --- the key rule on small graphs -----------------------------------------------------------------------------

def test_gelu_has_no_key_at_any_opset():
    problems = atc_problems(_model([helper.make_node("Gelu", ["x"], ["y"], name="g")], {"": 20}))
    assert _codes(problems) == ["E13010"]
    assert problems[0].key == "ai.onnx::20::Gelu" and problems[0].node == "g"
    assert "Erf/Tanh" in problems[0].fix and "NPUFastGelu" in problems[0].fix


@pytest.mark.parametrize("opset, codes", [(16, ["E13010"]), (17, []), (18, [])])
def test_layer_normalization_only_at_17_and_18(opset, codes):
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], name="ln")
    init = [numpy_helper.from_array(np.ones(4, np.float32), n) for n in ("s", "b")]
    problems = atc_problems(_model([node], {"": opset}, initializers=init))
    assert _codes(problems) == codes
    if codes:
        assert problems[0].key == "ai.onnx::16::LayerNormalization" and "17-18" in problems[0].fix


def test_constant_is_exempt_at_any_opset():
    nodes = [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones((2, 4), np.float32))),
             helper.make_node("Add", ["x", "c"], ["y"], name="add")]
    problems = atc_problems(_model(nodes, {"": 20}))
    assert [(p.code, p.op_type) for p in problems] == [("E13010", "Add")]


def _two_domain_model(add_domain: str, opsets: dict[str, int]) -> onnx.ModelProto:
    nodes = [helper.make_node("Add", ["x", "x"], ["a"], name="add", domain=add_domain),
             helper.make_node("NPURmsNorm", ["a", "gamma"], ["y", "rstd"], name="rms", domain="npu")]
    gamma = numpy_helper.from_array(np.ones(4, np.float32), "gamma")
    return _model(nodes, opsets, initializers=[gamma])


def test_literal_ai_onnx_domain_form_parses_on_released():
    model = _two_domain_model("ai.onnx", {"ai.onnx": 17, "npu": 1})
    assert atc_problems(model, ge="released") == []
    assert atc_problems(model, ge="head") == []


def test_empty_domain_with_two_imports_is_e16005_on_released_only():
    model = _two_domain_model("", {"": 17, "npu": 1})
    problems = atc_problems(model, ge="released")
    assert [(p.code, p.node) for p in problems] == [("E16005", "add")]
    assert "ai.onnx" in problems[0].fix
    assert atc_problems(model, ge="head") == []


def test_released_matches_the_domain_string_verbatim():
    # Node domain "ai.onnx", import "": released looks up "ai.onnx" and finds no import; head reads "" as ai.onnx.
    model = _two_domain_model("ai.onnx", {"": 17, "npu": 1})
    assert [(p.code, p.node) for p in atc_problems(model, ge="released")] == [("no-opset-import", "add")]
    assert atc_problems(model, ge="head") == []


def test_no_opset_import_at_all():
    model = _model([helper.make_node("Relu", ["x"], ["y"], name="r")], {})
    del model.opset_import[:]
    assert _codes(atc_problems(model, ge="released")) == ["E16005"]  # domain_version size 0 != 1
    assert _codes(atc_problems(model, ge="head")) == ["no-opset-import"]


@pytest.mark.parametrize("opset, codes", [(16, []), (17, ["E13010"])])
def test_prompt_flash_attention_in_default_domain(opset, codes):
    node = helper.make_node("NPUPromptFlashAttention", ["q", "k", "v"], ["y"], name="pfa", num_heads=2,
                            input_layout="BSH")
    problems = atc_problems(_model([node], {"": opset}, inputs=("q", "k", "v")))
    assert _codes(problems) == codes
    if codes:
        assert problems[0].key == "ai.onnx::17::NPUPromptFlashAttention" and "npu 1" in problems[0].fix


def test_repeated_and_generated_node_names():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="n"), helper.make_node("Relu", ["a"], ["b"], name="n"),
             helper.make_node("Gelu", ["b"], ["y"])]
    problems = atc_problems(_model(nodes, {"": 17}))
    assert [(p.code, p.node) for p in problems] == [("E13009", "n"), ("E13010", "Gelu_0")]


def test_model_local_function_call_is_looked_up_like_an_op():
    fn = helper.make_function("local", "MyRelu", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])],
                              [helper.make_opsetid("", 17)])
    model = _model([helper.make_node("MyRelu", ["x"], ["y"], name="call", domain="local")], {"": 17, "local": 1})
    model.functions.append(fn)
    problems = atc_problems(model, ge="head")
    assert _codes(problems) == ["functions-dropped", "E13010"]
    assert problems[1].key == "local::1::MyRelu" and "inline" in problems[1].fix


def test_weights_are_never_read(tmp_path):
    init = numpy_helper.from_array(np.ones((2, 4), np.float32), "w")
    model = _model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], {"": 17}, initializers=[init])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="m.data",
              size_threshold=0)
    (tmp_path / "m.data").unlink()  # a read of the weights would now fail
    assert atc_problems(onnx.load(str(path), load_external_data=False)) == []


# --- If, Loop ----------------------------------------------------------------------------------------------------

def _branch(name: str, nodes: list[onnx.NodeProto], out: str) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, [], [_vi(out)])


def _if(name: str, then_nodes, else_nodes, out: str, **extra) -> onnx.NodeProto:
    then_out, else_out = then_nodes[-1].output[0], else_nodes[-1].output[0]
    return helper.make_node("If", ["cond"], [out], name=name, then_branch=_branch("t", then_nodes, then_out),
                            else_branch=_branch("e", else_nodes, else_out), **extra)


def _if_model(node: onnx.NodeProto, opset: int = 17) -> onnx.ModelProto:
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    graph = helper.make_graph([node], "g", [cond, _vi("x")], [_vi("y")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_if_with_flat_branches_is_accepted():
    node = _if("if0", [helper.make_node("Relu", ["x"], ["t"])], [helper.make_node("Neg", ["x"], ["e"])], "y")
    assert atc_problems(_if_model(node)) == []


def test_if_branch_nodes_use_the_model_keys():
    node = _if("if0", [helper.make_node("Gelu", ["x"], ["t"], name="gelu")], [helper.make_node("Neg", ["x"], ["e"])],
               "y")
    problems = atc_problems(_if_model(node))
    assert [(p.code, p.graph, p.key) for p in problems] == [("E13010", "If 'if0'/then_branch", "ai.onnx::17::Gelu")]


def test_if_with_a_third_attribute_is_refused():
    node = _if("if0", [helper.make_node("Relu", ["x"], ["t"])], [helper.make_node("Neg", ["x"], ["e"])], "y",
               note="extra")
    problems = atc_problems(_if_model(node))
    assert _codes(problems) == ["if-attributes"] and "note" in problems[0].fix


def test_nested_if_reading_two_levels_up_is_a_warning():
    inner = _if("inner", [helper.make_node("Relu", ["x"], ["t2"])], [helper.make_node("Neg", ["x"], ["e2"])], "t")
    outer = _if("outer", [inner], [helper.make_node("Neg", ["x"], ["e"])], "y")
    problems = atc_problems(_if_model(outer))
    # `x` is read by the else branch's direct node, so the adapter passes it to both branches: no problem.
    assert problems == []
    outer = _if("outer", [inner], [helper.make_node("Neg", ["cond"], ["e"])], "y")
    problems = atc_problems(_if_model(outer))
    assert [(p.code, p.node, p.graph, p.severity) for p in problems] == [
        ("nested-if-capture", "inner", "If 'outer'/then_branch", "warning")]
    assert "'x'" in problems[0].message and not refused(problems)


def test_loop_is_unsupported_and_its_body_not_parsed():
    body = helper.make_graph([helper.make_node("Gelu", ["v"], ["v2"])], "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                              helper.make_tensor_value_info("c", TensorProto.BOOL, []), _vi("v")],
                             [helper.make_tensor_value_info("c", TensorProto.BOOL, []), _vi("v2")])
    node = helper.make_node("Loop", ["", "cond", "x"], ["y"], name="loop", body=body)
    problems = atc_problems(_if_model(node))
    assert [(p.code, p.node, p.key) for p in problems] == [("unsupported-subgraph-op", "loop", "ai.onnx::17::Loop")]
    assert refused(problems)


# --- renderers and the command --------------------------------------------------------------------------------

def test_text_and_json_renderers():
    problems = atc_problems(_model([helper.make_node("Gelu", ["x"], ["y"], name="g\nx")], {"": 20}))
    text = format_text(problems, "m.onnx")
    lines = text.splitlines()
    assert len(lines) == 2 and "E13010 ai.onnx::20::Gelu" in lines[0] and "g\\x0ax" in lines[0]
    assert "1 problem(s) (1 E13010)" in lines[1]
    doc = to_json(problems)
    assert doc["refused"] is True and doc["counts"] == {"E13010": 1}
    assert doc["problems"][0]["key"] == "ai.onnx::20::Gelu" and doc["problems"][0]["node"] == "g\nx"
    assert "no problems" in format_text([], "m.onnx")


def test_cli_exit_codes_and_json(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(atc_check, [str(FIXTURES / "bert_ts17.onnx")])
    assert ok.exit_code == 0 and "no problems" in ok.output

    bad = runner.invoke(atc_check, [str(FIXTURES / "llama_dynamo.onnx"), "--format", "json"])
    assert bad.exit_code == 1
    doc = json.loads(bad.output)
    assert doc["refused"] is True and doc["ge"] == "released" and set(doc["counts"]) == {"E13010"}

    out = tmp_path / "report.txt"
    written = runner.invoke(atc_check, [str(FIXTURES / "llama_dynamo.onnx"), "-o", str(out)])
    assert written.exit_code == 1 and "E13010" in out.read_text() and len(written.output.splitlines()) == 1

    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\xff\xfe not a model")
    for args in ([str(tmp_path / "missing.onnx")], [str(junk)], [str(tmp_path)],
                 [str(FIXTURES / "bert_ts17.onnx"), "--ge", "newest"]):
        result = runner.invoke(atc_check, args)
        assert result.exit_code == 2, (args, result.output)
        assert "npufuse: error:" in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1


def test_cli_head_lifts_e16005(optimized):
    runner = CliRunner()
    released = json.loads(runner.invoke(atc_check, [str(optimized), "--format", "json"]).output)
    head = json.loads(runner.invoke(atc_check, [str(optimized), "--format", "json", "--ge", "head"]).output)
    assert "E16005" in released["counts"] and "E16005" not in head["counts"] and head["refused"] is True
