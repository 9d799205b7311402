"""Fusion inside If / Loop / Scan subgraphs: chains in branches and bodies fuse (nested too), outer-scope
values a subgraph reads are never fused away or dropped, and every subgraph rewrite is checked and rolled back
when it is wrong."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from builders import WrongEpsilonLayerNorm, conv_chain
from onnx import TensorProto, helper, numpy_helper

import npufuse.fusion.engine as engine
from npufuse.fusion.engine import APPLIED, ROLLED_BACK, OptimizeOptions, optimize
from npufuse.ir.graph import Graph
from npufuse.ir.modelio import write_model
from npufuse.patterns import PATTERNS
from npufuse.ir.runtime import run
from npufuse.reporting.summary import optimize_report
from npufuse.verify.compare import compare

H = 16
SHAPE = [2, 3, H]
F = TensorProto.FLOAT


def _layernorm(p: str, x: str, out: str, gamma: str = "gamma", beta: str = "beta") -> list[onnx.NodeProto]:
    """The decomposition exporters leave at opset 14 (ReduceMean with `axes` attributes); `two` and `eps` are
    initializers of the main graph, read from the outer scope."""
    return [
        helper.make_node("ReduceMean", [x], [f"{p}mean"], name=f"{p}rm1", axes=[-1]),
        helper.make_node("Sub", [x, f"{p}mean"], [f"{p}d"], name=f"{p}sub"),
        helper.make_node("Pow", [f"{p}d", "two"], [f"{p}sq"], name=f"{p}pow"),
        helper.make_node("ReduceMean", [f"{p}sq"], [f"{p}var"], name=f"{p}rm2", axes=[-1]),
        helper.make_node("Add", [f"{p}var", "eps"], [f"{p}ve"], name=f"{p}add"),
        helper.make_node("Sqrt", [f"{p}ve"], [f"{p}std"], name=f"{p}sqrt"),
        helper.make_node("Div", [f"{p}d", f"{p}std"], [f"{p}n"], name=f"{p}div"),
        helper.make_node("Mul", [f"{p}n", gamma], [f"{p}g"], name=f"{p}mul"),
        helper.make_node("Add", [f"{p}g", beta], [out], name=f"{p}addb"),
    ]


def _matmul_bias_gelu(p: str, x: str, out: str) -> list[onnx.NodeProto]:
    """x·W + b -> Gelu (erf form)."""
    return [
        helper.make_node("MatMul", [x, "W"], [f"{p}mm"], name=f"{p}matmul"),
        helper.make_node("Add", [f"{p}mm", "b"], [f"{p}h"], name=f"{p}bias"),
        helper.make_node("Div", [f"{p}h", "sqrt2"], [f"{p}s"], name=f"{p}div"),
        helper.make_node("Erf", [f"{p}s"], [f"{p}e"], name=f"{p}erf"),
        helper.make_node("Add", [f"{p}e", "one"], [f"{p}e1"], name=f"{p}add1"),
        helper.make_node("Mul", [f"{p}h", f"{p}e1"], [f"{p}m"], name=f"{p}mul"),
        helper.make_node("Mul", [f"{p}m", "half"], [out], name=f"{p}half"),
    ]


def _constants(seed: int = 0) -> list[onnx.TensorProto]:
    rng = np.random.default_rng(seed)
    values = {"two": np.array(2.0), "eps": np.array(1e-5), "sqrt2": np.array(np.sqrt(2.0)), "one": np.array(1.0),
              "half": np.array(0.5), "gamma": rng.uniform(0.5, 1.5, H), "beta": rng.standard_normal(H),
              "W": rng.standard_normal((H, H)) * 0.3, "b": rng.standard_normal(H)}
    return [numpy_helper.from_array(v.astype(np.float32), k) for k, v in values.items()]


def _model(nodes, inputs, outputs, inits, opset: int = 14) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _if_model(opset: int = 14) -> onnx.ModelProto:
    """y = If(cond, then: LayerNorm(x), else: Gelu(x·W + b)), x a graph input read from both branches."""
    then = helper.make_graph(_layernorm("t_", "x", "ty"), "then", [], [helper.make_tensor_value_info("ty", F, SHAPE)])
    other = helper.make_graph(_matmul_bias_gelu("e_", "x", "ey"), "else", [],
                              [helper.make_tensor_value_info("ey", F, SHAPE)])
    node = helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then, else_branch=other)
    return _model([node], [helper.make_tensor_value_info("x", F, SHAPE),
                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                  [helper.make_tensor_value_info("y", F, SHAPE)], _constants(), opset)


def _loop_model(nested_if: bool = False) -> onnx.ModelProto:
    """h <- LayerNorm(h) + iteration, three times (Loop); with `nested_if`, the body's LayerNorm sits in the then
    branch of an If inside the body (its else branch a Gelu)."""
    body_inputs = [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                   helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
                   helper.make_tensor_value_info("h_in", F, SHAPE)]
    body_outputs = [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
                    helper.make_tensor_value_info("h_out", F, SHAPE)]
    nodes = [helper.make_node("Identity", ["c_in"], ["c_out"], name="cond_id"),
             helper.make_node("Cast", ["i"], ["fi"], name="cast_i", to=F)]
    if nested_if:
        then = helper.make_graph(_layernorm("bt_", "h_in", "bty"), "then", [],
                                 [helper.make_tensor_value_info("bty", F, SHAPE)])
        other = helper.make_graph(_matmul_bias_gelu("be_", "h_in", "bey"), "else", [],
                                  [helper.make_tensor_value_info("bey", F, SHAPE)])
        nodes += [helper.make_node("Greater", ["fi", "one"], ["odd"], name="gt"),
                  helper.make_node("If", ["odd"], ["ln"], name="inner_if", then_branch=then, else_branch=other)]
    else:
        nodes += _layernorm("b_", "h_in", "ln")
    nodes.append(helper.make_node("Add", ["ln", "fi"], ["h_out"], name="plus_i"))
    body = helper.make_graph(nodes, "body", body_inputs, body_outputs)
    trip = numpy_helper.from_array(np.array(3, np.int64), "trip")
    loop = helper.make_node("Loop", ["trip", "", "x"], ["h"], name="loop", body=body)
    return _model([loop], [helper.make_tensor_value_info("x", F, SHAPE)], [helper.make_tensor_value_info("h", F, SHAPE)],
                  _constants() + [trip])


def _ops(graph: onnx.GraphProto) -> list[tuple[str, str]]:
    return [(n.domain, n.op_type) for n in graph.node]


def _branch(model: onnx.ModelProto, node: str, attr: str) -> onnx.GraphProto:
    n = next(n for n in model.graph.node if n.name == node)
    return next(a.g for a in n.attribute if a.name == attr)


def _same_outputs(a: onnx.ModelProto, b: onnx.ModelProto, feeds: dict) -> None:
    names = [o.name for o in a.graph.output]
    want, got = run(a, feeds, names), run(b, feeds, names)
    for n in names:
        c = compare(n, got[n], want[n])
        assert c.ok, c.detail


def _feeds(seed: int = 1, **extra) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32), **extra}


def test_chains_in_both_branches_of_an_if_fuse_and_run_for_either_condition(tmp_path) -> None:
    model = _if_model()
    res = optimize(model)
    applied = {r.graph: r for r in res.applied}
    assert set(applied) == {"if.then_branch", "if.else_branch"}, [r.to_dict() for r in res.records]
    assert applied["if.then_branch"].match.pattern == "layernorm"
    assert applied["if.else_branch"].match.kind.startswith("FusedMatMul")
    assert all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok
    assert res.notes == []   # every branch ran on its own: the checks saw real boundary values
    out = res.model
    assert _ops(_branch(out, "if", "then_branch")) == [("npufuse", "LayerNorm")]
    assert _ops(_branch(out, "if", "else_branch")) == [("npufuse", "FusedMatMul")]
    assert {f.name for f in out.functions} >= {"LayerNorm", "FusedMatMul"}
    onnx.checker.check_model(out, full_check=True)
    for cond in (True, False):
        _same_outputs(model, out, _feeds(cond=np.array(cond)))
    # the fused node records what it replaced, and the report says where it lies
    fused = _branch(out, "if", "then_branch").node[0]
    meta = {p.key: p.value for p in fused.metadata_props}
    assert meta["npufuse.replaced"].split(",")[0] == "t_rm1"
    fusions = optimize_report(res, "m.onnx", None, None, True)["fusions"]
    assert {f.get("graph") for f in fusions} == {"if.then_branch", "if.else_branch"}
    # written and read back, it still runs
    write_model(out, tmp_path / "o.onnx")
    back = onnx.load(tmp_path / "o.onnx")
    _same_outputs(model, back, _feeds(cond=np.array(False)))


def test_a_standard_op_at_a_high_opset_fuses_inside_a_branch() -> None:
    model = _if_model(opset=17)
    res = optimize(model, options=OptimizeOptions(patterns=[p for p in PATTERNS if p.name == "layernorm"]))
    assert [r.graph for r in res.applied] == ["if.then_branch"]
    assert _ops(_branch(res.model, "if", "then_branch")) == [("", "LayerNormalization")]
    _same_outputs(model, res.model, _feeds(cond=np.array(True)))


def test_a_chain_in_a_loop_body_fuses() -> None:
    model = _loop_model()
    res = optimize(model)
    assert [(r.graph, r.match.pattern) for r in res.applied] == [("loop.body", "layernorm")]
    body = _branch(res.model, "loop", "body")
    assert ("npufuse", "LayerNorm") in _ops(body) and ("", "ReduceMean") not in _ops(body)
    assert res.model_check is not None and res.model_check.ok
    onnx.checker.check_model(res.model, full_check=True)
    _same_outputs(model, res.model, _feeds())


def test_chains_in_a_subgraph_nested_in_a_loop_body_fuse() -> None:
    model = _loop_model(nested_if=True)
    res = optimize(model)
    assert {r.graph for r in res.applied} == {"loop.body/inner_if.then_branch", "loop.body/inner_if.else_branch"}
    inner = next(n for n in _branch(res.model, "loop", "body").node if n.op_type == "If")
    branches = {a.name: _ops(a.g) for a in inner.attribute}
    assert branches == {"then_branch": [("npufuse", "LayerNorm")], "else_branch": [("npufuse", "FusedMatMul")]}
    onnx.checker.check_model(res.model, full_check=True)
    _same_outputs(model, res.model, _feeds())


def test_a_chain_in_a_scan_body_fuses() -> None:
    """s <- LayerNorm(s + seq[t]) over the slices of seq, every state an output slice too."""
    st = [3, H]
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "sl"], ["a"], name="acc")] + _layernorm("s_", "a", "s_out") +
        [helper.make_node("Identity", ["s_out"], ["ys"], name="emit")], "body",
        [helper.make_tensor_value_info("s_in", F, st), helper.make_tensor_value_info("sl", F, st)],
        [helper.make_tensor_value_info("s_out", F, st), helper.make_tensor_value_info("ys", F, st)])
    scan = helper.make_node("Scan", ["x", "seq"], ["s", "ys_all"], name="scan", body=body, num_scan_inputs=1)
    model = _model([scan], [helper.make_tensor_value_info("x", F, st), helper.make_tensor_value_info("seq", F, [4] + st)],
                   [helper.make_tensor_value_info("s", F, st), helper.make_tensor_value_info("ys_all", F, [4] + st)],
                   _constants())
    res = optimize(model)
    assert [(r.graph, r.match.pattern) for r in res.applied] == [("scan.body", "layernorm"),
                                                                 ("scan.body", "add_layernorm")]
    assert _ops(_branch(res.model, "scan", "body")) == [("npufuse", "AddLayerNorm"), ("", "Identity")]
    onnx.checker.check_model(res.model, full_check=True)
    rng = np.random.default_rng(3)
    _same_outputs(model, res.model, {"x": rng.standard_normal(st).astype(np.float32),
                                     "seq": rng.standard_normal([4] + st).astype(np.float32)})


def test_a_value_read_only_inside_a_subgraph_keeps_its_producer() -> None:
    """A main-graph fusion rebuilds the graph and drops what became dead: a node (and an initializer) whose only
    reader is an If branch is not dead."""
    model = conv_chain(act="Relu")
    g = model.graph
    g.initializer.extend([numpy_helper.from_array(np.full((1,), 3.0, np.float32), "k"),
                          numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    g.node.extend([helper.make_node("Neg", ["X"], ["negx"], name="neg"),
                   helper.make_node("ReduceSum", ["X"], ["s"], name="rs", keepdims=0),
                   helper.make_node("Greater", ["s", "zero"], ["cond"], name="gt")])
    shape = [1, 4, 7, 7]
    then = helper.make_graph([helper.make_node("Mul", ["negx", "k"], ["t"], name="tmul")], "then", [],
                             [helper.make_tensor_value_info("t", F, shape)])
    other = helper.make_graph([helper.make_node("Add", ["negx", "k"], ["e"], name="eadd")], "else", [],
                              [helper.make_tensor_value_info("e", F, shape)])
    g.node.append(helper.make_node("If", ["cond"], ["z"], name="if", then_branch=then, else_branch=other))
    g.output.append(helper.make_tensor_value_info("z", F, shape))
    onnx.checker.check_model(model)
    res = optimize(model)
    assert [r.match.kind for r in res.applied] == ["FusedConv[Relu]"]
    assert "neg" in {n.name for n in res.model.graph.node}
    assert "k" in {t.name for t in res.model.graph.initializer}
    onnx.checker.check_model(res.model, full_check=True)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    _same_outputs(model, res.model, {"X": x})


def test_an_intermediate_a_subgraph_reads_is_not_fused_away() -> None:
    """The main graph's LayerNorm would consume its mean internally, but an If branch reads the mean: the Graph
    counts the If as a reader, so the LayerNorm is a near-miss and the mean stays."""
    nodes = _layernorm("m_", "x", "y")
    then = helper.make_graph([helper.make_node("Mul", ["m_mean", "two"], ["t"], name="tmul")], "then", [],
                             [helper.make_tensor_value_info("t", F, [2, 3, 1])])
    other = helper.make_graph([helper.make_node("Neg", ["m_mean"], ["e"], name="eneg")], "else", [],
                              [helper.make_tensor_value_info("e", F, [2, 3, 1])])
    nodes.append(helper.make_node("If", ["cond"], ["z"], name="if", then_branch=then, else_branch=other))
    model = _model(nodes, [helper.make_tensor_value_info("x", F, SHAPE),
                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                   [helper.make_tensor_value_info("y", F, SHAPE), helper.make_tensor_value_info("z", F, [2, 3, 1])],
                   _constants())
    g = Graph(model)
    assert {c.name for c in g.consumers_of("m_mean")} == {"m_sub", "if"}
    res = optimize(model)
    assert res.applied == []
    assert any(f.reason == "shared-intermediate" and "m_mean" in f.detail for f in res.refusals)
    assert "m_rm1" in {n.name for n in res.model.graph.node}
    for cond in (True, False):
        _same_outputs(model, res.model, _feeds(cond=np.array(cond)))


def test_a_fused_output_a_subgraph_reads_comes_before_the_subgraph() -> None:
    """AddLayerNorm keeps the residual sum as a second output, placed where the LayerNorm ended: an If between
    the Add and the LayerNorm that reads the sum must come after the fused node."""
    nodes = [helper.make_node("Add", ["x", "r"], ["s"], name="resid")]
    then = helper.make_graph([helper.make_node("Neg", ["s"], ["t"], name="tneg")], "then", [],
                             [helper.make_tensor_value_info("t", F, SHAPE)])
    other = helper.make_graph([helper.make_node("Abs", ["s"], ["e"], name="eabs")], "else", [],
                              [helper.make_tensor_value_info("e", F, SHAPE)])
    nodes.append(helper.make_node("If", ["cond"], ["z"], name="if", then_branch=then, else_branch=other))
    nodes += _layernorm("m_", "s", "y")
    model = _model(nodes, [helper.make_tensor_value_info(v, F, SHAPE) for v in ("x", "r")] +
                   [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                   [helper.make_tensor_value_info("y", F, SHAPE), helper.make_tensor_value_info("z", F, SHAPE)],
                   _constants(), opset=17)
    res = optimize(model)
    assert [r.match.pattern for r in res.applied] == ["layernorm", "add_layernorm"]
    assert [n.op_type for n in res.model.graph.node] == ["AddLayerNorm", "If"]
    onnx.checker.check_model(res.model, full_check=True)
    r = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    for cond in (True, False):
        _same_outputs(model, res.model, _feeds(r=r, cond=np.array(cond)))


def test_a_wrong_rewrite_in_a_branch_is_rolled_back() -> None:
    model = _if_model()
    patterns = [WrongEpsilonLayerNorm()] + [p for p in PATTERNS if p.name != "layernorm"]
    res = optimize(model, options=OptimizeOptions(patterns=patterns))
    rolled = [(r.graph, r.match.pattern) for r in res.rolled_back]
    assert rolled == [("if.then_branch", "layernorm")]
    assert {r.graph for r in res.applied} == {"if.else_branch"}   # Gelu, then FusedMatMul absorbing it
    then = _branch(res.model, "if", "then_branch")
    assert ("", "ReduceMean") in _ops(then) and ("npufuse", "LayerNorm") not in _ops(then)
    assert res.model_check is not None and res.model_check.ok
    for cond in (True, False):
        _same_outputs(model, res.model, _feeds(cond=np.array(cond)))


def test_a_subgraph_that_drifts_as_a_whole_is_left_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should a wrong rewrite pass its own check, the subgraph run on its own before vs after still catches it."""
    def lenient(g, m, rep, feeds):
        return engine.RewriteCheck(True)

    monkeypatch.setattr(engine, "check_rewrite", lenient)
    model = _loop_model()
    res = optimize(model, options=OptimizeOptions(patterns=[WrongEpsilonLayerNorm()]))
    assert [(r.graph, r.status) for r in res.records] == [("loop.body", ROLLED_BACK)]
    assert "drifts" in res.records[0].reason
    assert ("npufuse", "LayerNorm") not in _ops(_branch(res.model, "loop", "body"))
    _same_outputs(model, res.model, _feeds())


