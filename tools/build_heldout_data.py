"""Write benchmarks/data/heldout_Ascend310P3.toml from the ModelZoo-PyTorch READMEs (issue 22's held-out set).

    PYTHONPATH=. python tools/build_heldout_data.py --mirror /work/.mirror/Ascend+ModelZoo-PyTorch/repo

--mirror is a git directory of github.com/Ascend/ModelZoo-PyTorch (the gitee repository's GitHub mirror). Every
figure is read from the README line named below (line numbers at the mirror commit `COMMIT`) and the row text is
copied into `table_row`; nothing is typed by hand but the line numbers, the two columns to read (batch, value) and
the recipe. The script refuses a line that does not parse or whose batch disagrees with the expected one.

The models are ones that are NOT calibration workloads (npufuse/npu_model/calibration/ascend310p3.toml) and that
can be built offline with random weights (timm with pretrained=False, transformers configs). See the notes of each
entry for where the recipe differs from the published graph.
"""
from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

COMMIT = "6a2804a358a5b18e3dac1ab902f41f88e240b00f"
GITEE = "https://gitee.com/ascend/ModelZoo-PyTorch/blob/master/"
OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "heldout_Ascend310P3.toml"

CV = "ACL_PyTorch/contrib/cv/classfication/"
BI = "ACL_PyTorch/built-in/cv/"

