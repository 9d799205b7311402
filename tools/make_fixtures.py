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

The families live in tools/fixtures/, one module per group (cnn, encoders, decoders, encdec, vision,
torch_blocks), each with a ``REGISTRY`` of its families; this script merges them (``FAMILY_MODULES``, in the
manifest's order ``FAMILY_ORDER``) into ``FAMILIES``, ``LLM_FAMILIES``, ``CENSUS_FAMILIES`` and ``ALL_FAMILIES``.
tools/fixtures/__init__.py describes a family module's interface and how to add one.

The tests never import torch; they only read the committed .onnx files and the manifest.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the fixtures package beside this script
from fixtures.common import EXPORTERS, FIXTURES, MANIFEST_LISTS, Family
from fixtures.generate import generate_family
from fixtures.manifest import read_manifest, write_manifest

# The family modules under tools/fixtures/, each with a REGISTRY; a new module is registered by adding its name here.
FAMILY_MODULES = ("cnn", "encoders", "decoders", "encdec", "vision", "torch_blocks", "diffusion", "moe", "hybrid_cnn", "gemma2",
                  "flux", "ultralytics_yolo")

# The order of the families in the manifest (its entries are sorted by it), as it was when the families were split
# into modules. A family not named here follows these, in FAMILY_MODULES and then REGISTRY order.
FAMILY_ORDER = (
    # "fixtures"
    "resnet", "mlp_bn", "mobilenetv2", "bert", "gpt2", "vit", "llama", "bert_sdpa", "llama_sdpa",
    # "llm_fixtures"
    "qwen2", "qwen3", "phi", "gptj", "gemma", "deepseek_v3", "qwen2_fp16",
    # "census_fixtures"
    "distilbert", "albert", "electra", "deberta_v2", "t5", "bart", "mistral", "falcon", "bloom", "gpt_neox", "swin",
    "beit", "clip_vision", "convnext", "regnet", "mha_torch", "attn_pool", "mistral_fp16", "mistral_static",
    "mistral_static_fp16", "mistral_sdpa_static_fp16", "bart_fp16",
)


def merged_registry() -> dict[str, Family]:
    """Every registered family, by manifest list ("fixtures", "llm_fixtures", "census_fixtures") and within a list in
    FAMILY_ORDER, then module and registry order."""
    registered: dict[str, Family] = {}
    home: dict[str, str] = {}
    for module_name in FAMILY_MODULES:
        for fam, family in importlib.import_module(f"fixtures.{module_name}").REGISTRY.items():
            if fam in registered:
                raise ValueError(f"family {fam!r} is registered by tools/fixtures/{home[fam]}.py and by "
                                 f"tools/fixtures/{module_name}.py: rename one")
            registered[fam], home[fam] = family, module_name
    missing = [fam for fam in FAMILY_ORDER if fam not in registered]
    if missing:
        raise ValueError(f"FAMILY_ORDER names families no module registers: {missing}; remove them from FAMILY_ORDER "
                         f"in tools/make_fixtures.py or register them")
    rank = {fam: i for i, fam in enumerate(FAMILY_ORDER)}
    ordered = sorted(registered, key=lambda fam: rank.get(fam, len(rank)))  # stable: the rest keep module order
    return {fam: registered[fam] for lst in MANIFEST_LISTS for fam in ordered if registered[fam].manifest_list == lst}


REGISTRY = merged_registry()
FAMILIES = {fam: f.build for fam, f in REGISTRY.items() if f.manifest_list == "fixtures"}
LLM_FAMILIES = {fam: f.build for fam, f in REGISTRY.items() if f.manifest_list == "llm_fixtures"}
CENSUS_FAMILIES = {fam: f.build for fam, f in REGISTRY.items() if f.manifest_list == "census_fixtures"}
ALL_FAMILIES = {**FAMILIES, **LLM_FAMILIES, **CENSUS_FAMILIES}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=sorted(ALL_FAMILIES), help="families to regenerate")
    ap.add_argument("--exporters", nargs="+", choices=EXPORTERS, default=list(EXPORTERS))
    args = ap.parse_args(argv)

    FIXTURES.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(args.only)
    families = args.only or list(ALL_FAMILIES)
    failures = 0
    for fam in families:
        failures += generate_family(fam, REGISTRY[fam], args.exporters, manifest)
    write_manifest(manifest, list(ALL_FAMILIES))
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