def test_without_verification_subgraphs_still_fuse() -> None:
    model = _if_model()
    res = optimize(model, options=OptimizeOptions(verify=False))
    assert {r.graph for r in res.records if r.status == APPLIED} == {"if.else_branch", "if.then_branch"}
    _same_outputs(model, res.model, _feeds(cond=np.array(True)))


def test_report_places_subgraph_fusions_and_the_cost_model_prices_them() -> None:
    from npufuse.npu_model.spec import load_profile
    from npufuse.reporting import build_report, render

    model = _if_model()
    spec = load_profile("Ascend910B2")
    res = optimize(model, options=OptimizeOptions(spec=spec, force_fuse=True))
    assert {r.graph for r in res.applied} == {"if.then_branch", "if.else_branch"}
    assert all(r.decision is not None for r in res.applied)
    doc = build_report(model, res, spec, "m.onnx")
    assert {c.get("graph") for c in doc["candidates"]} == {"if.then_branch", "if.else_branch"}
    assert {r.get("graph") for r in doc["regions"]} == {"if.then_branch", "if.else_branch"}
    assert "(in if.then_branch)" in render(doc, "text")
    assert "if.else_branch" in render(doc, "markdown")
    render(doc, "html")


def test_normalize_keeps_a_large_constant_only_a_subgraph_reads() -> None:
    from npufuse.prepare.normalize import normalize

    big = numpy_helper.from_array(np.ones((300, 300), np.float32), "bigv")
    small = numpy_helper.from_array(np.ones((300,), np.float32), "smallv")
    then = helper.make_graph([helper.make_node("Add", ["x", "big"], ["t"], name="tadd")], "then", [],
                             [helper.make_tensor_value_info("t", F, [300, 300])])
    other = helper.make_graph([helper.make_node("Sub", ["x", "big"], ["e"], name="esub")], "else", [],
                              [helper.make_tensor_value_info("e", F, [300, 300])])
    nodes = [helper.make_node("Constant", [], ["big"], name="cbig", value=big),
             helper.make_node("Constant", [], ["small"], name="csmall", value=small),
             helper.make_node("Add", ["x", "small"], ["y"], name="add"),
             helper.make_node("If", ["cond"], ["z"], name="if", then_branch=then, else_branch=other)]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, [300, 300]),
                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                   [helper.make_tensor_value_info("y", F, [300, 300]), helper.make_tensor_value_info("z", F, [300, 300])],
                   [], opset=17)
    out, _ = normalize(model)
    onnx.checker.check_model(out)
