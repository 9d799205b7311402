"""ATC's fusion switch file: `--fusion-switch FILE` (CANN's JSON and `PassName:off` line forms, CANN pass names and
npufuse pattern names) and `optimize --write-fusion-switch FILE` (npufuse/emit/fusion_switch.py, docs/fusion-switch.md)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import onnx
import pytest

from npufuse.errors import InputError
from npufuse.fusion.engine import APPLIED, ROLLED_BACK, SKIPPED_COST, FusionRecord, OptimizeResult
from npufuse.ir.candidates import Match, Refusal
from npufuse.emit.fusion_switch import (
    SECTIONS,
    cann_passes,
    pattern_names,
    read_fusion_switch,
    select_patterns,
    switch_for_atc,
)

REPO = Path(__file__).resolve().parent.parent
BERT17 = REPO / "tests" / "fixtures" / "bert_ts17.onnx"
BERT14 = REPO / "tests" / "fixtures" / "bert_ts14.onnx"
ALL = set(pattern_names())


def write(tmp_path: Path, text: str, name: str = "fusion_switch.cfg") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def switch_json(graph: dict | None = None, ub: dict | None = None) -> str:
    sw = {}
    if graph is not None:
        sw["GraphFusion"] = graph
    if ub is not None:
        sw["UBFusion"] = ub
    return json.dumps({"Switch": sw}, indent=4)


# ---- reading ------------------------------------------------------------------------------------------------

def test_json_form_with_cann_names(tmp_path: Path) -> None:
    p = write(tmp_path, switch_json({"ALL": "on", "ConvBatchnormFusionPass": "off", "GeluFusionPass": "off"},
                                    {"ATbeMatmulElemwiseFusionPass": "off"}), "sw.json")
    sw = read_fusion_switch(p)
    assert sw.enabled == ALL - {"conv_bn_act", "gelu", "matmul_epilogue"}
    assert [(e.name, e.on) for e in sw.entries] == [("ALL", True), ("ConvBatchnormFusionPass", False),
                                                     ("GeluFusionPass", False), ("ATbeMatmulElemwiseFusionPass", False)]


def test_line_form_with_comments_blank_lines_and_npufuse_names(tmp_path: Path) -> None:
    p = write(tmp_path, "# switched off while debugging accuracy\n\nLayerNormFusionPass:off\n"
                        "  add_layernorm : off   # npufuse's own name\nFlashAttentionFusionPass:on\n")
    sw = read_fusion_switch(p)
    assert sw.enabled == ALL - {"layernorm", "add_layernorm"}
    assert [e.line for e in sw.entries] == [3, 4, 5]


def test_all_off_keeps_only_what_is_turned_on(tmp_path: Path) -> None:
    # CANN's own example: ALL off in both sections, one pass on in each
    p = write(tmp_path, switch_json({"ALL": "off", "FlashAttentionFusionPass": "on"},
                                    {"ALL": "off", "AddLayerNormV3FusionPass": "on"}), "sw.json")
    assert read_fusion_switch(p).enabled == {"attention", "add_layernorm"}
    lines = write(tmp_path, "ALL:off\ngelu:on\n", "lines.cfg")
    assert read_fusion_switch(lines).enabled == {"gelu"}


def test_all_off_alone_turns_every_pattern_off(tmp_path: Path) -> None:
    p = write(tmp_path, switch_json({"ALL": "off"}, {"ALL": "off"}), "sw.json")
    assert read_fusion_switch(p).enabled == frozenset()
    assert select_patterns(p) == []


def test_a_pass_mapping_to_several_passes_and_off_wins_over_on(tmp_path: Path) -> None:
    # AConv2dMulFusion and ConvBatchnormFusionPass both map to conv_bn_act: where they disagree, off wins
    p = write(tmp_path, "AConv2dMulFusion:on\nConvBatchnormFusionPass:off\n")
    assert "conv_bn_act" not in read_fusion_switch(p).enabled
    # MatMulBiasAddFusionPass (graph) and the UB MatMul+elementwise pass are one npufuse family
    p = write(tmp_path, "TbeBatchMatmulElementWiseFusionPass:off\n")
    assert read_fusion_switch(p).enabled == ALL - {"matmul_epilogue"}


def test_a_cann_pass_without_counterpart_is_accepted_and_changes_nothing(tmp_path: Path) -> None:
    # users' ATC files carry the quantization passes CANN asks them to switch off, and SoftmaxFusionPass
    p = write(tmp_path, "RequantFusionPass:off\nTbeConvDequantQuantFusionPass:off\nSoftmaxFusionPass:off\n")
    assert read_fusion_switch(p).enabled == ALL


def test_the_table_maps_only_onto_real_patterns() -> None:
    table = cann_passes()
    assert len(table) >= 20
    for cp in table.values():
        assert cp.section in SECTIONS, cp
        assert set(cp.patterns) <= ALL, cp
        assert cp.source.strip(), cp
        assert cp.written in ("done", "folded", "on", "-") and (cp.written == "-") == (cp.patterns == ()), cp
    # the names the issue asks for, each mapped where npufuse has the family
    assert table["ConvBatchnormFusionPass"].patterns == ("conv_bn_act",)
    assert table["LayerNormFusionPass"].patterns == ("layernorm",)
    assert table["MatMulBiasAddFusionPass"].patterns == ("matmul_epilogue",)
    assert table["SoftmaxFusionPass"].patterns == ()


def test_the_wheel_carries_the_table() -> None:
    try:
        import tomllib
    except ModuleNotFoundError:   # Python 3.10
        import tomli as tomllib
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "fusion_switch.tsv" in data["npufuse.emit"]
    assert (REPO / "npufuse" / "emit" / "fusion_switch.tsv").is_file()


def test_every_cann_pass_of_the_table_is_documented() -> None:
    doc = (REPO / "docs" / "fusion-switch.md").read_text(encoding="utf-8")
    missing = [name for name in cann_passes() if f"`{name}`" not in doc]
    assert missing == []


@pytest.mark.parametrize("text,name,where,what", [
    ("LayerNormFusionPass:off\nNoSuchFusionPass:off\n", "sw.cfg", ":2:", "unknown fusion pass or pattern 'NoSuchFusionPass'"),
    ("LayerNormFusionPass:off\nLayerNormFusionPass\n", "sw.cfg", ":2:", "expected PassName:on or PassName:off"),
    ("LayerNormFusionPass:disabled\n", "sw.cfg", ":1:", "value 'disabled' is neither"),
    ("LayerNormFusionPass:OFF\n", "sw.cfg", ":1:", "value 'OFF' is neither"),
    ('{\n "Switch": {\n  "GraphFusion": {"GeluFusionPass": "off",}\n }\n}\n', "sw.json", ":3:", "malformed JSON"),
    ('{"Switch": {\n "GraphFusion": {\n  "GeluFusionPass": false\n }}}\n', "sw.json", ":3:", "value False is neither"),
    ('{"Switch": {\n "VectorFusion": {"GeluFusionPass": "off"}}}\n', "sw.json", ":2:", "unknown section 'VectorFusion'"),
    ('{"GraphFusion": {"GeluFusionPass": "off"}}\n', "sw.json", ":1:", 'expected one top-level key "Switch"'),
    ('{"Switch": {"GraphFusion": {\n"GeluFusionPass": "off",\n"GeluFusionPass": "on"}}}\n', "sw.json", ":2:",
     "appears twice"),
    ('{"Switch": {"GraphFusion": ["GeluFusionPass"]}}\n', "sw.json", ":1:", "must be an object"),
    ('{"Switch": {\n "GraphFusion": {"ALL": "on"},\n "UBFusion": {\n  "ALL": "none"}}}\n', "sw.json", ":4:",
     "ALL: value 'none' is neither"),
    ('{"Switch": ' + "[" * 100000, "sw.json", ":1:", "malformed JSON"),
])
def test_bad_files_name_the_line_and_what_is_wrong(tmp_path: Path, text: str, name: str, where: str,
                                                   what: str) -> None:
    p = write(tmp_path, text, name)
    with pytest.raises(InputError) as exc:
        read_fusion_switch(p)
    msg = str(exc.value)
    assert msg.startswith(f"{p}{where}"), msg
    assert what in msg, msg
    assert "\n" not in msg


def test_unknown_name_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(InputError) as exc:
        read_fusion_switch(write(tmp_path, "layer_norm:off\n"))
    msg = str(exc.value)
    for name in ALL:
        assert name in msg
    assert "ConvBatchnormFusionPass" in msg and "docs/fusion-switch.md" in msg


def test_only_replaces_the_switch_set_and_disable_removes_from_it(tmp_path: Path) -> None:
    p = write(tmp_path, "ALL:off\ngelu:on\nattention:on\n")
    assert [q.name for q in select_patterns(p)] == ["gelu", "attention"]
    assert [q.name for q in select_patterns(p, disable=["gelu"])] == ["attention"]
    # --only names the exact set, whatever the file said
    assert [q.name for q in select_patterns(p, only=["layernorm"])] == ["layernorm"]
    with pytest.raises(InputError, match="unknown pattern 'nope'"):
        select_patterns(p, disable=["nope"])
    # --only does not skip reading the file: a broken one is still an error
    with pytest.raises(InputError, match="unknown fusion pass or pattern 'Nope'"):
        select_patterns(write(tmp_path, "Nope:off\n", "broken.cfg"), only=["layernorm"])


# ---- writing ------------------------------------------------------------------------------------------------

def _record(pattern: str, status: str) -> FusionRecord:
    return FusionRecord(Match(pattern, (f"{pattern}_node",), ("x",), ("y",), pattern), status)


def test_written_switch_turns_off_only_what_npufuse_did_everywhere() -> None:
    result = OptimizeResult(onnx.ModelProto(), records=[
        _record("attention", APPLIED), _record("attention", APPLIED),
        _record("gelu", APPLIED), _record("gelu", SKIPPED_COST),              # one GELU left to ATC
        _record("matmul_epilogue", APPLIED), _record("matmul_epilogue", ROLLED_BACK),
        _record("conv_bn_act", APPLIED)],
        refusals=[Refusal("add_layernorm", "n", "operand-broadcast", "why")])
    ran = sorted(ALL - {"layernorm"})
    sw = switch_for_atc(result, ran)["Switch"]
    assert sw["GraphFusion"]["FlashAttentionFusionPass"] == "off"
    assert sw["GraphFusion"]["ConvBatchnormFusionPass"] == "off"
    # ATC's UB fusion is how a FusedConv's activation becomes one kernel: never switched off
    assert sw["UBFusion"]["ConvClipByValueFusionPass"] == "on"
    assert sw["GraphFusion"]["GeluFusionPass"] == "on"           # skipped by cost: ATC may still fuse it
    assert sw["GraphFusion"]["MatMulBiasAddFusionPass"] == "on"  # rolled back
    assert sw["GraphFusion"]["AddLayerNormFusionPass"] == "on"   # refused: a near-miss
    assert sw["GraphFusion"]["LayerNormFusionPass"] == "on"      # not run
    assert sw["GraphFusion"]["AddRmsNormFusionGraphPass"] == "on"  # nothing of it in the model
    assert "SoftmaxFusionPass" not in sw["GraphFusion"]          # no counterpart: ATC's default stands


# ---- the command line ---------------------------------------------------------------------------------------

def npufuse(*args: str | Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "npufuse.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


def ops(path: Path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def test_optimize_with_layernorm_fusion_off_keeps_layernorm_and_fuses_attention(tmp_path: Path) -> None:
    sw = write(tmp_path, switch_json({"ALL": "on", "LayerNormFusionPass": "off", "AddLayerNormFusionPass": "off"}),
               "sw.json")
    out, atc = tmp_path / "bert.npufuse.onnx", tmp_path / "atc_switch.json"
    r = npufuse("optimize", BERT17, "-o", out, "--fusion-switch", sw, "--write-fusion-switch", atc)
    assert r.returncode == 0, r.stderr
    got = ops(out)
    assert got["LayerNormalization"] == ops(BERT17)["LayerNormalization"] == 5   # no AddLayerNorm took them
    assert got["AddLayerNorm"] == 0
    assert got["FusedAttention"] == 2 and got["FusedMatMul"] > 0
    assert "whole model, output last_hidden_state" in r.stdout and "-> ok" in r.stdout
    assert "please report it" not in r.stdout   # a start the user turned off is no silent refusal
    # what it wrote for ATC reads back with our own reader, with each pass where it belongs
    written = json.loads(atc.read_text())["Switch"]
    assert written["GraphFusion"]["FlashAttentionFusionPass"] == "off"
    assert written["GraphFusion"]["GeluFusionPass"] == "off"
    assert written["GraphFusion"]["MatMulBiasAddFusionPass"] == "off"
    assert written["GraphFusion"]["AddLayerNormFusionPass"] == "on"      # left to ATC: the switch turned it off
    assert written["GraphFusion"]["LayerNormFusionPass"] == "on"
    assert written["GraphFusion"]["ConvBatchnormFusionPass"] == "on"     # no Conv: nothing done
    assert written["UBFusion"]["ATbeMatmulElemwiseFusionPass"] == "on"  # how FusedMatMul[bias,gelu] is one kernel
    back = read_fusion_switch(atc)
    assert {"attention", "gelu", "matmul_epilogue"}.isdisjoint(back.enabled)   # off wins over the UB pass's on
    assert {"layernorm", "add_layernorm", "conv_bn_act"} <= back.enabled


def test_line_form_on_a_decomposed_layernorm_leaves_it_decomposed(tmp_path: Path) -> None:
    sw = write(tmp_path, "# ATC's older form\nLayerNormFusionPass:off\n")
    out = tmp_path / "bert14.npufuse.onnx"
    r = npufuse("optimize", BERT14, "-o", out, "--fusion-switch", sw, "--no-verify")
    assert r.returncode == 0, r.stderr
    got = ops(out)
    assert got["ReduceMean"] == ops(BERT14)["ReduceMean"] == 10
    assert got["LayerNorm"] == got["AddLayerNorm"] == got["LayerNormalization"] == 0
    assert got["FusedAttention"] == 2
    assert "please report it" not in r.stdout


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("case", ["unknown-name", "bad-line", "not-on-off", "malformed-json", "missing-file",
                                  "not-utf8", "write-over-input", "write-over-switch", "write-over-output"])
def test_bad_switch_input_is_one_line_exit_2_and_changes_nothing(tmp_path: Path, case: str) -> None:
    model = tmp_path / "bert.onnx"
    model.write_bytes(BERT17.read_bytes())
    before = _digest(model)
    out = tmp_path / "out.onnx"
    good = write(tmp_path, "GeluFusionPass:off\n", "good.cfg")
    args: list = ["optimize", model, "-o", out, "--no-verify"]
    expect = ""
    if case == "unknown-name":
        args += ["--fusion-switch", write(tmp_path, "GeluFusionPass:off\nMyFusionPass:off\n")]
        expect = ":2: unknown fusion pass or pattern 'MyFusionPass'"
    elif case == "bad-line":
        args += ["--fusion-switch", write(tmp_path, "GeluFusionPass off\n")]
        expect = ":1: expected PassName:on or PassName:off"
    elif case == "not-on-off":
        args += ["--fusion-switch", write(tmp_path, switch_json({"GeluFusionPass": "0"}), "sw.json")]
        expect = ":4: GeluFusionPass: value '0' is neither"
    elif case == "malformed-json":
        args += ["--fusion-switch", write(tmp_path, '{"Switch": {"GraphFusion": {"GeluFusionPass": "off"}', "sw.json")]
        expect = ":1: malformed JSON"
    elif case == "missing-file":
        args += ["--fusion-switch", tmp_path / "nope.json"]
        expect = "--fusion-switch file does not exist"
    elif case == "not-utf8":
        bad = tmp_path / "sw.cfg"
        bad.write_bytes(b"GeluFusionPass:off\n\xff\xfe\n")
        args += ["--fusion-switch", bad]
        expect = "is not UTF-8 text"
    elif case == "write-over-input":
        args += ["--write-fusion-switch", model]
        expect = "--write-fusion-switch would overwrite the input model"
    elif case == "write-over-switch":
        args += ["--fusion-switch", good, "--write-fusion-switch", good]
        expect = "--write-fusion-switch names a file this run already reads or writes"
    elif case == "write-over-output":
        args += ["--write-fusion-switch", out]
        expect = "--write-fusion-switch names a file this run already reads or writes"
    good_before = _digest(good)
    r = npufuse(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("npufuse: error: "), r.stderr
    assert expect in lines[0], lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert _digest(model) == before and _digest(good) == good_before
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []   # no temp file left


def test_report_takes_the_switch_file_too(tmp_path: Path) -> None:
    sw = write(tmp_path, "ALL:off\nFlashAttentionFusionPass:on\n")
    r = npufuse("report", BERT17, "--fusion-switch", sw, "--no-verify", "--format", "json", "-q")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    fused = {c["pattern"] for c in doc["candidates"] if c["status"] == "applied"}
    assert fused == {"attention"}


def test_atc_form_switch_leaves_on_the_passes_its_standard_regions_need(tmp_path: Path) -> None:
    """--emit atc: BERT (fp32) keeps the MatMul epilogues and the GELU as standard ops for ATC's passes, so their
    passes stay on, and its attention too where the precision mode keeps fp32 (must_keep_origin_dtype: no fp32
    PromptFlashAttention); under ATC's default force_fp16 the attention is the plugin and its pass goes off. The
    same run in the ONNX form turns them all off. An fp16 Mistral reaches PromptFlashAttention and AddRmsNorm
    through plugins: those passes go off."""
    onnx_sw, atc_sw, kept_sw = tmp_path / "onnx.json", tmp_path / "atc.json", tmp_path / "kept.json"
    r = npufuse("optimize", BERT17, "-o", tmp_path / "b.onnx", "--write-fusion-switch", onnx_sw, "-q")
    assert r.returncode == 0, r.stderr
    r = npufuse("optimize", BERT17, "-o", tmp_path / "b.atc.onnx", "--emit", "atc", "--write-fusion-switch", atc_sw,
                "-q")
    assert r.returncode == 0, r.stderr
    r = npufuse("optimize", BERT17, "-o", tmp_path / "k.atc.onnx", "--emit", "atc", "--write-fusion-switch", kept_sw,
                "--precision-mode", "must_keep_origin_dtype", "-q")
    assert r.returncode == 0, r.stderr
    plain, atc, kept = (json.loads(p.read_text())["Switch"]["GraphFusion"] for p in (onnx_sw, atc_sw, kept_sw))
    for name in ("FlashAttentionFusionPass", "MatMulBiasAddFusionPass", "GeluFusionPass"):
        assert plain[name] == "off" and kept[name] == "on", name
    assert atc["FlashAttentionFusionPass"] == "off"
    assert atc["MatMulBiasAddFusionPass"] == "on" and atc["GeluFusionPass"] == "on"
    mistral = REPO / "tests" / "fixtures" / "mistral_fp16_ts17.onnx"
    r = npufuse("optimize", mistral, "-o", tmp_path / "m.atc.onnx", "--emit", "atc", "--write-fusion-switch",
                tmp_path / "m.json", "-q")
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "m.json").read_text())["Switch"]["GraphFusion"]
    assert m["FlashAttentionFusionPass"] == "off" and m["AddRmsNormFusionGraphPass"] == "off"


def test_the_matmul_ub_pass_is_spelled_as_cann_spells_it(tmp_path):
    # CANN registers ATbeMatmulElemwiseFusionPass (lower-case m); a switch file copied from an ATC setup must parse
    path = tmp_path / "switch.cfg"
    path.write_text("ATbeMatmulElemwiseFusionPass:off\n")
    switch = read_fusion_switch(path)
    assert "matmul_epilogue" not in switch.enabled


# The switch files CANN's ATC guide gives for AMCT-quantized models (hicann/ge docs/zh/user_guides/atc_tools/
# CLI_options/--fusion_switch_file.md, id4-id7): copied into npufuse they must parse, every pass a known one.
_CANN_310P_QUANT_LIST = """\
V200RequantFusionPass:off
ConvConcatFusionPass:off
SplitConvConcatFusionPass:off
TbeEltwiseQuantFusionPass:off
TbeConvDequantVaddReluQuantFusionPass:off
TbeConvDequantVaddReluFusionPass:off
TbeConvDequantQuantFusionPass:off
TbeDepthwiseConvDequantFusionPass:off
TbeFullyconnectionElemwiseDequantFusionPass:off
TbeConv2DAddMulQuantPass:off
TbePool2dQuantFusionPass:off
TbeCommonRules0FusionPass:off
TbeCommonRules2FusionPass:off
"""


def test_cann_documented_quantized_switch_files_parse(tmp_path):
    from npufuse.emit.fusion_switch import read_fusion_switch

    path = tmp_path / "fusion_switch.cfg"
    for first in ("V200RequantFusionPass:off\n", "V100RequantFusionPass:off\n", ""):
        path.write_text(first + _CANN_310P_QUANT_LIST.split("\n", 1)[1])
        enabled = read_fusion_switch(path).enabled
        # ATC's Conv and MatMul UB fusions off: npufuse leaves those regions to ATC as well
        assert "conv_bn_act" not in enabled and "matmul_epilogue" not in enabled
        assert {"layernorm", "attention", "gelu"} <= enabled
