"""optimum-cli exports (tools/make_optimum_fixtures.py): the exports most Hugging Face users run optimize with no
flags. Their verification inputs respect the model's own structure: a dim written as arithmetic of others
(`past_sequence_length + sequence_length`) is that arithmetic of their sizes, position ids continue the cache.
Before, the attention mask of the Llama export got a length unrelated to the cache and the sequence, and
onnxruntime refused the generated inputs (exit 2 unless --dim or --no-verify)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import npufuse
from npufuse.ir.graph import Graph
from npufuse.verify.dim_sizes import dim_size
from npufuse.verify.inputs import model_inputs

OPTIMUM = Path(__file__).parent / "fixtures" / "optimum"


@pytest.mark.parametrize("name, kinds", [
    ("llama_with_past.onnx", {"FusedAttention[mask]", "GatedMLP[silu]", "RotaryEmbedding[half]"}),
    ("bert.onnx", {"FusedAttention[mask]", "AddLayerNorm", "FusedMatMul[bias,gelu]"}),
    ("whisper_encoder.onnx", {"FusedAttention", "FusedMatMul[bias,gelu]"}),
    ("whisper_decoder_merged.onnx", {"FusedAttention[mask,kvcache]", "FusedMatMul[bias,gelu]"}),
])
def test_optimum_exports_optimize_with_no_flags(tmp_path, name, kinds):
    r = npufuse.optimize(str(OPTIMUM / name), output=str(tmp_path / "o.onnx"))
    assert r.ok and r.verified and kinds <= set(r.fused)
    assert r.report["summary"]["model_check"]["ok"]


def test_a_dim_written_as_arithmetic_of_others_is_sized_from_them():
    assert dim_size("past_sequence_length + sequence_length") == 1 + 8
    assert dim_size("past_sequence_length + sequence_length", {"sequence_length": 3, "past_sequence_length": 5}) == 8
    assert dim_size("s0 + 1", {"s0": 6}) == 7 and dim_size("2*s1", {"s1": 5}) == 10
    assert dim_size("batch // 2", {"batch": 6}) == 3
    # not arithmetic: sized from the name as before
    assert dim_size("batch_size") == 2 and dim_size("x-y?") == 4 and dim_size("a + ") == 4


def test_cache_inputs_are_consistent_and_positions_continue_the_cache():
    g = Graph(onnx.load(str(OPTIMUM / "llama_with_past.onnx")))
    feeds = model_inputs(g, 0, {"batch_size": 2, "sequence_length": 3, "past_sequence_length": 5})
    assert feeds["attention_mask"].shape == (2, 8)
    assert feeds["past_key_values.0.key"].shape[2] == 5
    np.testing.assert_array_equal(feeds["position_ids"], np.broadcast_to(np.arange(5, 8), (2, 3)))
