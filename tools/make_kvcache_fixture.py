#!/usr/bin/env python3
"""Regenerate tests/fixtures/kvcache/: tiny HF Llama decoder steps with their KV cache as graph inputs/outputs.

The model is ``transformers.LlamaForCausalLM`` (hidden 64, 4 heads, 2 layers, eager attention, seeded random
weights: nothing is downloaded), in two variants: ``llama_decode_*`` (2 KV heads, float32: GQA) and
``llama_mqa_fp16_decode_ts17`` (1 KV head, float16: multi-query attention, the one form ATC's IncreFlashAttention
plugin computes). A wrapper takes the past keys/values as plain tensors
(``past_key_values.N.key/value``, [B, 2, past, 16]), builds a ``DynamicCache`` from them, runs one step and returns
the logits and the updated cache (``present.N.key/value``, [B, 2, past + q, 16]). Exported by the TorchScript
exporter (``torch.onnx.export(..., dynamo=False, opset_version=17)``) in the decode form (query length fixed at
1, past length symbolic); each file is checked against torch in onnxruntime.

Usage::

    pip install torch==2.13.0 transformers onnx onnxruntime
    python tools/make_kvcache_fixture.py                                   # every variant
    python tools/make_kvcache_fixture.py llama_mqa_fp16_decode_ts17.onnx   # one file

The tests never import torch; they read the committed .onnx files.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "kvcache"
LAYERS, HEAD_DIM = 2, 16
TOL = {torch.float32: 1e-4, torch.float16: 1e-2}   # torch on CPU vs onnxruntime, max abs


class Variant:
    """Which model is exported: its KV head count and dtype (set by main for each file)."""

    kv_heads, dtype = 2, torch.float32


class CachedStep(nn.Module):
    """(input_ids, attention_mask, past k/v per layer) -> (logits, present k/v per layer)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, *past):
        cache = transformers.DynamicCache(config=self.model.config)
        for i in range(LAYERS):
            cache.update(past[2 * i], past[2 * i + 1], i)
        # transformers >= 5.2x names the cache `cache` (`past_key_values` is deprecated)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=True)
        present = []
        for i in range(LAYERS):
            layer = out.cache.layers[i]
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def build() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=Variant.kv_heads,
                                      num_hidden_layers=LAYERS, intermediate_size=128, vocab_size=100,
                                      max_position_embeddings=128, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():   # non-trivial norm gains
        for m in model.modules():
            if hasattr(m, "weight") and m.__class__.__name__.endswith("RMSNorm"):
                m.weight.uniform_(0.5, 1.5)
    return CachedStep(model.to(Variant.dtype)).eval()


def inputs(batch: int, q: int, past: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (batch, q), generator=g)
    mask = torch.ones(batch, past + q, dtype=torch.int64)
    pkv = [torch.randn(batch, Variant.kv_heads, past, HEAD_DIM, generator=g).to(Variant.dtype)
           for _ in range(2 * LAYERS)]
    return (ids, mask, *pkv)


def names() -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{w}" for i in range(LAYERS) for w in ("key", "value")]
    present = [f"present.{i}.{w}" for i in range(LAYERS) for w in ("key", "value")]
    return ["input_ids", "attention_mask", *past], ["logits", *present]


def export_ts17(model: nn.Module, path: Path) -> None:
    in_names, out_names = names()
    dyn = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch", 1: "total_sequence"}, "logits": {0: "batch"}}
    for n in in_names[2:]:
        dyn[n] = {0: "batch", 2: "past_sequence"}
    for n in out_names[1:]:
        dyn[n] = {0: "batch", 2: "total_sequence"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs(2, 1, 5), str(path), dynamo=False, opset_version=17, input_names=in_names,
                          output_names=out_names, dynamic_axes=dyn, do_constant_folding=True)


def export_dynamo(model: nn.Module, path: Path) -> None:
    in_names, out_names = names()
    batch, past = torch.export.Dim("batch", max=64), torch.export.Dim("past_sequence", max=100)
    shapes = ({0: batch}, {0: batch, 1: past + 1}, tuple({0: batch, 2: past} for _ in in_names[2:]))  # *past: 1 arg
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(model, inputs(2, 1, 5), dynamo=True, input_names=in_names, output_names=out_names,
                                 dynamic_shapes=shapes, verbose=False)
        prog.save(str(path))


def check(model: nn.Module, path: Path) -> float:
    onnx.checker.check_model(str(path))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    worst = 0.0
    for batch, past in ((2, 5), (1, 9), (3, 0)):
        args = inputs(batch, 1, past)
        with torch.no_grad():
            want = [t.numpy() for t in model(*args)]
        got = sess.run(None, {n: a.numpy() for n, a in zip(names()[0], args)})
        worst = max([worst] + [float(np.abs(w.astype(np.float64) - x).max()) for w, x in zip(want, got)])
    if worst > TOL[Variant.dtype]:
        raise SystemExit(f"{path.name}: torch vs onnxruntime max abs error {worst:.2e} > {TOL[Variant.dtype]}")
    return worst


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    variants = (("llama_decode_ts17.onnx", export_ts17, 2, torch.float32),
                ("llama_decode_dynamo.onnx", export_dynamo, 2, torch.float32),
                ("llama_mqa_fp16_decode_ts17.onnx", export_ts17, 1, torch.float16))
    only = set(sys.argv[1:])
    for name, export, Variant.kv_heads, Variant.dtype in variants:
        if only and name not in only:
            continue
        model = build()
        path = OUT / name
        export(model, path)
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size} bytes, max abs error {check(model, path):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
