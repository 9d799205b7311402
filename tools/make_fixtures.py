#!/usr/bin/env python3
"""Regenerate the ONNX fixtures under tests/fixtures/ from real exporters.

Every model is built from a ``transformers`` config object with seeded random weights (nothing
is downloaded), made tiny but structurally real, and exported three ways (CNNs a fourth):

* ``ts14``   - TorchScript exporter, ``torch.onnx.export(..., dynamo=False, opset_version=14)``
* ``ts17``   - TorchScript exporter, opset 17
* ``dynamo`` - ``torch.onnx.export(..., dynamo=True)`` with its default opset (falls back to 18)
* ``dynamo_noopt`` - the same with ``optimize=False`` (CNNs only): the exporter's own optimizer folds
  BatchNorm into Conv, this keeps it

The LLM decoder families (``LLM_FAMILIES``: qwen2, qwen3, phi, gptj, gemma, deepseek_v3, qwen2_fp16) get
``ts17`` and ``dynamo`` and go into the manifest's separate ``llm_fixtures`` list; their expected counts add
rotary applications, counted by monkeypatching the modeling module's ``apply_rotary_pos_emb*``.

The census families (``CENSUS_FAMILIES``, issue 9: distilbert, albert, electra, deberta_v2, t5, bart, mistral,
falcon, bloom, gpt_neox, swin, beit, clip_vision, convnext, regnet, mha_torch, attn_pool, mistral_fp16, bart_fp16,
mistral_static, mistral_static_fp16, mistral_sdpa_static_fp16)
get ``ts17`` and ``dynamo`` (regnet: ``ts17`` and ``dynamo_noopt``) and go into the manifest's ``census_fixtures``
list, with ``dtype`` and ``shapes``; their expected counts come from ``census_structure`` (one hooked forward:
softmax calls inside attention modules, norm / GELU / gated-MLP module calls, rotary applications, Conv/BN/activation
chains, residual blocks), never from the ONNX graph.

Each file is loaded back, run in onnxruntime (graph optimizations off) on seeded inputs and
compared with the torch model; everything observed goes into ``tests/fixtures/manifest.json``.

Usage::

    pip install torch==2.13.0 transformers onnxscript onnx onnxruntime
    python tools/make_fixtures.py                  # all families
    python tools/make_fixtures.py --only bert gpt2 # a subset (manifest entries of others kept)

The tests never import torch; they only read the committed .onnx files and the manifest.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
MANIFEST = FIXTURES / "manifest.json"
SEED = 0
TOL = 1e-4
EXPORTERS = ("ts14", "ts17", "dynamo", "dynamo_noopt")
DEFAULT_EXPORTERS = ("ts14", "ts17", "dynamo")
DYNAMO_FALLBACK_OPSET = 18


# --------------------------------------------------------------------------------------------
# weight randomisation: make norms / biases non-trivial so folding and fusion numerics are
# actually exercised (HF init leaves BN at mean 0 / var 1 / gamma 1 / beta 0 and biases at 0).
# --------------------------------------------------------------------------------------------
def _randomise_(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 1)

    def rn(t, std):
        return torch.randn(t.shape, generator=g, dtype=t.dtype) * std

    def ru(t, lo, hi):
        return lo + (hi - lo) * torch.rand(t.shape, generator=g, dtype=t.dtype)

    with torch.no_grad():
        for mod in model.modules():
            cls = type(mod).__name__
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                mod.weight.copy_(ru(mod.weight, 0.5, 1.5))
                mod.bias.copy_(rn(mod.bias, 0.1))
                mod.running_mean.copy_(rn(mod.running_mean, 0.1))
                mod.running_var.copy_(ru(mod.running_var, 0.5, 1.5))
            elif isinstance(mod, nn.LayerNorm):
                if mod.weight is not None:
                    mod.weight.copy_(ru(mod.weight, 0.5, 1.5))
                if mod.bias is not None:
                    mod.bias.copy_(rn(mod.bias, 0.1))
            elif "RMSNorm" in cls and getattr(mod, "weight", None) is not None:
                mod.weight.copy_(ru(mod.weight, 0.5, 1.5))
            elif isinstance(mod, nn.Linear) or cls == "Conv1D" or isinstance(mod, nn.Conv2d):
                if getattr(mod, "bias", None) is not None:
                    mod.bias.copy_(rn(mod.bias, 0.05))


# --------------------------------------------------------------------------------------------
# wrappers: plain tensors in, last_hidden_state out
# --------------------------------------------------------------------------------------------
class TextWrapper3(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.m(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            return_dict=True,
        ).last_hidden_state


class TextWrapper2(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask):
        return self.m(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=True
        ).last_hidden_state


class ImageWrapper(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, pixel_values):
        return self.m(pixel_values=pixel_values, return_dict=True).last_hidden_state


# --------------------------------------------------------------------------------------------
# families
# --------------------------------------------------------------------------------------------
def _text_inputs(batch, seq, vocab, with_tt, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g, dtype=torch.int64)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    if batch > 1 and seq > 2:
        mask[1, -2:] = 0  # right padding on the second row
    out = [ids, mask]
    if with_tt:
        tt = torch.zeros(batch, seq, dtype=torch.int64)
        tt[:, seq // 2 :] = 1
        out.append(tt)
    return tuple(out)


def _image_inputs(batch, size, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, size, size, generator=g),)


def build_resnet():
    cfg = transformers.ResNetConfig(
        num_channels=3,
        embedding_size=16,
        hidden_sizes=[32, 64, 96, 128],
        depths=[2, 1, 1, 1],
        layer_type="bottleneck",
        hidden_act="relu",
    )
    m = transformers.ResNetModel(cfg)
    return dict(
        model=ImageWrapper(m),
        kind="cnn",
        inputs=_image_inputs(1, 64, SEED),
        extra_inputs=[],
        input_names=["pixel_values"],
        dynamic=None,
        config={
            "class": "ResNetModel",
            "layer_type": "bottleneck",
            "embedding_size": 16,
            "hidden_sizes": [32, 64, 96, 128],
            "depths": [2, 1, 1, 1],
            "hidden_act": "relu",
            "image": [1, 3, 64, 64],
        },
    )


def build_mobilenetv2():
    cfg = transformers.MobileNetV2Config(
        num_channels=3,
        image_size=64,
        depth_multiplier=0.25,
        expand_ratio=4.0,
        finegrained_output=False,
        hidden_act="relu6",
        tf_padding=True,
    )
    m = transformers.MobileNetV2Model(cfg)
    return dict(
        model=ImageWrapper(m),
        kind="cnn",
        inputs=_image_inputs(1, 64, SEED),
        extra_inputs=[],
        input_names=["pixel_values"],
        dynamic=None,
        config={
            "class": "MobileNetV2Model",
            "depth_multiplier": 0.25,
            "expand_ratio": 4.0,
            "finegrained_output": False,
            "hidden_act": "relu6",
            "tf_padding": True,
            "image": [1, 3, 64, 64],
        },
    )


def build_bert(attn="eager"):
    L, H, NH = 2, 32, 4
    cfg = transformers.BertConfig(
        vocab_size=100,
        hidden_size=H,
        num_hidden_layers=L,
        num_attention_heads=NH,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    cfg._attn_implementation = attn
    m = transformers.BertModel(cfg, add_pooling_layer=False)
    m.config._attn_implementation = attn
    return dict(
        model=TextWrapper3(m),
        kind="transformer",
        inputs=_text_inputs(2, 8, 100, True, SEED),
        extra_inputs=[_text_inputs(3, 5, 100, True, SEED + 7)],
        input_names=["input_ids", "attention_mask", "token_type_ids"],
        dynamic={"batch": 0, "sequence": 1},
        config={
            "class": "BertModel",
            "num_layers": L,
            "hidden": H,
            "heads": NH,
            "intermediate": 64,
            "vocab": 100,
            "hidden_act": "gelu (erf)",
            "attn_implementation": attn,
        },
    )


def build_gpt2(attn="eager"):
    L, H, NH = 2, 32, 4
    cfg = transformers.GPT2Config(
        vocab_size=100,
        n_positions=64,
        n_embd=H,
        n_layer=L,
        n_head=NH,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg._attn_implementation = attn
    m = transformers.GPT2Model(cfg)
    m.config._attn_implementation = attn
    return dict(
        model=TextWrapper2(m),
        kind="transformer",
        inputs=_text_inputs(2, 8, 100, False, SEED),
        extra_inputs=[_text_inputs(3, 5, 100, False, SEED + 7)],
        input_names=["input_ids", "attention_mask"],
        dynamic={"batch": 0, "sequence": 1},
        config={
            "class": "GPT2Model",
            "num_layers": L,
            "hidden": H,
            "heads": NH,
            "intermediate": 4 * H,
            "vocab": 100,
            "hidden_act": "gelu_new (tanh)",
            "attn_implementation": attn,
        },
    )


def build_vit(attn="eager"):
    L, H, NH = 2, 32, 4
    cfg = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=H,
        num_hidden_layers=L,
        num_attention_heads=NH,
        intermediate_size=64,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    cfg._attn_implementation = attn
    m = transformers.ViTModel(cfg, add_pooling_layer=False)
    m.config._attn_implementation = attn
    return dict(
        model=ImageWrapper(m),
        kind="transformer",
        inputs=_image_inputs(2, 32, SEED),
        extra_inputs=[_image_inputs(3, 32, SEED + 7)],
        input_names=["pixel_values"],
        dynamic={"batch": 0},
        config={
            "class": "ViTModel",
            "num_layers": L,
            "hidden": H,
            "heads": NH,
            "intermediate": 64,
            "image": [32, 32],
            "patch": 8,
            "hidden_act": "gelu (erf)",
            "attn_implementation": attn,
        },
    )


def build_llama(attn="eager"):
    L, H, NH, KV = 2, 32, 4, 2
    cfg = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=L,
        num_attention_heads=NH,
        num_key_value_heads=KV,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        use_cache=False,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = attn
    m = transformers.LlamaModel(cfg)
    m.config._attn_implementation = attn
    return dict(
        model=TextWrapper2(m),
        kind="transformer",
        inputs=_text_inputs(2, 8, 100, False, SEED),
        extra_inputs=[_text_inputs(3, 5, 100, False, SEED + 7)],
        input_names=["input_ids", "attention_mask"],
        dynamic={"batch": 0, "sequence": 1},
        config={
            "class": "LlamaModel",
            "num_layers": L,
            "hidden": H,
            "heads": NH,
            "kv_heads": KV,
            "head_dim": H // NH,
            "intermediate": 64,
            "vocab": 100,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "attn_implementation": attn,
        },
    )


def build_mlp_bn():
    """Not a transformers model: the Linear -> BatchNorm1d -> ReLU head that classifiers and recommender
    towers use (torch.nn only), for the Gemm + BatchNormalization fold."""
    m = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 24), nn.BatchNorm1d(24),
                      nn.ReLU(), nn.Linear(24, 8), nn.BatchNorm1d(8))
    g = torch.Generator().manual_seed(SEED)
    return dict(
        model=m,
        kind="cnn",  # BatchNorm kept by the exporter, as for the CNNs
        inputs=(torch.randn(4, 16, generator=g),),
        extra_inputs=[],
        input_names=["features"],
        dynamic=None,
        config={"class": "torch.nn.Sequential", "layers": "Linear-BN1d-ReLU x2, Linear-BN1d", "input": [4, 16]},
    )


FAMILIES = {
    "resnet": build_resnet,
    "mlp_bn": build_mlp_bn,
    "mobilenetv2": build_mobilenetv2,
    "bert": build_bert,
    "gpt2": build_gpt2,
    "vit": build_vit,
    "llama": build_llama,
    # Extra variants: the same models with attn_implementation="sdpa". At these opsets the
    # exporters do not hide SDPA in one op; they decompose it into the form the main (eager)
    # fixtures lack: Mul on Q and on K^T by 1/sqrt(sqrt(d)), a per-layer boolean-mask
    # Where(mask, 0, -inf) -> Add, and the IsNaN -> Where guard after Softmax.
    "bert_sdpa": lambda: build_bert(attn="sdpa"),
    "llama_sdpa": lambda: build_llama(attn="sdpa"),
}
# which exporters each family gets (default: all three)
FAMILY_EXPORTERS = {"bert_sdpa": ("ts17", "dynamo"), "llama_sdpa": ("ts17", "dynamo"),
                    # The dynamo exporter's own optimizer folds BN into Conv; `dynamo_noopt` keeps it, so the
                    # dynamo form of an eval-mode BatchNormalization is covered too.
                    "resnet": ("ts14", "ts17", "dynamo", "dynamo_noopt"),
                    "mobilenetv2": ("ts14", "ts17", "dynamo", "dynamo_noopt"),
                    "mlp_bn": ("ts14", "ts17", "dynamo_noopt")}
BASE_FAMILY = {"bert_sdpa": "bert", "llama_sdpa": "llama", "qwen2_fp16": "qwen2"}


# --------------------------------------------------------------------------------------------
# LLM decoders beyond llama (issue 10): rotary variants, QK-norm, GeGLU, MLA. Tiny (2 layers,
# hidden 64), eager attention, last_hidden_state out. Their manifest entries go in the separate
# list "llm_fixtures" (same entry format as "fixtures"): the older suites parametrize over every
# entry of "fixtures" and check families they were written for; tests/test_llm_fixtures.py reads
# this list.
# --------------------------------------------------------------------------------------------
LLM_L, LLM_H, LLM_NH, LLM_KV, LLM_FF, LLM_VOCAB = 2, 64, 4, 2, 96, 100


def _build_decoder(cfg_cls, model_cls, summary, dtype=torch.float32, **cfg_kw):
    cfg = getattr(transformers, cfg_cls)(vocab_size=LLM_VOCAB, use_cache=False, tie_word_embeddings=False,
                                         **cfg_kw)
    cfg._attn_implementation = "eager"
    m = getattr(transformers, model_cls)(cfg)
    m.config._attn_implementation = "eager"
    return dict(
        model=TextWrapper2(m),
        kind="transformer",
        dtype=dtype,
        inputs=_text_inputs(2, 8, LLM_VOCAB, False, SEED),
        extra_inputs=[_text_inputs(3, 5, LLM_VOCAB, False, SEED + 7)],
        input_names=["input_ids", "attention_mask"],
        dynamic={"batch": 0, "sequence": 1},
        config={"class": model_cls, "num_layers": LLM_L, "hidden": LLM_H, "vocab": LLM_VOCAB,
                "attn_implementation": "eager", "dtype": str(dtype).replace("torch.", ""), **summary},
    )


def build_qwen2(dtype=torch.float32):
    hd = LLM_H // LLM_NH
    return _build_decoder(
        "Qwen2Config", "Qwen2Model",
        {"heads": LLM_NH, "kv_heads": LLM_KV, "head_dim": hd, "intermediate": LLM_FF, "hidden_act": "silu",
         "qkv_bias": True, "rotary": "half-split (rotate_half), full head_dim"},
        dtype=dtype, hidden_size=LLM_H, intermediate_size=LLM_FF, num_hidden_layers=LLM_L,
        num_attention_heads=LLM_NH, num_key_value_heads=LLM_KV, max_position_embeddings=64, rms_norm_eps=1e-6,
        hidden_act="silu", use_sliding_window=False)


def build_qwen3():
    hd = LLM_H // LLM_NH
    return _build_decoder(
        "Qwen3Config", "Qwen3Model",
        {"heads": LLM_NH, "kv_heads": LLM_KV, "head_dim": hd, "intermediate": LLM_FF, "hidden_act": "silu",
         "qkv_bias": False, "qk_norm": "RMSNorm over head_dim of q and k, before rotary",
         "rotary": "half-split (rotate_half), full head_dim"},
        hidden_size=LLM_H, intermediate_size=LLM_FF, num_hidden_layers=LLM_L, num_attention_heads=LLM_NH,
        num_key_value_heads=LLM_KV, head_dim=hd, max_position_embeddings=64, rms_norm_eps=1e-6,
        hidden_act="silu", attention_bias=False, use_sliding_window=False)


def build_phi():
    hd = LLM_H // LLM_NH
    return _build_decoder(
        "PhiConfig", "PhiModel",
        {"heads": LLM_NH, "kv_heads": LLM_NH, "head_dim": hd, "intermediate": LLM_FF, "hidden_act": "gelu_new (tanh)",
         "partial_rotary_factor": 0.5, "rotary": "half-split on the first 8 of 16 head dims (partial)",
         "block": "parallel attention + MLP off one LayerNorm"},
        hidden_size=LLM_H, intermediate_size=LLM_FF, num_hidden_layers=LLM_L, num_attention_heads=LLM_NH,
        num_key_value_heads=LLM_NH, max_position_embeddings=64, hidden_act="gelu_new", resid_pdrop=0.0,
        embd_pdrop=0.0, attention_dropout=0.0, layer_norm_eps=1e-5, qk_layernorm=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def build_gptj():
    cfg = transformers.GPTJConfig(vocab_size=LLM_VOCAB, n_positions=64, n_embd=LLM_H, n_layer=LLM_L, n_head=LLM_NH,
                                  rotary_dim=8, n_inner=LLM_FF, activation_function="gelu_new", resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=False,
                                  bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"
    m = transformers.GPTJModel(cfg)
    m.config._attn_implementation = "eager"
    return dict(
        model=TextWrapper2(m), kind="transformer", dtype=torch.float32,
        inputs=_text_inputs(2, 8, LLM_VOCAB, False, SEED),
        extra_inputs=[_text_inputs(3, 5, LLM_VOCAB, False, SEED + 7)],
        input_names=["input_ids", "attention_mask"], dynamic={"batch": 0, "sequence": 1},
        config={"class": "GPTJModel", "num_layers": LLM_L, "hidden": LLM_H, "vocab": LLM_VOCAB,
                "attn_implementation": "eager", "dtype": "float32", "heads": LLM_NH, "kv_heads": LLM_NH,
                "head_dim": LLM_H // LLM_NH, "intermediate": LLM_FF, "hidden_act": "gelu_new (tanh)",
                "rotary_dim": 8, "rotary": "interleaved (rotate_every_two) on the first 8 of 16 head dims",
                "block": "parallel attention + MLP off one LayerNorm"},
    )


def build_gemma():
    hd = LLM_H // LLM_NH
    return _build_decoder(
        "GemmaConfig", "GemmaModel",
        {"heads": LLM_NH, "kv_heads": LLM_KV, "head_dim": hd, "intermediate": LLM_FF,
         "hidden_act": "gelu_pytorch_tanh (GeGLU)", "rmsnorm": "x * (1 + w)",
         "rotary": "half-split (rotate_half), full head_dim", "embedding_scale": "sqrt(hidden)"},
        hidden_size=LLM_H, intermediate_size=LLM_FF, num_hidden_layers=LLM_L, num_attention_heads=LLM_NH,
        num_key_value_heads=LLM_KV, head_dim=hd, max_position_embeddings=64, rms_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh", attention_bias=False)


def build_deepseek_v3():
    return _build_decoder(
        "DeepseekV3Config", "DeepseekV3Model",
        {"heads": LLM_NH, "intermediate": LLM_FF, "hidden_act": "silu", "attention": "MLA",
         "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
         "rotary": "half-split on the 8-dim rope part of q and of the shared k latent (rope split)",
         "moe": "none (first_k_dense_replace = num_layers: every MLP is dense)"},
        hidden_size=LLM_H, intermediate_size=LLM_FF, moe_intermediate_size=32, num_hidden_layers=LLM_L,
        num_attention_heads=LLM_NH, num_key_value_heads=LLM_NH, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=LLM_L, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=64,
        rms_norm_eps=1e-6, hidden_act="silu", rope_interleave=False, attention_bias=False)


LLM_FAMILIES = {
    "qwen2": build_qwen2,
    "qwen3": build_qwen3,
    "phi": build_phi,
    "gptj": build_gptj,
    "gemma": build_gemma,
    "deepseek_v3": build_deepseek_v3,
    "qwen2_fp16": lambda: build_qwen2(dtype=torch.float16),
}
LLM_MODULES = {"qwen2": "qwen2", "qwen3": "qwen3", "phi": "phi", "gptj": "gptj", "gemma": "gemma",
               "deepseek_v3": "deepseek_v3"}
# the fp16 variant: exported in half precision, checked against the fp32 torch model (same weights) at FP16_TOL
FP16_TOL = 1e-2


@contextlib.contextmanager
def count_rotary(family: str):
    """Monkeypatches the modeling module's apply_rotary_pos_emb* to count rotated tensors (q and k each count
    once: a call returning (q, k) counts 2, GPT-J's per-tensor call counts 1)."""
    import importlib

    mod = importlib.import_module(f"transformers.models.{LLM_MODULES[family]}.modeling_{LLM_MODULES[family]}")
    counter = collections.Counter()
    saved = {}
    for name in dir(mod):
        if name.startswith("apply_rotary_pos_emb"):
            fn = getattr(mod, name)

            def wrapped(*a, _fn=fn, _name=name, **k):
                out = _fn(*a, **k)
                counter[_name] += len(out) if isinstance(out, tuple) else 1
                return out

            saved[name] = fn
            setattr(mod, name, wrapped)
    try:
        yield counter
    finally:
        for name, fn in saved.items():
            setattr(mod, name, fn)


