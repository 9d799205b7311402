"""The Python API (npufuse.optimize / report / check): the same answers as the command line, from a path or an
onnx.ModelProto, and bad input raised as NpufuseError with exactly the line the command prints."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import conv_chain
from click.testing import CliRunner
from onnx import helper, numpy_helper

import npufuse
from npufuse.cli import main
from npufuse.fusion import engine

REPO = Path(__file__).resolve().parent.parent
BERT = REPO / "tests" / "fixtures" / "bert_ts17.onnx"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cli(*args: str | Path) -> tuple[int, str, str]:
    """The command in process: (exit code, stdout, stderr)."""
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def _cli_error(*args: str | Path) -> str:
    """The one error line the command prints for `args`, without its `npufuse: error: ` prefix."""
    code, _, err = _cli(*args)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("npufuse: error: "), (code, err)
    return lines[0].removeprefix("npufuse: error: ")


@pytest.fixture()
def net(tmp_path: Path) -> Path:
    p = tmp_path / "net.onnx"
    onnx.save(conv_chain(act="Relu"), p)
    return p


# ---- import ----------------------------------------------------------------------------------------------------

def test_import_npufuse_stays_cheap_and_the_api_loads_on_first_use() -> None:
    code = ("import sys, npufuse; heavy = [m for m in ('onnx', 'numpy', 'onnxruntime', 'click') if m in sys.modules]; "
            "print(heavy); npufuse.optimize; print('onnx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                         check=True).stdout.split()
    assert out == ["[]", "True"]
    assert {"optimize", "report", "check", "profiles", "NpufuseError", "DriftError"} <= set(dir(npufuse))
    with pytest.raises(AttributeError):
        npufuse.no_such_function  # noqa: B018


def test_input_error_is_the_one_public_error_type() -> None:
    assert issubclass(npufuse.InputError, npufuse.NpufuseError)
    assert issubclass(npufuse.InconclusiveError, npufuse.InputError)
    assert issubclass(npufuse.DriftError, npufuse.NpufuseError) and not issubclass(npufuse.DriftError,
                                                                                      npufuse.InputError)


# ---- optimize --------------------------------------------------------------------------------------------------

def test_a_path_and_a_modelproto_give_the_same_fusions_and_graph_on_bert() -> None:
    before = _sha(BERT)
    by_path = npufuse.optimize(BERT)
    by_proto = npufuse.optimize(onnx.load(BERT))
    assert by_path.fused == by_proto.fused
    assert by_path.fused["FusedAttention[mask]"] == 2 and by_path.fused["AddLayerNorm"] == 4
    # Self-contained: every weight is inside the returned model, byte for byte as from the in-memory input.
    assert by_path.model.SerializeToString() == by_proto.model.SerializeToString()
    assert not any(t.external_data for t in by_path.model.graph.initializer)
    onnx.checker.check_model(by_path.model)
    assert by_path.ok and by_path.verified and by_path.output is None
    assert by_path.report["model"] == str(BERT) and by_proto.report["model"] is None
    assert by_path.report["summary"]["applied_by_kind"] == dict(by_path.fused)
    assert by_path.near_misses == by_path.report["near_misses"]
    assert _sha(BERT) == before


def test_output_none_writes_nothing_and_output_writes_like_the_cli(net: Path, tmp_path: Path) -> None:
    before = _sha(net)
    listing = sorted(tmp_path.iterdir())
    r = npufuse.optimize(net)
    assert sorted(tmp_path.iterdir()) == listing   # not even the CLI's default net.npufuse.onnx
    assert r.output is None and "wrote" not in r.summary()

    out, rep = tmp_path / "out.onnx", tmp_path / "report.json"
    w = npufuse.optimize(net, output=out, report=rep)
    assert w.output == out and str(w).endswith(f"wrote {out}")
    assert [n.op_type for n in onnx.load(out).graph.node] == ["FusedConv"]
    assert onnx.load(out).graph == w.model.graph
    assert json.loads(rep.read_text())["output"] == str(out) and w.report["output"] == str(out)
    assert not list(tmp_path.glob(".*tmp*"))
    assert _sha(net) == before

    # The command writes the same model and prints the same summary.
    cli_out = tmp_path / "cli.onnx"
    code, stdout, _ = _cli("optimize", net, "-o", cli_out)
    assert code == 0
    assert cli_out.read_bytes() == out.read_bytes()
    assert stdout.strip() == w.summary().replace(str(out), str(cli_out))


def test_a_modelproto_with_external_data_needs_base_dir(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(conv_chain(act="Relu", cin=16, cout=32), src, save_as_external_data=True, location="m.data",
              size_threshold=0)
    before = {p: _sha(p) for p in (src, tmp_path / "m.data")}
    lazy = onnx.load(src, load_external_data=False)
    with pytest.raises(npufuse.NpufuseError, match=r"external data file; pass base_dir="):
        npufuse.optimize(lazy)
    r = npufuse.optimize(lazy, base_dir=tmp_path)
    assert r.fused == npufuse.optimize(src).fused == {"FusedConv[Relu]": 1}
    # The in-memory model's own data file is an input too: no output may overwrite it.
    with pytest.raises(npufuse.NpufuseError, match="would overwrite the input's external data file"):
        npufuse.optimize(lazy, base_dir=tmp_path, output=tmp_path / "m.data")
    with pytest.raises(npufuse.NpufuseError, match="base_dir= is for an onnx.ModelProto"):
        npufuse.optimize(src, base_dir=tmp_path)
    assert {p: _sha(p) for p in before} == before


def _perturb_the_fused_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rewrite broken after its own check: the fused Conv's weight scaled just before the whole-model check."""
    real = engine.check_structure

    def tamper(model: onnx.ModelProto) -> None:
        conv = next(n for n in model.graph.node if n.op_type == "FusedConv")
        init = next(t for t in model.graph.initializer if t.name == conv.input[1])
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 1.5, init.name))
        real(model)

    monkeypatch.setattr(engine, "check_structure", tamper)


