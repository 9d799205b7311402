"""Models npufuse refuses before it rewrites anything, through the command line: one line, exit 2, no traceback, the
input untouched, no output. A model function in the `npufuse` domain under a fused op's name (the fused nodes would
run it), and an opset below the lowest npufuse can write bodies for. npufuse's own output, whose bodies it stamps,
is optimized again; a stamped body edited since is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from builders import conv_chain
from onnx import TensorProto, helper
from test_norms_gelu import layernorm_model

from npufuse.patterns.base import BODY_STAMP_KEY, MIN_OPSET, is_npufuse_body

# npufuse.LayerNorm's overload for a float32 model (norms._norm_body): the key a fused node would be bound by.
LN_OVERLOAD = "float32_stats_float32"


def npufuse(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "npufuse", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def _assert_refused(r: subprocess.CompletedProcess, model: Path, out: Path, before: bytes, *needles: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("npufuse: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert model.read_bytes() == before
    assert not out.exists()
    assert sorted(p.name for p in model.parent.iterdir()) == [model.name]   # no stray file


def _own_layer_norm(domain: str = "npufuse", name: str = "LayerNorm") -> onnx.FunctionProto:
    """A model's own function under npufuse's name and overload whose body is not a LayerNorm (Y = X)."""
    return helper.make_function(domain, name, ["X", "gamma", "beta"], ["Y"], [helper.make_node("Identity", ["X"], ["Y"])],
                                [helper.make_opsetid("", 14)], overload=LN_OVERLOAD)


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    d = tmp_path / "in"
    d.mkdir()
    return d


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_model_function_named_like_a_fused_op_is_refused(folder: Path, tmp_path: Path, verify: bool) -> None:
    model = layernorm_model(14)   # fuses into npufuse.LayerNorm, whose body has the overload above
    model.functions.append(_own_layer_norm())
    onnx.checker.check_model(model, full_check=True)
    path, out = folder / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    before = path.read_bytes()
    r = npufuse("optimize", path, "-o", out, *([] if verify else ["--no-verify"]))
    _assert_refused(r, path, out, before, "npufuse.LayerNorm", "another domain")


def test_report_refuses_it_too(folder: Path, tmp_path: Path) -> None:
    model = layernorm_model(14)
    model.functions.append(_own_layer_norm())
    path, out = folder / "m.onnx", tmp_path / "r.json"
    onnx.save(model, path)
    before = path.read_bytes()
    _assert_refused(npufuse("report", path, "-o", out), path, out, before, "npufuse.LayerNorm")


def test_other_functions_of_the_model_are_left_alone(folder: Path, tmp_path: Path) -> None:
    """A function in another domain, or in npufuse's under a name npufuse does not use, is no clash."""
    model = layernorm_model(14)
    model.functions.extend([_own_layer_norm(domain="mine"), _own_layer_norm(name="MyNorm")])
    path, out = folder / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    r = npufuse("optimize", path, "-o", out)
    assert r.returncode == 0, r.stderr
    result = onnx.load(out)
    onnx.checker.check_model(result, full_check=True)
    assert [(n.domain, n.op_type) for n in result.graph.node] == [("npufuse", "LayerNorm")]
    names = {(f.domain, f.name): f for f in result.functions}
    assert {("mine", "LayerNorm"), ("npufuse", "MyNorm"), ("npufuse", "LayerNorm")} == set(names)
    assert is_npufuse_body(names["npufuse", "LayerNorm"])
    assert [n.op_type for n in names["npufuse", "LayerNorm"].node] != ["Identity"]


def test_npufuse_output_is_optimized_again_but_an_edited_body_is_refused(folder: Path, tmp_path: Path) -> None:
    path, first, second = folder / "m.onnx", tmp_path / "first.onnx", tmp_path / "second.onnx"
    onnx.save(layernorm_model(14), path)
    r = npufuse("optimize", path, "-o", first)
    assert r.returncode == 0, r.stderr
    fns = onnx.load(first).functions
    assert fns and all(any(p.key == BODY_STAMP_KEY for p in f.metadata_props) for f in fns)
    r = npufuse("optimize", first, "-o", second)
    assert r.returncode == 0, r.stderr
    assert [f.SerializeToString() for f in onnx.load(second).functions] == [f.SerializeToString() for f in fns]

    edited = onnx.load(first)
    eps = next(n for n in edited.functions[0].node if n.op_type == "Sqrt")
    eps.op_type = "Abs"                    # a body changed after npufuse wrote it: its stamp no longer matches
    tampered = folder.parent / "t" / "tampered.onnx"
    tampered.parent.mkdir()
    onnx.save(edited, tampered)
    before = tampered.read_bytes()
    _assert_refused(npufuse("optimize", tampered, "-o", second.with_name("x.onnx"), "--no-verify"), tampered,
                    second.with_name("x.onnx"), before, "npufuse.LayerNorm")


def test_an_opset_below_the_lowest_is_refused(folder: Path, tmp_path: Path) -> None:
    model = conv_chain(opset=MIN_OPSET - 1, act="Relu")
    path, out = folder / "old.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    before = path.read_bytes()
    _assert_refused(npufuse("optimize", path, "-o", out, "--no-verify"), path, out, before,
                    f"opset {MIN_OPSET - 1}", f">= {MIN_OPSET}")


def test_the_lowest_opset_is_accepted(folder: Path, tmp_path: Path) -> None:
    path, out = folder / "m.onnx", tmp_path / "out.onnx"
    onnx.save(layernorm_model(MIN_OPSET), path)
    r = npufuse("optimize", path, "-o", out)
    assert r.returncode == 0, r.stderr
    result = onnx.load(out)
    onnx.checker.check_model(result, full_check=True)
    assert [n.op_type for n in result.graph.node] == ["LayerNorm"]
    assert result.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
