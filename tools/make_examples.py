"""Build the transformer example shipped in examples/: a small BERT encoder with random weights.

``examples/bert_tiny.onnx`` is a 2-layer BERT (hidden 128, 4 heads, intermediate 512, vocabulary 1000, with the
pooler) from ``transformers.BertConfig``, exported by TorchScript at opset 17 (``torch.onnx.export(...,
dynamo=False)``) with symbolic ``batch`` and ``sequence``. It is what ``npufuse optimize`` and ``npufuse report``
show attention, AddLayerNorm, GELU and MatMul-epilogue fusion on (the README's second transcript). Weights are
random (seeded), with LayerNorm scales and biases made non-trivial so the fused ops' numerics are exercised.

Usage (torch is needed only here; the tests read the committed file)::

    pip install torch==2.13.0 transformers
    python tools/make_examples.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import transformers
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixtures.common import _randomise_  # noqa: E402  (the fixtures' weight randomisation, one copy)

OUT = ROOT / "examples" / "bert_tiny.onnx"
SEED = 0


class BertOutputs(nn.Module):
    """Plain tensors in, (last_hidden_state, pooler_output) out."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = self.m(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                     return_dict=True)
        return out.last_hidden_state, out.pooler_output


def main() -> int:
    torch.manual_seed(SEED)
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=512, max_position_embeddings=128, type_vocab_size=2,
                                  hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"   # the explicit MatMul/Softmax attention an exporter leaves in most models
    bert = transformers.BertModel(cfg, add_pooling_layer=True).eval()
    _randomise_(bert, SEED)
    model = BertOutputs(bert).eval()
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, 1000, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, -3:] = 0
    tt = torch.zeros(2, 16, dtype=torch.int64)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {n: {0: "batch", 1: "sequence"} for n in names}
    axes["last_hidden_state"] = {0: "batch", 1: "sequence"}
    axes["pooler_output"] = {0: "batch"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids, mask, tt), str(OUT), input_names=names,
                          output_names=["last_hidden_state", "pooler_output"], dynamic_axes=axes,
                          opset_version=17, dynamo=False)
    with torch.no_grad():
        want = [t.numpy() for t in model(ids, mask, tt)]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    got = ort.InferenceSession(str(OUT), so, providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": tt.numpy()})
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(want, got))
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size / 1024:.0f} KiB); onnxruntime vs torch max abs {err:.2e}")
    return 0 if err < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