def test_drift_raises_drift_error_writes_nothing_but_the_report_like_the_cli(net: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _perturb_the_fused_weight(monkeypatch)
    out, rep = tmp_path / "out.onnx", tmp_path / "r.json"
    with pytest.raises(npufuse.DriftError) as caught:
        npufuse.optimize(net, output=out, report=rep)
    assert not out.exists() and json.loads(rep.read_text())["ok"] is False
    result = caught.value.result
    assert not result.ok and result.output is None and "DRIFT" in result.summary()
    code, stdout, stderr = _cli("optimize", net, "-o", out)
    assert code == 1 and not out.exists()
    assert stderr.splitlines() == [f"npufuse: error: {caught.value}"]
    assert stdout.strip() == result.summary()


def _nan_model() -> onnx.ModelProto:
    """conv_chain, then Log of something negative: every output is NaN on any input."""
    m = conv_chain(act="Relu")
    y = m.graph.output[0].name
    m.graph.node.extend([helper.make_node("Neg", [y], ["neg"]), helper.make_node("Sub", ["neg", "one"], ["low"]),
                         helper.make_node("Log", ["low"], ["nan"])])
    m.graph.initializer.append(numpy_helper.from_array(np.array(1.0, np.float32), "one"))
    out = onnx.ValueInfoProto()
    out.CopyFrom(m.graph.output[0])
    out.name = "nan"
    del m.graph.output[:]
    m.graph.output.append(out)
    return m


def test_an_inconclusive_check_is_an_npufuse_error_with_the_cli_line(tmp_path: Path) -> None:
    src, out = tmp_path / "nan.onnx", tmp_path / "out.onnx"
    onnx.save(_nan_model(), src)
    with pytest.raises(npufuse.NpufuseError) as caught:
        npufuse.optimize(src, output=out)
    assert isinstance(caught.value, npufuse.InconclusiveError) and "inconclusive" in str(caught.value)
    assert caught.value.result.fused == {"FusedConv[Relu]": 1} and not out.exists()
    assert _cli_error("optimize", src, "-o", out, "-q") == str(caught.value)
    r = npufuse.optimize(src, output=out, verify=False)   # unchecked, as --no-verify
    assert r.output == out and not r.verified


# ---- errors: the command's line, from the API ------------------------------------------------------------------

@pytest.mark.parametrize("case", ["missing", "garbage", "directory", "control-characters", "target", "dims",
                                  "dims-mapping", "pattern", "output-is-input", "report-is-input", "verify-memory"])
def test_bad_input_raises_npufuse_error_with_the_line_the_cli_prints(case: str, net: Path, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07\xff\xff\xff not a protobuf at all")
    api_args: tuple = (net,)
    api_kw: dict = {}
    cli_args: list = ["optimize", net]
    if case == "missing":
        api_args, cli_args = (tmp_path / "nope.onnx",), ["optimize", tmp_path / "nope.onnx"]
    elif case == "garbage":
        api_args, cli_args = (garbage,), ["optimize", garbage]
    elif case == "directory":
        api_args, cli_args = (tmp_path,), ["optimize", tmp_path]
    elif case == "control-characters":   # escaped in the message as on the terminal
        bad = tmp_path / "x\x1b]0;pwned\x07.onnx"
        api_args, cli_args = (bad,), ["optimize", bad]
    elif case == "target":
        api_kw, cli_args = {"target": "Ascend999"}, cli_args + ["--target", "Ascend999"]
    elif case == "dims":
        api_kw, cli_args = {"dims": ["batch"]}, cli_args + ["--dim", "batch"]
    elif case == "dims-mapping":
        api_kw, cli_args = {"dims": {"batch": 0}}, cli_args + ["--dim", "batch=0"]
    elif case == "pattern":
        api_kw, cli_args = {"only": ["conv_bn"], "disable": ["nope"]}, cli_args + ["--only", "conv_bn",
                                                                                  "--disable", "nope"]
    elif case == "output-is-input":
        api_kw, cli_args = {"output": net}, cli_args + ["-o", net]
    elif case == "report-is-input":
        api_kw, cli_args = {"output": tmp_path / "o.onnx", "report": net}, cli_args + ["-o", tmp_path / "o.onnx",
                                                                                       "--report", net]
    elif case == "verify-memory":
        api_kw, cli_args = {"verify_memory": "lots"}, cli_args + ["--verify-memory", "lots"]
    before = _sha(net)
    with pytest.raises(npufuse.NpufuseError) as caught:
        npufuse.optimize(*api_args, **api_kw)
    assert isinstance(caught.value, npufuse.InputError)
    message = str(caught.value)
    assert "\n" not in message and "\x1b" not in message
    assert message == _cli_error(*cli_args)
    assert _sha(net) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.onnx", "net.onnx"]   # neither wrote a thing


def test_api_only_arguments_are_checked_too(net: Path) -> None:
    for kw, says in (({"margin": 1.5}, "margin 1.5"), ({"seed": -1}, "seed -1"), ({"verify_memory": True}, "verify_memory"),
                     ({"format": "pdf"}, "report format 'pdf'")):
        with pytest.raises(npufuse.NpufuseError, match=says):
            (npufuse.report if "format" in kw else npufuse.optimize)(net, **kw)
    with pytest.raises(npufuse.NpufuseError, match="expected a path or an onnx.ModelProto, got bytes"):
        npufuse.optimize(net.read_bytes())
    with pytest.raises(npufuse.NpufuseError, match="holds no graph"):
        npufuse.optimize(onnx.ModelProto())
    broken = conv_chain(act="Relu")
    broken.graph.node[0].input[0] = "dangling"
    with pytest.raises(npufuse.NpufuseError, match=r"model \(an onnx.ModelProto\): invalid ONNX graph"):
        npufuse.optimize(broken)


# ---- report ----------------------------------------------------------------------------------------------------

def test_report_returns_the_document_and_writes_each_format(net: Path, tmp_path: Path) -> None:
    doc = npufuse.report(net, verify=False)
    assert doc["schema"] == "npufuse.report/1" and json.loads(json.dumps(doc)) == doc
    for fmt, marker in (("json", '"schema": "npufuse.report/1"'), ("markdown", "# "), ("html", "<html"),
                        ("text", "FusedConv")):
        out = tmp_path / f"r.{fmt}"
        written = npufuse.report(net, format=fmt, output=out, verify=False)
        text = out.read_text(encoding="utf-8")
        assert marker in text and text == written.render(fmt) + "\n"
    assert json.loads((tmp_path / "r.json").read_text())["candidates"] == doc["candidates"]
    with pytest.raises(npufuse.NpufuseError) as caught:
        npufuse.report(net, format="html", output=net)
    assert str(caught.value) == _cli_error("report", net, "--format", "html", "-o", net)
    assert npufuse.report(onnx.load(net), verify=False)["candidates"] == doc["candidates"]


# ---- check -----------------------------------------------------------------------------------------------------

def test_check_passes_an_optimized_model_and_names_the_output_that_drifts(net: Path, tmp_path: Path) -> None:
    opt = tmp_path / "opt.onnx"
    npufuse.optimize(net, output=opt)
    ok = npufuse.check(net, opt)
    assert ok.ok and [o.name for o in ok.outputs] == [o.name for o in onnx.load(net).graph.output]

    drifting = onnx.load(opt)
    conv = drifting.graph.node[0]
    w = next(t for t in drifting.graph.initializer if t.name == conv.input[1])
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * 1.5, w.name))
    bad = npufuse.check(onnx.load(net), drifting)
    assert not bad.ok and [o.name for o in bad.failed] == [drifting.graph.output[0].name]
    assert bad.culprits and bad.culprits[0].to_dict()   # the fused node is named
    bad_path = tmp_path / "bad.onnx"
    onnx.save(drifting, bad_path)
    code, stdout, _ = _cli("check", net, bad_path)
    assert code == 1 and "DRIFT" in stdout

    golden = tmp_path / "g.npz"
    assert npufuse.save_golden(net, golden) == golden
    assert npufuse.check(opt, golden=golden).ok and not npufuse.check(drifting, golden=golden).ok


