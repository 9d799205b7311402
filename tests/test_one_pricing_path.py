"""Report, optimize and calibrate price one graph one way: on the calibration recipes, the modeled time of the
fused model agrees to the microsecond (the JSON's 3 decimals) between `npufuse report`, `npufuse optimize
--report` and the row `npufuse calibrate` builds, on the calibrated 310P3 profile under the row's precision mode."""

from __future__ import annotations

import pytest

import npufuse
from npufuse.calibrate.data import Row
from npufuse.calibrate.evaluate import compile_rows, row_times_us
from npufuse.calibrate.workloads import ROW_PRECISION_MODES, Builder, read_index
from npufuse.npu_model import load_profile

TARGET = "Ascend310P3"


def _row(workload: str, batch: int, seq_len: int | None) -> Row:
    return Row(where="test", workload=workload, recipe="", profile=TARGET, batch=batch, metric="latency_ms",
               value=1.0, source="test", seq_len=seq_len, dtype="fp16")


@pytest.mark.parametrize("workload, batch, seq_len, disable", [
    ("resnet18", 8, None, ()),
    ("mobilenet_v2", 1, None, ()),
    ("vit_base_patch32_224", 4, None, ("attention",)),   # as `npufuse calibrate --disable attention` runs it
    ("bert-base-uncased-squad", 1, 128, ()),
])
def test_report_optimize_and_calibrate_agree(workload, batch, seq_len, disable):
    spec = load_profile(TARGET)
    entry = read_index()[workload]
    row = _row(workload, batch, seq_len)
    built = Builder(spec, disable=disable).build(row)
    calibrate_us = float(row_times_us(compile_rows([built.kernels], [False], spec), spec)[0])
    assert calibrate_us == pytest.approx(sum(k.t_total_us for k in built.kernels), rel=1e-9)

    dims = {entry["dims"]["batch"]: batch} | ({entry["dims"]["seq_len"]: seq_len} if seq_len else {})
    path = f"{entry['_dir']}/workloads/{entry['file']}"
    mode = ROW_PRECISION_MODES["float16"]
    assert mode == spec.precision_mode == "force_fp16"   # ATC's default, as the 310P om rows ran
    report = npufuse.report(path, target=TARGET, dims=dims, verify=False, disable=disable)
    optimized = npufuse.optimize(path, target=TARGET, dims=dims, verify=False, disable=disable).report
    assert report["summary"]["modeled_time_us"]["after"] == round(calibrate_us, 3)
    assert optimized["modeled_time_us"]["after"] == round(calibrate_us, 3)
    assert optimized["modeled_time_us"] == report["summary"]["modeled_time_us"]


@pytest.mark.parametrize("workload, batch, seq_len", [
    ("vit_base_patch32_224", 4, None),
    ("resnet18", 8, None),
])
def test_report_atc_alone_is_the_row_calibrate_builds(workload, batch, seq_len):
    # the report's like-for-like figure for a published ATC compile is what calibrate prices the row as: the export
    # fused without the patterns the profile's calibration ran disabled (nor any no CANN pass does the work of),
    # whatever this report's own flags
    spec = load_profile(TARGET)
    without = tuple(spec.calibration_info()["disabled_patterns"])
    assert without == ("attention",)
    entry = read_index()[workload]
    built = Builder(spec, disable=without).build(_row(workload, batch, seq_len))
    calibrate_us = float(row_times_us(compile_rows([built.kernels], [False], spec), spec)[0])
    dims = {entry["dims"]["batch"]: batch} | ({entry["dims"]["seq_len"]: seq_len} if seq_len else {})
    report = npufuse.report(f"{entry['_dir']}/workloads/{entry['file']}", target=TARGET, dims=dims, verify=False)
    assert report["summary"]["atc_alone"]["time_us"] == round(calibrate_us, 3)
    # the calibration's models fuse nothing that lacks a CANN pass, so leaving those out changes none of their rows
    assert set(without) <= set(report["summary"]["atc_alone"]["without"])
