"""The one published with/without pair for a fused attention on Ascend310P3, against what npufuse models (issue 22).

    PYTHONPATH=. python benchmarks/attention_pair.py [-o benchmarks/results/attention_pair_Ascend310P3.json]

Data: benchmarks/data/attention_pair_Ascend310P3.toml (Chinese-CLIP's ViT-B/16 image tower, two successive
ModelZoo-PyTorch README versions, CANN 8.0.RC1: the same compile without and with MindIE's FlashAttentionTik).
npufuse prices the calibration workload of the same architecture (npu_model/calibration/workloads/
vit_base_patch16_224.onnx) exactly as `npufuse report --target Ascend310P3 --dim batch=B --no-verify
--enable-small-channel` does (the published atc command sets --enable_small_channel), once
as is (attention fused: FusedAttention) and once with `--disable attention`, and compares the whole-model gains:

- raw: modeled unfused time / modeled fused time, on the plain 197-token export;
- form-matched: the same, with the fused graph in the published form. FlashAttentionTik takes q, k, v in
  [B, heads, T, 64], so the head Transposes that npufuse's FusedAttention absorbs stay in the published fused graph:
  their time is put back into the fused time. Both published graphs run the attention on the 197 tokens (their
  pad_nz_block step pads only the rows of the output projection and the MLP to 208, which scales both sides alike
  and is left out), so the unfused side keeps its TransData kernels.

Published gain = (1000 * B / published fps without) / (published ms with). The kernels differ: npufuse's ATC form
for 310P3 is PromptFlashAttention, the published one MindIE's FlashAttentionTik, so this checks the size of the
fusion's gain on this chip, not one kernel's timing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "attention_pair_Ascend310P3.toml"
WORKLOADS = ROOT / "npufuse" / "npu_model" / "calibration" / "workloads"


def load_pairs(path: Path = DATA) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def _priced(model: Path, batch: int, target: str, disable: tuple[str, ...]) -> dict:
    from npufuse import api

    # both published compiles pass --enable_small_channel 1 (the atc command in the data file's header)
    doc = api.report(model, target=target, format="json", verify=False, dims=(f"batch={batch}",), disable=disable,
                     enable_small_channel=True)
    after = doc["model_estimate"]["after"]
    by_op = after["by_op_type"]
    return {"time_us": doc["summary"]["modeled_time_us"]["after"],
            "transdata_us": by_op.get("TransData", {}).get("time_us", 0.0),
            "transpose_us": by_op.get("Transpose", {}).get("time_us", 0.0),
            "fused_attention": by_op.get("FusedAttention", {}).get("count", 0)}


def modeled_pair(batch: int, data: dict | None = None) -> dict:
    """npufuse's modeled gains of fusing attention at `batch` (raw and form-matched, see the module docstring)."""
    data = data or load_pairs()
    model = WORKLOADS / f"{data['workload']}.onnx"
    unfused = _priced(model, batch, data["profile"], ("attention",))
    fused = _priced(model, batch, data["profile"], ())
    if not fused["fused_attention"]:
        raise AssertionError(f"{model.name} at batch {batch}: npufuse did not fuse attention on {data['profile']}")
    fused_with_transposes = fused["time_us"] + (unfused["transpose_us"] - fused["transpose_us"])
    return {"batch": batch, "unfused_us": round(unfused["time_us"], 1), "fused_us": round(fused["time_us"], 1),
            "raw_gain": round(unfused["time_us"] / fused["time_us"], 4),
            "form_matched_gain": round(unfused["time_us"] / fused_with_transposes, 4),
            "transdata_us": round(unfused["transdata_us"], 1),
            "head_transposes_us": round(unfused["transpose_us"] - fused["transpose_us"], 1)}


def published_gain(pair: dict) -> float:
    return (1000.0 * pair["batch"] / pair["without_fps"]) / pair["with_ms"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", type=Path, help="write the rows as JSON here")
    a = ap.parse_args()
    data = load_pairs()
    rows = []
    print(f"{'B':>3s} {'published':>9s} {'raw':>7s} {'matched':>7s} {'matched/pub':>11s}  "
          "(gains: unfused / fused time)")
    for pair in data["pair"]:
        m = modeled_pair(pair["batch"], data)
        pub = published_gain(pair)
        m |= {"published_gain": round(pub, 4), "form_matched_error": round(m["form_matched_gain"] / pub - 1, 4)}
        rows.append(m)
        print(f"{pair['batch']:3d} {pub:9.3f} {m['raw_gain']:7.3f} {m['form_matched_gain']:7.3f} "
              f"{m['form_matched_error']:+11.1%}")
    if a.output:
        doc = {"command": "PYTHONPATH=. python benchmarks/attention_pair.py -o " + str(a.output),
               "data": str(DATA.relative_to(ROOT)), "model": data["model"], "workload": data["workload"],
               "profile": data["profile"], "rows": rows}
        a.output.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
