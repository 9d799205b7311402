"""`npufuse check`: the CI guard — honest optimizations pass, perturbed ones fail and name the rewrite."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import pytest
from builders import conv_chain
from onnx import TensorProto, helper, numpy_helper

from npufuse.errors import InputError
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import Graph
from npufuse.guard import (CheckResult, assert_matches_golden, assert_no_drift, check_golden, check_models,
                           save_golden)
from npufuse.guard import attribution
from npufuse.guard.attribution import fused_nodes, undo
from npufuse.guard.golden import decode_name, encode_name, read_golden
from npufuse.guard.stats import OutputTolerance, measure
from npufuse.ir.modelio import load_model
from npufuse.ir.weights import read_array
from npufuse.prepare.normalize import normalize
from npufuse.ir.runtime import run
from npufuse.verify.inputs import model_inputs

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
RESNET = FIXTURES / "resnet_ts17.onnx"
# The original nodes of one of resnet_ts17's Conv -> BN -> Relu chains, deep in the network.
RESNET_BLOCK = "/m/encoder/stages.1/layers.0/layer/layer.1"


def npufuse_check(*args: str | Path) -> subprocess.CompletedProcess:
    """`npufuse check ARGS` in a fresh process, so exit codes and stderr are the real ones."""
    return subprocess.run([sys.executable, "-c", "from npufuse.guard.cli import check; check()", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def _optimized(model: onnx.ModelProto, base_dir: str | None = None) -> onnx.ModelProto:
    res = optimize(model, base_dir, OptimizeOptions(spec=None))
    assert res.applied, "the test model should have something to fuse"
    return res.model


def _fused_for(model: onnx.ModelProto, original_node: str) -> attribution.FusedNode:
    """The fused node of `model` that replaced `original_node`."""
    return next(f for f in fused_nodes(model) if original_node in f.replaced)


def _perturb_weight(model: onnx.ModelProto, node_name: str, delta: float = 1e-2, index: int = 5) -> onnx.ModelProto:
    """A copy of `model` with one element of `node_name`'s weight (input 1) moved by `delta`."""
    out = copy.deepcopy(model)
    weight = next(n for n in out.graph.node if n.name == node_name).input[1]
    for t in out.graph.initializer:
        if t.name == weight:
            arr = numpy_helper.to_array(t).copy()
            arr.flat[index] += delta
            t.CopyFrom(numpy_helper.from_array(arr, weight))
            return out
    raise AssertionError(f"no initializer {weight!r}")


def _one_error_line(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("npufuse: error: "), lines[0]
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def conv_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, onnx.ModelProto]:
    d = tmp_path_factory.mktemp("conv")
    original = conv_chain(act="Relu")
    optimized = _optimized(original)
    onnx.save(original, d / "orig.onnx")
    onnx.save(optimized, d / "opt.onnx")
    return d / "orig.onnx", d / "opt.onnx", optimized


@pytest.fixture(scope="module")
def resnet() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    original = load_model(RESNET)
    optimized = _optimized(original, str(FIXTURES))
    assert len(fused_nodes(optimized)) >= 10
    return original, optimized


# ---- ORIGINAL vs OPTIMIZED -----------------------------------------------------------------------

