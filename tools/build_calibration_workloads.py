#!/usr/bin/env python3
"""Build the weight-free ONNX recipes of the 310P3 calibration workloads (npufuse/npu_model/calibration/workloads/).

Each published row of ``ascend310p3.toml`` names a ``workload``; ``npufuse calibrate`` must build that workload's
fused graph at the row's batch (and sequence length) without torch and without downloads. This tool exports each
architecture once, with random weights, and makes the file LIGHT: every initializer bigger than a few elements is
replaced by a ``ConstantOfShape`` node of the same shape and dtype (onnx's own ``backend/test/data/light`` models do
the same), so ResNet-152 or BERT-large is a few tens of KB. npufuse's normaliser treats such weight-only nodes as
constants and folds them only when a rewrite asks (see ``npufuse/prepare/normalize.py``), so the light file fuses like the
full one — ``--compare`` checks that (fusion census of ``npufuse optimize --no-verify`` on both must be equal).

Export: TorchScript exporter (``dynamo=False``, opset 17; the ModelZoo ONNX files were made by this exporter),
eval mode, ``do_constant_folding=True`` (ATC sees the folded graph; BatchNorm after a Conv is folded into it, which
the om also has fused). Symbolic dims: ``batch`` (all), ``sequence`` (text models). The image size is fixed per
file: ViT and Swin position tables and window partitions fix it.

Implementations: torchvision 0.28.0 models (imported without torchvision's C extension, which does not load with
this torch build: the package ``__init__`` and the PIL-dependent modules are stubbed; the model classes need
neither), transformers configs (no download), and one own definition (SE-ResNet50, after Cadene's
``pretrainedmodels``). Weight values do not matter to the cost model; norms and biases are nonetheless randomised
so no canonicalisation rule sees an identity scale that a trained model would not have.

Usage (needs torch + transformers; run by hand, not in CI)::

    python tools/build_calibration_workloads.py                 # all workloads
    python tools/build_calibration_workloads.py --only resnet18 bert-base-uncased-squad
    python tools/build_calibration_workloads.py --only resnet18 --compare   # also check light == full fusion
    python tools/build_calibration_workloads.py --index-only    # rewrite workloads.toml from the files present
    python tools/build_calibration_workloads.py --relight       # redo the light step on the files present
"""

from __future__ import annotations

import argparse
import collections.abc
import enum
import importlib
import importlib.machinery
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixtures.common import _randomise_  # noqa: E402  (the fixtures' weight randomisation, one copy)
CALIB = ROOT / "npufuse" / "npu_model" / "calibration"
OUT_DIR = CALIB / "workloads"
INDEX = CALIB / "workloads.toml"
OPSET = 17
SEED = 0
# Initializers / Constant values up to this many elements stay as they are (shapes, pads, axes, scalars, eps,
# Gelu constants); bigger ones become ConstantOfShape. Integer tensors are kept up to a larger size: they are
# indices and shapes a pattern may read (e.g. Gather indices), not weights.
KEEP_FLOAT_ELEMENTS = 64
KEEP_INT_ELEMENTS = 4096


