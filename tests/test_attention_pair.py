"""The fused attention on Ascend310P3 against the one published with/without pair (benchmarks/attention_pair.py,
data in benchmarks/data/attention_pair_Ascend310P3.toml): Chinese-CLIP's ViT-B/16 image tower, CANN 8.0.RC1,
without and with a fused attention kernel.

The calibration's rows ran without a fused attention, so this pair is the only measurement of how much fusing
attention gains on this chip. With the fused graph in the published form (the head Transposes outside the kernel),
the modeled whole-model gain must be the published one within `TOLERANCE`; the gain of npufuse's own form is larger,
by the Transposes its FusedAttention absorbs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The published gains are 1.16-1.20x; today's model is within 15% of each once the forms match (-3, +10, +15%). 20% is
# about the spread of published figures for one architecture on this chip (ViT-B/16 at batch 16: 24.2 ms in the
# ViT_base README, 29.3 ms in Chinese-CLIP's); a modeled gain below 0.93-0.96x or above 1.39-1.44x fails.
TOLERANCE = 0.20


def _bench():
    spec = importlib.util.spec_from_file_location("attention_pair", ROOT / "benchmarks" / "attention_pair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BENCH = _bench()
DATA = BENCH.load_pairs()


def test_the_data_is_the_published_pair():
    assert DATA["profile"] == "Ascend310P3" and DATA["cann"] == "8.0.RC1"
    assert [p["batch"] for p in DATA["pair"]] == [1, 16, 64]
    # pure-inference throughput without, pure-inference time with: a gain of 1.16-1.20x, never a loss
    assert [round(BENCH.published_gain(p), 2) for p in DATA["pair"]] == [1.19, 1.2, 1.16]


@pytest.mark.parametrize("pair", DATA["pair"], ids=lambda p: f"batch{p['batch']}")
def test_modeled_attention_gain_matches_the_published_one(pair):
    m = BENCH.modeled_pair(pair["batch"], DATA)
    published = BENCH.published_gain(pair)
    assert m["form_matched_gain"] > 1.0, m   # the fusion pays on this chip, as published
    assert abs(m["form_matched_gain"] / published - 1) <= TOLERANCE, (m, published)
    # npufuse's form (PromptFlashAttention in the projections' layout) also absorbs the head Transposes, and the
    # unfused 197-token attention runs a TransData before each BatchMatMul
    assert m["transdata_us"] > 0 and m["head_transposes_us"] > 0, m
    assert m["raw_gain"] > m["form_matched_gain"], m