def test_honest_optimization_passes(conv_pair, tmp_path: Path) -> None:
    orig, opt, _ = conv_pair
    r = npufuse_check(orig, opt, "--junit", tmp_path / "j.xml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and "DRIFT" not in r.stdout
    suite = ET.parse(tmp_path / "j.xml").getroot().find("testsuite")
    assert suite.get("failures") == "0" and suite.find("testcase").get("name") == "Y"


def test_honest_optimization_of_a_real_export_passes(resnet) -> None:
    original, optimized = resnet
    result = check_models(original, optimized, base_dir=str(FIXTURES))
    assert result.ok, result.to_text()
    assert result.culprits == []
    (out,) = result.outputs
    assert 0 < out.max_abs_err < out.atol  # a real (rounding) difference, well inside the tolerance


def test_perturbed_weight_fails_and_names_the_fused_node(conv_pair, tmp_path: Path) -> None:
    orig, _, optimized = conv_pair
    fused = _fused_for(optimized, "bn")
    bad = tmp_path / "bad.onnx"
    onnx.save(_perturb_weight(optimized, fused.name), bad)
    r = npufuse_check(orig, bad, "--json", tmp_path / "r.json")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DRIFT" in r.stdout and "culprits" in r.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["ok"] is False and doc["outputs"][0]["ok"] is False
    assert doc["outputs"][0]["max_abs_err"] > 1e-3
    (culprit,) = doc["culprits"]
    assert culprit["node"] == fused.name
    assert culprit["pattern"] == "conv_bn_act"
    assert culprit["replaced"] == ["conv", "bn", "act"]
    assert culprit["confirmed"] is True


def test_drift_is_attributed_to_the_one_rewrite_among_twenty(resnet) -> None:
    original, optimized = resnet
    fused = _fused_for(optimized, f"{RESNET_BLOCK}/convolution/Conv")
    result = check_models(original, _perturb_weight(optimized, fused.name), base_dir=str(FIXTURES))
    assert not result.ok
    (culprit,) = result.culprits  # downstream fused nodes see drifting inputs and are not blamed
    assert culprit.node == fused.name and culprit.confirmed
    assert culprit.pattern == "conv_bn_act"
    assert culprit.replaced == [f"{RESNET_BLOCK}/convolution/Conv", f"{RESNET_BLOCK}/normalization/BatchNormalization",
                                f"{RESNET_BLOCK}/activation/Relu"]
    assert culprit.inputs_match is True
    assert result.attribution.startswith("per-node evidence")


def test_bisection_finds_the_rewrite_without_per_node_evidence(resnet, monkeypatch) -> None:
    original, optimized = resnet
    fused = _fused_for(optimized, f"{RESNET_BLOCK}/convolution/Conv")
    monkeypatch.setattr(attribution, "_node_evidence", lambda *a, **k: {})
    result = check_models(original, _perturb_weight(optimized, fused.name), base_dir=str(FIXTURES))
    assert result.attribution.startswith("bisection")
    assert [c.node for c in result.culprits] == [fused.name]
    assert result.culprits[0].confirmed


def test_two_drifting_rewrites_are_both_named(resnet) -> None:
    original, optimized = resnet
    first = _fused_for(optimized, "/m/encoder/stages.0/layers.0/layer/layer.1/convolution/Conv")
    second = _fused_for(optimized, "/m/encoder/stages.2/layers.0/layer/layer.0/convolution/Conv")
    # Index 200 lies in an output channel that reaches the output (some of this export's channels are dead).
    bad = _perturb_weight(_perturb_weight(optimized, first.name, index=200), second.name, delta=5e-2)
    for evidence in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if not evidence:
                mp.setattr(attribution, "_node_evidence", lambda *a, **k: {})
            result = check_models(original, bad, base_dir=str(FIXTURES))
        assert sorted(c.node for c in result.culprits) == sorted([first.name, second.name]), result.to_text()
        assert all(c.confirmed for c in result.culprits)


def test_undoing_every_rewrite_gives_back_the_original_computation(resnet) -> None:
    original, optimized = resnet
    norm, types = normalize(original, str(FIXTURES))
    g = Graph(norm, str(FIXTURES), types)
    undone = undo(optimized, g, fused_nodes(optimized))
    onnx.checker.check_model(undone)
    assert not fused_nodes(undone)
    assert sum(n.op_type == "BatchNormalization" for n in undone.graph.node) == \
        sum(n.op_type == "BatchNormalization" for n in original.graph.node)
    feeds = {"pixel_values": np.random.default_rng(3).standard_normal((1, 3, 64, 64)).astype(np.float32)}
    want, got = run(original, feeds, base_dir=str(FIXTURES)), run(undone, feeds, base_dir=str(FIXTURES))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_drift_not_from_a_rewrite_blames_nobody(conv_pair) -> None:
    """An unfused change (here: the input conv's bias in a model without provenance) names no culprit."""
    orig, _, _ = conv_pair
    original = onnx.load(orig)
    changed = copy.deepcopy(original)
    for t in changed.graph.initializer:
        if t.name == "B":
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) + 0.5, "B"))
    result = check_models(original, changed)
    assert not result.ok and result.culprits == []
    assert "provenance" in result.attribution