# --------------------------------------------------------------------------------------------------------------
# torchvision without its C extension
# --------------------------------------------------------------------------------------------------------------
def torchvision_models() -> Callable[[str], types.ModuleType]:
    """Return a loader of ``torchvision.models.<module>`` that does not run torchvision's package ``__init__``.

    With torch 2.13.0+cpu, ``import torchvision`` (0.28.0) fails in ``_meta_registrations`` ("operator
    torchvision::nms does not exist": its C extension does not match), and ``torchvision.utils`` needs PIL. The
    classification models use neither: stub the package, ``torchvision.utils`` (two helpers) and
    ``torchvision.transforms._presets`` (weight metadata only), then import the model modules one by one."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torchvision is not installed (pip install --no-deps torchvision==0.28.0)")
    base = list(spec.submodule_search_locations)[0]
    if "torchvision" not in sys.modules:
        pkg = types.ModuleType("torchvision")
        pkg.__path__ = [base]
        pkg.__spec__ = importlib.machinery.ModuleSpec("torchvision", None, is_package=True)
        pkg.__spec__.submodule_search_locations = [base]
        sys.modules["torchvision"] = pkg
        utils = types.ModuleType("torchvision.utils")
        utils._log_api_usage_once = lambda obj: None
        utils._make_ntuple = lambda x, n: (tuple(x) if isinstance(x, collections.abc.Iterable)
                                           else tuple(itertools.repeat(x, n)))
        sys.modules["torchvision.utils"] = utils
        transforms = types.ModuleType("torchvision.transforms")
        transforms.__path__ = []
        presets = types.ModuleType("torchvision.transforms._presets")

        class InterpolationMode(enum.Enum):
            NEAREST = "nearest"
            BILINEAR = "bilinear"
            BICUBIC = "bicubic"

        class ImageClassification:
            def __init__(self, *args, **kwargs):
                pass

        presets.InterpolationMode = InterpolationMode
        presets.ImageClassification = ImageClassification
        transforms.InterpolationMode = InterpolationMode
        sys.modules["torchvision.transforms"] = transforms
        sys.modules["torchvision.transforms._presets"] = presets
        models = types.ModuleType("torchvision.models")
        models.__path__ = [os.path.join(base, "models")]
        sys.modules["torchvision.models"] = models
    return lambda module: importlib.import_module(f"torchvision.models.{module}")


def torchvision_version() -> str:
    from importlib.metadata import version
    return version("torchvision")


def tv(module: str, fn: str, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return getattr(torchvision_models()(module), fn)(weights=None, **kwargs)
    return build


# --------------------------------------------------------------------------------------------------------------
# SE-ResNet50 (own definition, after Cadene pretrainedmodels senet.py: SEResNetBottleneck, stride on conv1)
# --------------------------------------------------------------------------------------------------------------
class _SE(nn.Module):
    def __init__(self, channels: int, reduction: int = 16):
        super().__init__()
        self.avg_pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, channels // reduction, 1)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(channels // reduction, channels, 1)
        self.sigmoid = nn.Sigmoid()

    def forward(self, x):
        s = self.sigmoid(self.fc2(self.relu(self.fc1(self.avg_pool(x)))))
        return x * s


class _SEResNetBottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.se_module = _SE(planes * 4)
        self.downsample = downsample

    def forward(self, x):
        residual = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.se_module(self.bn3(self.conv3(out)))
        return self.relu(out + residual)


class SEResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.layer0 = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                                    nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, ceil_mode=True))
        self.inplanes = 64
        self.layer1 = self._layer(64, 3, 1)
        self.layer2 = self._layer(128, 4, 2)
        self.layer3 = self._layer(256, 6, 2)
        self.layer4 = self._layer(512, 3, 2)
        self.avg_pool = nn.AvgPool2d(7, stride=1)
        self.last_linear = nn.Linear(2048, num_classes)

    def _layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * 4, 1, stride=stride, bias=False),
                                   nn.BatchNorm2d(planes * 4))
        layers = [_SEResNetBottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * 4
        layers += [_SEResNetBottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.layer0(x)))))
        return self.last_linear(torch.flatten(self.avg_pool(x), 1))


# --------------------------------------------------------------------------------------------------------------
# transformers (configs only, eager attention as the ModelZoo exports of that time had)
# --------------------------------------------------------------------------------------------------------------
def hf(model_cls: str, config_cls: str, **config) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers
        cfg = getattr(transformers, config_cls)(**config)
        cfg._attn_implementation = "eager"
        m = getattr(transformers, model_cls)(cfg)
        m.config._attn_implementation = "eager"
        return m
    return build


class _ImageLogits(nn.Module):
    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, pixel_values):
        return self.m(pixel_values=pixel_values).logits


class _Text3(nn.Module):
    """input_ids, attention_mask, token_type_ids -> the head's outputs (as transformers.onnx exported them)."""

    def __init__(self, m: nn.Module, outputs: tuple[str, ...]):
        super().__init__()
        self.m = m
        self.outputs = outputs

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = self.m(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return tuple(getattr(out, k) for k in self.outputs)


class _Text1(nn.Module):
    """input_ids only (fairseq RoBERTa's src_tokens): the attention mask is all ones."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids=input_ids).logits


# --------------------------------------------------------------------------------------------------------------
# the workloads
# --------------------------------------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    build: Callable[[], nn.Module] | None
    built_with: str
    exact: bool
    kind: str = "image"                       # image | text3 | text1 | text3_qa | text3_mlm
    image_size: int | None = 224
    notes: str = ""
    missing: str = ""                         # why it is not built
    text_outputs: tuple[str, ...] = field(default=())


def _tv(name: str, module: str, fn: str | None = None, exact: bool = True, notes: str = "", image_size: int = 224,
        **kwargs) -> Workload:
    return Workload(name, tv(module, fn or name, **kwargs), f"torchvision {{tv}} models.{fn or name}"
                    + (f"({', '.join(f'{k}={v}' for k, v in kwargs.items())})" if kwargs else ""),
                    exact, image_size=image_size, notes=notes)


def _vit(patch: int, size: int) -> Workload:
    return Workload(f"vit_base_patch{patch}_{size}",
                    hf("ViTForImageClassification", "ViTConfig", image_size=size, patch_size=patch, num_labels=1000),
                    f"transformers {{hf}} ViTForImageClassification(ViTConfig(image_size={size}, patch_size={patch}, "
                    "num_labels=1000)), eager attention", True, image_size=size,
                    notes="= timm vit_base; published graph went through onnxsim + opt_vit.py before ATC")


def _swin(name: str, size: int, embed: int, heads: list[int], window: int) -> Workload:
    return Workload(name, hf("SwinForImageClassification", "SwinConfig", image_size=size, embed_dim=embed,
                             depths=[2, 2, 18, 2] if embed > 96 else [2, 2, 6, 2], num_heads=heads,
                             window_size=window, num_labels=1000),
                    f"transformers {{hf}} SwinForImageClassification(SwinConfig(image_size={size}, embed_dim={embed}, "
                    f"num_heads={heads}, window_size={window}, num_labels=1000)), eager attention", True,
                    image_size=size, notes="published model is timm / microsoft Swin-Transformer (same architecture)")


BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
WORKLOADS: list[Workload] = [
    _tv("resnet18", "resnet"), _tv("resnet34", "resnet"), _tv("resnet50", "resnet"), _tv("resnet101", "resnet"),
    _tv("resnet152", "resnet"), _tv("resnext50_32x4d", "resnet"), _tv("resnext101_32x8d", "resnet"),
    _tv("wide_resnet50_2", "resnet"), _tv("wide_resnet101_2", "resnet"),
    _tv("vgg16", "vgg"), _tv("vgg19", "vgg"), _tv("alexnet", "alexnet"), _tv("squeezenet1_1", "squeezenet"),
    _tv("mobilenet_v2", "mobilenetv2"),
    _tv("mobilenet_v3_small", "mobilenetv3", exact=False,
        notes="published model is xiaolai-sqlai/mobilenetv3 mbv3_small (fp16 input/output), not torchvision"),
    _tv("shufflenet_v2_x1_0", "shufflenetv2"), _tv("mnasnet1_0", "mnasnet"), _tv("densenet121", "densenet"),
    _tv("googlenet", "googlenet", aux_logits=False, init_weights=False),
    _tv("inception_v3", "inception", image_size=299, aux_logits=False, init_weights=False),
    _tv("efficientnet_b0", "efficientnet", exact=False,
        notes="published model is pycls EfficientNet-B0 (same MBConv+SE+swish topology, not bit-identical)"),
    _tv("regnet_x_1_6gf", "regnet", exact=False,
        notes="implementation behind ModelZoo's RegNetX-1.6GF not checked (torchvision or pycls)"),
    Workload("se_resnet50", SEResNet50, "own definition (tools/build_calibration_workloads.py SEResNet50, after "
             "Cadene pretrainedmodels senet.py se_resnet50)", False,
             notes="published model is Cadene se_resnet50; own re-implementation of its topology (SE as 1x1 convs, "
                   "stride on conv1, ceil-mode max pool)"),
    _vit(16, 224), _vit(32, 224), _vit(16, 384), _vit(32, 384), _vit(8, 224),
    _swin("swin_tiny_patch4_window7_224", 224, 96, [3, 6, 12, 24], 7),
    _swin("swin_base_patch4_window12_384", 384, 128, [4, 8, 16, 32], 12),
    _swin("swin_large_patch4_window12_384", 384, 192, [6, 12, 24, 48], 12),
    _swin("swin_large_patch4_window7_224", 224, 192, [6, 12, 24, 48], 7),
    Workload("bert-base-uncased-squad", hf("BertForQuestionAnswering", "BertConfig"),
             "transformers {hf} BertForQuestionAnswering(BertConfig()), eager attention", True, kind="text3",
             image_size=None, text_outputs=("start_logits", "end_logits"),
             notes="inputs input_ids/attention_mask/token_type_ids (batch, sequence) int64, as transformers.onnx "
                   "exported it; published graph went through onnxsim + fix_onnx.py"),
    Workload("bert-large-uncased-wwm-squad", hf("BertForQuestionAnswering", "BertConfig", **BERT_LARGE),
             "transformers {hf} BertForQuestionAnswering(BertConfig(hidden_size=1024, num_hidden_layers=24, "
             "num_attention_heads=16, intermediate_size=4096)), eager attention", True, kind="text3",
             image_size=None, text_outputs=("start_logits", "end_logits"),
             notes="inputs as bert-base-uncased-squad"),
    Workload("bert-base-chinese", hf("BertForMaskedLM", "BertConfig", vocab_size=21128),
             "transformers {hf} BertForMaskedLM(BertConfig(vocab_size=21128)), eager attention", False,
             kind="text3", image_size=None, text_outputs=("logits",),
             notes="published head after fix_onnx.py not checked (output 'batchsize x seq_length'); the full MLM "
                   "head over 21128 tokens is an upper bound of the published graph's work"),
    Workload("albert-base-v2-sst2", hf("AlbertForSequenceClassification", "AlbertConfig", vocab_size=30000,
                                       embedding_size=128, hidden_size=768, num_attention_heads=12,
                                       intermediate_size=3072, num_labels=2),
             "transformers {hf} AlbertForSequenceClassification(AlbertConfig(vocab_size=30000, embedding_size=128, "
             "hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_labels=2)), eager attention",
             True, kind="text3", image_size=None, text_outputs=("logits",),
             notes="shared layer weights: the exported graph repeats the layer 12 times over the same initializers"),
    Workload("roberta-base-sst2", hf("RobertaForSequenceClassification", "RobertaConfig", vocab_size=50265,
                                     num_labels=2),
             "transformers {hf} RobertaForSequenceClassification(RobertaConfig(vocab_size=50265, num_labels=2)), "
             "eager attention, input_ids only", False, kind="text1", image_size=None,
             notes="published model is fairseq roberta.base (src_tokens only, roberta-infer.patch, opt_onnx.py): "
                   "same compute, not the same graph"),
]


# --------------------------------------------------------------------------------------------------------------
# export and lighten
# --------------------------------------------------------------------------------------------------------------
def export_full(w: Workload, path: Path) -> None:
    torch.manual_seed(SEED)
    model = w.build()
    _randomise_(model, SEED)   # the fixtures' randomisation (tools/fixtures/common.py), one copy
    model.eval()
    if w.kind == "image":
        wrapped = _ImageLogits(model) if w.built_with.startswith("transformers") else model
        args = (torch.randn(1, 3, w.image_size, w.image_size),)
        names, outs = ["pixel_values" if wrapped is not model else "input"], ["logits" if wrapped is not model
                                                                           else "output"]
        dyn = {names[0]: {0: "batch"}, outs[0]: {0: "batch"}}
    elif w.kind == "text3":
        wrapped = _Text3(model, w.text_outputs)
        seq = 16
        args = (torch.randint(0, 100, (1, seq)), torch.ones(1, seq, dtype=torch.int64),
                torch.zeros(1, seq, dtype=torch.int64))
        names, outs = ["input_ids", "attention_mask", "token_type_ids"], list(w.text_outputs)
        dyn = {n: {0: "batch", 1: "sequence"} for n in names}
        for o in outs:
            dyn[o] = {0: "batch", 1: "sequence"} if o != "logits" or "MaskedLM" in w.built_with else {0: "batch"}
    else:
        wrapped = _Text1(model)
        args = (torch.randint(3, 100, (1, 16)),)
        names, outs = ["input_ids"], ["logits"]
        dyn = {"input_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch"}}
    wrapped.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapped, args, str(path), dynamo=False, opset_version=OPSET, do_constant_folding=True,
                          input_names=names, output_names=outs, dynamic_axes=dyn)


def _small(arr: np.ndarray) -> bool:
    limit = KEEP_INT_ELEMENTS if arr.dtype.kind in "iub" else KEEP_FLOAT_ELEMENTS
    return arr.size <= limit


def _stand_in_value(arr: np.ndarray) -> np.ndarray:
    """One element of arr's dtype: the mean magnitude (non-zero unless arr is all zeros, so no rewrite sees an
    identity that the real tensor is not)."""
    if arr.dtype.kind == "f":
        v = np.mean(np.abs(arr.astype(np.float64))) if arr.size else 0.0
    else:
        v = 0
    return np.array([v], dtype=arr.dtype)


def lighten(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Replace every large initializer (and large Constant value) by ConstantOfShape(shape, value=mean |x|)."""
    g = model.graph
    new_nodes, keep = [], []
    replaced = 0
    for init in g.initializer:
        arr = numpy_helper.to_array(init)
        if _small(arr):
            keep.append(init)
            continue
        shape_name = f"{init.name}__shape"
        keep.append(numpy_helper.from_array(np.array(arr.shape, dtype=np.int64), shape_name))
        new_nodes.append(helper.make_node("ConstantOfShape", [shape_name], [init.name], name=f"{init.name}__light",
                                          value=numpy_helper.from_array(_stand_in_value(arr))))
        replaced += 1
    for node in g.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            arr = numpy_helper.to_array(node.attribute[0].t)
            if not _small(arr):
                shape_name = f"{node.output[0]}__shape"
                keep.append(numpy_helper.from_array(np.array(arr.shape, dtype=np.int64), shape_name))
                new_nodes.append(helper.make_node("ConstantOfShape", [shape_name], [node.output[0]],
                                                  name=f"{node.name or node.output[0]}__light",
                                                  value=numpy_helper.from_array(_stand_in_value(arr))))
                replaced += 1
                continue
        new_nodes.append(node)
    del g.initializer[:]
    g.initializer.extend(keep)
    del g.node[:]
    g.node.extend(new_nodes)
    del g.value_info[:]
    share_constants(g)
    compact_names(g)
    model.doc_string = ("npufuse calibration recipe (tools/build_calibration_workloads.py): weights replaced by "
                        "ConstantOfShape stand-ins; structure and shapes only, not for inference")
    onnx.checker.check_model(model)
    return model, replaced


