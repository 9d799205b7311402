"""Every fused region names the Ascend (CANN) kernel it becomes, and the target's chip decides whether it fuses.

The catalogue ships in the package; every applied fusion of every fixture names a kernel of the catalogue (or an
ATC built-in); attention attributes come out right; a chip without the kernel (or without what the region needs
of it) prices the candidate as unfused with a reason naming kernel and chip; reports carry the record."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from importlib import resources
from pathlib import Path

import onnx
import pytest
from builders import conv_chain
from click.testing import CliRunner
from onnx import helper
from test_attention import D, G, H, attention_model

from npufuse.cli import main
from npufuse.cost_model import FusionCandidate, OpWork, TensorInfo, decide
from npufuse.fusion.costing import CostShapes, price
from npufuse.fusion.engine import APPLIED, SKIPPED_COST, OptimizeOptions, optimize
from npufuse.ir.graph import Graph
from npufuse.ir.modelio import load_model
from npufuse.prepare.normalize import normalize
from npufuse.npu_model import ascend_kernels as ak
from npufuse.npu_model.spec import load_profile
from npufuse.patterns.attention import FusedAttentionPattern
from npufuse.reporting import build_report, render
from npufuse.reporting.summary import optimize_report

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
ENTRIES = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]


@pytest.fixture(scope="module")
def specs() -> dict:
    return {n: load_profile(n) for n in ("Ascend910B2", "Ascend910A", "Ascend310P3")}


def _attention_records(model: onnx.ModelProto, spec, **kw) -> list:
    res = optimize(model, options=OptimizeOptions(spec=spec, verify=False, **kw))
    return [r for r in res.records if r.match.pattern == "attention"]


# ---- the catalogue ---------------------------------------------------------------------------------------

def test_catalogue_ships_with_the_package() -> None:
    res = resources.files("npufuse.npu_model").joinpath("ascend_kernels.tsv")
    assert res.is_file()
    head = res.read_text("utf-8").splitlines()[:2]
    assert "op_host/*_def.cpp" in head[0] and "Ascend/ops-transformer" in head[1] and "Ascend/ops-nn" in head[1]
    cat = ak.catalogue()
    assert len(cat) > 400
    pfa = cat["PromptFlashAttention"]
    assert pfa.source == "Ascend/ops-transformer" and "atten_mask" in pfa.inputs and "sparse_mode" in pfa.attributes
    assert set(pfa.chips) >= {"ascend910b", "ascend310p"} and "ascend910" not in pfa.chips
    assert {"ascend910", "ascend910b", "ascend310p"} <= set(ak.known_chips())
    # the wheel carries it: setuptools' package data names the file, beside the profiles
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "ascend_kernels.tsv" in data["npufuse.npu_model"]


@pytest.mark.parametrize("op", ["FlashAttentionScore", "GemmaRmsNorm", "GeluMul"])
def test_a_910b_only_kernel_is_refused_on_310p(op: str, specs: dict) -> None:
    assert "ascend910b" in ak.catalogue()[op].chips and "ascend310p" not in ak.catalogue()[op].chips
    assert ak.no_kernel(op, "ascend910b", "Ascend910B2") is None
    why = ak.no_kernel(op, "ascend310p", "Ascend310P3")
    assert why == f"{op} has no kernel for ascend310p (Ascend310P3)"
    # ... and the cost model, told so, prices the candidate as unfused (a region mapped to it the same way)
    x = TensorInfo((4096, 4096), "float16")
    cand = FusionCandidate("p", (OpWork("a", "Mul", "", (x, x), (x,)), OpWork("b", "Add", "", (x, x), (x,))),
                           (OpWork("f", op, "", (x, x), (x,)),))
    d = decide(cand, specs["Ascend310P3"], unsupported=why)
    assert not d.fuse and d.t_fused_us is None and d.gain_us == 0.0 and d.unsupported == why
    assert d.reason == f"not fused: {why}"
    forced = decide(cand, specs["Ascend310P3"], force=True, unsupported=why)
    assert forced.fuse and forced.forced and why in forced.reason


def test_a_registered_region_mapped_to_a_910b_only_kernel_is_refused_on_310p() -> None:
    key = ("npufuse", "TestGeluMul")

    @ak.register(*key)
    def _map(node, ctx):
        return ak.kernel_record("GeluMul", node, {"approximate": "none"}, ak.bind(("input",), node.input),
                          ak.bind(("output",), node.output))

    try:
        node = helper.make_node("TestGeluMul", ["x"], ["y"], name="n", domain="npufuse")
        on_b = ak.region_kernel([node], chip="ascend910b", profile="Ascend910B2")
        on_p = ak.region_kernel([node], chip="ascend310p", profile="Ascend310P3")
        assert on_b["available"] and on_b["problem"] is None
        assert not on_p["available"] and on_p["problem"] == "GeluMul has no kernel for ascend310p (Ascend310P3)"
        assert ak.region_kernel([node])["available"] is None      # no chip: nothing decided
    finally:
        del ak.MAPPERS[key]


# ---- every fixture -----------------------------------------------------------------------------------------

def _check_against_catalogue(rec: dict, node: onnx.NodeProto | None) -> None:
    if rec["builtin"] or rec.get("folded"):
        assert rec["builtin"] or rec["op"] in ak.catalogue()
        return
    row = ak.catalogue()[rec["op"]]
    assert set(rec["attrs"]) <= set(row.attributes), (rec["op"], set(rec["attrs"]) - set(row.attributes))
    assert {b["name"] for b in rec["inputs"]} <= set(row.inputs), rec["inputs"]
    assert {b["name"] for b in rec["outputs"]} <= set(row.outputs), rec["outputs"]
    if node is not None:
        assert {b["value"] for b in rec["inputs"] if b["value"]} <= set(node.input)
        assert {b["value"] for b in rec["outputs"]} <= set(node.output)


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"] for e in ENTRIES])
def test_every_applied_fusion_names_a_kernel_of_the_catalogue(entry: dict, specs: dict) -> None:
    res = optimize(load_model(FIXTURES / entry["file"]), str(FIXTURES),
                   OptimizeOptions(spec=specs["Ascend910B2"], verify=False))
    assert res.applied
    nodes = {n.name: n for n in res.model.graph.node}
    kernels = set()
    for r in res.applied:
        rec = r.ascend_kernel
        assert rec is not None, r.match.kind
        assert rec["chip"] == "ascend910b" and rec["available"] and rec["problem"] is None
        # the record names the fused node, unless a later fusion absorbed it (and may have taken its name)
        node = nodes.get(rec["node"])
        if node is not None and (f"{node.domain}.{node.op_type}" if node.domain else node.op_type) not in r.fused_ops:
            node = None
        _check_against_catalogue(rec, node)
        kernels.add(rec["op"])
        json.dumps(rec)
    family = entry["family"]
    expect = {"bert": {"PromptFlashAttention", "AddLayerNorm", "BatchMatMulV3"},
              "gpt2": {"PromptFlashAttention", "AddLayerNorm", "MatMulV3"},
              "vit": {"PromptFlashAttention", "AddLayerNorm", "BatchMatMulV3"},
              "llama": {"PromptFlashAttention", "AddRmsNorm", "RmsNorm"},
              "resnet": {"Conv2D"}, "mobilenetv2": {"Conv2D"}, "mlp_bn": {"MatMulV3"}}.get(family, set())
    if entry["exporter"] == "ts14" and family in ("bert", "vit"):
        expect = expect | {"LayerNormV4"}       # opset 14 has no LayerNormalization: npufuse.LayerNorm
    assert expect <= kernels, (family, kernels)


def test_llama_on_each_chip(specs: dict) -> None:
    """llama: GQA attention with an additive mask, AddRMSNorm, RMSNorm, FusedMatMul[silu]."""
    model = load_model(FIXTURES / "llama_ts17.onnx")
    by_chip = {}
    for name, spec in specs.items():
        res = optimize(model, str(FIXTURES), OptimizeOptions(spec=spec, verify=False))
        by_chip[name] = {(r.status, r.ascend_kernel["op"], r.reason) for r in res.records if r.ascend_kernel}
    assert {op for st, op, _ in by_chip["Ascend910B2"] if st == APPLIED} >= {
        "PromptFlashAttention", "AddRmsNorm", "RmsNorm", "RotaryPositionEmbedding"}
    skipped_a = {op: why for st, op, why in by_chip["Ascend910A"] if st == SKIPPED_COST}
    assert skipped_a["PromptFlashAttention"] == "not fused: PromptFlashAttention has no kernel for ascend910 " \
                                                "(Ascend910A)"
    assert "AddRmsNorm" in skipped_a
    assert ("applied", "RmsNorm") in {(st, op) for st, op, _ in by_chip["Ascend910A"]}   # RmsNorm has a 910 kernel
    skipped_p = {op: why for st, op, why in by_chip["Ascend310P3"] if st == SKIPPED_COST}
    # RotaryPositionEmbedding ships for Atlas A2/A3 only: the rotary embeddings stay unfused on 310P (and 910A);
    # 310P's ApplyRotaryPosEmb (the q/k pair) takes head dims 64 and 128 only, and this llama's is 8
    assert set(skipped_p) == {"PromptFlashAttention", "RotaryPositionEmbedding", "ApplyRotaryPosEmb"}
    assert skipped_p["ApplyRotaryPosEmb"] == "not fused: ApplyRotaryPosEmb on ascend310p (Ascend310P3) takes a head " \
                                             "dim of 64 or 128 (this region: 8)"
    assert "Atlas training series" in skipped_a["ApplyRotaryPosEmb"]
    assert "ApplyRotaryPosEmb" in {op for st, op, _ in by_chip["Ascend910B2"] if st == SKIPPED_COST}
    assert skipped_p["RotaryPositionEmbedding"] == "not fused: RotaryPositionEmbedding has no kernel for ascend310p " \
                                                   "(Ascend310P3)"
    assert "RotaryPositionEmbedding" in skipped_a
    assert "ascend310p (Ascend310P3)" in skipped_p["PromptFlashAttention"]


# ---- attention: attributes and chips ----------------------------------------------------------------------

@pytest.mark.parametrize("gqa", [None, "expand"])
def test_attention_attributes(gqa: str | None, specs: dict) -> None:
    (rec,) = [r.ascend_kernel for r in _attention_records(attention_model(mask="causal_const", gqa=gqa),
                                                          specs["Ascend910B2"])]
    assert rec["op"] == "PromptFlashAttention" and rec["source"] == "Ascend/ops-transformer"
    a = rec["attrs"]
    assert a["num_heads"] == H
    assert a["num_key_value_heads"] == (G if gqa else 0)      # 0: as many as query (the kernel's convention)
    assert a["scale_value"] == pytest.approx(D ** -0.5, rel=1e-6)
    assert a["input_layout"] == "BSH"                          # head split and merge absorbed
    assert a["sparse_mode"] == 3 and a["next_tokens"] == 0     # causal, aligned to the last key
    ins = {b["name"]: b for b in rec["inputs"]}
    assert ins["query"]["value"] == "xq" and ins["key"]["value"] == "xk" and ins["value"]["value"] == "xv"
    assert ins["atten_mask"]["value"] is None                  # the kernel's own causal mask, no tensor
    _check_against_catalogue(rec, None)


def test_attention_masks_and_layouts(specs: dict) -> None:
    spec = specs["Ascend910B2"]
    (none,) = [r.ascend_kernel for r in _attention_records(attention_model(), spec)]
    assert none["attrs"]["sparse_mode"] == 0 and "atten_mask" not in {b["name"] for b in none["inputs"]}
    (boolean,) = [r.ascend_kernel for r in _attention_records(attention_model(mask="bool_keep"), spec)]
    ins = {b["name"]: b["value"] for b in boolean["inputs"]}
    assert ins["atten_mask"] == "bool_mask" and boolean["attrs"]["sparse_mode"] == 0
    assert boolean["attrs"]["next_tokens"] == 2147483647 and boolean["attrs"]["inner_precise"] == 2
    assert any("Not(" in n for n in boolean["notes"])          # the kernel masks where 1; this mask keeps
    (additive,) = [r.ascend_kernel for r in _attention_records(attention_model(mask="additive_input"), spec)]
    assert {b["name"]: b["value"] for b in additive["inputs"]}["pse_shift"] == "float_mask"
    (bnsd,) = [r.ascend_kernel for r in _attention_records(attention_model(layout="bnsd", merge=False), spec)]
    assert bnsd["attrs"]["input_layout"] == "BNSD"
    (merged,) = [r.ascend_kernel for r in _attention_records(attention_model(layout="bnsd", merge=True), spec)]
    assert merged["attrs"]["input_layout"] == "BNSD_BSND"     # BNSD in, BSND (= BSH, a view) out


def test_910a_refuses_attention_910b2_and_310p3_fuse_it(specs: dict) -> None:
    model = attention_model(mask="causal_const")
    for name in ("Ascend910B2", "Ascend310P3"):
        (r,) = _attention_records(model, specs[name])
        assert r.status == APPLIED and r.ascend_kernel["available"], (name, r.reason)
    (r,) = _attention_records(model, specs["Ascend910A"])
    assert r.status == SKIPPED_COST and not r.decision.fuse
    assert r.reason == "not fused: PromptFlashAttention has no kernel for ascend910 (Ascend910A)"
    assert r.decision.unsupported == "PromptFlashAttention has no kernel for ascend910 (Ascend910A)"
    assert r.decision.t_fused_us is None and r.decision.gain_us == 0.0
    assert r.ascend_kernel["available"] is False and r.ascend_kernel["chip"] == "ascend910"
    # --force-fuse still forces, and says why the model would not have
    (forced,) = _attention_records(model, specs["Ascend910A"], force_fuse=True)
    assert forced.status == APPLIED and forced.decision.forced
    assert "PromptFlashAttention has no kernel for ascend910" in forced.reason


def test_310p_limits_from_the_kernel_documentation(specs: dict) -> None:
    p3 = specs["Ascend310P3"]
    (causal,) = _attention_records(attention_model(mask="causal_const"), p3)
    assert causal.ascend_kernel["attrs"]["sparse_mode"] == 0       # 310P takes sparse_mode 0 only
    assert causal.ascend_kernel["attrs"]["next_tokens"] == 0
    (gqa,) = _attention_records(attention_model(mask="causal_const", gqa="expand"), p3)
    assert gqa.status == SKIPPED_COST and "num_key_value_heads 0 only" in gqa.reason and "Ascend310P3" in gqa.reason
    (add,) = _attention_records(attention_model(mask="additive_input"), p3)
    assert add.status == SKIPPED_COST and "pse_shift" in add.reason


def _node(heads: int, dim: int, layout: str = "BNSD") -> tuple[onnx.NodeProto, dict]:
    node = helper.make_node("FusedAttention", ["q", "k", "v"], ["y"], name="att", domain="npufuse", num_heads=heads,
                            kv_num_heads=heads, scale=1.0, q_layout=layout, k_layout=layout, v_layout=layout,
                            out_layout=layout)
    shape = (1, heads, 128, dim) if layout == "BNSD" else (1, 128, heads * dim)
    return node, {"q": shape, "k": shape, "v": shape}


@pytest.mark.parametrize("heads,dim,layout,expect", [
    (32, 128, "BNSD", None), (300, 64, "BNSD", "at most 256 heads (this region: 300)"),
    (8, 640, "BNSD", "head dim of at most 512 (this region: 640)"), (256, 256, "BSH", "N x D below 65535"),
    (8, 512, "BSH", None)])
def test_documented_head_limits(heads: int, dim: int, layout: str, expect: str | None) -> None:
    node, shapes = _node(heads, dim, layout)
    rec = ak.region_kernel([node], shapes.get, "ascend910b", "Ascend910B2")
    assert rec["op"] == "PromptFlashAttention"
    if expect is None:
        assert rec["problem"] is None
    else:
        assert expect in rec["problem"]


@pytest.mark.parametrize("sq,sk,refused", [(128, 256, True), (128, 128, False), ("seq", "total", False)])
def test_310p_causal_needs_equal_lengths(sq, sk, refused: bool) -> None:
    node = helper.make_node("FusedAttention", ["q", "k", "v"], ["y"], name="att", domain="npufuse", num_heads=8,
                            kv_num_heads=8, scale=0.125, causal=1, q_layout="BNSD", k_layout="BNSD",
                            v_layout="BNSD", out_layout="BNSD")
    shapes = {"q": (1, 8, sq, 64), "k": (1, 8, sk, 64), "v": (1, 8, sk, 64)}
    on_p = ak.region_kernel([node], shapes.get, "ascend310p", "Ascend310P3")
    assert on_p["attrs"]["sparse_mode"] == 0 and on_p["attrs"]["next_tokens"] == 0
    assert (on_p["problem"] is not None) == refused         # lengths that may be equal are not refused
    if refused:
        assert "query and key lengths differ" in on_p["problem"]
    on_b = ak.region_kernel([node], shapes.get, "ascend910b", "Ascend910B2")
    assert on_b["attrs"]["sparse_mode"] == 3 and on_b["problem"] is None   # right-down causal takes Sq != Sk


@pytest.mark.parametrize("batch,layout,refused", [(128, "BNSD", False), (129, "BNSD", True), (300, "BSH", False),
                                                  (301, "BSH", True), ("batch", "BNSD", False)])
def test_310p_prompt_flash_attention_batch_limit(batch, layout: str, refused: bool) -> None:
    node, shapes = _node(8, 64, layout)
    shapes = {k: (batch, *v[1:]) for k, v in shapes.items()}
    on_p = ak.region_kernel([node], shapes.get, "ascend310p", "Ascend310P3")
    assert on_p["op"] == "PromptFlashAttention"
    assert (on_p["problem"] is not None) == refused        # a symbolic batch is not refused
    if refused:
        assert f"batch of at most {300 if layout == 'BSH' else 128} in the {layout} layout" in on_p["problem"]
    assert ak.region_kernel([node], shapes.get, "ascend910b", "Ascend910B2")["problem"] is None   # 310P only


def test_decode_attention_is_incre_flash_attention() -> None:
    node = helper.make_node("FusedAttention", ["q", "k", "v"], ["y"], name="att", domain="npufuse", num_heads=8,
                            kv_num_heads=8, scale=0.125, q_layout="BNSD", k_layout="BNSD", v_layout="BNSD",
                            out_layout="BNSD")
    shapes = {"q": (1, 8, 1, 64), "k": (1, 8, 512, 64), "v": (1, 8, 512, 64)}
    rec = ak.region_kernel([node], shapes.get, "ascend310p", "Ascend310P3")
    assert rec["op"] == "IncreFlashAttention" and rec["available"] and rec["problem"] is None
    assert rec["attrs"] == {"num_heads": 8, "num_key_value_heads": 0, "scale_value": 0.125, "input_layout": "BNSD"}
    _check_against_catalogue(rec, node)


def test_price_cache_keys_on_the_chip(specs: dict) -> None:
    """Two profiles that differ only in their chip get their own decisions from one pricing cache."""
    model, types = normalize(attention_model(mask="causal_const"), None)
    g = Graph(model, None, types)
    pattern = FusedAttentionPattern()
    m = pattern.match(g, next(n for n in g.nodes if n.op_type == "Softmax"))
    rep = pattern.build(g, m)
    shapes = CostShapes(model, None, types=types)
    b2 = specs["Ascend910B2"]
    same_name_910 = dataclasses.replace(b2, chip="ascend910")
    assert price(g, m, rep, b2, False, shapes).fuse
    d = price(g, m, rep, same_name_910, False, shapes)
    assert not d.fuse and "no kernel for ascend910 (Ascend910B2)" in d.reason
    assert price(g, m, rep, dataclasses.replace(b2, chip=None), False, shapes).fuse   # no chip: nothing refused


# ---- other regions -----------------------------------------------------------------------------------------

def test_conv_is_atc_builtin_with_its_activation_named() -> None:
    res = optimize(conv_chain(act="Relu"), options=OptimizeOptions(spec=load_profile("Ascend910A"), verify=False))
    (r,) = res.applied
    rec = r.ascend_kernel
    assert rec["op"] == "Conv2D" and rec["builtin"] and rec["available"] and rec["problem"] is None
    assert rec["epilogue"] == [{"op": "Relu"}] and rec["fusion"] == "ATC UB fusion: Conv2D + Relu"
    assert rec["attrs"]["pads"] == [1, 1, 1, 1] and rec["attrs"]["strides"] == [1, 1, 1, 1]
    assert {b["name"] for b in rec["inputs"]} == {"x", "filter", "bias"}
    res = optimize(conv_chain(act=None), options=OptimizeOptions(spec=load_profile("Ascend910A"), verify=False))
    (r,) = res.applied
    assert r.ascend_kernel["folded"] and r.ascend_kernel["op"] == "Conv2D"


def test_matmul_with_a_norm_epilogue_has_no_kernel() -> None:
    node = helper.make_node("FusedMatMul", ["a", "b", "bias", "g", "be"], ["y"], name="mm", domain="npufuse",
                            epilogue=["bias", "layernorm"], epsilon=1e-5)
    rec = ak.region_kernel([node], {"a": (128, 64)}.get, "ascend910b", "Ascend910B2")
    assert rec["op"] == "MatMulV3" and "no layernorm epilogue" in rec["problem"]
    node = helper.make_node("FusedMatMul", ["a", "b", "bias"], ["y"], name="mm", domain="npufuse",
                            epilogue=["bias", "gelu"])
    rec = ak.region_kernel([node], {"a": (2, 128, 64)}.get, "ascend910b", "Ascend910B2")
    assert rec["op"] == "BatchMatMulV3" and rec["problem"] is None and rec["epilogue"][0]["op"] == "Gelu"
    assert ak.kernel_label(rec) == "BatchMatMulV3+Gelu"


# ---- reports and the command line ---------------------------------------------------------------------------

def test_reports_carry_the_kernel(specs: dict) -> None:
    model = attention_model(mask="causal_const")
    res = optimize(model, options=OptimizeOptions(spec=specs["Ascend910A"], verify=False))
    doc = optimize_report(res, "m.onnx", None, "Ascend910A", False)
    att = next(f for f in doc["fusions"] if f["pattern"] == "attention")
    assert att["ascend_kernel"]["op"] == "PromptFlashAttention" and att["status"] == SKIPPED_COST
    assert att["decision"]["unsupported"].startswith("PromptFlashAttention has no kernel")
    json.dumps(doc)
    report = build_report(model, res, specs["Ascend910A"], "m.onnx", verified=False)
    assert any(c["ascend_kernel"] and c["ascend_kernel"]["op"] == "PromptFlashAttention"
               for c in report["candidates"])
    assert json.loads(render(report, "json"))["candidates"][0]["ascend_kernel"] is not None
    text = render(report, "text")
    assert "Ascend kernel" in text and "PromptFlashAttention" in text
    md = render(report, "markdown")
    assert "| Ascend kernel |" in md and "`PromptFlashAttention`" in md
    html = render(report, "html")
    assert "PromptFlashAttention" in html and "no kernel for ascend910" in html


def test_profiles_command_shows_the_chip() -> None:
    out = CliRunner().invoke(main, ["profiles"])
    assert out.exit_code == 0, out.output
    row = next(line for line in out.output.splitlines() if line.startswith("Chip"))
    assert re.search(r"ascend910b\s+ascend910\s+ascend310p|ascend310p\s+ascend910\s+ascend910b", row), row
