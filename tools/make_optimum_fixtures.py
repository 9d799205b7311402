#!/usr/bin/env python3
"""Regenerate tests/fixtures/optimum/: what `optimum-cli export onnx` (Hugging Face optimum-onnx) writes for tiny
models built from configs with seeded random weights (nothing downloaded): the exports most users run.

* ``llama_with_past.onnx``: LlamaForCausalLM (hidden 64, 4 heads on 2 KV heads, 2 layers), task
  ``text-generation-with-past``: input_ids, an attention_mask over ``past_sequence_length + sequence_length``,
  position_ids and the past keys/values as inputs;
* ``bert.onnx``: BertModel (hidden 32, 2 layers), task ``feature-extraction``;
* ``whisper_encoder.onnx`` and ``whisper_decoder_merged.onnx``: WhisperForConditionalGeneration (d_model 32, one
  layer each side), task ``automatic-speech-recognition-with-past``; the merged decoder holds the cache and no-cache
  decoders as the branches of an If on ``use_cache_branch``.

optimum pins its own transformers, so it runs in a virtual environment of its own::

    python3 -m venv /tmp/optenv
    /tmp/optenv/bin/pip install torch==2.13.0 optimum-onnx onnxruntime
    /tmp/optenv/bin/python tools/make_optimum_fixtures.py

The tests never import torch or optimum; they read the committed .onnx files.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "optimum"


def _models(tmp: Path) -> dict[str, tuple[Path, str]]:
    torch.manual_seed(0)
    llama = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp / "llama")
    bert = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=64)
    transformers.BertModel(bert).save_pretrained(tmp / "bert")
    # max_source_positions 1500: optimum's dummy audio is 3000 mel frames, whatever the config says
    whisper = transformers.WhisperConfig(
        vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=1500,
        max_target_positions=32, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        suppress_tokens=[], begin_suppress_tokens=[])
    transformers.WhisperForConditionalGeneration(whisper).save_pretrained(tmp / "whisper")
    return {"llama": (tmp / "llama", "text-generation-with-past"), "bert": (tmp / "bert", "feature-extraction"),
            "whisper": (tmp / "whisper", "automatic-speech-recognition-with-past")}


# (export folder's file, fixture name)
FILES = {"llama": [("model.onnx", "llama_with_past.onnx")], "bert": [("model.onnx", "bert.onnx")],
         "whisper": [("encoder_model.onnx", "whisper_encoder.onnx"),
                     ("decoder_model_merged.onnx", "whisper_decoder_merged.onnx")]}


def main() -> int:
    cli = Path(sys.executable).with_name("optimum-cli")
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for name, (model_dir, task) in _models(tmp).items():
            out = tmp / f"{name}_onnx"
            subprocess.run([str(cli), "export", "onnx", "--model", str(model_dir), "--task", task, str(out)],
                           check=True, capture_output=True)
            for src, dst in FILES[name]:
                shutil.copyfile(out / src, OUT / dst)
                print(f"{(OUT / dst).relative_to(ROOT)}: {(OUT / dst).stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