def share_constants(g: onnx.GraphProto) -> None:
    """One Constant node per distinct small value (TorchScript emits a fresh Constant for every shape scalar: Swin
    has ~1500, mostly copies of a dozen values). Constants have no inputs, so the kept ones move to the front of
    the graph and every reader of a copy reads the kept one; the computation is unchanged."""
    first: dict[tuple, str] = {}
    alias: dict[str, str] = {}
    front, rest = [], []
    keep = {v.name for v in g.output}
    for node in g.node:
        if (node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value"
                and node.output[0] not in keep):
            t = node.attribute[0].t
            key = (t.data_type, tuple(t.dims), numpy_helper.to_array(t).tobytes())
            if key in first:
                alias[node.output[0]] = first[key]
                continue
            first[key] = node.output[0]
            front.append(node)
        else:
            rest.append(node)
    for node in rest:
        node.input[:] = [alias.get(v, v) for v in node.input]
    del g.node[:]
    g.node.extend(front + rest)


def compact_names(g: onnx.GraphProto) -> None:
    """Short value and node names (`v12`, `MatMul_40`): the exporter's module paths are most of a big graph's bytes
    (Swin: 600 of 760 KB). Graph inputs and outputs keep their names; the renaming is a pure relabelling."""
    keep = {v.name for v in g.input} | {v.name for v in g.output}
    names: dict[str, str] = {}

    def short(name: str) -> str:
        if not name or name in keep:
            return name
        if name not in names:
            names[name] = f"v{len(names)}"
        return names[name]

    for node in g.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise SystemExit(f"{node.op_type} with a subgraph: compact_names does not rename inside subgraphs")
    for i, node in enumerate(g.node):
        node.name = f"{node.op_type}_{i}"
        node.input[:] = [short(v) for v in node.input]
        node.output[:] = [short(v) for v in node.output]
    for init in g.initializer:
        init.name = short(init.name)