# workload, family, README, first line, last line, batch column, value column, recipe dict, recipe_exact, notes
# Columns index the cells of the markdown row ('|'-split, outer empties dropped).
MODELS: list[dict] = [
    {"workload": "vit_small_patch16_224", "family": "vit", "readme": CV + "vit-small/README.md", "lines": (258, 263),
         "bcol": 0, "vcol": 2, "build": {"kind": "timm", "name": "vit_small_patch16_224", "image": 224}, "exact": True,
         "notes": "table columns 310 | 310P | T4: the 310P column is read; ATC --enable_small_channel=1 "
               "--optypelist_for_implmode=Gelu --op_select_implmode=high_performance; timm ViT-S/16"},
    {"workload": "beit_base_patch16_224", "family": "beit", "readme": CV + "Beit/README.md", "lines": (330, 334),
         "bcol": 1, "vcol": 2, "build": {"kind": "timm", "name": "beit_base_patch16_224", "image": 224}, "exact": False,
         "notes": "column header 'fps/card'; published graph is unilm BEiT (timm 0.4.12) exported at a static batch, "
               "onnxsim'd and rewritten by graph_modify.py (MagicONNX) before ATC; recipe is timm's BEiT-B/16"},
    {"workload": "twins_pcpvt_small", "family": "twins", "readme": CV + "Twins-PCPVT-S/README.md", "lines": (259, 263),
         "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "twins_pcpvt_small", "image": 224}, "exact": True,
         "notes": "Meituan-AutoML Twins pcpvt_small (the timm port has the same layers); ATC --op_precision_mode="
               "op_precision.ini"},
    {"workload": "twins_svt_large", "family": "twins", "readme": BI + "Twins-SVT-L/README.md", "lines": (288, 290),
         "transposed": True, "build": {"kind": "timm", "name": "twins_svt_large", "image": 224}, "exact": True,
         "notes": "transposed table (batch sizes on the header line 288, 310P figures on line 290); Meituan "
               "alt_gvt_large = timm twins_svt_large; ais_bench --loop 20"},
    {"workload": "xcit_small_12_p16_224", "family": "xcit", "readme": CV + "xcit/README.md", "lines": (246, 246),
         "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "xcit_small_12_p16_224", "image": 224}, "exact": True,
         "notes": "only batch 8 published; facebookresearch xcit_small_12_p16 (= timm)"},
    {"workload": "convnext_tiny", "family": "convnext", "readme": CV + "ConvNext_for_Pytorch/README.md",
         "lines": (247, 251), "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "convnext_tiny", "image": 224}, "exact": False,
         "notes": "facebookresearch ConvNeXt-T with the README's convnext.patch applied (not read here); ATC with "
               "op_precision.ini; recipe is timm convnext_tiny"},
    {"workload": "hrnet_w18", "family": "hrnet", "readme": CV + "HRNet-Image-Classification/README.md",
         "lines": (248, 253), "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "hrnet_w18", "image": 224}, "exact": True,
         "notes": "HRNet-Image-Classification cls_hrnet_w18 (timm hrnet_w18 is its port)"},
    {"workload": "repvgg_a0_train", "family": "repvgg", "readme": CV + "RepVGG/README.md", "lines": (223, 228),
         "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "repvgg_a0", "image": 224}, "exact": True,
         "notes": "RepVGG_pth2onnx.py builds repvgg with deploy=False: the train-time 3x3 + 1x1 + identity-BN "
               "branches are exported (not re-parameterised); recipe is timm repvgg_a0 without reparameterize"},
    {"workload": "dpn131", "family": "dpn", "readme": CV + "DPN131/README.md", "lines": (254, 259), "bcol": 1, "vcol": 4,
         "build": {"kind": "timm", "name": "dpn131", "image": 224}, "exact": True,
         "notes": "Cadene pretrainedmodels dpn131 (timm's port); the built-in DPN131_for_Pytorch README lists "
               "384/567/483/388/353/348 for bs1..64 (another run), not recorded"},
    {"workload": "regnety_016", "family": "regnet", "readme": CV + "RegNetY-1.6GF/README.md", "lines": (263, 268),
         "bcol": 1, "vcol": 3, "build": {"kind": "timm", "name": "regnety_016", "image": 224}, "exact": True,
         "notes": "timm 0.4.9 regnety_016; calibration README: the bs16 figure 4417.628 equals ReID_for_Pytorch's "
               "(copy-paste suspected)"},
    {"workload": "efficientnet_b1_pycls", "family": "efficientnet", "readme": CV + "EfficientNet-B1/README.md",
         "lines": (266, 271), "bcol": 1, "vcol": 5, "build": {"kind": "timm", "name": "efficientnet_b1", "image": 240},
         "exact": False, "notes": "pycls EfficientNet-B1 at 240, onnxsim'd; recipe timm efficientnet_b1 (same stage "
                            "widths/depths)"},
    {"workload": "efficientnet_b3_pycls", "family": "efficientnet", "readme": CV + "EfficientNet-B3/README.md",
         "lines": (235, 240), "bcol": 1, "vcol": 5, "build": {"kind": "timm", "name": "efficientnet_b3", "image": 300},
         "exact": False, "notes": "pycls EfficientNet-B3 at 300, onnxsim'd; recipe timm efficientnet_b3"},
    {"workload": "efficientnet_b5_pycls", "family": "efficientnet", "readme": CV + "EfficientNet-B5/README.md",
         "lines": (238, 243), "bcol": 1, "vcol": 5, "build": {"kind": "timm", "name": "efficientnet_b5", "image": 456},
         "exact": False, "notes": "pycls EfficientNet-B5 at 456; recipe timm efficientnet_b5; bs1 (65.5) is 2.5x "
                            "below bs4 (161.3) as published"},
    {"workload": "efficientnet_b7", "family": "efficientnet", "readme": BI + "EfficientNet_b7_for_Pytorch/README.md",
         "lines": (246, 251), "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "tf_efficientnet_b7", "image": 600},
         "exact": False, "notes": "lukemelas efficientnet_pytorch b7 at 600 (static 'same' pads), onnxsim'd, ATC "
                            "--optypelist_for_implmode=Sigmoid high_performance; recipe timm tf_efficientnet_b7 "
                            "(TF 'same' padding computed from shapes in the export)"},
    {"workload": "efficientnetv2_rw_t", "family": "efficientnet", "readme": BI + "EfficientNetV2_for_Pytorch/README.md",
         "lines": (236, 242), "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "efficientnetv2_rw_t", "image": 288},
         "exact": True, "notes": "timm efficientnetv2_rw_t at 288; ATC Sigmoid high_performance"},
    {"workload": "mobilenetv3_large_100", "family": "mobilenet", "readme": CV + "MobileNetV3_large_100/README.md",
         "lines": (239, 244), "bcol": 1, "vcol": 2, "build": {"kind": "timm", "name": "mobilenetv3_large_100", "image": 224},
         "exact": True, "notes": "gen-efficientnet-pytorch mobilenetv3_large_100 (= timm)"},
    {"workload": "mobilenet_v1", "family": "mobilenet", "readme": CV + "MobileNet-v1/README.md", "lines": (273, 278),
         "bcol": 0, "vcol": 2, "build": {"kind": "timm", "name": "mobilenetv1_100", "image": 224}, "exact": False,
         "notes": "table columns 310*4 | 310P3 | 310B1: the 310P3 column is read; wjc852456 pytorch-mobilenet-v1; "
               "recipe timm mobilenetv1_100"},
    {"workload": "ghostnet_100", "family": "ghostnet", "readme": CV + "GhostNet1.0x/readme.md", "lines": (249, 254),
         "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "ghostnet_100", "image": 224}, "exact": True,
         "notes": "huawei-noah CV-Backbones GhostNet 1.0x (= timm ghostnet_100)"},
    {"workload": "spnasnet_100", "family": "mobilenet", "readme": CV + "spnasnet_100/README.md", "lines": (239, 244),
         "bcol": 1, "vcol": 2, "build": {"kind": "timm", "name": "spnasnet_100", "image": 224}, "exact": True,
         "notes": "timm spnasnet_100"},
    {"workload": "resnest50d", "family": "resnet", "readme": CV + "ResNeSt50/README.md", "lines": (258, 263), "bcol": 1,
         "vcol": 4, "build": {"kind": "timm", "name": "resnest50d", "image": 224}, "exact": True,
         "notes": "zhanghang1989 ResNeSt-50 (timm resnest50d is its port), onnxsim'd"},
    {"workload": "res2net101_v1b", "family": "resnet", "readme": BI + "Res2Net_v1b_101_for_PyTorch/README.md",
         "lines": (250, 255), "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "res2net101d", "image": 224}, "exact": False,
         "notes": "Res2Net-PretrainedModels res2net101_v1b_26w_4s; recipe timm res2net101d (deep stem, avg-pool "
               "downsample: the v1b/v1d layout)"},
    {"workload": "cspresnext50", "family": "resnet", "readme": CV + "CSPResneXt50/README.md", "lines": (245, 250),
         "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "cspresnext50", "image": 224}, "exact": True,
         "notes": "timm cspresnext50"},
    {"workload": "legacy_xception", "family": "inception", "readme": CV + "xception/README.md", "lines": (200, 205),
         "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "legacy_xception", "image": 299}, "exact": True,
         "notes": "tstandley Xception-PyTorch (the timm legacy_xception layout)"},
    {"workload": "inception_v4", "family": "inception", "readme": CV + "Inception_V4/README.md", "lines": (227, 232),
         "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "inception_v4", "image": 299}, "exact": True,
         "notes": "Cadene inceptionv4 (= timm inception_v4); the built-in InceptionV4 README has the same table"},
    {"workload": "inception_resnet_v2", "family": "inception", "readme": CV + "InceptionResnetV2/README.md",
         "lines": (222, 227), "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "inception_resnet_v2", "image": 299},
         "exact": True, "notes": "Cadene inceptionresnetv2 (= timm inception_resnet_v2)"},
    {"workload": "pnasnet5large", "family": "nasnet", "readme": CV + "pnasnet5large/README.md", "lines": (260, 265),
         "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "pnasnet5large", "image": 331}, "exact": True,
         "notes": "timm pnasnet5large at 331, onnxsim'd"},
    {"workload": "convmixer_1536_20", "family": "conv", "readme": CV + "convmixer_1536_20/README.md", "lines": (230, 235),
         "bcol": 1, "vcol": 4, "build": {"kind": "timm", "name": "convmixer_1536_20", "image": 224}, "exact": True,
         "notes": "locuslab convmixer_1536_20 (= timm)"},
    {"workload": "tinybert_4l_312d_sst2", "family": "tinybert", "readme": "ACL_PyTorch/contrib/nlp/tinybert/README.md",
         "lines": (163, 168), "bcol": 0, "vcol": 5,
         "build": {"kind": "bert", "layers": 4, "hidden": 312, "heads": 12, "intermediate": 1200, "seq": 64}, "exact": False,
         "seq_len": 64,
         "notes": "huawei-noah TinyBERT SST-2 task model, max_seq_length 64 (test/pth2onnx.sh), exported at opset 11 "
               "with inputs input_ids/segment_ids/input_mask and onnxsim'd; table columns 310 | 310P | T4 "
               "performance: 310P read; the 4-layer 312-wide student (General_TinyBERT 4L-312D) is inferred, the "
               "README does not give the layer count"},
    {"workload": "wav2vec2_base_960h", "family": "wav2vec2", "readme": "ACL_PyTorch/contrib/audio/wav2vec2/README.md",
         "lines": (275, 280), "bcol": 1, "vcol": 4, "build": {"kind": "wav2vec2", "samples": 100000}, "exact": False,
         "notes": "facebook/wav2vec2-base-960h Wav2Vec2ForCTC, input (B, 100000) raw audio (ATC --input_shape "
               "modelInput:bs,100000), exported at opset 11 and rewritten by wav2vec2_modify.py before ATC, "
               "op_precision.ini; the column read is '性能', the next one is '基准性能' (baseline)"},
]