def test_assert_no_drift_for_pytest(conv_pair) -> None:
    orig, opt, optimized = conv_pair
    assert isinstance(assert_no_drift(orig, opt), CheckResult)
    fused = _fused_for(optimized, "bn")
    with pytest.raises(AssertionError) as info:
        assert_no_drift(orig, _perturb_weight(optimized, fused.name))
    msg = str(info.value)
    assert "DRIFT" in msg and fused.name in msg and "conv_bn_act" in msg
    # A loose enough tolerance is a pass, and says so in the result.
    assert assert_no_drift(orig, _perturb_weight(optimized, fused.name), atol=1.0).ok


# ---- golden files --------------------------------------------------------------------------------

def test_golden_round_trip_and_drift_from_an_older_model(conv_pair, tmp_path: Path) -> None:
    orig, opt, _ = conv_pair
    golden = tmp_path / "golden.npz"
    r = npufuse_check(orig, "--save-golden", golden)
    assert r.returncode == 0, r.stderr
    with np.load(golden, allow_pickle=False) as npz:
        assert sorted(npz.files) == ["input/X", "meta", "output/Y"]
        meta = json.loads(str(npz["meta"]))
    assert meta["format"] == "npufuse.golden" and meta["format_version"] == 1
    assert meta["seed"] == 0 and meta["model"] == "orig.onnx" and len(meta["graph_sha256"]) == 64
    assert {"npufuse", "onnxruntime", "onnx", "numpy"} <= set(meta)

    assert npufuse_check(orig, "--golden", golden).returncode == 0
    r = npufuse_check(opt, "--golden", golden)  # the optimized model matches the original's golden
    assert r.returncode == 0, r.stdout + r.stderr
    assert "differs from the one the golden was saved from" in r.stdout

    # A newer model whose weights moved a little: the golden catches it.
    newer = _perturb_weight(onnx.load(orig), "conv", delta=1e-2)
    onnx.save(newer, tmp_path / "newer.onnx")
    r = npufuse_check(tmp_path / "newer.onnx", "--golden", golden, "--junit", tmp_path / "j.xml")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DRIFT" in r.stdout
    case = ET.parse(tmp_path / "j.xml").getroot().find("testsuite/testcase")
    assert case.get("name") == "Y" and case.find("failure") is not None


def test_golden_api_and_name_encoding(tmp_path: Path) -> None:
    """Any ONNX value name survives the npz key encoding."""
    name_in, name_out = "in:0/a b.ü", "logits/0:%"
    x = helper.make_tensor_value_info(name_in, TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info(name_out, TensorProto.FLOAT, [2, 3])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", [name_in], [name_out], name="r")],
                                                "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)],
                              ir_version=10)
    assert decode_name(encode_name(name_in)) == name_in and "/" not in encode_name(name_in)
    path = save_golden(model, tmp_path / "g.npz", seed=7)
    golden = read_golden(path)
    assert list(golden.inputs) == [name_in] and list(golden.outputs) == [name_out]
    np.testing.assert_array_equal(golden.outputs[name_out], np.maximum(golden.inputs[name_in], 0))
    assert check_golden(model, path).ok
    assert assert_matches_golden(model, path).ok


def test_golden_whose_inputs_do_not_match_is_refused(conv_pair, tmp_path: Path) -> None:
    orig, _, _ = conv_pair
    golden = tmp_path / "g.npz"
    save_golden(orig, golden)
    other = tmp_path / "other.onnx"
    onnx.save(conv_chain(cin=3, cout=6), other)  # X is [1, 3, 7, 7] now
    _one_error_line(npufuse_check(other, "--golden", golden), "input 'X'", "shape", "--save-golden")
    renamed = conv_chain()
    renamed.graph.input[0].name = "image"
    renamed.graph.node[0].input[0] = "image"
    with pytest.raises(InputError, match="has no input 'image'"):
        check_golden(renamed, golden)


# ---- tolerances and statistics -------------------------------------------------------------------

