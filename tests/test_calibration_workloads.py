"""The calibration recipes (npufuse/npu_model/calibration/workloads/): one weight-free ONNX per published workload.

`npufuse calibrate` builds each row's fused graph from these files at the row's batch (and sequence length); these
tests hold the index to the data set and check that each recipe loads, carries the dims the index names, and fuses
on Ascend310P3. The full per-workload optimize sweep is `slow` (one to fifteen seconds each: Swin's shape arithmetic
is long); the default run optimizes one CNN, one ViT and BERT.
"""

from __future__ import annotations

import tomllib
from collections import Counter
from pathlib import Path

import onnx
import pytest
from onnx import numpy_helper

import npufuse
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.npu_model.spec import load_profile

CALIB = Path(npufuse.__file__).parent / "npu_model" / "calibration"
WORKLOADS_DIR = CALIB / "workloads"
INDEX: dict[str, dict] = tomllib.loads((CALIB / "workloads.toml").read_text())["workload"]
ROWS = [r for r in tomllib.loads((CALIB / "ascend310p3.toml").read_text())["measurement"] if r["use_for_fit"]]
BUILT = sorted(name for name, e in INDEX.items() if "file" in e)
FILE_BUDGET_BYTES = 300_000
SET_BUDGET_BYTES = 5_000_000


def _rows_of(name: str) -> list[dict]:
    return [r for r in ROWS if r["workload"] == name]


def _is_text(entry: dict) -> bool:
    return "seq_len" in entry["dims"]


def _load(name: str) -> onnx.ModelProto:
    return onnx.load(str(WORKLOADS_DIR / INDEX[name]["file"]))


def _input_dims(model: onnx.ModelProto) -> dict[str, list]:
    init = {i.name for i in model.graph.initializer}
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input if i.name not in init}


def test_every_fit_workload_has_an_index_entry() -> None:
    needed = {r["workload"] for r in ROWS}
    assert needed, "no use_for_fit row in ascend310p3.toml"
    assert needed - set(INDEX) == set()


def test_every_entry_is_built_or_says_why_not() -> None:
    for name, entry in INDEX.items():
        assert ("file" in entry) != ("missing" in entry), name
        if "missing" in entry:
            assert entry["missing"].strip(), name
        assert isinstance(entry["exact"], bool) and entry["built_with"].strip(), name


def test_exact_flag_matches_the_data_set() -> None:
    """A recipe the data set calls approximate (recipe_exact = false) is not promoted to exact by the index."""
    for name, entry in INDEX.items():
        rows = _rows_of(name)
        if rows:
            assert entry["exact"] == all(r["recipe_exact"] for r in rows), name


def test_recipes_are_light() -> None:
    sizes = {name: (WORKLOADS_DIR / INDEX[name]["file"]).stat().st_size for name in BUILT}
    assert {n: s for n, s in sizes.items() if s > FILE_BUDGET_BYTES} == {}
    assert sum(sizes.values()) <= SET_BUDGET_BYTES
    assert not [p.name for p in WORKLOADS_DIR.glob("*.onnx") if p.name not in {INDEX[n]["file"] for n in BUILT}]


@pytest.mark.parametrize("name", BUILT)
def test_recipe_loads_with_the_dims_and_image_size_the_rows_need(name: str) -> None:
    entry = INDEX[name]
    model = _load(name)
    onnx.checker.check_model(model)
    inputs = _input_dims(model)
    assert inputs, name
    symbols = {d for dims in inputs.values() for d in dims if isinstance(d, str)}
    assert set(entry["dims"].values()) == symbols, (name, symbols)
    rows = _rows_of(name)
    if _is_text(entry):
        assert all(dims == ["batch", "sequence"] for dims in inputs.values()), inputs
        assert all(r.get("seq_len") for r in rows), name
    else:
        (dims,) = inputs.values()
        assert dims == ["batch", 3, entry["image_size"], entry["image_size"]], dims
        assert {r["image_size"] for r in rows} <= {entry["image_size"]}, name
    # weight-free: no initializer bigger than the stand-ins' shape vectors and the kept small constants
    assert max((numpy_helper.to_array(i).size for i in model.graph.initializer), default=0) <= 4096, name


def _optimize(name: str, row: dict):
    entry = INDEX[name]
    dims = {entry["dims"]["batch"]: row["batch"]}
    if _is_text(entry):
        dims[entry["dims"]["seq_len"]] = row["seq_len"]
    return optimize(_load(name), str(WORKLOADS_DIR),
                    OptimizeOptions(spec=load_profile("Ascend310P3"), verify=False, dims=dims))


def _check_fuses(name: str, res) -> None:
    assert res.ok, name
    ops = Counter(n.op_type for n in res.model.graph.node)
    patterns = Counter(r.match.pattern for r in res.records)
    if _is_text(INDEX[name]) or "vit" in name or "swin" in name:
        # an attention region is matched (fused, or priced and refused: PromptFlashAttention on 310P takes no
        # additive mask), the LayerNorms are fused, and the GEMMs take their bias
        assert patterns["attention"] > 0, (name, patterns)
        assert ops["AddLayerNorm"] + ops["LayerNorm"] > 0, (name, ops)
        assert ops["FusedMatMul"] > 0, (name, ops)
    else:
        assert ops["FusedConv"] > 0, (name, ops)
    assert res.nodes_after < res.nodes_before, name


def _smallest(name: str) -> dict:
    return min(_rows_of(name), key=lambda r: (r["batch"], r.get("seq_len", 0)))


@pytest.mark.parametrize("name,pick", [("resnet18", max), ("vit_base_patch32_224", max),
                                       ("bert-base-uncased-squad", min)])
def test_recipe_fuses_at_a_published_batch(name: str, pick) -> None:
    """One CNN and one ViT at their largest published batch, BERT at its smallest (batch, sequence) row."""
    assert name in BUILT
    _check_fuses(name, _optimize(name, pick(_rows_of(name), key=lambda r: (r["batch"], r.get("seq_len", 0)))))


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILT)
def test_every_recipe_fuses_at_its_smallest_published_batch(name: str) -> None:
    _check_fuses(name, _optimize(name, _smallest(name)))
