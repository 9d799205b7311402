"""ATC's --enable_small_channel as a pricing input: a Conv of at most 4 input channels in the C04 format (Cin padded
to 4, Cin x kernel positions folded into one K padded to 16 once), every other Conv as before; the report says when
the compile sets it; calibration rows say which published compiles did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from npufuse.calibrate import data as calibration_data
from npufuse.cli import main
from npufuse.cost_model.cube_ops import SMALL_CHANNEL_C0, conv_gemm
from npufuse.cost_model.estimate import estimate_op
from npufuse.cost_model.workload import OpWork, TensorInfo
from npufuse.npu_model.spec import load_profile

P310 = load_profile("Ascend310P3")
ROOT = Path(__file__).resolve().parent.parent
CALIBRATION = ROOT / "npufuse" / "npu_model" / "calibration"


def _conv(cin: int, cout: int, k: int, group: int = 1, batch: int = 8, size: int = 224, stride: int = 2) -> OpWork:
    out = size // stride
    x = TensorInfo((batch, cin, size, size), "float32")
    w = TensorInfo((cout, cin // group, k, k), "float32", True)
    return OpWork("c", "Conv", "", (x, w), (TensorInfo((batch, cout, out, out), "float32"),),
                  {"kernel_shape": [k, k], "strides": [stride, stride], "pads": [k // 2] * 4, "group": group})


def test_an_rgb_stem_folds_channels_and_kernel_positions_into_one_k():
    stem = _conv(3, 64, 7)
    plain, small = conv_gemm(stem, P310), conv_gemm(stem, P310.with_small_channel(True))
    assert plain.k == 16 * 49 and small.k == 208   # round_up(4 * 49, 16)
    assert small.n == plain.n and small.m == plain.m and small.batch == 1
    assert small.a_bytes == pytest.approx(plain.a_bytes * 4 / 16)   # NC1HWC0_C04: 3 -> 4 channels, not 16
    t_plain = estimate_op(stem, P310).t_total_us
    t_small = estimate_op(stem, P310.with_small_channel(True)).t_total_us
    assert t_small < 0.75 * t_plain


@pytest.mark.parametrize("conv", [_conv(16, 64, 3), _conv(64, 64, 3, group=64), _conv(SMALL_CHANNEL_C0 + 1, 32, 3),
                                  _conv(4, 4, 3, group=2)], ids=["16-channels", "depthwise", "5-channels", "grouped"])
def test_other_convs_are_priced_as_without_it(conv):
    assert conv_gemm(conv, P310.with_small_channel(True)) == conv_gemm(conv, P310)


def test_the_flag_prices_the_model_and_the_report_says_so(tmp_path):
    model = str(CALIBRATION / "workloads" / "resnet18.onnx")
    times = {}
    for flag in ((), ("--enable-small-channel",)):
        out = tmp_path / f"r{len(flag)}.json"
        res = CliRunner().invoke(main, ["report", model, "--target", "Ascend310P3", "--dim", "batch=8", "--no-verify",
                                        "--format", "json", "-o", str(out), "-q", *flag])
        assert res.exit_code == 0, res.output
        doc = json.loads(out.read_text())
        times[bool(flag)] = doc["summary"]["modeled_time_us"]["after"]
        assert doc["target"].get("enable_small_channel", False) is bool(flag)
    assert 0.85 * times[False] < times[True] < 0.98 * times[False]   # the stem is a few % of ResNet-18


def test_calibration_rows_carry_the_published_compiles_flag(tmp_path):
    rows = [r for f in calibration_data.load([CALIBRATION / "ascend310p3.toml"]) for r in f.rows]
    flagged = {r.workload for r in rows if r.small_channel}
    assert {"resnet18", "vit_base_patch16_224", "squeezenet1_1"} <= flagged
    assert not flagged & {"resnet34", "densenet121", "efficientnet_b0", "bert-base-uncased-squad"}
    row = next(r for r in rows if r.workload == "resnet18")
    plain = next(r for r in rows if r.workload == "resnet34")
    assert row.key != plain.key and row.key[-1] is True