def llm_expected(family: str, model: nn.Module, st: dict, cfg: dict, rotary: collections.Counter) -> dict:
    """Expected fusion counts of an LLM decoder, from what ran in torch (hooks) and the module tree."""
    mc = st["module_calls"]
    L = cfg["num_layers"]
    attn = sum(v for k, v in mc.items() if k.endswith("Attention"))
    mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
    gated = [m for m in mlps if hasattr(m, "gate_proj") and hasattr(m, "up_proj")]
    qk_norm = sum(1 for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("q_norm", "k_norm")
                  and "RMSNorm" in type(m).__name__)
    exp = {
        "attention": attn,
        "rotary_applications": sum(rotary.values()),
        "gated_mlp": sum(mc.get(c, 0) for c in {type(g).__name__ for g in gated}),
        "rmsnorm": sum(v for k, v in mc.items() if "RMSNorm" in k),
        "qk_norm": qk_norm,
        "layernorm": mc.get("LayerNorm", 0),
        "gelu": sum(v for k, v in mc.items() if "GELU" in k or "Gelu" in k),
        "silu": mc.get("SiLUActivation", 0) + mc.get("SiLU", 0),
    }
    if cfg.get("kv_heads"):
        exp["gqa_group"] = cfg["heads"] // cfg["kv_heads"]
    # multi-head latent attention (DeepSeek-V2/V3): one MLA prolog per attention module that has the query
    # down-projection (q_a_proj) and the compressed kv path (kv_a_proj_with_mqa) the MlaProlog kernel computes
    mla = {type(m).__name__ for m in model.modules() if hasattr(m, "q_a_proj") and hasattr(m, "kv_a_proj_with_mqa")}
    if mla:
        exp["mla_prolog"] = sum(mc.get(c, 0) for c in mla)
    formula = {"attention": L, "rotary_applications": 2 * L}
    formula["gated_mlp"] = L if family.startswith(("qwen", "gemma", "deepseek")) else 0
    for k, v in formula.items():
        if exp[k] != v:
            print(f"  !! {family}: expected {k}={v} by formula but torch ran {exp[k]}")
    return exp