def _offset_model(offsets: dict[str, np.ndarray]) -> onnx.ModelProto:
    """out_i = X + offset_i: the outputs of two such models differ by exactly the offsets' difference."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [1000])
    nodes, outs, inits = [], [], []
    for name, off in offsets.items():
        inits.append(numpy_helper.from_array(off.astype(np.float32), f"{name}_off"))
        nodes.append(helper.make_node("Add", ["X", f"{name}_off"], [name], name=f"add_{name}"))
        outs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1000]))
    return helper.make_model(helper.make_graph(nodes, "offsets", [x], outs, inits),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """out0 is off by 1e-3 in one element of 1000; out1 by 1e-2 in 20 elements."""
    d = tmp_path_factory.mktemp("crafted")
    zero = np.zeros(1000)
    one_off, many_off = zero.copy(), zero.copy()
    one_off[17] = 1e-3
    many_off[:20] = 1e-2
    onnx.save(_offset_model({"out0": zero, "out1": zero}), d / "a.onnx")
    onnx.save(_offset_model({"out0": one_off, "out1": many_off}), d / "b.onnx")
    return d / "a.onnx", d / "b.onnx"


def _verdicts(a: Path, b: Path, **kw) -> dict[str, bool]:
    return {o.name: o.ok for o in check_models(a, b, **kw).outputs}


def test_per_output_tolerance_changes_only_that_output(crafted, tmp_path: Path) -> None:
    a, b = crafted
    assert _verdicts(a, b, atol=1e-4) == {"out0": False, "out1": False}
    assert _verdicts(a, b, atol=1e-4, per_output={"out0": {"atol": 2e-3}}) == {"out0": True, "out1": False}
    assert _verdicts(a, b, atol=2e-2) == {"out0": True, "out1": True}
    r = npufuse_check(a, b, "--atol", "1e-4", "--atol", "out0:2e-3", "--json", tmp_path / "r.json")
    assert r.returncode == 1
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [(o["name"], o["ok"], o["atol"]) for o in doc["outputs"]] == [("out0", True, 2e-3), ("out1", False, 1e-4)]
    r = npufuse_check(a, b, "--atol", "out0:2e-3", "--atol", "out1:2e-2", "--rtol", "0")
    assert r.returncode == 0, r.stdout


def test_each_statistic_moves_the_verdict_the_expected_way(crafted) -> None:
    a, b = crafted
    tol = dict(atol=5e-4, rtol=0.0)
    # elementwise: one element over atol fails.
    assert _verdicts(a, b, statistic="elementwise", **tol) == {"out0": False, "out1": False}
    # max: same as elementwise when rtol is 0 and the floor is absolute.
    assert _verdicts(a, b, statistic="max", **tol) == {"out0": False, "out1": False}
    # mean: 1e-3/1000 = 1e-6 passes; 20*1e-2/1000 = 2e-4 passes at 5e-4 too, fails at 1e-4.
    assert _verdicts(a, b, statistic="mean", **tol) == {"out0": True, "out1": True}
    assert _verdicts(a, b, statistic="mean", atol=1e-4, rtol=0.0) == {"out0": True, "out1": False}
    # quantile: 1 bad element in 1000 passes at q=0.99; 20 (2%) fail at q=0.99 and pass at q=0.98.
    assert _verdicts(a, b, statistic="quantile", quantile=0.99, **tol) == {"out0": True, "out1": False}
    assert _verdicts(a, b, statistic="quantile", quantile=0.98, **tol) == {"out0": True, "out1": True}
    assert _verdicts(a, b, statistic="quantile", quantile=1.0, **tol) == {"out0": False, "out1": False}


def test_worst_error_location_and_smallest_passing_tolerance(crafted) -> None:
    a, b = crafted
    result = check_models(a, b, statistic="elementwise", atol=0.0, rtol=0.0)
    out0 = result.outputs[0]
    assert out0.worst_index == (17,)
    assert out0.max_abs_err == pytest.approx(1e-3, rel=1e-3)
    assert out0.min_passing_atol == pytest.approx(out0.max_abs_err)
    # The smallest passing tolerances are exactly that: a little more passes, a little less fails.
    for stat in ("elementwise", "max", "mean", "quantile"):
        for o in check_models(a, b, statistic=stat, atol=0.0, rtol=1e-4).outputs:
            assert check_models(a, b, statistic=stat, rtol=1e-4, per_output={o.name: {"atol": o.min_passing_atol
                                * 1.01}}).outputs[int(o.name[-1])].ok, (stat, o)
            if o.min_passing_atol > 0:
                assert not check_models(a, b, statistic=stat, rtol=1e-4, per_output={o.name: {"atol": o.min_passing_atol
                                        * 0.9}}).outputs[int(o.name[-1])].ok, (stat, o)


def test_measure_relative_tolerance_and_nan() -> None:
    want = np.array([1.0, 100.0, -3.0], dtype=np.float32)
    got = want * np.float32(1 + 1e-3)
    c = measure("y", got, want, OutputTolerance(rtol=0.0, atol=0.0))
    assert not c.ok and c.min_passing_rtol == pytest.approx(1e-3, rel=1e-3) and c.worst_index == (1,)
    assert measure("y", got, want, OutputTolerance(rtol=c.min_passing_rtol * 1.01, atol=0.0)).ok
    nan = measure("y", np.array([np.nan, 1.0], np.float32), np.array([1.0, 1.0], np.float32))
    assert not nan.ok and nan.worst_index == (0,)
    # NaN against NaN is equal; a reference that is all NaN proves nothing: inconclusive, not drift (issue 12)
    assert measure("y", np.array([np.nan, 2.0, 3.0], np.float32), np.array([np.nan, 2.0, 3.0], np.float32)).ok
    all_nan = measure("y", np.array([np.nan], np.float32), np.array([np.nan], np.float32))
    assert not all_nan.ok and all_nan.inconclusive
    ints = measure("ids", np.array([1, 2], np.int64), np.array([1, 3], np.int64))
    assert not ints.ok  # non-float outputs default to exact equality
    assert not measure("y", np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32)).ok


# ---- bad input and usage -------------------------------------------------------------------------

def test_bad_input_exits_2_with_one_line(conv_pair, crafted, tmp_path: Path) -> None:
    orig, opt, _ = conv_pair
    _one_error_line(npufuse_check(orig, tmp_path / "missing.onnx"), "missing.onnx", "no such file")
    _one_error_line(npufuse_check(orig, opt, "--atol", "out0=1e-3"), "--atol", "NAME:NUMBER")
    _one_error_line(npufuse_check(orig, opt, "--rtol", "-1"), "--rtol", ">= 0")
    _one_error_line(npufuse_check(orig, opt, "--atol", "nosuch:1e-3"), "'nosuch'", "not an output")
    _one_error_line(npufuse_check(orig), "exactly one of")
    _one_error_line(npufuse_check(orig, opt, "--golden", tmp_path / "g.npz"), "exactly one of")
    _one_error_line(npufuse_check(orig, "--golden", tmp_path / "none.npz"), "no such golden file")
    _one_error_line(npufuse_check(orig, opt, "--statistic", "median"), "--statistic")
    _one_error_line(npufuse_check(orig, opt, "--statistic", "quantile", "--quantile", "1.5"), "quantile")
    _one_error_line(npufuse_check(orig, opt, "--no-such-flag"), "--no-such-flag")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    _one_error_line(npufuse_check(orig, "--golden", junk), "not a readable golden")
    renamed = conv_chain()
    renamed.graph.input[0].name = "image"
    renamed.graph.node[0].input[0] = "image"
    onnx.save(renamed, tmp_path / "renamed.onnx")
    _one_error_line(npufuse_check(orig, tmp_path / "renamed.onnx"), "needs input 'image'")
    a, _ = crafted
    # another model (X of another shape, other outputs): its outputs are not ORIGINAL's, a usage error, not drift
    _one_error_line(npufuse_check(orig, a), "has no output 'Y'", "'out0', 'out1'")
    _one_error_line(npufuse_check(orig, opt, "--seed", "-1"), "--seed")


def test_nothing_is_written_over_a_file_the_check_reads(conv_pair, tmp_path: Path) -> None:
    orig, opt, _ = conv_pair
    before = {p: p.read_bytes() for p in (orig, opt)}
    _one_error_line(npufuse_check(orig, "--save-golden", orig), "--save-golden", "overwrite the input")
    _one_error_line(npufuse_check(orig, opt, "--junit", opt), "--junit")
    _one_error_line(npufuse_check(orig, opt, "--junit", tmp_path / "r.xml", "--json", tmp_path / "r.xml"), "--json")
    assert {p: p.read_bytes() for p in (orig, opt)} == before


def test_junit_xml_is_valid_and_carries_the_failure(conv_pair, tmp_path: Path) -> None:
    orig, _, optimized = conv_pair
    fused = _fused_for(optimized, "bn")
    bad = tmp_path / "bad.onnx"
    onnx.save(_perturb_weight(optimized, fused.name), bad)
    junit = tmp_path / "out" / "check.xml"
    junit.parent.mkdir()
    assert npufuse_check(orig, bad, "--junit", junit).returncode == 1
    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites"
    suite = root.find("testsuite")
    assert suite.get("tests") == "2" and suite.get("failures") == "2"
    out_case, culprit_case = suite.findall("testcase")
    assert out_case.get("classname") == "npufuse.check.output" and out_case.get("name") == "Y"
    assert "drifts" in out_case.find("failure").get("message")
    assert culprit_case.get("classname") == "npufuse.check.culprit"
    assert fused.name in culprit_case.get("name")
    assert "conv, bn, act" in culprit_case.find("failure").get("message")
    assert "DRIFT" in suite.find("system-out").text


def test_attribution_with_unnamed_original_nodes() -> None:
    """Exporters may leave nodes unnamed; npufuse names them on load, and the guard finds them the same way."""
    original = conv_chain(act="Silu")
    for n in original.graph.node:
        n.name = ""
    optimized = _optimized(original)
    (fused,) = fused_nodes(optimized)
    result = check_models(original, _perturb_weight(optimized, fused.name))
    (culprit,) = result.culprits
    assert culprit.confirmed and culprit.replaced == list(fused.replaced)
    assert set(culprit.replaced) == {"Conv_0", "BatchNormalization_1", "Sigmoid_2", "Mul_3"}


def test_statistic_on_the_command_line(crafted) -> None:
    a, b = crafted
    assert npufuse_check(a, b, "--atol", "5e-4", "--rtol", "0").returncode == 1
    r = npufuse_check(a, b, "--atol", "5e-4", "--rtol", "0", "--statistic", "quantile", "--quantile", "0.98")
    assert r.returncode == 0, r.stdout
    assert "statistic quantile q=0.98" in r.stdout
    assert npufuse_check(a, b, "--atol", "5e-4", "--rtol", "0", "--statistic", "mean", "-q").stdout.startswith("PASS")


@pytest.mark.parametrize("name", ["gpt2_ts17", "llama_ts17"])
def test_attribution_on_transformer_rewrites(name: str) -> None:
    """Other patterns' rewrites (several replacement nodes sharing one provenance record, epilogues whose
    `npufuse.replaced` need not list every node) are undone exactly and blamed one at a time."""
    original = load_model(FIXTURES / f"{name}.onnx")
    optimized = _optimized(original, str(FIXTURES))
    rewrites = fused_nodes(optimized)
    norm, types = normalize(original, str(FIXTURES))
    g = Graph(norm, str(FIXTURES), types)
    honest = check_models(original, optimized, base_dir=str(FIXTURES))
    assert honest.ok, honest.to_text()
    inputs = model_inputs(g, seed=0)
    want, got = run(original, inputs, base_dir=str(FIXTURES)), run(undo(optimized, g, rewrites), inputs, base_dir=str(FIXTURES))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    weights = {t.name: t for t in optimized.graph.initializer}
    blamed = 0
    for f in rewrites:
        w = next((v for v in f.inputs if v in weights and int(np.prod(weights[v].dims)) > 4), None)
        if w is None:
            continue
        bad = copy.deepcopy(optimized)
        t = next(t for t in bad.graph.initializer if t.name == w)
        arr = read_array(t, str(FIXTURES)).copy()  # a stored weight: read from the fixture's file
        arr += 0.05 * (np.abs(arr).max() + 1)
        t.CopyFrom(numpy_helper.from_array(arr, w))
        result = check_models(original, bad, base_dir=str(FIXTURES))
        if result.ok:
            continue
        assert [(c.node, c.pattern, c.confirmed) for c in result.culprits] == [(f.name, f.pattern, True)], \
            result.to_text()
        assert set(f.replaced) <= set(result.culprits[0].restored)
        blamed += 1
        if blamed == 3:
            break
    assert blamed >= 1
