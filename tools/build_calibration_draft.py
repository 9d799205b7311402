"""Generates the draft calibration TOML files from the numbers transcribed (by hand) from the sources.

Every value below was copied from the cited README table; nothing is derived. Run: python3 build_draft.py
"""
import tomllib
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "npufuse" / "npu_model" / "calibration"
GITEE = "https://gitee.com/ascend/ModelZoo-PyTorch/blob/master/"
MIRROR = "github mirror Ascend/ModelZoo-PyTorch"

def q(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'

ORDER = ["workload", "family", "recipe", "recipe_exact", "profile", "chip_as_published", "batch", "dtype",
         "dtype_source", "seq_len", "image_size", "metric", "value", "mode", "per", "use_for_fit", "fit_scope", "source",
         "table_row", "cann", "tool", "notes"]

def emit(path, header, rows):
    lines = [header.rstrip(), ""]
    for r in rows:
        lines.append("[[measurement]]")
        for k in ORDER + sorted(set(r) - set(ORDER)):
            if k in r and r[k] is not None:
                lines.append(f"{k} = {q(r[k])}")
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return data["measurement"]

# ------------------------------------------------------------------ 310P
P310 = "Ascend310P3"
OM_NOTE = ("om offline model (ATC, static shape) run by ais_bench pure-inference mode; throughput = "
           "1000*batch/NPU_compute_time.mean, H2D/D2H excluded; single device (--device N) -> per chip "
           "(Atlas 300I Pro = 1 chip/card; not stated in the README)")
AIPP = "ATC --insert_op_conf aipp (on-chip crop/colour/normalise op added, uint8 input) --enable_small_channel=1"
DT = "inferred: ONNX exported fp32, ATC default precision_mode(_v2)=fp16 (force_fp16); README gives no compute dtype"

rows310 = []

def table(workload, family, recipe, exact, path, commit, batches, values, *, cann, tool="ais_bench", aipp=False,
          image=224, seq=None, notes="", fit=True, metric="throughput_fps", row_fmt="{chip} | bs{b} | {v}",
          chip="Ascend310P3", extra=None, dtype="fp16", dtype_source=DT, per="chip (inferred)"):
    for b, v in zip(batches, values):
        n = OM_NOTE + ("; " + AIPP if aipp else "") + ("; " + notes if notes else "")
        r = dict(workload=workload, family=family, recipe=recipe, recipe_exact=exact, profile=P310,
                 chip_as_published=chip, batch=b, dtype=dtype, dtype_source=dtype_source, seq_len=seq,
                 image_size=image, metric=metric, value=v, mode="om_graph", per=per, use_for_fit=fit,
                 source=f"{GITEE}{path} ({MIRROR} @ {commit})", table_row=row_fmt.format(chip=chip, b=b, v=v),
                 cann=cann, tool=tool, notes=n)
        if extra:
            r.update(extra)
        rows310.append(r)

B6 = [1, 4, 8, 16, 32, 64]
B8 = [1, 4, 8, 16, 32, 64, 128, 256]
TV = "torchvision.models.{}(weights=None), input (B,3,{s},{s}) fp32 NCHW"

table("resnet18", "resnet", TV.format("resnet18", s=224), True,
      "ACL_PyTorch/built-in/cv/Resnet18_for_PyTorch/README.md", "3c2cbb83c5c16fa4facdf5a62b118c87c5c2e671",
      B8, [2864.96, 6821.99, 9450.12, 9705.72, 9678.07, 9816.71, 9827.83, 9803.72], cann="6.0.RC1", aipp=True,
      notes="ais_bench --loop 100; ACL_PyTorch/README.md overview lists 10796(bs16) for the same model (another run/version)")
table("resnet34", "resnet", TV.format("resnet34", s=224), True,
      "ACL_PyTorch/contrib/cv/classfication/ResNet34/README.md", "b3af8737f36be38b2dbe98a2725a9bd0a90a9ab2",
      B6, [1775.08, 4113.16, 5140.21, 5455.38, 5527.69, 5082.96], cann="6.0.RC1",
      notes="no AIPP; ais_bench --loop 20; overview lists 5967(bs32)")
table("resnet50", "resnet", TV.format("resnet50", s=224), True,
      "ACL_PyTorch/built-in/cv/Resnet50_Pytorch_Infer/README.md", "c7b1ac4fdd7169301198a8b3a1f148b7db53c515",
      [64], [4250], cann="5.1.RC2", aipp=True, row_fmt="310P3 | 64 | ImageNet | top-1 76.14% | {v}",
      notes="README table gives unit-less '性能' 4250 (fps); overview: 4250(bs64), input listed as bs x 3 x 256 x 256 "
            "(AIPP crops 256->224, atc --input_shape 64,3,224,224); issue 11 cites this row (model 2.45x pessimistic)")
table("resnet101", "resnet", TV.format("resnet101", s=224), True,
      "ACL_PyTorch/built-in/cv/Resnet101_Pytorch_Infer/README.md", "e9c424a21469fa1c3c03ba10ab4de32e883fcd48",
      B8, [1024.26, 2468.16, 2793.40, 2584.88, 2464.79, 2358.69, 2356.88, 1781.40], cann="6.0.RC1", aipp=True,
      notes="ais_bench --loop 100")
table("resnet152", "resnet", TV.format("resnet152", s=224), True,
      "ACL_PyTorch/contrib/cv/classfication/ResNet152/README.md", "e9c424a21469fa1c3c03ba10ab4de32e883fcd48",
      B8, [752.67, 1688.28, 1934.15, 1529.59, 1591.97, 1514.48, 1505.90, 1261.98], cann="6.0.RC1", aipp=True,
      notes="ais_bench --loop 100; overview lists 1908(bs16)")
table("resnext50_32x4d", "resnet", TV.format("resnext50_32x4d", s=224), True,
      "ACL_PyTorch/contrib/cv/classfication/ResNeXt50/ReadMe.md", "d69f9bfb12a6749c4b684277d97a0d939cf80584",
      B6, [1490, 3066, 3560, 3695, 3749, 2188], cann="6.0.RC1", aipp=True,
      notes="ais_bench --loop 100; overview lists 3985(bs32)")
table("shufflenet_v2_x1_0", "shufflenet", TV.format("shufflenet_v2_x1_0", s=224), True,
      "ACL_PyTorch/built-in/cv/Shufflenetv2_for_Pytorch/ReadMe.md", "b12d7858643ee5e2397654c517853a3c73c34f4b",
      B6, [2269.32, 4536.69, 5639.87, 5771.61, 7765.68, 6584.61], cann="6.0.RC1",
      notes="no AIPP; ais_bench --loop 50; non-monotonic (bs16 5771 -> bs32 7765)")
table("densenet121", "densenet", TV.format("densenet121", s=224), True,
      "ACL_PyTorch/built-in/cv/Densenet121_Pytorch_Infer/ReadMe.md", "8463001d3ea56c4075d21f62a7fa3473c1f41398",
      B6, [1147.06, 2125.39, 2368.25, 1739.55, 1452.45, 1277.14], cann="6.0.RC1",
      notes="no AIPP; ais_bench --loop 50; throughput falls above bs8 (memory-bound concat chain)")
table("inception_v3", "inception", "torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False), input (B,3,299,299)",
      True, "ACL_PyTorch/built-in/cv/InceptionV3_for_Pytorch/README.md", "e4aeaf873cdccb5ff44bcc76fb78935b5d049281",
      B6, [1099.11, 2300.75, 2388.07, 2336.78, 2317.59, 1916.61], cann="6.0.RC1", aipp=True, image=299,
      notes="README prose says 'bs8 best, 2736.9 fps' but its own table says 2388.07 at bs8 (overview: 2736(bs8)); "
            "table copied; aux head not in the exported eval graph")
table("googlenet", "inception", "torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False), input (B,3,224,224)",
      True, "ACL_PyTorch/built-in/cv/GoogleNet_for_Pytorch/README.md", "d9d3e45ece256f6f26e352e689bf45ee3e81c362",
      B6, [2333.64, 4778.77, 6308.38, 5906.61, 5116.16, 4886.97], cann="6.0.RC1", aipp=True,
      notes="ONNX rewritten by auto-optimizer onnx_optimize.py before ATC")
table("squeezenet1_1", "squeezenet", TV.format("squeezenet1_1", s=224), True,
      "ACL_PyTorch/contrib/cv/classfication/Squeezenet1_1/README.md", "949ee5a1d6c13a1c95f0d461f78bac1ff5d8027d",
      B6, [5797.1, 15289.3, 21301.5, 18339.9, 15468.8, 14051.23], cann="not read", aipp=True,
      notes="ais_bench --loop 50; same table has an Ascend310B1 column (not one of our profiles)")
table("alexnet", "vgg_alexnet", TV.format("alexnet", s=224), True,
      "ACL_PyTorch/contrib/cv/classfication/AlexNet/README.md", "7b701e428e1a7d2811e2a1ec270c49c8793025a2",
      B6, [1266, 4324, 7266, 9975, 11055, 12672], cann="6.0.RC1", notes="no AIPP; ais_bench --loop 1000")
table("vgg16", "vgg_alexnet", TV.format("vgg16", s=224), True,
      "ACL_PyTorch/contrib/cv/classfication/VGG16/ReadMe.md", "e4aeaf873cdccb5ff44bcc76fb78935b5d049281",
      B6, [465.54, 1056.92, 1187.63, 1424.51, 1338.95, 1430.39], cann="5.1.RC2", row_fmt="bs{b} | 310P {v}",
      notes="no AIPP; table also has '最优batch 1508.33' (bs not given, not recorded) and an Ascend310 column")
table("mnasnet1_0", "mobilenet", TV.format("mnasnet1_0", s=224), True,
      "ACL_PyTorch/contrib/cv/classfication/Mnasnet1_0/README.md", "251f6942da30edf052c7b3f369e87bf7b96fea17",
      B6, [2113.01, 6606.25, 8926.09, 9836.44, 10649.9, 5511.77], cann="5.0.1", tool="benchmark (old cann-benchmark tool)",
      chip="710", per="card ('710单卡吞吐率'); 710 = 310P codename, whether the figure is one device or a card is not stated",
      row_fmt="bs{b} | 710/FPS {v}",
      notes="old template: 'Interface throughputRate' of the benchmark tool, full-dataset bs1/bs16, pure-inference others; "
            "prose gives bs8 8926.07 vs table 8926.09; bs64 drop to 5511.77 unexplained; template text 'npu x4' "
            "is left over from the Ascend310 (4-chip card) template")
table("efficientnet_b0", "efficientnet", TV.format("efficientnet_b0", s=224), False,
      "ACL_PyTorch/built-in/cv/EfficientNet_for_Pytorch/README.md", "14261b6fec35f742ee9bf4ff9994b27e82bb78b0",
      B6, [1245.33, 2179.84, 2489.11, 2394.85, 2416.19, 2278.72], cann="6.0.RC1", aipp=True,
      notes="published model is facebookresearch/pycls EfficientNet-B0 (same MBConv+SE+swish topology, "
            "not bit-identical to torchvision); recipe approximate")
table("mobilenet_v3_small", "mobilenet", TV.format("mobilenet_v3_small", s=224), False,
      "ACL_PyTorch/built-in/cv/MobileNetV3_for_Pytorch/README.md", "9713ea2e6223a5d7d9e6ee0619d7d515a88f29c8",
      B6, [2769.64, 7743.44, 10965.24, 14284.28, 15442.12, 14863.88], cann="6.0.RC1",
      notes="published model is xiaolai-sqlai/mobilenetv3 'mbv3_small' (fp16 input/output via --input_fp16_nodes/"
            "--output_type), not torchvision; recipe approximate; ais_bench --loop 1000")
table("mobilenet_v2", "mobilenet", TV.format("mobilenet_v2", s=224), True,
      "ACL_PyTorch/built-in/cv/MobileNetV2_for_Pytorch/README.md", "949ee5a1d6c13a1c95f0d461f78bac1ff5d8027d",
      [4], [7072], cann="6.0.RC1", row_fmt="310P3 | 4 | ImageNet | 71.87/Top1 | {v}fps",
      notes="fp16 input/output; only bs4 published; same table has 310B1 1488.1fps")
table("se_resnet50", "resnet", "pretrainedmodels (Cadene) se_resnet50 / timm 'legacy_seresnet50', input (B,3,224,224)", False,
      "ACL_PyTorch/built-in/cv/SE_ResNet50_Pytorch_Infer/README.md", "5f36b6f0917f707fce0482757fd5a33a004e72d4",
      [32], [2690], cann="6.0.RC1", aipp=True, row_fmt="310P3 | 32 | ImageNet | {v}",
      notes="not torchvision; needs an SE-ResNet50 builder (torchvision resnet50 + SE blocks)")
# overview-only rows (ACL_PyTorch/README.md '310P最优性能(对应bs)' column)
OV = ("ACL_PyTorch/README.md", "00d2cb11c0281316f4f4ef48aca772b0c5901c8d")
for wl, fam, rec, b, v, ex, nt in [
    ("wide_resnet50_2", "resnet", TV.format("wide_resnet50_2", s=224), 32, 2097, True, ""),
    ("wide_resnet101_2", "resnet", TV.format("wide_resnet101_2", s=224), 16, 1151, True, ""),
    ("resnext101_32x8d", "resnet", TV.format("resnext101_32x8d", s=224), 8, 1251, True, ""),
    ("vgg19", "vgg_alexnet", TV.format("vgg19", s=224), 16, 1316.24, True, ""),
    ("regnet_x_1_6gf", "regnet", TV.format("regnet_x_1_6gf", s=224), 8, 5426.759, False,
     "implementation behind ModelZoo RegNetX-1.6GF not checked (torchvision or pycls)"),
]:
    table(wl, fam, rec, ex, *OV, [b], [v], cann="not stated", row_fmt=wl + " | 310P最优性能 {v}(bs{b})",
          notes="overview table only: best batch size per model, per-model README not read; " + nt)

# ViT (timm) -> transformers ViT
VIT = ("ACL_PyTorch/contrib/cv/classfication/ViT_base/performances.md", "ddb86ab2d3a11cf888dc5fdc6aa3ca050513b521")
for name, p, s, vals in [
    ("vit_base_patch16_224", 16, 224, [342.34, 541.11, 655.67, 660.64, 599.02, 558.65]),
    ("vit_base_patch32_224", 32, 224, [431.89, 1118.96, 1439.61, 1569.50, 1593.47, 1679.63]),
    ("vit_base_patch16_384", 16, 384, [108.87, 129.80, 151.01, 141.72, 139.40, 139.65]),
    ("vit_base_patch32_384", 32, 384, [267.01, 468.30, 587.07, 576.49, 596.55, 543.51]),
    ("vit_base_patch8_224", 8, 224, [76.42, 93.78, 98.48, 92.32, 93.30, 93.43]),
]:
    table(name, "vit", f"transformers.ViTForImageClassification(transformers.ViTConfig(image_size={s}, patch_size={p}, "
          f"num_labels=1000)) (= timm {name}), input (B,3,{s},{s})", True, *VIT, B6, vals, cann="6.0.RC1", image=s,
          notes="ONNX simplified + opt_vit.py graph rewrite before ATC; --optypelist_for_implmode=Gelu high_performance; "
                "--enable_small_channel=1; ais_bench --loop 100")
table("swin_tiny_patch4_window7_224", "swin", "torchvision.models.swin_t(weights=None) or transformers.SwinForImageClassification("
      "transformers.SwinConfig()) (defaults = swin-tiny), input (B,3,224,224)", True,
      "ACL_PyTorch/contrib/cv/classfication/Swin-Transformer_tiny/README.md", "83471dc372e0332e397544982bfb2ca1fade5804",
      B6, [339.7, 507.2, 564.7, 482.3, 434.2, 406.9], cann="6.0.RC1", row_fmt="310P | bs{b} | {v}fps",
      notes="microsoft/Swin-Transformer with swin.patch; onnxsim; Gelu high_performance; table also has Ascend310 row")
SWB = ("ACL_PyTorch/built-in/cv/SwinTransformer_for_Pytorch/README.md", "e4aeaf873cdccb5ff44bcc76fb78935b5d049281")
table("swin_base_patch4_window12_384", "swin", "transformers.SwinForImageClassification(transformers.SwinConfig(image_size=384, "
      "embed_dim=128, depths=[2,2,18,2], num_heads=[4,8,16,32], window_size=12, num_labels=1000)), input (B,3,384,384)",
      True, *SWB, B6, [104, 121, 132, 129, 129, 131], cann="6.0.RC1", aipp=True, image=384,
      notes="timm swin_base_patch4_window12_384; opt_onnx.py rewrite; --output_type=FP16; Gelu high_performance")
table("swin_large_patch4_window12_384", "swin", "transformers.SwinForImageClassification(transformers.SwinConfig(image_size=384, "
      "embed_dim=192, depths=[2,2,18,2], num_heads=[6,12,24,48], window_size=12, num_labels=1000))", True, *SWB,
      [1, 8], [51, 76], cann="6.0.RC1", aipp=True, image=384, notes="'其他配置' table: bs1 and best bs only")
table("swin_large_patch4_window7_224", "swin", "transformers.SwinForImageClassification(transformers.SwinConfig(image_size=224, "
      "embed_dim=192, depths=[2,2,18,2], num_heads=[6,12,24,48], window_size=7, num_labels=1000))", True, *SWB,
      [1, 8], [112, 204], cann="6.0.RC1", aipp=True, image=224, notes="'其他配置' table: bs1 and best bs only")

# ---- NLP
BERT_HF = ("ACL_PyTorch/built-in/nlp/Bert_Uncased_Huggingface/README.md", "6023e8412a72de1099ca01e4365a2fd49866ff33")
NLP_NOTE = ("static om per (bs, seq); inputs int64 input_ids/attention_mask/token_type_ids padded to seq; ONNX by "
            "transformers.onnx (question-answering), onnxsim, fix_onnx.py; --optypelist_for_implmode=Gelu "
            "--op_select_implmode=high_performance; ais_bench --loop 50 (纯推理)")
base = {64: [421.30, 1672.77, 2507.14, 2699.84, 2883.59, 2641.95],
        128: [484.39, 1166.12, 1321.87, 1344.72, 1273.30, 1242.68],
        256: [336.10, 547.37, 577.30, 569.14, 555.13, 542.94],
        320: [271.03, 385.70, 372.05, 357.51, 374.45, 363.87],
        384: [224.96, 328.64, 316.07, 308.66, 314.01, 313.14],
        512: [178.97, 221.47, 220.62, 220.08, 218.18, 212.47]}
for s, vals in base.items():
    table("bert-base-uncased-squad", "bert", "transformers.BertForQuestionAnswering(transformers.BertConfig()) "
          "(bert-base-uncased: 12 layers, 768, 12 heads, 3072, vocab 30522), inputs (B, seq) int64 x3", True,
          *BERT_HF, B6, vals, cann="6.0.RC1", image=None, seq=s, row_fmt="Ascend310P3 | seq " + str(s) + " | bs{b} | {v}",
          notes=NLP_NOTE + ("; seq128 bs1 (484.39) > seq64 bs1 (421.30) as published" if s in (64, 128) else ""))
large = {64: [204.1607, 572.3639, 694.0155, 762.6932, 768.5499, 746.2670],
         128: [188.9719, 332.5935, 367.1520, 364.3270, 353.7399, 346.8615],
         256: [125.5092, 162.0578, 163.4326, 158.2651, 155.5583, 154.2266],
         320: [96.4345, 119.5064, 125.2701, 114.0485, 101.7498, 101.2074],
         384: [78.6289, 101.1932, 98.6971, 98.2296, 98.1087, 98.8876],
         512: [62.2018, 70.7663, 71.3450, 71.5686, 70.5622, 70.0256]}
for s, vals in large.items():
    table("bert-large-uncased-wwm-squad", "bert", "transformers.BertForQuestionAnswering(transformers.BertConfig("
          "hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096))", True,
          *BERT_HF, B6, vals, cann="6.0.RC1", image=None, seq=s, row_fmt="Ascend310P3 | seq " + str(s) + " | bs{b} | {v}",
          notes=NLP_NOTE)
table("bert-base-chinese", "bert", "transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=21128)), inputs (B,384)",
      False, "ACL_PyTorch/built-in/nlp/Bert_Base_Chinese_for_Pytorch/README.md", "24211a083ce2bd9ae9e637c1bffa2c7682a5fb7d",
      B6, [175, 251, 254, 242, 246, 251], cann="5.1.RC2", image=None, seq=384, row_fmt="Bert-Base-Chinese | {b} | {v} fps",
      notes="the figure issue 11 quotes; inputs declared FP32; output 'batchsize x "
            "seq_length' (MLM head + fix_onnx.py rewrite: exact head not checked -> recipe approximate); Gelu "
            "high_performance; ais_infer; table header 'NPU性能' (chip not named in the table, 310P per overview 254(bs8))")
table("bert-base-cased-sst2", "bert", "transformers.BertForSequenceClassification(transformers.BertConfig(vocab_size=28996), num_labels=2)",
      True, "ACL_PyTorch/built-in/nlp/Bert_Base_Cased_SST2/README.md", "7296baa0302768d2eacee7cba27e5edd8fe79b79",
      B6, [522.28, 1634.64, 2426.22, 2694.21, 2906.40, 2661.63], cann="6.0.RC1", image=None, seq=None, fit=False,
      row_fmt="310P | {b} | SST-2 | 92.43 | {v}",
      notes="om built with --dynamic_dims for seq 64 and 128; table header 'seq_len = 64, 128' does not say which gear "
            "ran (values track seq 64 of Bert_Uncased_Huggingface) -> excluded from the fit until resolved")
ALB = ("ACL_PyTorch/contrib/nlp/albert/README.md", "8444609053a202982238010f6af048031d98f808")
ALB_R = ("transformers.AlbertForSequenceClassification(transformers.AlbertConfig(vocab_size=30000, embedding_size=128, "
         "hidden_size=768, num_attention_heads=12, intermediate_size=3072), num_labels=2) (albert-base-v2; NB AlbertConfig() "
         "default is xxlarge)")
table("albert-base-v2-sst2", "bert", ALB_R, True, *ALB, B6, [763, 1148, 1321, 1350, 1320, 1330], cann="6.3.RC2",
      image=None, seq=128, row_fmt="Albert bs{b} | 310P3 {v}fps",
      notes="static om, opt_onnx.py rewrite, Gelu high_performance; same table has dynamic 'unpad' (transformer "
            "acceleration library) rows, not recorded")
for s, pairs in {16: [(1, 1180), (64, 9775)], 32: [(1, 926), (64, 5843)], 64: [(1, 582), (32, 2937)]}.items():
    table("albert-base-v2-sst2", "bert", ALB_R, True, *ALB, [p[0] for p in pairs], [p[1] for p in pairs],
          cann="6.3.RC2", image=None, seq=s, row_fmt="seq " + str(s) + " | bs{b} | 310P {v}fps",
          notes="'其他seq' table: bs1 and best bs only" + ("; seq16 om built with --op_precision_mode=precision.ini" if s == 16 else ""))
ROB = ("ACL_PyTorch/contrib/nlp/roberta/README.md", "c79df832adff070a264ca41daaf6c71a35a91e43")
ROB_R = ("transformers.RobertaForSequenceClassification(transformers.RobertaConfig(), num_labels=2) (fairseq roberta.base: "
         "12 layers, 768, vocab 50265), input src_tokens (B, seq) int64 only")
table("roberta-base-sst2", "bert", ROB_R, False, *ROB, B6, [205, 817, 1244, 1463, 1473, 1206], cann="6.0.RC1",
      image=None, seq=70, row_fmt="310P3 | {b} | SST-2 | {v} fps",
      notes="fairseq model exported with roberta-infer.patch, opt_onnx.py, --op_precision_mode=precision.ini; HF recipe "
            "equivalent in compute but not the same graph -> recipe approximate")
for s, pairs in {16: [(1, 602), (64, 8649)], 32: [(1, 508), (64, 4718)], 64: [(1, 405), (32, 2413)],
                 128: [(1, 418), (32, 1100)]}.items():
    table("roberta-base-sst2", "bert", ROB_R, False, *ROB, [p[0] for p in pairs], [p[1] for p in pairs], cann="6.0.RC1",
          image=None, seq=s, row_fmt="seq " + str(s) + " | bs{b} | 310P {v}fps", notes="'其他seq' table: bs1 and best bs only")
table("gpt2-chinese", "gpt2", "transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=21128, n_layer=?, n_embd=?)) "
      "input_ids (B,512); config.json of the published checkpoint not seen", False,
      "ACL_PyTorch/built-in/nlp/GPT2_for_Pytorch/readme.md", "32a3110ea923325d2701d853fb070eb908bd55f0",
      B6, [149, 188, 189, 189, 185, 181], cann="6.0.RC1", image=None, seq=512, fit=False,
      row_fmt="310P3 | {b} | wiki_zh_2019 | 16.5 | {v}",
      notes="Morizeyao/GPT2-Chinese, LM head (output fp16 B x 512 x 21128), onnxsim repeated + opt_onnx_update.py, "
            "op_precision.ini Gelu/Tanh high_performance, --output_type=FP16; layer count unknown -> excluded until "
            "the config is pinned")
table("spanbert-squad1", "bert", "transformers.BertForQuestionAnswering(transformers.BertConfig(...)) (SpanBERT; base or "
      "large not certain)", False, "ACL_PyTorch/contrib/nlp/SpanBERT/README.md", "c79df832adff070a264ca41daaf6c71a35a91e43",
      B6, [43.833, 25.411, 31.726, 31.904, 32.038, 32.343], cann="6.0.RC1", image=None, seq=512, fit=False,
      row_fmt="310P3 | {b} | SQuAD 1.1 | {v}",
      notes="suspect: bs1 faster than every larger batch, 5x slower than bert-base seq512; reference f1 92.4 "
            "(base) vs NPU f1 93.95 (large?) -> excluded")

H310 = '''# Draft calibration data for npufuse calibrate: Ascend 310P3 (profile Ascend310P3).
# One [[measurement]] per published number, copied from the cited table (no conversion). See NOTES.md.
# value is in the unit of `metric`; throughput_fps = samples/s for the whole batch.
# per: what one number covers (chip or card); use_for_fit=false marks rows kept for the record only.
# Generated by build_draft.py (hand-transcribed tables); do not edit values without re-reading the source.
'''
m310 = emit(OUT / "ascend310p3.toml", H310, rows310)

# ------------------------------------------------------------------ 910B
rows910b = []
PTO = "https://gitcode.com/cann/pto-isa (github mirror zouzias/pto-isa-mirror"
def k910(**r):
    r.setdefault("profile", "Ascend910B2")
    r.setdefault("dtype", "fp16")
    r.setdefault("dtype_source", "stated")
    r.setdefault("per", "chip")
    rows910b.append(r)

for n, ms, tm in [(1536, 0.0388, "54.5%"), (3072, 0.2067, "79.0%"), (6144, 1.5060, "86.7%"), (7680, 3.1680, "80.6%")]:
    k910(workload=f"gemm_{n}", family="gemm", recipe=f"gemm m={n} n={n} k={n} (A m x k fp16 ND, B n x k fp16 ND i.e. B^T, C fp32)",
         recipe_exact=True, chip_as_published="Ascend A3, 24 cores (run.sh -v Ascend910B1)", batch=1, metric="latency_ms",
         value=ms, mode="kernel", use_for_fit=True,
         source=f"{PTO} @ c138a4b2c1ef2bfc60745cf9c7a8b9309c166a38): kernels/manual/a2a3/gemm_performance/README.md",
         table_row=f"m=k=n={n} | TMATMUL ratio {tm} | Execution time (ms) {ms}", cann="not stated", tool="pto-isa kernel (timing method not stated in the README)",
         notes="hand-tuned PTO GEMM, 24 cores 4x6 split, base 128x256x64, stepK 4, double-buffered L1/L0; "
               "fp32 output (4 B/elem written); 2*6144^3/1.506 ms = 308 TFLOP/s = 87% of 24 cores x 4096 MAC x 1.8 GHz, matching the published TMATMUL ratio 86.7% (so the clock is consistent with 1.8 GHz); 6144^3 row is issue 11's known-answer test (1506 us)")
CONV = [((4, 8, 8, 48), 72, 96, 0.0322, "52.90%"), ((4, 16, 12, 64), 144, 192, 0.1473, "86.1%"),
        ((4, 24, 12, 96), 216, 288, 0.4709, "89.3%"), ((4, 32, 16, 96), 288, 384, 1.0979, "90.8%"),
        ((4, 40, 15, 128), 360, 480, 2.1312, "91.3%")]
for (nb, c1, h, w), kk, nn, ms, tm in CONV:
    cin, cout = c1 * 16, nn * 16
    k910(workload=f"conv3x3_cin{cin}_cout{cout}_{h}x{w}", family="conv", recipe=f"conv N={nb} Cin={cin} H={h} W={w} "
         f"Cout={cout} k=3x3 stride 1 pad 1 dilation 1 (implicit GEMM M={nb*h*w} K={cin*9} N={cout})", recipe_exact=True,
         chip_as_published="Ascend A3, 24 cores (run.sh -v Ascend910B1)", batch=nb, metric="latency_ms", value=ms,
         mode="kernel", use_for_fit=True,
         source=f"{PTO} @ 10dec7f1eb05be14381bcb5b7ad2d7979cc5427d): kernels/manual/a2a3/conv2d_forward/README.md",
         table_row=f"X=[{nb},{c1},{h},{w},16] K=[{kk},{nn},16,16] | TMATMUL {tm} | {ms} ms", cann="not stated",
         tool="pto-isa kernel", notes="NC1HWC0 input, Fractal_Z weight (no TransData in the timing); spec table says "
         "output half, measurement heading says 'fp16 input -> fp32 output' (ambiguous)")
FA_T = {1: [42.08, 51.44, 43.80, 74.54], 2: [33.201, 44.101, 43.521, 75.162], 4: [41.721, 55.441, 46.621, 86.322],
        8: [63.72, 85.882, 64.461, 107.342]}
for cores, vals in FA_T.items():
    for s1, us in zip([1024, 2048, 4096, 8192], vals):
        k910(workload=f"flash_attention_sq{128*cores}_skv{s1}", family="attention",
             recipe=f"flash attention fwd b=1 heads=1 s_q={128*cores} s_kv={s1} d=128 fp16 (Q,K,V fp16; O fp32), non-causal, "
                    f"cores_used={cores} (one 128-row query tile per core)", recipe_exact=True,
             chip_as_published="A2/A3 (run.sh -v Ascend910B1; normalisation to a 24-core A3)", batch=1, metric="time_us",
             value=us, mode="kernel", use_for_fit=True,
             source=f"{PTO} @ f9bde1d5d07cf00aa82636ab23511e9a4caca52d): kernels/manual/a2a3/flash_atten/README.md",
             table_row=f"Cores {cores} | S0 {128*cores} | S1={s1} | Total task time (us) {us}", cann="not stated",
             tool="pto-isa manual FA kernel (TFA), onboard", notes="'Total task time' = end-to-end kernel time per task; "
             "non-monotonic in S1 (S1=4096 faster than 2048 at 1 core) as published; README also gives a simulator "
             "figure (28.59 us vs onboard 147.92 us at seq 2K) -> use onboard rows only")
FAJ = f"{PTO} @ 067f1e7d667f6e062f5f044ad01d9db65add562f): demos/torch_jit/flash_atten/README.md (+ fa_benchmark.py)"
sq = [128]*4 + [256]*4 + [512]*4 + [1024]*4 + [2048]*4
sk = [1024, 2048, 4096, 8192] * 5
fused_arm = [70.338, 70.898, 72.652, 73.365, 72.522, 73.369, 74.567, 73.150, 71.964, 74.180, 73.984, 75.936,
             74.404, 73.102, 75.043, 90.272, 76.777, 75.535, 91.798, 126.845]
fused_x86 = [46.83, 48.20, 47.93, 52.58, 48.41, 50.13, 49.19, 68.99, 52.50, 53.62, 61.27, 88.09, 55.40, 61.38,
             84.73, 103.27, 63.49, 84.70, 101.94, 142.38]
for host, vals in (("aarch64", fused_arm), ("x86_64", fused_x86)):
    for a, b, us in zip(sq, sk, vals):
        k910(workload=f"fused_infer_attention_sq{a}_skv{b}_{host}", family="attention_eager",
             recipe=f"torch_npu.npu_fused_infer_attention_score(q (1,{a},128), k/v (1,{b},128) fp16, num_heads=1, "
                    f"input_layout='BSH', scale=1/sqrt(128), next_tokens=65535) one eager call", recipe_exact=True,
             chip_as_published="910B2", batch=1, seq_len=a, metric="time_us", value=us, mode="eager_torch_npu",
             use_for_fit=False, fit_scope="eager_launch_only", source=FAJ, table_row=f"({host} table) S0 {a} | S1 {b} | Fused µs {us}",
             cann="not stated", tool="torch.npu.Event around 50 back-to-back calls after 10 warm-up, mean",
             notes="eager op dispatch: time is flat ~70 us (aarch64 host) / ~47 us (x86 host) until the kernel outgrows "
                   "the host cost -> measures host dispatch + launch, not the kernel; the host CPU changes the number")
FJ2 = f"{PTO} @ 8d8c14a80f2165ba060efd10d314565dffe2d0a5): demos/torch_jit/flash/README.md"
sq2 = [128, 256, 512, 1024] * 4
sk2 = [1024]*4 + [2048]*4 + [4096]*4 + [8192]*4
gemm_att = [60.123, 44.078, 60.581, 65.399, 71.658, 63.335, 66.823, 63.706, 62.175, 58.798, 63.263, 60.047,
            61.161, 59.491, 57.969, 79.325]
fused2 = [68.735, 68.513, 67.892, 70.002, 74.909, 80.121, 73.713, 70.119, 71.704, 70.272, 71.013, 70.864,
          67.072, 68.459, 72.393, 90.021]
for a, b, g, f in zip(sq2, sk2, gemm_att, fused2):
    k910(workload=f"torch_gemm_attention_sq{a}_skv{b}", family="attention_eager",
         recipe=f"eager torch_npu: softmax(q @ k^T * scale) @ v, q ({a},128), k/v ({b},128) fp16 (several aten ops)",
         recipe_exact=False, chip_as_published="910B2 (24-core normalisation in README)", batch=1, seq_len=a,
         metric="time_us", value=g, mode="eager_torch_npu", use_for_fit=False, fit_scope="eager_launch_only", source=FJ2,
         table_row=f"B 1 | Sq {a} | Sk {b} | H 128 | Torch NPU GEMM attention time (µs) {g}", cann="not stated",
         tool="50 warm-up, mean of 200 iterations", notes="exact op sequence of the 'GEMM attention' reference not read "
         "(fa_benchmark.py of this variant not stored) -> recipe approximate; host-bound like the fused rows")
    k910(workload=f"fused_infer_attention_sq{a}_skv{b}_200it", family="attention_eager",
         recipe=f"torch_npu.npu_fused_infer_attention_score(q (1,{a},128), k/v (1,{b},128) fp16, num_heads=1, BSH)",
         recipe_exact=True, chip_as_published="910B2", batch=1, seq_len=a, metric="time_us", value=f,
         mode="eager_torch_npu", use_for_fit=False, fit_scope="eager_launch_only", source=FJ2,
         table_row=f"B 1 | Sq {a} | Sk {b} | Fused npu_fused_infer_attention_score time (µs) {f}", cann="not stated",
         tool="50 warm-up, mean of 200 iterations", notes="host architecture not stated for this table")

# Whole-model graph-mode timings on a 910B-class chip: the only ones found in the index for a workload with a recipe
# (a search for ModelZoo / MindIE-Torch / torchair / FlagPerf / MindSpore Lite tables on 910B1-4, Atlas 800I/800T/
# 300I A2 found no ResNet, BERT, ALBERT, RoBERTa or Swin figure). One MindSpore Lite tutorial, two revisions, one
# batch size (256). Kept for the record, not fitted: see the notes and calibration/README.md ("Sources read").
VITM = ("MindSpore Lite tutorial 'ViT (Vision Transformer) High-Performance Deployment on {title}' (Huawei, Apache-2.0; "
        "points to gitcode.com/mindspore/mindspore-lite); read in the code index (file id {fid}), whose answer does not "
        "name the repository or path -- not resolved")
VIT_NOTE = ("MindSpore Lite GE backend (converter_lite ONNX->MindIR without device options, Context provider='ge', "
            "precision_mode='enforce_fp16'): GE compiles and sinks the whole graph like an ATC om. ViT variant inferred: "
            "'timm' export of 'vit_base_b256.onnx' (patch 16 / 224 not stated). Not for the fit: (1) the chip: the "
            "earlier revision says 'Ascend 910B (A2 280T)' (280 TFLOPS fp16; the later one only 'Atlas 800I A2'), i.e. "
            "not the 24-core 1.8 GHz 910B2 of the profile; core count and clock not stated); (2) one batch size, 256, where "
            "the per-kernel launch is under 1% of the modeled time (Ascend910B2 as shipped: 39.5 ms for 117 kernels, "
            "3 us each = 0.35 ms; launch.graph_kernel_us 3.0 vs 1.5 changes it by 0.01%), so it cannot identify the launch; (3) published "
            "3.4x the modeled time on a chip with ~20% fewer FLOPs -- GE's graph is not npufuse's fused graph here "
            "(the README lists only MatMul+bias, GELU and layout fusions, no fused attention)")
VIT_REC = ("transformers.ViTForImageClassification(ViTConfig(image_size=224, patch_size=16)) (= timm vit_base_patch16_224; "
           "variant inferred), input (256,3,224,224)")
for title, fid, metric, value, trow, chip, note in [
        ("Atlas 800I A2", "60501546536", "latency_ms", 135.30,
         "model | ModelExecute | Avg 135.30 | Min 134.97 | Max 139.15 | Count 53",
         "Atlas 800I A2 (910B-class; SKU not stated in this revision)",
         "msprof host-side API table, ModelExecute = device execution of the whole graph per batch (README: 'pure NPU "
         "compute time'); InputCopy 67.60 ms and OutputCopy 1.40 ms are separate rows, excluded"),
        ("Atlas 800I A2", "60501546536", "latency_ms", 227.0, "Average Latency: ~227 ms | Throughput: ~1130 FPS",
         "Atlas 800I A2 (910B-class; SKU not stated in this revision)",
         "'~' as published; end-to-end per batch including the 67.6 ms host-to-device InputCopy -> not a device time"),
        ("Ascend 910B", "60400118725", "latency_ms", 146.0, "Average Latency: ~146 ms | Throughput: ~1749 FPS",
         "Ascend 910B (A2 280T), e.g. Atlas 800T A2",
         "earlier revision of the same tutorial (Huawei 2025; the 800I A2 one is 2026); '~' as published; 'end-to-end "
         "inference latency' (copies included or not: not stated); disagrees with the later revision (227 ms)")]:
    k910(workload="vit_base_patch16_224", family="vit", recipe=VIT_REC, recipe_exact=False, chip_as_published=chip,
         batch=256, dtype_source="stated (precision_mode enforce_fp16)", image_size=224, metric=metric, value=value,
         mode="om_graph", use_for_fit=False, fit_scope="cross_check_only", source=VITM.format(title=title, fid=fid),
         table_row=trow, cann=">= 8.2.RC1 (requirement; the CANN of the run not stated)",
         tool="MindSpore Lite >= 2.7.0, vit_ascend_infer.py", notes=note + "; " + VIT_NOTE)

H910B = '''# Draft calibration data for npufuse calibrate: Ascend 910B class (profile Ascend910B2).
# Kernel rows (mode="kernel") are device times of single hand-written kernels; eager rows (mode="eager_torch_npu")
# are per-call wall times of torch_npu ops and mostly measure host dispatch (use_for_fit=False, fit_scope="eager_launch_only").
# Several kernel rows were measured on an A3 part (24 cores, run.sh -v Ascend910B1): same core count as 910B2,
# clock not stated. The three om_graph rows (ViT-Base, batch 256, MindSpore Lite GE on an Atlas 800I A2 '280T' SKU)
# are the only whole-model 910B-class graph-mode timings found; they cannot calibrate the per-kernel launch
# (use_for_fit=False, fit_scope="cross_check_only"). See NOTES.md. Generated by build_draft.py.
'''
m910b = emit(OUT / "ascend910b.toml", H910B, rows910b)

# ------------------------------------------------------------------ 910A
rows910a = []
MSB = "https://gitee.com/mindspore/docs/blob/r0.6/docs/source_zh_cn/benchmark.md"
MSR = ("https://gitee.com/mindspore/mindspore/tree/master/model_zoo/official/cv/resnet/README.md "
       "(github mirror mindspore-ai/mindspore @ 03ddf421cabcf8eb2ec7e2254d51b98f34ecc179)")
TRAIN = ("TRAINING throughput (forward + backward + optimizer, data pipeline sunk to device, mixed precision); npufuse "
         "prices inference only -> not usable for the fit; kept as the only published 910A figures found")
for r in [
    dict(workload="resnet50_v1.5_train", family="resnet", recipe=TV.format("resnet50", s=224) + " (training step)", batch=256,
         metric="throughput_fps", value=2115, source=MSB, per="chip ('1 * Ascend 910')",
         table_row="ResNet-50 v1.5 | ImageNet2012 | 0.5.0-beta | Ascend: 1 * Ascend 910 | Mixed | 256 | 2115 images/sec",
         notes=TRAIN + "; MindSpore 0.5.0-beta, ModelArts"),
    dict(workload="bert_large_train", family="bert", recipe="BERT-large 24 layers, seq 128, vocab 21128 (training step)",
         batch=96, seq_len=128, metric="throughput_fps", value=269, source=MSB, per="chip ('1 * Ascend 910')",
         table_row="BERT-Large | zhwiki | 0.5.0-beta | Ascend: 1 * Ascend 910 | Mixed | 96 | 269 sentences/sec",
         notes=TRAIN + "; value in sentences/s"),
    dict(workload="resnet50_v1.5_train_8p", family="resnet", recipe=TV.format("resnet50", s=224) + " (training step)",
         batch=32, metric="latency_ms", value=18.4, source=MSR, per="per step, 8 cards data-parallel (per-card batch 32)",
         table_row="ResNet50 on ImageNet2012 | Ascend 910 | batch_size = 32 | Speed 18.4ms/step（8pcs）",
         notes=TRAIN + "; includes all-reduce; MindSpore 0.1.0-alpha"),
    dict(workload="resnet101_train_8p", family="resnet", recipe=TV.format("resnet101", s=224) + " (training step)",
         batch=32, metric="latency_ms", value=30.3, source=MSR, per="per step, 8 cards data-parallel",
         table_row="ResNet101 on ImageNet2012 | Ascend 910 | batch_size = 32 | Speed 30.3ms/step（8pcs）", notes=TRAIN),
    dict(workload="se_resnet50_train_8p", family="resnet", recipe="SE-ResNet50 (training step)", batch=32,
         metric="latency_ms", value=24.6, source=MSR, per="per step, 8 cards data-parallel",
         table_row="SE-ResNet50 on ImageNet2012 | Ascend 910 | batch_size = 32 | Speed 24.6ms/step（8pcs）",
         notes=TRAIN + "; MindSpore 0.7.0-alpha"),
]:
    r.update(profile="Ascend910A", chip_as_published="Ascend 910", dtype="mixed fp16/fp32", dtype_source="stated ('Mixed')",
             recipe_exact=False, mode="training_graph_sink", use_for_fit=False, cann="not stated", tool="MindSpore")
    rows910a.append(r)
H910A = '''# Ascend 910A (profile Ascend910A): no published INFERENCE timing was found; the rows below are training figures,
# recorded for completeness with use_for_fit = false. See NOTES.md.
'''
m910a = emit(OUT / "ascend910a.toml", H910A, rows910a)

from collections import Counter
for name, m in (("310P3", m310), ("910B", m910b), ("910A", m910a)):
    fit = [x for x in m if x.get("use_for_fit") is True]
    print(name, len(m), "rows,", len(fit), "use_for_fit=true,", len({x['workload'] for x in m}), "workloads")
    print("  families:", dict(Counter(x["family"] for x in m)))
    print("  families (fit):", dict(Counter(x["family"] for x in fit)))