def census(path: Path, workdir: Path, dims: dict[str, int]) -> dict:
    """Fusion census of `npufuse optimize --no-verify` on Ascend310P3 (run as a subprocess: its own memory)."""
    report = workdir / (path.stem + ".report.json")
    cmd = [sys.executable, "-m", "npufuse.cli", "optimize", str(path), "-o", str(workdir / (path.stem + ".out.onnx")),
           "--no-verify", "--target", "Ascend310P3", "--report", str(report), "-q"]
    for k, v in dims.items():
        cmd += ["--dim", f"{k}={v}"]
    subprocess.run(cmd, check=True, cwd=ROOT)
    data = json.loads(report.read_text())
    from npufuse.fusion.census import fusion_census
    out = onnx.load(str(workdir / (path.stem + ".out.onnx")), load_external_data=False)
    return {"applied": data["summary"]["applied_by_kind"], "census": dict(sorted(fusion_census(out).items()))}


def dims_of(w: Workload) -> dict[str, str]:
    return {"batch": "batch"} | ({"seq_len": "sequence"} if w.kind.startswith("text") else {})


def _toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def write_index(results: dict[str, dict]) -> None:
    lines = ["# Recipes of the calibration workloads: one ONNX file per `workload` of ascend310p3.toml.",
             "# Generated by tools/build_calibration_workloads.py; see README.md (\"Recipes\").",
             "# file: under calibration/workloads/; dims: row field -> symbolic dim of the file; exact: the recipe",
             "# rebuilds the published graph's architecture (false: an approximation, report separately).", ""]
    for w in WORKLOADS:
        r = results.get(w.name, {})
        lines.append(f"[workload.{_toml_str(w.name) if '-' in w.name else w.name}]")
        missing = w.missing or ("" if (OUT_DIR / f"{w.name}.onnx").exists() else
                                "not built yet: run tools/build_calibration_workloads.py --only " + w.name)
        if missing:
            lines.append(f"missing = {_toml_str(missing)}")
        else:
            lines.append(f"file = {_toml_str(w.name + '.onnx')}")
            lines.append("dims = { " + ", ".join(f"{k} = {_toml_str(v)}" for k, v in dims_of(w).items()) + " }")
            if w.image_size:
                lines.append(f"image_size = {w.image_size}")
            lines.append(f"inputs = [{', '.join(_toml_str(n) for n in r.get('inputs', []))}]")
        lines.append(f"built_with = {_toml_str(r.get('built_with', w.built_with))}")
        lines.append(f"exact = {'true' if w.exact else 'false'}")
        if w.notes:
            lines.append(f"notes = {_toml_str(w.notes)}")
        lines.append("")
    INDEX.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", help="workload names (default: all)")
    ap.add_argument("--compare", action="store_true", help="also check the light file fuses like the full one")
    ap.add_argument("--index-only", action="store_true", help="only rewrite workloads.toml from the files present")
    ap.add_argument("--relight", action="store_true",
                    help="re-run the light step (stand-ins, short names) on the recipe files present; no torch export")
    args = ap.parse_args()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    import transformers
    versions = {"tv": torchvision_version(), "hf": transformers.__version__}
    chosen = [w for w in WORKLOADS if not args.only or w.name in args.only]
    unknown = set(args.only or ()) - {w.name for w in WORKLOADS}
    if unknown:
        raise SystemExit(f"unknown workloads: {sorted(unknown)}")
    results: dict[str, dict] = {}
    for w in WORKLOADS:   # keep the entries of workloads not rebuilt now
        target = OUT_DIR / f"{w.name}.onnx"
        if target.exists():
            m = onnx.load(str(target), load_external_data=False)
            init = {i.name for i in m.graph.initializer}
            results[w.name] = {"inputs": [i.name for i in m.graph.input if i.name not in init]}
    failures = 0
    if args.relight:
        for w in chosen:
            target = OUT_DIR / f"{w.name}.onnx"
            if target.exists():
                before = target.stat().st_size
                onnx.save(lighten(onnx.load(str(target)))[0], str(target))
                print(f"{w.name}: {before / 1e3:.0f} KB -> {target.stat().st_size / 1e3:.0f} KB", flush=True)
    for w in ([] if args.index_only or args.relight else chosen):
        if w.missing:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            full = Path(tmp) / f"{w.name}.full.onnx"
            try:
                export_full(w, full)
            except Exception as e:   # noqa: BLE001 - report and go on with the others
                print(f"{w.name}: export failed: {type(e).__name__}: {e}", file=sys.stderr)
                failures += 1
                continue
            light, replaced = lighten(onnx.load(str(full)))
            target = OUT_DIR / f"{w.name}.onnx"
            onnx.save(light, str(target))
            init = {i.name for i in light.graph.initializer}
            results[w.name] = {"inputs": [i.name for i in light.graph.input if i.name not in init],
                               "built_with": w.built_with.format(**versions)}
            msg = (f"{w.name}: {full.stat().st_size / 1e6:.1f} MB -> {target.stat().st_size / 1e3:.0f} KB "
                   f"({replaced} tensors replaced, {len(light.graph.node)} nodes)")
            if args.compare:
                dims = {"batch": 2} | ({"sequence": 64} if w.kind.startswith("text") else {})
                a, b = census(full, Path(tmp), dims), census(target, Path(tmp), dims)
                same = a == b
                msg += f"; full vs light fusion: {'same' if same else 'DIFFERENT'} {b}"
                if not same:
                    msg += f" (full: {a})"
                    failures += 1
            print(msg, flush=True)
    for w in WORKLOADS:
        results.setdefault(w.name, {})
        results[w.name].setdefault("built_with", w.built_with.format(**versions))
    write_index(results)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