FAMILY_EXPORTERS.update({f: ("ts17", "dynamo") for f in LLM_FAMILIES})


# --------------------------------------------------------------------------------------------
# Census fixtures (issue 9, "matching that generalises"): architectures beyond the ones the patterns were
# written against: encoders, GQA/MQA decoders (rotary, partial rotary, ALiBi, sliding window), encoder-decoders
# with cross-attention, vision transformers with windowed or relative attention, CNNs with residual blocks, and
# two plain torch modules (nn.MultiheadAttention; attention pooling with a learned constant query). Tiny (2
# layers, hidden 32-64). Their manifest entries go in the separate list "census_fixtures" (same entry format,
# plus "dtype"); tests/test_census_fixtures.py and tools/census_report.py read it. `expected` is measured on the
# torch model only (hooks and monkeypatching during one forward, `census_structure`), never on the ONNX graph.
# --------------------------------------------------------------------------------------------
class EncoderWrapper2(nn.Module):
    """input_ids, attention_mask -> last_hidden_state (encoders whose forward takes no use_cache)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask):
        return self.m(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).last_hidden_state


class EncDecWrapper(nn.Module):
    """Encoder-decoder: encoder on input_ids/attention_mask, decoder on decoder_input_ids with cross-attention to
    the encoder output; the decoder's last_hidden_state out."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask, decoder_input_ids):
        return self.m(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                      use_cache=False, return_dict=True).last_hidden_state


def _encdec_inputs(batch, seq, vocab, seed):
    ids, mask = _text_inputs(batch, seq, vocab, False, seed)
    g = torch.Generator().manual_seed(seed + 100)
    dec = torch.randint(0, vocab, (batch, seq), generator=g, dtype=torch.int64)
    return ids, mask, dec


class MHABlock(nn.Module):
    """Pre-norm transformer block on torch.nn.MultiheadAttention (seq-first, batch_first=False: the path that
    decomposes in F.multi_head_attention_forward, not the fused fast path), GELU (tanh) MLP."""

    def __init__(self, d, heads, ff):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.0, bias=True, batch_first=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ff)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(ff, d)

    def forward(self, x, key_padding_mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=True)
        x = x + a
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class MHAEncoder(nn.Module):
    """features [B, S, D], padding_mask [B, S] (1 = pad) -> [B, S, D]; the blocks run seq-first ([S, B, D], as
    nn.MultiheadAttention's default batch_first=False wants), transposed in and out."""

    def __init__(self, d=32, heads=4, ff=64, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList(MHABlock(d, heads, ff) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, features, padding_mask):
        kpm = padding_mask.bool()
        x = features.transpose(0, 1)
        for b in self.blocks:
            x = b(x, kpm)
        return self.norm(x).transpose(0, 1)


class AttentionPool(nn.Module):
    """Multi-head attention pooling with a learned constant query (SigLIP/Perceiver-style MAP head, written out as
    eager attention): q = Wq(query) is weight-only, k, v from the tokens; softmax(q k^T / sqrt(d)) v."""

    def __init__(self, d, heads, queries):
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.query = nn.Parameter(torch.randn(1, queries, d) * 0.5)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        nq = self.query.shape[1]
        q = self.q_proj(self.query).expand(b, nq, d).reshape(b, nq, self.h, self.dh).transpose(1, 2)
        k = self.k_proj(x).reshape(b, s, self.h, self.dh).transpose(1, 2)
        v = self.v_proj(x).reshape(b, s, self.h, self.dh).transpose(1, 2)
        w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.dh)
        w = nn.functional.softmax(w, dim=-1)
        o = torch.matmul(w, v).transpose(1, 2).reshape(b, nq, d)
        return self.o_proj(o)


class AttnPoolHead(nn.Module):
    """tokens [B, S, D] -> LayerNorm -> AttentionPool (4 learned queries) -> + GELU(erf) MLP -> [B, 4, D]."""

    def __init__(self, d=32, heads=4, queries=4, ff=64):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.pool = AttentionPool(d, heads, queries)
        self.norm2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ff)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ff, d)

    def forward(self, tokens):
        p = self.pool(self.norm(tokens))
        return p + self.fc2(self.act(self.fc1(self.norm2(p))))


CEN_L, CEN_H, CEN_NH, CEN_FF, CEN_VOCAB = 2, 32, 4, 64, 100


def _cen_spec(model, inputs, extra, names, dynamic, config, formula, dtype=torch.float32, kind="transformer",
              rotary_module=None):
    return dict(model=model, kind=kind, dtype=dtype, inputs=inputs, extra_inputs=extra, input_names=names,
                dynamic=dynamic, config={**config, "dtype": str(dtype).replace("torch.", "")}, formula=formula,
                rotary_module=rotary_module)


def _hf(cfg_cls, model_cls, model_kw=None, **cfg_kw):
    cfg = getattr(transformers, cfg_cls)(**cfg_kw)
    cfg._attn_implementation = "eager"
    m = getattr(transformers, model_cls)(cfg, **(model_kw or {}))
    m.config._attn_implementation = "eager"
    return m


def _text2(m, with_tt=False):
    n = 3 if with_tt else 2
    inputs = _text_inputs(2, 8, CEN_VOCAB, with_tt, SEED)
    extra = [_text_inputs(3, 5, CEN_VOCAB, with_tt, SEED + 7)]
    names = ["input_ids", "attention_mask", "token_type_ids"][:n]
    return (TextWrapper3(m) if with_tt else EncoderWrapper2(m)), inputs, extra, names


