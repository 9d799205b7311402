"""npufuse.calibrate: rows are checked, the fast evaluator is the cost model, the fit finds known terms, and
leave-one-model-out never predicts a model from itself."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from npufuse.calibrate import data
from npufuse.calibrate.evaluate import compile_rows, row_times_us, with_terms
from npufuse.calibrate.fit import fit, group_weights, leave_one_model_out
from npufuse.calibrate.workloads import Builder, Unbuildable, kernel_work
from npufuse.cost_model import OpWork, TensorInfo, estimate_op
from npufuse.errors import InputError
from npufuse.npu_model import load_profile

T = TensorInfo
F16 = "float16"
ROW = """
[[measurement]]
workload = "{w}"
recipe = "{recipe}"
profile = "Ascend910B2"
batch = 1
dtype = "fp16"
metric = "{metric}"
value = {value}
mode = "kernel"
source = "test"
"""


def _row(**kw) -> data.Row:
    base = dict(where="t", workload="w", recipe="gemm m=256 n=256 k=256", profile="Ascend910B2", batch=1,
                metric="time_us", value=10.0, source="s", mode="kernel")
    base.update(kw)
    return data.Row(**base)


def test_published_time_per_batch():
    assert _row(metric="throughput_fps", value=500.0, batch=4).time_us == pytest.approx(8000.0)
    assert _row(metric="latency_ms", value=1.5).time_us == pytest.approx(1500.0)
    assert _row(metric="time_us", value=42.0).time_us == 42.0


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('metric = "time_us"', 'metric = "fps"'), "field 'metric' is 'fps'"),
    (lambda t: t.replace("value = 10.0", "value = -1"), "field 'value'"),
    (lambda t: t.replace('workload = "g"\n', ""), "field 'workload' is missing"),
    (lambda t: t.replace("batch = 1", "batch = \"one\""), "field 'batch'"),
    (lambda t: t.replace("[[measurement]]", "[[rows]]"), "no [[measurement]] rows"),
    (lambda t: t + "\n[[[", "not valid TOML"),
    (lambda t: t + 'atc_op_select_implmode = "fast"\n', "'fast' is not an ATC --op_select_implmode value"),
    (lambda t: t + 'atc_enable_small_channel = "yes"\n', "field 'atc_enable_small_channel'"),
])
def test_bad_rows_are_one_line_errors(tmp_path, edit, message):
    p = tmp_path / "d.toml"
    p.write_text(edit(ROW.format(w="g", recipe="gemm m=8 n=8 k=8", metric="time_us", value=10.0)), "utf-8")
    with pytest.raises(InputError, match=re.escape(message)) as exc:
        data.load([str(p)])
    assert "\n" not in str(exc.value) and str(p) in str(exc.value)


def test_a_rows_published_implementation_mode_is_what_prices_it(tmp_path):
    """A row compiled with `--optypelist_for_implmode=Sigmoid --op_select_implmode=high_performance` is priced with
    the fast Sigmoid; one without the fields under ATC's default (the row's key tells the two apart)."""
    from npufuse.calibrate.workloads import Builder
    from npufuse.npu_model import load_profile

    p = tmp_path / "d.toml"
    text = ROW.format(w="g", recipe="gemm m=8 n=8 k=8", metric="time_us", value=10.0)
    p.write_text(text + text.replace('source = "test"', 'source = "test"\natc_op_select_implmode = "high_performance"'
                                     '\natc_optypelist_for_implmode = "Sigmoid"'), "utf-8")
    plain, flagged = data.load([str(p)])[0].rows
    assert plain.implmode == "high_performance" and plain.impl_optypes == ()
    assert flagged.impl_optypes == ("Sigmoid",) and plain.key != flagged.key
    wl = Builder.__new__(Builder)
    wl.spec = load_profile("Ascend310P3")
    assert wl.row_spec(flagged).repeat_cost("sigmoid") * wl.spec.sigmoid_high_precision_factor == \
        pytest.approx(wl.row_spec(plain).repeat_cost("sigmoid"))


def test_kernel_recipes_parse():
    g = kernel_work(_row(recipe="gemm m=64 n=32 k=128 (A m x k fp16 ND, B n x k fp16 ND i.e. B^T, C fp32)"))
    assert (g.op_type, g.inputs[1].shape, g.outputs[0].dtype, g.attrs) == ("Gemm", (32, 128), "float32", {"transB": 1})
    c = kernel_work(_row(recipe="conv N=4 Cin=128 H=8 W=48 Cout=1536 k=3x3 stride 1 pad 1 dilation 1"))
    assert c.inputs[1].shape == (1536, 128, 3, 3) and c.outputs[0].shape == (4, 1536, 8, 48)
    a = kernel_work(_row(recipe="flash attention fwd b=1 heads=2 s_q=128 s_kv=1024 d=64 fp16 (Q,K,V fp16; O fp32), "
                                "non-causal"))
    assert a.inputs[1].shape == (1, 2, 1024, 64) and a.attrs["causal"] == 0 and a.outputs[0].dtype == "float32"
    with pytest.raises(Unbuildable):
        kernel_work(_row(recipe="gemm m=64 n=32"))


def test_a_model_row_without_a_recipe_is_skipped_not_fatal():
    b = Builder(load_profile("Ascend310P3"), index={})
    with pytest.raises(Unbuildable, match="no recipe"):
        b.build(_row(workload="resnet18", recipe="torchvision resnet18", mode="om_graph"))


def _ops() -> list[list[OpWork]]:
    mm = [OpWork("mm", "MatMul", "", (T((m, 1024), F16), T((1024, 1024), F16, True)), (T((m, 1024), F16),))
          for m in (16, 512, 4096)]
    ln = OpWork("ln", "LayerNormalization", "", (T((512, 1024), F16), T((1024,), F16, True), T((1024,), F16, True)),
                (T((512, 1024), F16),), {"axis": -1})
    add = OpWork("add", "Add", "", (T((1 << 22,), F16), T((1 << 22,), F16)), (T((1 << 22,), F16),))
    gelu = OpWork("gelu", "Gelu", "", (T((512, 4096), F16),), (T((512, 4096), F16),))
    fa = OpWork("fa", "FusedAttention", "npufuse", (T((1, 8, 512, 64), F16),) * 3, (T((1, 8, 512, 64), F16),),
                {"num_heads": 8})
    view = OpWork("r", "Reshape", "", (T((512, 1024), F16),), (T((1024, 512), F16),))
    return [[mm[0]], [mm[1], ln, gelu, view], [mm[2], add], [fa, ln], [add, gelu]]


TERMS = ("launch.graph_kernel_us", "launch.kernel_fixed_us", "cube.efficiency_max", "cube.efficiency_knee_cycles",
         "bandwidth.gm_fraction", "vector.cost_factor")


@pytest.mark.parametrize("profile", ["Ascend910B2", "Ascend310P3"])
def test_fast_evaluator_is_the_cost_model(profile):
    """At random terms, re-pricing the recorded basis equals running the cost model on a spec with those terms."""
    spec = load_profile(profile)
    rows = _ops()
    bare = [True, False, False, False, False]
    comp = compile_rows([[estimate_op(op, spec) for op in ops] for ops in rows], bare, spec)
    assert comp.unreproduced == 0
    rng = np.random.default_rng(7)
    for _ in range(6):
        terms = {"launch.graph_kernel_us": rng.uniform(0, 20), "launch.kernel_fixed_us": rng.uniform(0, 5),
                 "cube.efficiency_max": rng.uniform(0.4, 1.0), "cube.efficiency_knee_cycles": rng.uniform(0, 5e4),
                 "bandwidth.gm_fraction": rng.uniform(0.2, 1.0), "vector.cost_factor": rng.uniform(0.3, 4.0)}
        tuned = with_terms(spec, terms)
        fast = row_times_us(comp, tuned)
        kernel_only = dataclasses.replace(tuned, launch_graph_kernel_us=0.0)   # a bare kernel: no launch
        for i, ops in enumerate(rows):
            s = kernel_only if bare[i] else tuned
            want = sum(estimate_op(op, s).t_total_us for op in ops)
            assert fast[i] == pytest.approx(want, rel=1e-9)
        # and the terms matter: the evaluator is not returning the base prices
        assert not np.allclose(fast, row_times_us(comp, spec))


def test_fit_recovers_known_terms():
    spec = load_profile("Ascend910B2")
    rows = [[OpWork("mm", "MatMul", "", (T((m, k), F16), T((k, 2048), F16, True)), (T((m, 2048), F16),))]
            for m in (64, 256, 1024, 4096, 8192) for k in (512, 4096)]
    comp = compile_rows([[estimate_op(op, spec) for op in ops] for ops in rows], [True] * len(rows), spec)
    truth = {"cube.efficiency_max": 0.85, "cube.efficiency_knee_cycles": 20000.0}
    published = row_times_us(comp, with_terms(spec, truth))
    res = fit(comp, spec, published, np.ones(len(rows)), list(truth))
    for k, v in truth.items():
        assert res.values[k] == pytest.approx(v, rel=1e-3)
    # GM fraction: these GEMMs are Cube-bound, nothing moves it
    res = fit(comp, spec, published, np.ones(len(rows)), list(truth) + ["bandwidth.gm_fraction"])
    assert res.not_identified == ("bandwidth.gm_fraction",)


def test_leave_one_model_out_never_sees_the_model():
    """Model 'odd' is 2x slower than the physics: its LOMO prediction comes from the others and misses by ~2x,
    while a fit that included it would have been pulled towards it."""
    spec = load_profile("Ascend910B2")
    rows = [[OpWork("mm", "MatMul", "", (T((m, 2048), F16), T((2048, 2048), F16, True)), (T((m, 2048), F16),))]
            for m in (256, 512, 1024, 2048, 4096, 8192)]
    comp = compile_rows([[estimate_op(op, spec) for op in ops] for ops in rows], [True] * 6, spec)
    truth = {"cube.efficiency_max": 0.8}
    published = row_times_us(comp, with_terms(spec, truth)).copy()
    groups = ["a", "a", "b", "b", "odd", "odd"]
    published[4:] *= 2.0
    val = leave_one_model_out(comp, spec, published, groups, np.ones(6, bool), ["cube.efficiency_max"])
    assert val.held_out.all()
    assert val.predicted_us[4:] == pytest.approx(published[4:] / 2.0, rel=1e-3)
    assert val.predicted_us[:4] != pytest.approx(published[:4], rel=1e-3)   # the others saw 'odd' when 'a' left
    assert group_weights(groups, np.ones(6, bool)).tolist() == [0.5] * 6


def test_leave_one_family_out_holds_out_a_whole_class_but_weighs_models():
    """Held out by class: 'a' and 'b' are one class, so neither is seen when it is predicted; the fits still weigh
    each model alike (the weights come from the models, not the classes)."""
    spec = load_profile("Ascend910B2")
    rows = [[OpWork("mm", "MatMul", "", (T((m, 2048), F16), T((2048, 2048), F16, True)), (T((m, 2048), F16),))]
            for m in (256, 512, 1024, 2048, 4096, 8192)]
    comp = compile_rows([[estimate_op(op, spec) for op in ops] for ops in rows], [True] * 6, spec)
    published = row_times_us(comp, with_terms(spec, {"cube.efficiency_max": 0.8})).copy()
    published[:4] *= 2.0                                        # the class of 'a' and 'b' runs 2x slower
    models, classes = ["a", "a", "b", "b", "c", "c"], ["slow", "slow", "slow", "slow", "fast", "fast"]
    by_model = leave_one_model_out(comp, spec, published, models, np.ones(6, bool), ["cube.efficiency_max"])
    by_class = leave_one_model_out(comp, spec, published, models, np.ones(6, bool), ["cube.efficiency_max"],
                                   hold_out_by=classes)
    # leaving out 'a' alone, 'b' (as slow) still teaches the fit; leaving out the class, only 'c' (fast) does
    assert by_class.predicted_us[:4] == pytest.approx(published[:4] / 2.0, rel=1e-3)
    assert by_model.predicted_us[:2] != pytest.approx(published[:2] / 2.0, rel=1e-2)


def test_architecture_classes_come_from_the_data_file():
    from npufuse.calibrate.run import architecture_class

    rows = data.load([str(Path(__file__).parent.parent / "npufuse" / "npu_model" / "calibration" /
                           "ascend310p3.toml")])[0].rows
    got = {r.family: architecture_class(r) for r in rows}
    assert got["resnet"] == "cnn" and got["vit"] == "vision_transformer" and got["bert"] == "text_transformer"


# ---- the CLI ---------------------------------------------------------------------------------------------------

def _small_data(tmp_path, rows=None) -> str:
    """Six 910B kernel rows in the shipped schema (published figures of the 910B data set)."""
    from npufuse.calibrate.workloads import CALIBRATION_DIR

    items = data.load([str(CALIBRATION_DIR / "ascend910b.toml")])[0].rows
    keep = [r for r in items if r.use_for_fit and r.workload in (rows or (
        "gemm_1536", "gemm_3072", "gemm_6144", "conv3x3_cin128_cout1536_8x48", "conv3x3_cin384_cout4608_12x96",
        "flash_attention_sq128_skv1024"))]
    text = "".join(ROW.format(w=r.workload, recipe=r.recipe, metric=r.metric, value=r.value) for r in keep)
    p = tmp_path / "rows.toml"
    p.write_text(text, "utf-8")
    return str(p)


def _cli(args):
    from click.testing import CliRunner

    from npufuse.cli import main

    return CliRunner().invoke(main, args)


def test_cli_calibrates_writes_a_loadable_profile_and_json(tmp_path):
    import json

    src = _small_data(tmp_path)
    out, js = tmp_path / "cal.toml", tmp_path / "cal.json"
    res = _cli(["calibrate", src, "--target", "Ascend910B2", "-o", str(out), "--json", str(js), "-q"])
    assert res.exit_code == 0, res.output
    assert "leave-one-model-out median |error|" in res.output and "gemm_6144" in res.output
    spec = load_profile(str(out))
    info = spec.calibration_info()
    assert set(info["parameters"]) <= {"cube.efficiency_max", "cube.efficiency_knee_cycles", "bandwidth.gm_fraction"}
    assert info["parameters"] and info["rows_used"] == 6 and len(info["data_sha256"][0]) == 64
    assert info["rows"] == "kernel"   # single-kernel timings: nothing said about what ATC fuses by itself
    assert spec.cube_efficiency_max == pytest.approx(info["values"]["cube.efficiency_max"])
    assert spec.cube_efficiency_max < 1.0      # hand-tuned kernels reach 55-87% of peak, not 100%
    sources = dict(spec.sources)
    assert all(sources[k].startswith("calibrated: npufuse calibrate on") for k in info["parameters"])
    doc = json.loads(js.read_text("utf-8"))
    assert len([t for t in doc["table"] if t["status"] == "lomo"]) == 6
    assert doc["command"].startswith("npufuse calibrate")
    # calibrating the calibrated profile again replaces the [calibration] table instead of adding a second one
    again = tmp_path / "again.toml"
    assert _cli(["calibrate", src, "--target", str(out), "-o", str(again), "-q"]).exit_code == 0
    assert again.read_text("utf-8").count("\n[calibration]") == 1
    load_profile(str(again))


@pytest.mark.parametrize("make, message", [
    (lambda tmp: [str(tmp / "missing.toml")], "cannot read the calibration data"),
    (lambda tmp: [_small_data(tmp), "--fit", "cube.speed"], "is not a calibrated term"),
    (lambda tmp: [_small_data(tmp), "--disable", "nosuch"], "unknown pattern"),
    (lambda tmp: [_small_data(tmp, ("gemm_1536",))], "fewer than two models"),
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, make, message):
    res = _cli(["calibrate", *make(tmp_path), "--target", "Ascend910B2", "-o", str(tmp_path / "o.toml"), "-q"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines[-1].startswith("npufuse: error:") and message in lines[-1]
    assert not (tmp_path / "o.toml").exists()


def test_cli_rows_for_another_profile_are_refused(tmp_path):
    res = _cli(["calibrate", _small_data(tmp_path), "--target", "Ascend310P3", "-o", str(tmp_path / "o.toml"), "-q"])
    assert res.exit_code == 2 and "no calibration row is for profile 'Ascend310P3'" in res.output


def test_cli_never_overwrites_its_input(tmp_path):
    src = _small_data(tmp_path)
    before = open(src, encoding="utf-8").read()
    res = _cli(["calibrate", src, "--target", "Ascend910B2", "-o", src, "-q"])
    assert res.exit_code == 2 and "is one of the inputs" in res.output
    assert open(src, encoding="utf-8").read() == before
