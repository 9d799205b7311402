"""Reports that stay readable on real exports (issue 13): dims shape inference made up (`unk__3`) never appear in
any report of any fixture (they read `?`, with the size the cost model priced them at), and the summary counts the
fused ops that are in the output model, a fusion later absorbed into a bigger one counted once, there."""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from npufuse import FUSED_DOMAIN
from npufuse.fusion.engine import OptimizeOptions, OptimizeResult, optimize
from npufuse.npu_model import load_profile
from npufuse.reporting import REPORT_FORMATS, build_report, render
from npufuse.reporting.dims import dims_text, own_dim_names, readable_shape, readable_text
from npufuse.reporting.region_svg import shape_text
from npufuse.reporting.summary import optimize_report, optimize_text

FIXTURES = Path(__file__).parent / "fixtures"
INVENTED = re.compile(r"unk__\d|_o\d+__d\d")


def _fixture_files() -> list[str]:
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    files = [e["file"] for key in ("fixtures", "llm_fixtures", "census_fixtures") for e in manifest[key]]
    files += sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.glob("*/*.onnx"))
    return [f for f in files if (FIXTURES / f).exists()]


FILES = _fixture_files()


@functools.lru_cache(maxsize=None)   # both parametrized tests read each run; the fixtures are small
def _run(file: str) -> tuple[onnx.ModelProto, OptimizeResult, dict]:
    """One priced, unverified optimize run per fixture and its report (the readability checks need no numerics)."""
    path = FIXTURES / file
    model = onnx.load(path)
    spec = load_profile("Ascend910B2")
    res = optimize(model, str(path.parent), OptimizeOptions(spec=spec, verify=False))
    return model, res, build_report(model, res, spec, str(path), str(path.parent), verified=False)


def _all_nodes(g: onnx.GraphProto):
    for n in g.node:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(a.g)
            for sub in a.graphs:
                yield from _all_nodes(sub)


def _op_of_kind(kind: str) -> str:
    """The op a kind names: `FusedMatMul[bias,gelu]` -> FusedMatMul, `npufuse.Gelu[tanh]` -> Gelu."""
    return kind.split("[")[0].removeprefix(f"{FUSED_DOMAIN}.")


def test_the_fixture_list_is_the_whole_set() -> None:
    assert len(FILES) > 80 and any(f.startswith("qdq/") for f in FILES) and any(f.startswith("kvcache/") for f in FILES)


@pytest.mark.parametrize("file", FILES)
def test_no_invented_dim_in_any_report(file: str) -> None:
    model, res, doc = _run(file)
    for fmt in REPORT_FORMATS:
        text = render(doc, fmt)
        hit = INVENTED.search(text)
        assert hit is None, f"{fmt}: ...{text[max(0, hit.start() - 150):hit.end() + 50]}..."
    opt = json.dumps(optimize_report(res, str(file), "out.onnx", "Ascend910B2", verified=False))
    assert not INVENTED.search(opt)
    assert not INVENTED.search(optimize_text(res, "out.onnx", verified=False))


@pytest.mark.parametrize("file", FILES)
def test_summary_counts_are_the_fused_ops_in_the_output(file: str) -> None:
    """Each kind naming an npufuse op counts exactly that op's nodes in the output (main graph and subgraphs)."""
    _, res, doc = _run(file)
    in_output = Counter(n.op_type for n in _all_nodes(res.model.graph) if n.domain == FUSED_DOMAIN)
    for summary in (doc["summary"], optimize_report(res, file, None, None, verified=False)["summary"]):
        counted: Counter = Counter()
        for kind, n in summary["applied_by_kind"].items():
            if "(" not in kind:   # `Conv(BN folded)`: folded into a standard op, nothing of npufuse's in the output
                counted[_op_of_kind(kind)] += n
        assert counted == in_output
        # every applied candidate is counted once: in the output, or absorbed into a bigger fusion
        assert sum(summary["applied_by_kind"].values()) + sum(summary["absorbed_by_kind"].values()) == \
            sum(1 for r in res.records if r.status == "applied")