def _cells(line: str) -> list[str]:
    cells = [c.strip() for c in line.strip().split("|")]
    if cells and cells[0] == "":
        cells = cells[1:]
    if cells and cells[-1] == "":
        cells = cells[:-1]
    return [re.sub(r"<[^>]+>", "", c).strip() for c in cells]


def _number(text: str) -> float:
    m = re.search(r"[0-9]+(?:\.[0-9]+)?", text.replace("*", ""))
    if not m:
        raise ValueError(f"no number in {text!r}")
    return float(m.group(0))


def _git(mirror: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(mirror), *args], check=True, capture_output=True,
                          text=True).stdout


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def rows(mirror: Path) -> list[dict]:
    out = []
    for m in MODELS:
        text = _git(mirror, "show", f"{COMMIT}:{m['readme']}").splitlines()
        last = _git(mirror, "log", "-1", "--format=%H", COMMIT, "--", m["readme"]).strip()
        cann = next((_cells(l)[1] for l in text if re.match(r"\s*\|\s*CANN\s*\|", l)), "not stated")
        first, end = m["lines"]
        if m.get("transposed"):
            head, vals = _cells(text[first - 1]), _cells(text[end - 1])
            pairs = [(int(_number(b)), _number(v), f"{text[first - 1].strip()} / {text[end - 1].strip()}")
                     for b, v in zip(head[1:], vals[1:])]
        else:
            pairs = []
            for i in range(first, end + 1):
                c = _cells(text[i - 1])
                pairs.append((int(_number(c[m["bcol"]])), _number(c[m["vcol"]]), text[i - 1].strip()))
        for batch, value, row in pairs:
            out.append(dict(m, batch=batch, value=value, table_row=row, cann=cann, readme_commit=last,
                            line_text=row))
    return out


