"""The command line as a user meets it: outputs, reports, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import conv_chain
from onnx import helper


def npufuse(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "npufuse", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture()
def model_path(tmp_path: Path) -> Path:
    p = tmp_path / "net.onnx"
    onnx.save(conv_chain(act="Relu"), p)
    return p


def test_optimize_writes_output_report_and_summary(model_path: Path, tmp_path: Path) -> None:
    before = model_path.read_bytes()
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    r = npufuse("optimize", model_path, "-o", out, "--report", report)
    assert r.returncode == 0, r.stderr
    assert "1 FusedConv[Relu]" in r.stdout
    assert "worst rewrite error" in r.stdout
    assert model_path.read_bytes() == before  # the input is never modified
    optimized = onnx.load(out)
    onnx.checker.check_model(optimized, full_check=True)
    assert [n.op_type for n in optimized.graph.node] == ["FusedConv"]
    doc = json.loads(report.read_text())
    assert doc["schema"] == "npufuse.optimize/1"
    assert doc["summary"]["applied_by_kind"] == {"FusedConv[Relu]": 1}
    assert doc["fusions"][0]["check"]["ok"] is True
    assert doc["fusions"][0]["nodes"] == ["conv", "bn", "act"]
    assert not list(tmp_path.glob(".*tmp"))  # no temp files left behind


def test_default_output_path_is_beside_the_input(model_path: Path) -> None:
    r = npufuse("optimize", model_path, "-q")
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    assert (model_path.parent / "net.npufuse.onnx").exists()


def test_no_verify_skips_checks(model_path: Path, tmp_path: Path) -> None:
    r = npufuse("optimize", model_path, "-o", tmp_path / "o.onnx", "--no-verify")
    assert r.returncode == 0, r.stderr
    assert "verification skipped" in r.stdout


def _assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_file(tmp_path: Path) -> None:
    _assert_one_line_error(npufuse("optimize", tmp_path / "nope.onnx"), "nope.onnx", "no such file")


def test_not_onnx(tmp_path: Path) -> None:
    p = tmp_path / "notes.onnx"
    p.write_text("this is not a model\n" * 50)
    _assert_one_line_error(npufuse("optimize", p), "notes.onnx", "not a readable ONNX model")


def test_truncated_model(model_path: Path) -> None:
    data = model_path.read_bytes()
    model_path.write_bytes(data[: len(data) // 2])
    _assert_one_line_error(npufuse("optimize", model_path), "net.onnx")


def test_invalid_graph(tmp_path: Path) -> None:
    g = helper.make_graph([helper.make_node("Relu", ["missing"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    p = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), p)
    _assert_one_line_error(npufuse("optimize", p), "bad.onnx", "invalid ONNX graph")


def test_output_folder_missing(model_path: Path, tmp_path: Path) -> None:
    _assert_one_line_error(npufuse("optimize", model_path, "-o", tmp_path / "no" / "dir" / "o.onnx"),
                           "does not exist")


def test_output_is_a_directory(model_path: Path, tmp_path: Path) -> None:
    _assert_one_line_error(npufuse("optimize", model_path, "-o", tmp_path), "directory")


def test_refuses_to_overwrite_input(model_path: Path) -> None:
    before = model_path.read_bytes()
    _assert_one_line_error(npufuse("optimize", model_path, "-o", model_path), "overwrite")
    assert model_path.read_bytes() == before


def test_overwrite_input_when_asked(model_path: Path) -> None:
    r = npufuse("optimize", model_path, "-o", model_path, "--overwrite", "-q")
    assert r.returncode == 0, r.stderr
    assert [n.op_type for n in onnx.load(model_path).graph.node] == ["FusedConv"]


def test_unknown_pattern_and_bad_dim(model_path: Path) -> None:
    _assert_one_line_error(npufuse("optimize", model_path, "--only", "nonesuch"), "unknown pattern", "conv_bn_act")
    _assert_one_line_error(npufuse("optimize", model_path, "--dim", "batch"), "NAME=INT")


def test_model_with_external_data(tmp_path: Path) -> None:
    """Weights beside the model stay on disk until a rewrite needs them; the output is self-contained."""
    from builders import random_feeds

    from npufuse.ir.runtime import run

    model = conv_chain(act="Relu", cin=16, cout=32)
    feeds = random_feeds(model)
    want = run(model, feeds)["Y"]
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(model, src / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.data", size_threshold=0)
    data_before = (src / "m.data").read_bytes()
    out = tmp_path / "out" / "o.onnx"
    out.parent.mkdir()
    r = npufuse("optimize", src / "m.onnx", "-o", out)
    assert r.returncode == 0, r.stderr
    assert (src / "m.data").read_bytes() == data_before
    got = run(onnx.load(out), feeds)["Y"]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_optimize_and_report_leave_nothing_in_the_working_directory(tmp_path: Path) -> None:
    # bert_ts14 once made onnxruntime's symbolic shape inference save a temp model into the cwd
    fixture = Path(__file__).parent / "fixtures" / "bert_ts14.onnx"
    work = tmp_path / "cwd"
    work.mkdir()
    out = tmp_path / "o.onnx"
    for args in (["optimize", fixture, "-o", out, "-q"], ["report", fixture, "--format", "json", "-o", tmp_path / "r.json"]):
        r = subprocess.run([sys.executable, "-m", "npufuse", *map(str, args)], capture_output=True, text=True,
                           timeout=300, cwd=work)
        assert r.returncode == 0, r.stderr
    assert list(work.iterdir()) == []


def test_report_path_equal_to_output_is_refused(model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "same.onnx"
    _assert_one_line_error(npufuse("optimize", model_path, "-o", out, "--report", out), "--report")
    assert not out.exists()


def test_bad_option_values_are_one_line(model_path: Path) -> None:
    _assert_one_line_error(npufuse("optimize", model_path, "--seed", "-1"), "--seed")
    _assert_one_line_error(npufuse("optimize", model_path, "--dim", "batch=0"), "INT >= 1")
    # conv_chain's input has fixed dims only: any --dim name is a typo that would silently change nothing
    _assert_one_line_error(npufuse("optimize", model_path, "--dim", "sequence=8"), "no such symbolic dim")
    _assert_one_line_error(npufuse("optimise", model_path), "No such command")
    _assert_one_line_error(npufuse("report", model_path, "--format", "pdf"), "--format")


def test_outputs_are_readable_like_any_file_the_user_writes(model_path: Path, tmp_path: Path) -> None:
    import os

    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    umask = os.umask(0o022)
    os.umask(umask)
    r = npufuse("optimize", model_path, "-o", out, "--report", report, "-q")
    assert r.returncode == 0, r.stderr
    for f in (out, report):
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask


def test_margin_option(model_path: Path, tmp_path: Path) -> None:
    """--margin sets the gain a fusion must exceed (a fraction of the unfused time) on optimize and report."""
    for cmd in ("optimize", "report"):
        _assert_one_line_error(npufuse(cmd, model_path, "--margin", "1.5"), "--margin")
        _assert_one_line_error(npufuse(cmd, model_path, "--margin", "lots"), "--margin")
    out = tmp_path / "r.json"
    r = npufuse("report", model_path, "--format", "json", "--no-verify", "--margin", "0.5", "-o", out)
    assert r.returncode == 0, r.stderr
    decisions = [c["decision"] for c in json.loads(out.read_text())["candidates"] if c["decision"]]
    assert decisions and all(d["margin"] == 0.5 for d in decisions)
    r = npufuse("optimize", model_path, "-o", tmp_path / "o.onnx", "--margin", "0", "--no-verify", "-q")
    assert r.returncode == 0, r.stderr