def test_a_gelu_absorbed_into_a_matmul_epilogue_is_counted_once() -> None:
    """gpt2: each layer's tanh GELU is fused first, then taken into its FusedMatMul[bias,gelu_tanh]: two
    FusedMatMuls in the output, no Gelu; the summary says so and names the absorbed ones apart."""
    _, res, doc = _run("gpt2_ts17.onnx")
    s = doc["summary"]
    assert "npufuse.Gelu[tanh]" not in s["applied_by_kind"]
    assert s["applied_by_kind"]["FusedMatMul[bias,gelu_tanh]"] == 2
    assert s["absorbed_by_kind"] == {"npufuse.Gelu[tanh]": 2}
    absorbed = [r for r in doc["regions"] if r["absorbed_into"] is not None]
    assert [doc["regions"][r["absorbed_into"]]["kind"] for r in absorbed] == ["FusedMatMul[bias,gelu_tanh]"] * 2
    text = render(doc, "text")
    fused_line = next(ln for ln in text.splitlines() if ln.startswith("fused: "))
    assert "Gelu" not in fused_line
    assert "absorbed into larger fusions (counted there): 2 npufuse.Gelu[tanh]" in text
    assert "absorbed into larger fusions (counted there): 2 npufuse.Gelu[tanh]" in optimize_text(res, None, False)
    assert "Absorbed into larger fusions (counted there): 2 npufuse.Gelu" in render(doc, "markdown") and "absorbed into a larger fusion" in render(doc, "html")


def test_an_invented_dim_reads_as_unknown_with_the_priced_size() -> None:
    """gpt2_ts17's second layer loses the batch name to shape inference (`unk__N`): the region's value shows
    `?` (JSON null) and the size the cost model priced it at."""
    _, _, doc = _run("gpt2_ts17.onnx")
    values = [v for r in doc["regions"] for v in r["inputs"] + r["outputs"]]
    unknown = [v for v in values if v["shape"] is not None and None in v["shape"]]
    assert unknown, "the fixture no longer loses a dim name; pick another"
    for v in unknown:
        assert len(v["priced_shape"]) == len(v["shape"]) and all(isinstance(d, int) for d in v["priced_shape"])
    v = next(v for v in unknown if v["shape"] == [None, "sequence", 128])
    assert shape_text(v) == "?×sequence×128 float32 (priced as 1×512×128)"
    assert all("priced_shape" not in v for v in values if v["shape"] and all(isinstance(d, int) for d in v["shape"]))


def test_the_model_own_names_are_kept_even_when_they_look_invented() -> None:
    """A graph input's dim is the model's own name whatever it is (a `--dim unk__7=INT` needs it); a persisted
    `unk__N` in value_info (a model saved after shape inference) is not."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["unk__7", "seq", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["unk__7", "seq", 4])
    t = helper.make_tensor_value_info("t", TensorProto.FLOAT, ["unk__9", "Reshapey_dim_1", 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
                          "g", [x], [y], value_info=[t])
    own = own_dim_names(helper.make_model(g))
    assert own == {"unk__7", "seq", "Reshapey_dim_1"}
    assert readable_shape(["unk__7", "unk__9", 3, None, "seq"], own) == ["unk__7", None, 3, None, "seq"]
    assert readable_text("shapes ['unk__9', 8, 'unk__7'] and [Reshape_12_o0__d1, 8]", own) == \
        "shapes [?, 8, 'unk__7'] and [?, 8]"
    # a value or node name that merely contains such a string is a name, not a dim
    assert readable_text("node '/m/unk__9/Add'", own) == "node '/m/unk__9/Add'"


def test_dims_text() -> None:
    assert dims_text(None) == "?" and dims_text([]) == "scalar" and dims_text([None, "batch", 3]) == "?×batch×3"