def render(rs: list[dict]) -> str:
    lines = [
        "# Held-out Ascend310P3 throughputs for issue 22: published 310P3 om (ATC offline model, ais_bench)",
        "# figures of models that are NOT calibration workloads. Written by tools/build_heldout_data.py from the",
        "# ModelZoo-PyTorch READMEs (GitHub mirror Ascend/ModelZoo-PyTorch @ " + COMMIT + ");",
        "# table_row is the README row as published. Same schema as npufuse/npu_model/calibration/ascend310p3.toml",
        "# plus `build` (how benchmarks/heldout.py makes the fp32 ONNX a user would export). Never used for a fit.",
        "",
    ]
    for r in rs:
        b = r["build"]
        build = "{ " + ", ".join(f"{k} = {_q(v) if isinstance(v, str) else v}" for k, v in b.items()) + " }"
        recipe = {"timm": f"timm.create_model({b.get('name')!r}, pretrained=False), input (B,3,{b.get('image')},"
                          f"{b.get('image')}) fp32 NCHW",
                  "bert": f"transformers BertForSequenceClassification(BertConfig(num_hidden_layers={b.get('layers')}, "
                          f"hidden_size={b.get('hidden')}, num_attention_heads={b.get('heads')}, intermediate_size="
                          f"{b.get('intermediate')}), 2 labels), inputs (B,{b.get('seq')}) int64 x3",
                  "wav2vec2": f"transformers Wav2Vec2ForCTC(Wav2Vec2Config()) (base, vocab 32), input (B,"
                              f"{b.get('samples')}) fp32"}[b["kind"]]
        fields = [
            ("workload", _q(r["workload"])), ("family", _q(r["family"])), ("recipe", _q(recipe)),
            ("recipe_exact", "true" if r["exact"] else "false"), ("profile", _q("Ascend310P3")),
            ("chip_as_published", _q("Ascend310P3")), ("batch", str(r["batch"])), ("dtype", _q("fp16")),
            ("dtype_source", _q("inferred: ONNX exported fp32, ATC default precision_mode(_v2)=fp16 (force_fp16)")),
        ]
        if "image" in b:
            fields.append(("image_size", str(b["image"])))
        if r.get("seq_len"):
            fields.append(("seq_len", str(r["seq_len"])))
        fields += [
            ("metric", _q("throughput_fps")), ("value", repr(r["value"])), ("mode", _q("om_graph")),
            ("per", _q("card (column header says fps/card)" if "fps/card" in r["notes"] else "chip (inferred)")),
            ("use_for_fit", "false"), ("fit_scope", _q("heldout")),
            ("source", _q(GITEE + r["readme"] + f" (github mirror Ascend/ModelZoo-PyTorch @ {r['readme_commit']}, "
                          f"line{'s' if r['lines'][0] != r['lines'][1] else ''} {r['lines'][0]}"
                          + (f"-{r['lines'][1]}" if r['lines'][0] != r['lines'][1] else "") + ")")),
            ("table_row", _q(r["table_row"])), ("cann", _q(r["cann"])), ("tool", _q("ais_bench")),
            ("build", build), ("notes", _q(r["notes"])),
        ]
        lines.append("[[measurement]]")
        lines += [f"{k} = {v}" for k, v in fields]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mirror", type=Path, required=True, help="git directory of Ascend/ModelZoo-PyTorch")
    ap.add_argument("-o", "--output", type=Path, default=OUT)
    a = ap.parse_args()
    rs = rows(a.mirror)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(render(rs), encoding="utf-8")
    print(f"{len(rs)} figures, {len({r['workload'] for r in rs})} models -> {a.output}")


if __name__ == "__main__":
    main()