def build_distilbert():
    m = _hf("DistilBertConfig", "DistilBertModel", vocab_size=CEN_VOCAB, dim=CEN_H, n_layers=CEN_L, n_heads=CEN_NH,
            hidden_dim=CEN_FF, max_position_embeddings=64, activation="gelu", dropout=0.0, attention_dropout=0.0)
    w, i, e, n = _text2(m)
    return _cen_spec(w, i, e, n, {"batch": 0, "sequence": 1},
                     {"class": "DistilBertModel", "num_layers": CEN_L, "hidden": CEN_H, "heads": CEN_NH,
                      "intermediate": CEN_FF, "hidden_act": "gelu (erf)", "what": "encoder, post-norm, q/k/v Linear"},
                     {"attention": CEN_L, "layernorm": 2 * CEN_L + 1, "gelu": CEN_L})


def build_albert():
    m = _hf("AlbertConfig", "AlbertModel", {"add_pooling_layer": False}, vocab_size=CEN_VOCAB, embedding_size=16,
            hidden_size=CEN_H, num_hidden_layers=CEN_L, num_attention_heads=CEN_NH, intermediate_size=CEN_FF,
            max_position_embeddings=64, hidden_act="gelu_new", hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
    w, i, e, n = _text2(m)
    return _cen_spec(w, i, e, n, {"batch": 0, "sequence": 1},
                     {"class": "AlbertModel", "num_layers": CEN_L, "hidden": CEN_H, "embedding_size": 16,
                      "heads": CEN_NH, "intermediate": CEN_FF, "hidden_act": "gelu_new (tanh)",
                      "what": "encoder with one layer's weights shared by every layer, factorised embedding"},
                     {"attention": CEN_L, "layernorm": 2 * CEN_L + 1, "gelu": CEN_L})


def build_electra():
    m = _hf("ElectraConfig", "ElectraModel", vocab_size=CEN_VOCAB, embedding_size=16, hidden_size=CEN_H,
            num_hidden_layers=CEN_L, num_attention_heads=CEN_NH, intermediate_size=CEN_FF,
            max_position_embeddings=64, hidden_act="gelu", hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
    w, i, e, n = _text2(m, with_tt=True)
    return _cen_spec(w, i, [], n, None,
                     {"class": "ElectraModel", "num_layers": CEN_L, "hidden": CEN_H, "embedding_size": 16,
                      "heads": CEN_NH, "intermediate": CEN_FF, "hidden_act": "gelu (erf)",
                      "what": "BERT-style encoder, embeddings_project 16 -> 32, static shapes [2, 8]"},
                     {"attention": CEN_L, "layernorm": 2 * CEN_L + 1, "gelu": CEN_L})


def build_deberta_v2():
    m = _hf("DebertaV2Config", "DebertaV2Model", vocab_size=CEN_VOCAB, hidden_size=CEN_H, num_hidden_layers=CEN_L,
            num_attention_heads=CEN_NH, intermediate_size=CEN_FF, max_position_embeddings=64, type_vocab_size=0,
            hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, relative_attention=True,
            max_relative_positions=-1, position_buckets=8, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
            share_att_key=True, position_biased_input=False)
    w, i, e, n = _text2(m)
    return _cen_spec(w, i, e, n, {"batch": 0, "sequence": 1},
                     {"class": "DebertaV2Model", "num_layers": CEN_L, "hidden": CEN_H, "heads": CEN_NH,
                      "intermediate": CEN_FF, "hidden_act": "gelu (erf)",
                      "what": "disentangled attention: c2p and p2c relative-position terms (position_buckets 8, "
                              "share_att_key) added to QK^T before Softmax; LayerNorm on the relative embeddings"},
                     {"attention": CEN_L, "layernorm": 2 * CEN_L + 2, "gelu": CEN_L})


def build_t5():
    m = _hf("T5Config", "T5Model", vocab_size=CEN_VOCAB, d_model=CEN_H, d_kv=8, d_ff=CEN_FF, num_layers=CEN_L,
            num_decoder_layers=CEN_L, num_heads=CEN_NH, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, dropout_rate=0.0, feed_forward_proj="gated-gelu",
            tie_word_embeddings=False, use_cache=False, decoder_start_token_id=0, pad_token_id=0)
    return _cen_spec(EncDecWrapper(m), _encdec_inputs(2, 8, CEN_VOCAB, SEED), [_encdec_inputs(3, 5, CEN_VOCAB, SEED + 7)],
                     ["input_ids", "attention_mask", "decoder_input_ids"], {"batch": 0, "sequence": 1},
                     {"class": "T5Model", "num_layers": CEN_L, "num_decoder_layers": CEN_L, "hidden": CEN_H,
                      "heads": CEN_NH, "d_kv": 8, "intermediate": CEN_FF, "hidden_act": "gelu_new (tanh), gated",
                      "what": "encoder-decoder: relative position bias (8 buckets) on self-attention, no 1/sqrt(d) "
                              "scale, causal decoder self-attention + cross-attention, T5LayerNorm = RMSNorm, "
                              "gated-gelu MLP (v1.1)"},
                     {"attention": 3 * CEN_L, "rmsnorm": 5 * CEN_L + 2, "gelu": 2 * CEN_L, "gated_mlp": 2 * CEN_L})


def build_bart(dtype=torch.float32):
    m = _hf("BartConfig", "BartModel", vocab_size=CEN_VOCAB, d_model=CEN_H, encoder_layers=CEN_L,
            decoder_layers=CEN_L, encoder_attention_heads=CEN_NH, decoder_attention_heads=CEN_NH,
            encoder_ffn_dim=CEN_FF, decoder_ffn_dim=CEN_FF, max_position_embeddings=64, activation_function="gelu",
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False, scale_embedding=False,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    return _cen_spec(EncDecWrapper(m), _encdec_inputs(2, 8, CEN_VOCAB, SEED), [_encdec_inputs(3, 5, CEN_VOCAB, SEED + 7)],
                     ["input_ids", "attention_mask", "decoder_input_ids"], {"batch": 0, "sequence": 1},
                     {"class": "BartModel", "num_layers": CEN_L, "num_decoder_layers": CEN_L, "hidden": CEN_H,
                      "heads": CEN_NH, "intermediate": CEN_FF, "hidden_act": "gelu (erf)",
                      "what": "encoder-decoder, post-norm, learned positions, causal decoder self-attention + "
                              "cross-attention (k/v from the encoder output)"},
                     {"attention": 3 * CEN_L, "layernorm": 5 * CEN_L + 2, "gelu": 2 * CEN_L}, dtype=dtype)


def build_mistral(dtype=torch.float32, static=False, attn="eager"):
    m = _hf("MistralConfig", "MistralModel", vocab_size=LLM_VOCAB, hidden_size=LLM_H, intermediate_size=LLM_FF,
            num_hidden_layers=LLM_L, num_attention_heads=LLM_NH, num_key_value_heads=LLM_KV, head_dim=LLM_H // LLM_NH,
            max_position_embeddings=64, rms_norm_eps=1e-6, hidden_act="silu", sliding_window=4, use_cache=False,
            tie_word_embeddings=False)
    m.config._attn_implementation = attn
    w = TextWrapper2(m)
    return _cen_spec(w, _text_inputs(2, 8, LLM_VOCAB, False, SEED), [_text_inputs(3, 5, LLM_VOCAB, False, SEED + 7)],
                     ["input_ids", "attention_mask"], None if static else {"batch": 0, "sequence": 1},
                     {"class": "MistralModel", "num_layers": LLM_L, "hidden": LLM_H, "heads": LLM_NH,
                      "kv_heads": LLM_KV, "head_dim": LLM_H // LLM_NH, "intermediate": LLM_FF, "hidden_act": "silu",
                      "sliding_window": 4, "attn_implementation": attn,
                      "what": "GQA decoder (4 q / 2 kv heads), rotary, SwiGLU, RMSNorm, "
                                                   "sliding-window (4) causal mask"
                                                   + ("; static shapes [2, 8] (the dynamo exporter then writes the "
                                                      "K head repeat flattened to 3-D with constant targets)"
                                                      if static else "")},
                     {"attention": LLM_L, "rmsnorm": 2 * LLM_L + 1, "gated_mlp": LLM_L,
                      "rotary_applications": 2 * LLM_L}, dtype=dtype, rotary_module="mistral")


def build_falcon():
    m = _hf("FalconConfig", "FalconModel", vocab_size=LLM_VOCAB, hidden_size=LLM_H, num_hidden_layers=LLM_L,
            num_attention_heads=LLM_NH, multi_query=True, new_decoder_architecture=False, parallel_attn=True,
            alibi=False, bias=False, hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=64,
            use_cache=False, bos_token_id=0, eos_token_id=0)
    return _cen_spec(TextWrapper2(m), _text_inputs(2, 8, LLM_VOCAB, False, SEED),
                     [_text_inputs(3, 5, LLM_VOCAB, False, SEED + 7)], ["input_ids", "attention_mask"],
                     {"batch": 0, "sequence": 1},
                     {"class": "FalconModel", "num_layers": LLM_L, "hidden": LLM_H, "heads": LLM_NH, "kv_heads": 1,
                      "head_dim": LLM_H // LLM_NH, "intermediate": 4 * LLM_H, "hidden_act": "gelu (erf)",
                      "what": "MQA (one kv head) from a fused query_key_value projection, rotary, parallel "
                              "attention + MLP off one LayerNorm (falcon-7b layout)"},
                     {"attention": LLM_L, "layernorm": LLM_L + 1, "gelu": LLM_L, "rotary_applications": 2 * LLM_L},
                     rotary_module="falcon")


def build_bloom():
    m = _hf("BloomConfig", "BloomModel", vocab_size=LLM_VOCAB, hidden_size=CEN_H, n_layer=CEN_L, n_head=CEN_NH,
            hidden_dropout=0.0, attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return _cen_spec(TextWrapper2(m), _text_inputs(2, 8, LLM_VOCAB, False, SEED),
                     [_text_inputs(3, 5, LLM_VOCAB, False, SEED + 7)], ["input_ids", "attention_mask"],
                     {"batch": 0, "sequence": 1},
                     {"class": "BloomModel", "num_layers": CEN_L, "hidden": CEN_H, "heads": CEN_NH,
                      "intermediate": 4 * CEN_H, "hidden_act": "bloom_gelu (tanh, written out)",
                      "what": "ALiBi decoder: per-head linear position bias via baddbmm, fused query_key_value, "
                              "LayerNorm after the embeddings"},
                     {"attention": CEN_L, "layernorm": 2 * CEN_L + 2, "gelu": CEN_L})


def build_gpt_neox():
    m = _hf("GPTNeoXConfig", "GPTNeoXModel", vocab_size=LLM_VOCAB, hidden_size=LLM_H, num_hidden_layers=LLM_L,
            num_attention_heads=LLM_NH, intermediate_size=LLM_FF, hidden_act="gelu", max_position_embeddings=64,
            use_parallel_residual=True, attention_dropout=0.0, hidden_dropout=0.0, use_cache=False,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    return _cen_spec(TextWrapper2(m), _text_inputs(2, 8, LLM_VOCAB, False, SEED),
                     [_text_inputs(3, 5, LLM_VOCAB, False, SEED + 7)], ["input_ids", "attention_mask"],
                     {"batch": 0, "sequence": 1},
                     {"class": "GPTNeoXModel", "num_layers": LLM_L, "hidden": LLM_H, "heads": LLM_NH,
                      "head_dim": LLM_H // LLM_NH, "intermediate": LLM_FF, "hidden_act": "gelu (erf)",
                      "partial_rotary_factor": 0.25,
                      "what": "partial rotary (4 of 16 head dims), fused query_key_value interleaved per head, "
                              "parallel residual (two LayerNorms per layer)"},
                     {"attention": LLM_L, "layernorm": 2 * LLM_L + 1, "gelu": LLM_L, "rotary_applications": 2 * LLM_L},
                     rotary_module="gpt_neox")


def _vision(m, size, dynamic_batch, dtype=torch.float32):
    w = ImageWrapper(m)
    inputs = tuple(t.to(dtype) for t in _image_inputs(2, size, SEED))
    extra = [tuple(t.to(dtype) for t in _image_inputs(3, size, SEED + 7))] if dynamic_batch else []
    return w, inputs, extra, ["pixel_values"], ({"batch": 0} if dynamic_batch else None)


def build_swin():
    m = _hf("SwinConfig", "SwinModel", {"add_pooling_layer": False}, image_size=32, patch_size=4, num_channels=3,
            embed_dim=16, depths=[2, 1], num_heads=[2, 4], window_size=4, mlp_ratio=2.0, hidden_act="gelu",
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return _cen_spec(*_vision(m, 32, False),
                     {"class": "SwinModel", "image": [2, 3, 32, 32], "patch": 4, "embed_dim": 16, "depths": [2, 1],
                      "heads": [2, 4], "window_size": 4, "hidden_act": "gelu (erf)",
                      "what": "windowed attention (4x4 windows of an 8x8 grid, the second block shifted with "
                              "torch.roll and an additive shift mask) + relative position bias table; patch "
                              "merging (LayerNorm on 4C); static shapes"},
                     {"attention": 3, "layernorm": 2 * 3 + 1 + 1 + 1, "gelu": 3})


def build_beit():
    m = _hf("BeitConfig", "BeitModel", {"add_pooling_layer": False}, image_size=32, patch_size=8, num_channels=3,
            hidden_size=CEN_H, num_hidden_layers=CEN_L, num_attention_heads=CEN_NH, intermediate_size=CEN_FF,
            hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
            use_relative_position_bias=True, use_shared_relative_position_bias=False, layer_scale_init_value=0.1,
            use_mean_pooling=False, use_absolute_position_embeddings=False)
    return _cen_spec(*_vision(m, 32, True),
                     {"class": "BeitModel", "num_layers": CEN_L, "hidden": CEN_H, "heads": CEN_NH,
                      "intermediate": CEN_FF, "image": [32, 32], "patch": 8, "hidden_act": "gelu (erf)",
                      "what": "ViT with a per-layer relative position bias table gathered into [H, N, N] and added "
                              "to QK^T; layer scale (lambda) on both residual branches; no q... k bias"},
                     {"attention": CEN_L, "layernorm": 2 * CEN_L + 1, "gelu": CEN_L})


def build_clip_vision(dtype=torch.float32):
    m = _hf("CLIPVisionConfig", "CLIPVisionModel", image_size=32, patch_size=8, num_channels=3, hidden_size=CEN_H,
            num_hidden_layers=CEN_L, num_attention_heads=CEN_NH, intermediate_size=CEN_FF, hidden_act="quick_gelu",
            attention_dropout=0.0)
    # post_layernorm only feeds pooler_output, which the wrapper drops: replaced so the torch count matches what
    # reaches last_hidden_state
    vm = getattr(m, "vision_model", m)  # transformers 5: the vision model is CLIPVisionModel itself
    vm.post_layernorm = nn.Identity()
    return _cen_spec(*_vision(m, 32, False, dtype),
                     {"class": "CLIPVisionModel", "num_layers": CEN_L, "hidden": CEN_H, "heads": CEN_NH,
                      "intermediate": CEN_FF, "image": [2, 3, 32, 32], "patch": 8,
                      "hidden_act": "quick_gelu (x * sigmoid(1.702 x))", "post_layernorm": "Identity (pooler only)",
                      "what": "pre-LN ViT with a pre_layrnorm after the embeddings, class embedding, quick_gelu; "
                              "static shapes"},
                     {"attention": CEN_L, "layernorm": 2 * CEN_L + 1, "gelu": CEN_L}, dtype=dtype)


def build_convnext():
    m = _hf("ConvNextConfig", "ConvNextModel", num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[16, 32],
            depths=[1, 1], hidden_act="gelu", layer_scale_init_value=0.1, drop_path_rate=0.0, image_size=32)
    m.layernorm = nn.Identity()  # only feeds pooler_output
    return _cen_spec(*_vision(m, 32, False),
                     {"class": "ConvNextModel", "hidden_sizes": [16, 32], "depths": [1, 1], "patch": 4,
                      "image": [2, 3, 32, 32], "hidden_act": "gelu (erf)", "final layernorm": "Identity (pooler only)",
                      "what": "depthwise 7x7 Conv -> channels-last LayerNorm -> Linear -> GELU -> Linear -> layer "
                              "scale -> residual; channels-first LayerNorm (mean/pow/sqrt over dim 1) after the stem "
                              "and in the downsampling layer; static shapes"},
                     {"layernorm": 4, "gelu": 2}, kind="cnn")


def build_regnet():
    m = _hf("RegNetConfig", "RegNetModel", num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[2, 1],
            groups_width=8, layer_type="y", hidden_act="relu")
    return _cen_spec(*_vision(m, 32, False),
                     {"class": "RegNetModel", "layer_type": "y", "embedding_size": 16, "hidden_sizes": [16, 32],
                      "depths": [2, 1], "groups_width": 8, "hidden_act": "relu", "image": [2, 3, 32, 32],
                      "what": "Conv-BN-ReLU, grouped 3x3 Conv-BN-ReLU, squeeze-excitation (avgpool -> Conv-ReLU -> "
                              "Conv-Sigmoid -> Mul), Conv-BN, then residual Add (shortcut Conv-BN or identity) -> "
                              "ReLU; static shapes"},
                     {"conv_residual": 3}, kind="cnn")


def build_mha_torch():
    torch.manual_seed(SEED)
    m = MHAEncoder()

    def inp(s, b, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(b, s, CEN_H, generator=g)
        pad = torch.zeros(b, s, dtype=torch.int64)
        if b > 1:
            pad[1, -2:] = 1
        return x, pad

    # static shapes: with dynamic_axes the TorchScript export of F.multi_head_attention_forward keeps a traced
    # size in a Reshape ('/blocks.0/attn/Reshape_4'), which onnxruntime rejects at [3, 5]
    return _cen_spec(m, inp(8, 2, SEED), [], ["features", "padding_mask"], None,
                     {"class": "MHAEncoder (torch.nn)", "num_layers": 2, "hidden": CEN_H, "heads": CEN_NH,
                      "intermediate": CEN_FF, "hidden_act": "gelu (tanh), nn.GELU(approximate='tanh')",
                      "what": "torch.nn.MultiheadAttention, seq-first [S, B, D] inside (input [B, S, D] transposed), packed in_proj_weight, "
                              "key_padding_mask, need_weights=True (F.multi_head_attention_forward, not the fast "
                              "path); static shapes [2, 8, 32] (TorchScript's dynamic export fails at run time)"},
                     {"attention": 2, "layernorm": 5, "gelu": 2})


def build_attn_pool():
    torch.manual_seed(SEED)
    m = AttnPoolHead()

    def inp(b, s, seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(b, s, CEN_H, generator=g),)

    return _cen_spec(m, inp(2, 8, SEED), [inp(3, 5, SEED + 7)], ["tokens"], {"batch": 0, "sequence": 1},
                     {"class": "AttnPoolHead (torch.nn)", "hidden": CEN_H, "heads": CEN_NH, "queries": 4,
                      "intermediate": CEN_FF, "hidden_act": "gelu (erf), nn.GELU()",
                      "what": "attention pooling: a learned [1, 4, D] query (q = Linear(query), weight-only, "
                              "expanded over the batch) attends over the tokens; no mask"},
                     {"attention": 1, "layernorm": 2, "gelu": 1})


def _randomise_census_extra_(model: nn.Module, seed: int) -> None:
    """Norm gains _randomise_ does not reach (T5LayerNorm, an RMSNorm by another name): made non-trivial too."""
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__ == "T5LayerNorm":
                mod.weight.copy_(0.5 + torch.rand(mod.weight.shape, generator=g, dtype=mod.weight.dtype))


CENSUS_FAMILIES = {
    "distilbert": build_distilbert,
    "albert": build_albert,
    "electra": build_electra,
    "deberta_v2": build_deberta_v2,
    "t5": build_t5,
    "bart": build_bart,
    "mistral": build_mistral,
    "falcon": build_falcon,
    "bloom": build_bloom,
    "gpt_neox": build_gpt_neox,
    "swin": build_swin,
    "beit": build_beit,
    "clip_vision": build_clip_vision,
    "convnext": build_convnext,
    "regnet": build_regnet,
    "mha_torch": build_mha_torch,
    "attn_pool": build_attn_pool,
    "mistral_fp16": lambda: build_mistral(dtype=torch.float16),
    "mistral_static": lambda: build_mistral(static=True),
    "mistral_static_fp16": lambda: build_mistral(dtype=torch.float16, static=True),
    "mistral_sdpa_static_fp16": lambda: build_mistral(dtype=torch.float16, static=True, attn="sdpa"),
    "bart_fp16": lambda: build_bart(dtype=torch.float16),
}
FAMILY_EXPORTERS.update({f: ("ts17", "dynamo") for f in CENSUS_FAMILIES})
# the CNN whose BN the dynamo exporter would fold: TorchScript (BN kept) and dynamo without its optimizer
FAMILY_EXPORTERS["regnet"] = ("ts17", "dynamo_noopt")
BASE_FAMILY.update({"mistral_fp16": "mistral", "bart_fp16": "bart", "mistral_static": "mistral",
                    "mistral_static_fp16": "mistral", "mistral_sdpa_static_fp16": "mistral"})

# leaf activation modules a Conv (or Conv -> BatchNorm) epilogue takes
_CONV_EPILOGUE_ACTS = ("ReLU", "ReLU6", "Sigmoid", "LeakyReLU", "Hardsigmoid", "Hardswish", "SiLU", "SiLUActivation")
_GELU_FORMS = {"GELUActivation": "erf", "NewGELUActivation": "tanh", "GELUTanh": "tanh", "FastGELUActivation": "tanh",
               "QuickGELUActivation": "quick (x*sigmoid(1.702x))", "BloomGelu": "tanh (bloom, written out)"}


def _is_attention_module(m: nn.Module) -> bool:
    return isinstance(m, nn.MultiheadAttention) or "Attention" in type(m).__name__


@contextlib.contextmanager
def _count_softmax(stack: list, counter: collections.Counter):
    """Counts softmax calls (F.softmax, torch.softmax, Tensor.softmax; nested calls once) by the innermost
    attention module on the module stack (`<outside attention>` when none)."""
    saved = (nn.functional.softmax, torch.softmax, torch.Tensor.softmax, nn.functional.scaled_dot_product_attention)
    depth = [0]

    def wrap(fn):
        def w(*a, **k):
            if depth[0] == 0:
                owner = next((type(m).__name__ for m in reversed(stack) if _is_attention_module(m)),
                             "<outside attention>")
                counter[owner] += 1
            depth[0] += 1
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
        return w

    # an SDPA call is one attention's softmax (the "sdpa" attention implementation never calls softmax itself)
    nn.functional.softmax, torch.softmax, torch.Tensor.softmax, nn.functional.scaled_dot_product_attention = \
        (wrap(f) for f in saved)
    try:
        yield
    finally:
        nn.functional.softmax, torch.softmax, torch.Tensor.softmax, nn.functional.scaled_dot_product_attention = saved


@contextlib.contextmanager
def _count_rotary_in(module_name: str | None):
    """count_rotary for a census family's modeling module (None: nothing to count)."""
    if module_name is None:
        yield collections.Counter()
        return
    LLM_MODULES.setdefault(module_name, module_name)
    with count_rotary(module_name) as c:
        yield c


def census_structure(spec: dict) -> dict:
    """One hooked forward of the torch model: module calls, softmax calls by attention module, norms by class,
    GELU calls by form, gated MLPs, rotary applications, and the Conv/BN/activation chains among leaf modules."""
    model, inputs = spec["model"], spec["inputs"]
    calls, softmax, records, stack, keep, hooks = collections.Counter(), collections.Counter(), [], [], [], []

    def pre(mod, args):
        stack.append(mod)

    def post(mod, args, out):
        stack.pop()
        calls[type(mod).__name__] += 1
        if len(list(mod.children())) == 0:
            a0 = args[0] if args and isinstance(args[0], torch.Tensor) else None
            o = out if isinstance(out, torch.Tensor) else None
            keep.extend([a0, o])
            records.append((mod, a0, o))

    for mod in model.modules():
        hooks.append(mod.register_forward_pre_hook(pre))
        hooks.append(mod.register_forward_hook(post))
    try:
        with _count_rotary_in(spec.get("rotary_module")) as rotary, _count_softmax(stack, softmax), torch.no_grad():
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    out_of = {id(o): mod for mod, _a, o in records if o is not None}

    def produced_by(t):
        return out_of.get(id(t)) if t is not None else None

    conv_epilogue, conv_epi_acts = 0, collections.Counter()
    for mod, a, _o in records:
        if type(mod).__name__ not in _CONV_EPILOGUE_ACTS:
            continue
        p = produced_by(a)
        if isinstance(p, nn.modules.batchnorm._BatchNorm):
            p = produced_by(next((ra for m2, ra, _ in records if m2 is p), None))
        if isinstance(p, nn.Conv2d):
            conv_epilogue += 1
            conv_epi_acts[type(mod).__name__] += 1
    layernorm = collections.Counter()
    rmsnorm = collections.Counter()
    gelu = collections.Counter()
    for mod, _a, _o in records:
        cls = type(mod).__name__
        if "RMSNorm" in cls or cls == "T5LayerNorm":
            rmsnorm[cls] += 1
        elif isinstance(mod, nn.LayerNorm):
            fmt = getattr(mod, "data_format", None)
            layernorm[cls + (f" ({fmt})" if fmt else "")] += 1
        if cls == "GELU":
            gelu[f"nn.GELU ({'tanh' if mod.approximate == 'tanh' else 'erf'})"] += 1
        elif cls in _GELU_FORMS:
            gelu[f"{cls} ({_GELU_FORMS[cls]})"] += 1
    # RMSNorm modules with children (none here) would be missed as non-leaves: count those by class too
    for cls, n in calls.items():
        if ("RMSNorm" in cls) and cls not in rmsnorm:
            rmsnorm[cls] += n
    gated_cls = {type(m).__name__ for m in model.modules()
                 if (hasattr(m, "gate_proj") and hasattr(m, "up_proj")) or (hasattr(m, "wi_0") and hasattr(m, "wi_1"))}
    residual_cls = {type(m).__name__ for m in model.modules()
                    if hasattr(m, "shortcut") and hasattr(m, "activation") and hasattr(m, "layer")}
    st = torch_structure(model, inputs)
    st.update({
        "all_module_calls": dict(sorted(calls.items())),
        "softmax_calls_by_attention_module": dict(sorted(softmax.items())),
        "layernorm_calls_by_class": dict(sorted(layernorm.items())),
        "rmsnorm_calls_by_class": dict(sorted(rmsnorm.items())),
        "gelu_calls_by_form": dict(sorted(gelu.items())),
        "gated_mlp_classes": sorted(gated_cls),
        "residual_block_classes": sorted(residual_cls),
        "conv_epilogue_activations": dict(sorted(conv_epi_acts.items())),
        "rotary_calls": dict(rotary),
    })
    exp = {
        "attention": sum(v for k, v in softmax.items() if k != "<outside attention>"),
        "layernorm": sum(layernorm.values()),
        "rmsnorm": sum(rmsnorm.values()),
        "gelu": sum(gelu.values()),
        "gated_mlp": sum(calls[c] for c in gated_cls),
        "rotary_applications": sum(rotary.values()),
        "batchnorm": st["bn_total"],
        "conv_bn": st["conv_bn"],
        "conv_epilogue": conv_epilogue,
        "conv_residual": sum(calls[c] for c in residual_cls),
    }
    if spec["config"].get("kv_heads"):
        exp["gqa_group"] = spec["config"]["heads"] // spec["config"]["kv_heads"]
    mismatch = {k: {"formula": v, "torch": exp.get(k)} for k, v in spec.get("formula", {}).items() if exp.get(k) != v}
    for k, v in mismatch.items():
        print(f"  !! expected {k}={v['formula']} by formula but torch ran {v['torch']}")
    st["formula"] = spec.get("formula", {})
    st["formula_mismatch"] = mismatch
    return exp, st


ALL_FAMILIES = {**FAMILIES, **LLM_FAMILIES, **CENSUS_FAMILIES}


# --------------------------------------------------------------------------------------------
# expected fusion counts, measured on the torch model by forward hooks (what really runs)
# --------------------------------------------------------------------------------------------
def torch_structure(model: nn.Module, inputs) -> dict:
    calls = collections.Counter()
    records = []  # (class, input tensor, output tensor) for leaf modules, in execution order
    keep = []
    hooks = []

    def hook(mod, args, out):
        cls = type(mod).__name__
        calls[cls] += 1
        if len(list(mod.children())) == 0 or "RMSNorm" in cls:
            a0 = args[0] if args and isinstance(args[0], torch.Tensor) else None
            o = out if isinstance(out, torch.Tensor) else None
            keep.extend([a0, o])
            records.append((mod, a0, o))

    for mod in model.modules():
        hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        model(*inputs)
    for h in hooks:
        h.remove()

    out_of = {}
    for mod, _a, o in records:
        if o is not None:
            out_of[id(o)] = mod
    bn_total = sum(
        1 for mod, _, _ in records if isinstance(mod, nn.modules.batchnorm._BatchNorm)
    )
    follows = collections.Counter()
    conv_bn = 0
    for mod, a, _o in records:
        if a is None:
            continue
        prod = out_of.get(id(a))
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and isinstance(prod, (nn.Conv2d, nn.Linear)):
            conv_bn += 1
        if isinstance(prod, nn.modules.batchnorm._BatchNorm):
            follows[type(mod).__name__] += 1
    interesting = {
        k: v
        for k, v in sorted(calls.items())
        if any(
            s in k
            for s in (
                "Attention",
                "LayerNorm",
                "RMSNorm",
                "GELU",
                "Gelu",
                "SiLU",
                "BatchNorm",
                "ReLU",
                "Conv2d",
                "Linear",
                "Conv1D",
                "Rotary",
                "Embedding",
                "MLP",
                "Intermediate",
            )
        )
    }
    return {
        "module_calls": interesting,
        "bn_total": bn_total,
        "conv_bn": conv_bn,
        "bn_followed_by": dict(sorted(follows.items())),
    }


def expected_counts(family: str, st: dict, cfg: dict) -> dict:
    mc = st["module_calls"]
    L = cfg.get("num_layers")
    if family in ("resnet", "mobilenetv2", "mlp_bn"):
        return {
            "batchnorm": st["bn_total"],
            "conv_bn": st["conv_bn"],
            "bn_relu": st["bn_followed_by"].get("ReLU", 0),
            "bn_relu6": st["bn_followed_by"].get("ReLU6", 0),
            "bn_no_activation": st["bn_total"]
            - st["bn_followed_by"].get("ReLU", 0)
            - st["bn_followed_by"].get("ReLU6", 0),
        }
    attn_cls = {
        "bert": ("BertSelfAttention",),
        "gpt2": ("GPT2Attention",),
        "vit": ("ViTSelfAttention", "ViTAttention"),  # transformers 5 has ViTAttention only
        "llama": ("LlamaAttention",),
    }[family]
    exp = {"attention": max(mc.get(c, 0) for c in attn_cls)}
    if family == "llama":
        exp["rmsnorm"] = mc.get("LlamaRMSNorm", 0)
        exp["silu"] = mc.get("SiLUActivation", 0) + mc.get("SiLU", 0)
        exp["rotary_applications"] = 2 * exp["attention"]  # q and k per layer
        exp["gqa_group"] = cfg["heads"] // cfg["kv_heads"]
    else:
        exp["layernorm"] = mc.get("LayerNorm", 0)
        exp["gelu"] = sum(v for k, v in mc.items() if "GELU" in k or "Gelu" in k)
    # sanity versus the architecture formulas in the brief
    formula = {"attention": L}
    if family == "llama":
        formula["rmsnorm"] = 2 * L + 1
    else:
        formula["layernorm"] = 2 * L + 1
        formula["gelu"] = L
    for k, v in formula.items():
        if exp.get(k) != v:
            print(f"  !! {family}: expected {k}={v} by formula but torch ran {exp.get(k)}")
    return exp


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------
def export_ts(spec, path, opset):
    model = spec["model"]
    kwargs = dict(
        input_names=spec["input_names"],
        output_names=["last_hidden_state"],
        opset_version=opset,
        dynamo=False,
    )
    if spec["kind"] == "cnn":
        kwargs.update(training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False)
    if spec["dynamic"]:
        axes = {n: {v: k for k, v in spec["dynamic"].items()} for n in spec["input_names"]}
        if "pixel_values" in spec["input_names"]:
            axes = {"pixel_values": {0: "batch"}}
        axes["last_hidden_state"] = {v: k for k, v in spec["dynamic"].items()}
        kwargs["dynamic_axes"] = axes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, spec["inputs"], str(path), **kwargs)
    shown = {k: (str(v) if k == "training" else v) for k, v in kwargs.items()}
    return {"export_kwargs": shown}


def export_dynamo(spec, path, optimize: bool = True):
    model = spec["model"]
    from torch.export import Dim

    dyn = None
    if spec["dynamic"]:
        dims = {name: Dim(name, min=1, max=64) for name in spec["dynamic"]}
        if "pixel_values" in spec["input_names"]:
            dims = {"batch": Dim("batch", min=1, max=64)}
            dyn = {"pixel_values": {0: dims["batch"]}}
        else:
            dims["sequence"] = Dim("sequence", min=2, max=63)
            dyn = {
                n: {spec["dynamic"]["batch"]: dims["batch"], spec["dynamic"]["sequence"]: dims["sequence"]}
                for n in spec["input_names"]
            }
    notes = []
    attempts = []
    for opset in (None, DYNAMO_FALLBACK_OPSET):
        for dshapes in ([dyn, None] if dyn else [None]):
            kwargs = dict(
                input_names=spec["input_names"],
                output_names=["last_hidden_state"],
                dynamo=True,
                external_data=False,
                optimize=optimize,
            )
            if opset is not None:
                kwargs["opset_version"] = opset
            if dshapes is not None:
                kwargs["dynamic_shapes"] = dshapes
            try:
                buf = io.StringIO()
                with warnings.catch_warnings(), contextlib.redirect_stdout(buf):
                    warnings.simplefilter("ignore")
                    prog = torch.onnx.export(model, spec["inputs"], **kwargs)
                    prog.save(str(path), external_data=False)
                info = {
                    "export_kwargs": {
                        "dynamo": True,
                        "opset_version": opset if opset is not None else "default",
                        "dynamic_shapes": (
                            {n: {str(k): str(v) for k, v in d.items()} for n, d in dshapes.items()}
                            if dshapes
                            else None
                        ),
                        "optimize": optimize,
                        "external_data": False,
                    },
                    "dynamic": dshapes is not None,
                }
                if attempts:
                    notes.append("earlier attempts failed: " + " | ".join(attempts))
                if dyn and dshapes is None:
                    notes.append("dynamic shapes failed; exported with static shapes")
                info["notes"] = notes
                return info
            except Exception as e:  # noqa: BLE001
                msg = f"opset={opset or 'default'} dynamic={dshapes is not None}: {type(e).__name__}: {str(e)[:300]}"
                attempts.append(msg)
                print("   dynamo attempt failed:", msg)
    raise RuntimeError("all dynamo attempts failed: " + " | ".join(attempts))


# --------------------------------------------------------------------------------------------
# inspection and verification
# --------------------------------------------------------------------------------------------
_DT = {v: k for k, v in onnx.TensorProto.DataType.items()}


def _inputs_of(model: onnx.ModelProto):
    inits = {i.name for i in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                shape.append(d.dim_value)
            elif d.HasField("dim_param"):
                shape.append(d.dim_param)
            else:
                shape.append("?")
        out.append({"name": vi.name, "shape": shape, "dtype": _DT[tt.elem_type].lower()})
    return out


def _all_nodes(model: onnx.ModelProto):
    """Nodes of the main graph, of subgraphs, and of local functions."""

    def walk(graph):
        for n in graph.node:
            yield n
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    yield from walk(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for g in a.graphs:
                        yield from walk(g)

    yield from walk(model.graph)
    for f in model.functions:
        yield from f.node


def _bn_report(model: onnx.ModelProto) -> dict:
    g = model.graph
    consumers = collections.defaultdict(list)
    producer = {}
    for n in g.node:
        for i in n.input:
            consumers[i].append(n)
        for o in n.output:
            producer[o] = n
    bns = [n for n in g.node if n.op_type == "BatchNormalization"]
    modes = collections.Counter()
    multi_out = 0
    follow = collections.Counter()
    conv_bn = 0
    for n in bns:
        tm = 0
        for a in n.attribute:
            if a.name == "training_mode":
                tm = a.i
        modes[tm] += 1
        if len([o for o in n.output if o]) > 1:
            multi_out += 1
        c = consumers.get(n.output[0], [])
        if len(c) == 1:
            follow[c[0].op_type] += 1
        else:
            follow[f"<{len(c)} consumers>"] += 1
        p = producer.get(n.input[0])
        if p is not None and p.op_type == "Conv":
            conv_bn += 1
    return {
        "count": len(bns),
        "training_mode_values": {str(k): v for k, v in modes.items()},
        "with_training_outputs": multi_out,
        "conv_bn": conv_bn,
        "followed_by": dict(sorted(follow.items())),
    }


def _run_ort(path, inputs, names):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feed_names = [i.name for i in sess.get_inputs()]
    feed = {}
    for n, t in zip(names, inputs):
        if n in feed_names:
            feed[n] = t.numpy()
    missing = set(feed_names) - set(feed)
    if missing:
        # dynamo may have named inputs differently; fall back to position
        feed = {n: t.numpy() for n, t in zip(feed_names, inputs)}
    return sess.run(None, feed)[0]


def verify(spec, path, dynamic: bool) -> dict:
    model = spec["model"]
    results = []
    sets = [spec["inputs"]] + (spec["extra_inputs"] if dynamic else [])
    for inp in sets:
        with torch.no_grad():
            ref = model(*inp).float().numpy()
        got = _run_ort(path, inp, spec["input_names"])
        if got.shape != ref.shape:
            results.append({"shape": list(ref.shape), "error": f"shape {got.shape} != {ref.shape}"})
            continue
        err = float(np.max(np.abs(got.astype(np.float32) - ref)))
        results.append({"shape": [int(s) for s in inp[0].shape], "max_abs_err": err})
    worst = max((r.get("max_abs_err", float("inf")) for r in results), default=float("inf"))
    tol = spec.get("tol", TOL)
    return {"max_abs_err": worst, "tolerance": tol, "passed": bool(worst <= tol), "checks": results}


# Node metadata the dynamo exporter writes that is bulky or machine-specific (absolute local
# paths in stack traces). Kept: "namespace" (module path of each node, the only readable trace of
# where a node came from, since dynamo node names are like node_Conv_12) and
# "pkg.onnxscript.rewriter.rule_name" (which optimizer rule produced a node).
STRIP_METADATA_KEYS = (
    "pkg.torch.onnx.stack_trace",
    "pkg.torch.onnx.fx_node",
    "pkg.torch.onnx.class_hierarchy",
    "pkg.torch.onnx.name_scopes",
)


def _strip_metadata(m: onnx.ModelProto) -> int:
    n_removed = 0
    for n in _all_nodes(m):
        keep = [p for p in n.metadata_props if p.key not in STRIP_METADATA_KEYS]
        if len(keep) != len(n.metadata_props):
            n_removed += len(n.metadata_props) - len(keep)
            del n.metadata_props[:]
            n.metadata_props.extend(keep)
    return n_removed


def _embed_weights(path: Path) -> bool:
    m = onnx.load(str(path), load_external_data=True)
    _strip_metadata(m)
    had_external = any(
        i.data_location == onnx.TensorProto.EXTERNAL for i in m.graph.initializer
    ) or any(p.name != path.name and p.name.startswith(path.name) for p in path.parent.iterdir())
    # always re-save in one file (drops any .data side file reference)
    onnx.save(m, str(path), save_as_external_data=False)
    for p in path.parent.iterdir():
        if p != path and p.name.startswith(path.name):
            p.unlink()
    return had_external


def describe(path: Path) -> dict:
    m = onnx.load(str(path))
    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), None)
    counts = collections.Counter(n.op_type for n in _all_nodes(m))
    main_counts = collections.Counter(n.op_type for n in m.graph.node)
    onnx.checker.check_model(m)
    info = {
        "opset": opset,
        "opset_imports": {(o.domain or "ai.onnx"): o.version for o in m.opset_import},
        "ir_version": m.ir_version,
        "producer": f"{m.producer_name} {m.producer_version}".strip(),
        "inputs": _inputs_of(m),
        "outputs": _inputs_of(onnx.ModelProto(graph=onnx.GraphProto(input=m.graph.output))),
        "num_nodes": len(m.graph.node),
        "num_initializers": len(m.graph.initializer),
        "local_functions": len(m.functions),
        "op_counts": dict(sorted(counts.items())),
        "size_bytes": path.stat().st_size,
    }
    rules = collections.Counter()
    for n in _all_nodes(m):
        for p in n.metadata_props:
            if p.key == "pkg.onnxscript.rewriter.rule_name":
                rules.update(r.strip() for r in p.value.split(",") if r.strip())
    if rules:
        # onnxscript optimizer rules the dynamo exporter applied (from node metadata)
        info["exporter_rewrite_rules"] = dict(sorted(rules.items()))
    if main_counts != counts:
        info["op_counts_main_graph"] = dict(sorted(main_counts.items()))
    if "BatchNormalization" in counts or "Conv" in counts:
        info["batchnorm"] = _bn_report(m)
    return info


# --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=sorted(ALL_FAMILIES), help="families to regenerate")
    ap.add_argument("--exporters", nargs="+", choices=EXPORTERS, default=list(EXPORTERS))
    args = ap.parse_args(argv)

    FIXTURES.mkdir(parents=True, exist_ok=True)
    manifest = {"fixtures": [], "llm_fixtures": [], "census_fixtures": [], "errors": []}
    if MANIFEST.exists() and args.only:
        old = json.loads(MANIFEST.read_text())
        manifest["fixtures"] = [f for f in old.get("fixtures", []) if f["family"] not in args.only]
        manifest["llm_fixtures"] = [f for f in old.get("llm_fixtures", []) if f["family"] not in args.only]
        manifest["census_fixtures"] = [f for f in old.get("census_fixtures", []) if f["family"] not in args.only]
        manifest["errors"] = [e for e in old.get("errors", []) if e["family"] not in args.only]

    families = args.only or list(ALL_FAMILIES)
    failures = 0
    for fam in families:
        torch.manual_seed(SEED)
        llm = fam in LLM_FAMILIES
        census = fam in CENSUS_FAMILIES
        spec = ALL_FAMILIES[fam]()
        _randomise_(spec["model"], SEED)
        if census:
            _randomise_census_extra_(spec["model"], SEED)
        if spec.get("dtype", torch.float32) == torch.float16:
            spec["model"].half()
            spec["tol"] = FP16_TOL
        spec["model"].eval()
        if census:
            exp, st = census_structure(spec)
        elif llm:
            with count_rotary(BASE_FAMILY.get(fam, fam)) as rotary:
                st = torch_structure(spec["model"], spec["inputs"])
            st["rotary_calls"] = dict(rotary)
            exp = llm_expected(BASE_FAMILY.get(fam, fam), spec["model"], st, spec["config"], rotary)
        else:
            st = torch_structure(spec["model"], spec["inputs"])
            exp = expected_counts(BASE_FAMILY.get(fam, fam), st, spec["config"])
        print(f"== {fam}: expected {exp}")
        for tag in [t for t in args.exporters if t in FAMILY_EXPORTERS.get(fam, DEFAULT_EXPORTERS)]:
            out = FIXTURES / f"{fam}_{tag}.onnx"
            entry = {
                "file": out.name,
                "family": fam,
                "base_family": BASE_FAMILY.get(fam, fam),
                "extra_variant": fam in BASE_FAMILY,
                "exporter": tag,
                "config": spec["config"],
                "torch": {"version": torch.__version__, "transformers": transformers.__version__},
            }
            try:
                with tempfile.TemporaryDirectory() as td:
                    tmp = Path(td) / out.name
                    if tag.startswith("dynamo"):
                        info = export_dynamo(spec, tmp, optimize=tag == "dynamo")
                    else:
                        info = export_ts(spec, tmp, int(tag[2:]))
                        info["dynamic"] = bool(spec["dynamic"])
                    info["had_external_data"] = _embed_weights(tmp)
                    if out.exists():
                        out.unlink()
                    tmp.replace(out)
                entry.update(info)
                if tag.startswith("dynamo"):
                    entry["stripped_node_metadata"] = list(STRIP_METADATA_KEYS)
                entry.update(describe(out))
                entry["expected"] = exp
                entry["torch_structure"] = st
                notes = entry.setdefault("notes", [])
                bn = entry.get("batchnorm")
                if spec["kind"] == "cnn":
                    if not bn or bn["count"] != st["bn_total"]:
                        notes.append(
                            f"BatchNormalization count in graph = {bn['count'] if bn else 0}, "
                            f"torch model has {st['bn_total']} BN modules (folded or decomposed)"
                        )
                        rr = entry.get("exporter_rewrite_rules", {})
                        if rr.get("FuseBatchNormIntoConv"):
                            notes.append(
                                "dynamo exporter's onnxscript optimizer folded BN into Conv "
                                f"(FuseBatchNormIntoConv x{rr['FuseBatchNormIntoConv']}; "
                                "torch.onnx.export(optimize=False) would keep BatchNormalization)"
                            )
                    elif bn["with_training_outputs"] or bn["training_mode_values"].get("1"):
                        notes.append("BatchNormalization has training outputs / training_mode=1")
                    else:
                        notes.append("all BatchNormalization preserved, training_mode=0, single output")
                v = verify(spec, out, entry.get("dynamic", False))
                entry["verification"] = v
                entry["max_abs_err"] = v["max_abs_err"]
                print(
                    f"  {out.name:28s} opset {entry['opset']:>2} nodes {entry['num_nodes']:4d} "
                    f"size {entry['size_bytes'] / 1024:7.1f} KiB  max|err| {v['max_abs_err']:.2e} "
                    f"{'OK' if v['passed'] else 'FAIL'}"
                )
                if not v["passed"]:
                    failures += 1
                if census:
                    entry["dtype"] = spec["config"]["dtype"]
                    entry["shapes"] = "dynamic" if entry.get("dynamic") else "static"
                manifest["census_fixtures" if census else "llm_fixtures" if llm else "fixtures"].append(entry)
            except Exception as e:  # noqa: BLE001
                failures += 1
                tb = traceback.format_exc(limit=3)
                print(f"  {out.name}: FAILED {type(e).__name__}: {str(e)[:500]}")
                manifest["errors"].append(
                    {
                        "file": out.name,
                        "family": fam,
                        "exporter": tag,
                        "error": f"{type(e).__name__}: {str(e)[:2000]}",
                        "traceback": tb[-2000:],
                    }
                )
                if out.exists():
                    out.unlink()

    order = {f: i for i, f in enumerate(ALL_FAMILIES)}
    key = lambda e: (order.get(e["family"], 99), EXPORTERS.index(e["exporter"]))  # noqa: E731
    manifest["fixtures"].sort(key=key)
    manifest["llm_fixtures"].sort(key=key)
    manifest["census_fixtures"].sort(key=key)
    manifest["errors"].sort(key=key)
    manifest["generator"] = {
        "script": "tools/make_fixtures.py",
        "seed": SEED,
        "tolerance": TOL,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "python": sys.version.split()[0],
    }
    try:
        import onnxscript

        manifest["generator"]["onnxscript"] = onnxscript.__version__
    except Exception:  # noqa: BLE001
        pass
    manifest = {"generator": manifest.pop("generator"), **manifest}
    MANIFEST.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    total = sum(p.stat().st_size for p in FIXTURES.glob("*.onnx"))
    print(f"wrote {MANIFEST.relative_to(ROOT)}; {len(manifest['fixtures']) + len(manifest['llm_fixtures']) + len(manifest['census_fixtures'])} fixtures, "
          f"{len(manifest['errors'])} errors, {total / 1024:.0f} KiB of .onnx")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