def test_check_errors_are_the_cli_lines(net: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.onnx"
    m = conv_chain(act="Relu")
    m.graph.output[0].name = "renamed"
    m.graph.node[-1].output[0] = "renamed"
    onnx.save(m, other)
    with pytest.raises(npufuse.NpufuseError) as caught:
        npufuse.check(net, other)
    assert str(caught.value) == _cli_error("check", net, other)
    with pytest.raises(npufuse.NpufuseError) as caught:
        npufuse.check(net, tmp_path / "missing.onnx")
    assert str(caught.value) == _cli_error("check", net, tmp_path / "missing.onnx")
    with pytest.raises(npufuse.NpufuseError, match="pass exactly one of"):
        npufuse.check(net)
    src = tmp_path / "nan.onnx"
    onnx.save(_nan_model(), src)
    with pytest.raises(npufuse.InconclusiveError) as inconclusive:
        npufuse.check(src, src)
    assert str(inconclusive.value) == _cli_error("check", src, src, "-q")
    assert inconclusive.value.result.inconclusive


# ---- profiles --------------------------------------------------------------------------------------------------

def test_profiles_lists_the_targets_optimize_accepts() -> None:
    names = [p.name for p in npufuse.profiles()]
    assert "Ascend910B2" in names and len(names) == len(set(names)) > 1
    assert [p.name for p in npufuse.profiles("Ascend910B2")] == ["Ascend910B2"]
    with pytest.raises(npufuse.NpufuseError) as caught:
        npufuse.profiles("Ascend999")
    assert str(caught.value) == _cli_error("profiles", "--target", "Ascend999")


# ---- docs/api.md -----------------------------------------------------------------------------------------------

def test_the_python_examples_of_docs_api_md_and_the_readme_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture) -> None:
    """Every Python block of the pages, in order, in a folder holding the shipped example (as from the repo root)."""
    import re
    import shutil

    def python_blocks(page: str) -> list[str]:
        return re.findall(r"```python\n(.*?)```", (REPO / page).read_text(encoding="utf-8"), re.S)

    blocks = python_blocks("docs/api.md")
    assert len(blocks) >= 5
    readme = python_blocks("README.md")
    assert readme and "npufuse.optimize(" in readme[0]
    blocks += readme[:1]
    (tmp_path / "examples").mkdir()
    shutil.copy(REPO / "examples" / "mobilenetv2.onnx", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/api.md block {i + 1}", "exec"), {})
    printed = capsys.readouterr().out
    assert "wrote mobilenetv2.npufuse.onnx" in printed and "35 FusedConv[Clip]" in printed
    assert "npufuse: error: model-that-is-not-there.onnx: no such file" in printed
    assert {"mobilenetv2.npufuse.onnx", "mobilenetv2.fused.onnx", "mobilenetv2.report.json",
            "mobilenetv2.report.html"} <= {p.name for p in tmp_path.iterdir()}


def test_an_embedded_rewrite_over_an_external_output_names_the_stale_data_file(tmp_path: Path) -> None:
    """OUT.data from an earlier external write is not read by an embedded OUT: npufuse says so (and deletes
    nothing it cannot prove it wrote); a fresh external write gets no note."""
    import os
    import time

    model = tmp_path / "m.onnx"
    onnx.save(conv_chain(), model)
    out = tmp_path / "o.onnx"
    first = npufuse.optimize(model, output=out, external_data=True, verify=False)
    assert first.notes == () and (tmp_path / "o.onnx.data").is_file()
    old = time.time() - 60
    os.utime(tmp_path / "o.onnx.data", (old, old))
    second = npufuse.optimize(model, output=out, external_data=False, verify=False)
    assert len(second.notes) == 1 and "o.onnx.data" in second.notes[0] and "does not read it" in second.notes[0]
    assert second.summary().rstrip().endswith(second.notes[0])
    assert (tmp_path / "o.onnx.data").is_file()
    third = npufuse.optimize(model, output=out, external_data=True, verify=False)
    assert third.notes == ()
