"""Lowering to what ATC's ONNX parser accepts (npufuse/emit/atc/lower.py): inlining model-local functions and
moving the default domain to one opset <= 18, checked numerically in onnxruntime against the original."""

from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from npufuse.emit.atc.lower import (
    LoweringError,
    convert_default_opset,
    decompose_unregistered,
    inline_functions,
    lower_for_atc,
)
from npufuse.errors import InputError

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
KEYS = ROOT / "npufuse" / "emit" / "atc" / "onnx_keys.tsv"


# ---- helpers ----------------------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def registered_keys() -> frozenset[tuple[str, int, str]]:
    """(domain, version, op_type) of every key ATC registers, read from the table shipped with the package."""
    if not KEYS.exists():
        pytest.skip("npufuse/emit/atc/onnx_keys.tsv is not there yet")
    out = set()
    for line in KEYS.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith(("#", "domain\t")):
            continue
        domain, version, op, *_ = line.split("\t")
        out.add((domain, int(version), op))
    return frozenset(out)


def unregistered(model: onnx.ModelProto, opset: int) -> set[str]:
    """Default-domain ops (subgraphs included) with no ATC key at `opset`; Constant is parsed without a key."""
    keys = registered_keys()
    missing, stack = set(), list(model.graph.node)
    while stack:
        n = stack.pop()
        stack.extend(sub for a in n.attribute if a.type == onnx.AttributeProto.GRAPH for sub in a.g.node)
        if n.domain in ("", "ai.onnx") and n.op_type != "Constant" and ("ai.onnx", opset, n.op_type) not in keys:
            missing.add(n.op_type)
    return missing


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    """onnxruntime with its graph optimizations off: compare what the graphs say, not ORT's own fusions."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return session(model).run(None, feeds)


def feeds_for(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: token ids in {0, 1} (valid for every vocabulary), masks of ones, floats ~N(0, 1);
    symbolic dims `batch` -> 2, others -> 8."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        tt = i.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (2 if "batch" in d.dim_param else 8)
                 for d in tt.shape.dim]
        if tt.elem_type == T.INT64:
            out[i.name] = np.ones(shape, np.int64) if "mask" in i.name else rng.integers(0, 2, shape, dtype=np.int64)
        else:
            out[i.name] = rng.standard_normal(shape).astype(h.tensor_dtype_to_np_dtype(tt.elem_type))
    return out


def assert_same(got: list[np.ndarray], want: list[np.ndarray], rtol: float = 1e-5, atol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol)


def opset_of(model: onnx.ModelProto) -> dict[str, int]:
    return {o.domain: o.version for o in model.opset_import}


def single(op: str, opset: int, inputs: list[tuple[str, int, list]], attrs: dict | None = None,
           inits: list[onnx.TensorProto] = (), outputs: int = 1, out_shape: list | None = None) -> onnx.ModelProto:
    """A one-node model: inputs (name, elem_type, shape) plus initializers."""
    names = [n for n, _, _ in inputs] + [t.name for t in inits]
    outs = ["y"] if outputs == 1 else [f"y{i}" for i in range(outputs)]
    node = h.make_node(op, names, outs, name=f"the_{op.lower()}", **(attrs or {}))
    g = h.make_graph([node], "g", [h.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                     [h.make_tensor_value_info(o, inputs[0][1], out_shape) for o in outs], list(inits))
    return shaped(h.make_model(g, opset_imports=[h.make_opsetid("", opset)]))


def shaped(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with its outputs' shapes inferred (the full checker wants shapes on graph outputs)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    if all(o.type.tensor_type.HasField("shape") for o in inferred.graph.output):
        return inferred
    return model


def lowered_equal(model: onnx.ModelProto, target: int, feeds: dict[str, np.ndarray], rtol: float = 1e-5,
                  atol: float = 1e-6) -> onnx.ModelProto:
    """Lower `model` to `target`, check the keys, the checker and onnxruntime against the original's outputs."""
    low = convert_default_opset(model, target)
    assert opset_of(low)[""] == target
    onnx.checker.check_model(low, full_check=True)
    assert not unregistered(low, target)
    assert_same(run(low, feeds), run(model, feeds), rtol, atol)
    return low


# ---- (a) inlining -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bert_fused() -> onnx.ModelProto:
    import npufuse

    return npufuse.optimize(str(ROOT / "examples" / "bert_tiny.onnx"), verify=False).model


def test_inline_bert_tiny_equals_optimized_and_original(bert_fused):
    assert bert_fused.functions and any(n.domain == "npufuse" for n in bert_fused.graph.node)
    flat = inline_functions(bert_fused)
    assert not flat.functions
    assert all(n.domain == "" for n in flat.graph.node)
    assert set(opset_of(flat)) == {""}
    onnx.checker.check_model(flat, full_check=True)
    names = [n.name for n in flat.graph.node]
    assert len(names) == len(set(names))
    outputs = [o for n in flat.graph.node for o in n.output]
    assert len(outputs) == len(set(outputs))
    # traceable: a body node is named after its caller
    callers = [n.name for n in bert_fused.graph.node if n.domain == "npufuse"]
    assert any(name.startswith(callers[0] + "/") for name in names)
    original = onnx.load(ROOT / "examples" / "bert_tiny.onnx")
    feeds = feeds_for(original, seed=3)
    want_fused, want_orig = run(bert_fused, feeds), run(original, feeds)
    got = run(flat, feeds)
    assert_same(got, want_fused, rtol=1e-5, atol=1e-6)
    assert_same(got, want_orig, rtol=1e-5, atol=1e-5)
    # and on to an ATC opset: every node has a key
    low = convert_default_opset(flat, 17)
    assert not unregistered(low, 17)
    assert_same(run(low, feeds), want_orig, rtol=1e-5, atol=1e-5)


def test_inline_keep_leaves_chosen_nodes_and_their_functions(bert_fused):
    keep = lambda n: n.domain == "npufuse" and n.op_type == "FusedAttention"
    kept = [n for n in bert_fused.graph.node if keep(n)]
    assert kept
    out = inline_functions(bert_fused, keep)
    left = [n for n in out.graph.node if n.domain == "npufuse"]
    assert [n.name for n in left] == [n.name for n in kept]
    assert {(f.domain, f.name, f.overload) for f in out.functions} == {(n.domain, n.op_type, n.overload) for n in kept}
    assert opset_of(out).get("npufuse") == 1
    onnx.checker.check_model(out, full_check=True)
    feeds = feeds_for(onnx.load(ROOT / "examples" / "bert_tiny.onnx"), seed=4)
    assert_same(run(out, feeds), run(bert_fused, feeds), rtol=1e-5, atol=1e-6)
    # lower_for_atc: the kept calls survive the opset move; everything else has an ATC key at 16
    low = lower_for_atc(bert_fused, 16, keep)
    assert opset_of(low) == {"": 16, "npufuse": 1}
    assert [n.name for n in low.graph.node if n.domain == "npufuse"] == [n.name for n in kept]
    assert not unregistered(low, 16)


def _function(name: str, overload: str, body: list[onnx.NodeProto], inputs: list[str], attrs: list[str] = (),
              defaults: list[onnx.AttributeProto] = ()) -> onnx.FunctionProto:
    f = h.make_function("my.dom", name, inputs, ["Y"], body, [h.make_opsetid("", 18)], attributes=list(attrs))
    f.overload = overload
    f.attribute_proto.extend(defaults)
    return f


def test_inline_overloads_attribute_refs_defaults_and_nesting():
    # Two overloads of one name with different bodies; `alpha` is an attribute reference whose value comes from
    # the caller, `beta` from the function's default; Outer calls Scale (nesting), and a dropped optional
    # attribute reference (no value anywhere) leaves the attribute out.
    def const_ref(out, ref):
        n = h.make_node("Constant", [], [out])
        a = onnx.AttributeProto(name="value_float", ref_attr_name=ref, type=onnx.AttributeProto.FLOAT)
        n.attribute.append(a)
        return n

    scale_mul = _function("Scale", "mul", [const_ref("a", "alpha"), h.make_node("Mul", ["X", "a"], ["t"]),
                                           const_ref("b", "beta"), h.make_node("Add", ["t", "b"], ["Y"])],
                          ["X"], ["alpha"], [h.make_attribute("beta", 0.25)])
    scale_add = _function("Scale", "add", [const_ref("a", "alpha"), h.make_node("Add", ["X", "a"], ["Y"])],
                          ["X"], ["alpha"])
    lrelu = h.make_node("LeakyRelu", ["X"], ["Y"])
    lrelu.attribute.append(onnx.AttributeProto(name="alpha", ref_attr_name="slope", type=onnx.AttributeProto.FLOAT))
    leaky = _function("Leaky", "", [lrelu], ["X"], ["slope"])
    inner = h.make_node("Scale", ["X"], ["Y"], domain="my.dom", alpha=3.0)
    inner.overload = "mul"
    outer = _function("Outer", "", [inner], ["X"])
    outer.opset_import.append(h.make_opsetid("my.dom", 1))
    n1 = h.make_node("Scale", ["x"], ["u"], name="s1", domain="my.dom", alpha=2.0)
    n1.overload = "mul"
    n2 = h.make_node("Scale", ["u"], ["v"], name="s2", domain="my.dom", alpha=10.0)
    n2.overload = "add"
    n3 = h.make_node("Outer", ["v"], ["w"], name="o", domain="my.dom")
    n4 = h.make_node("Leaky", ["w"], ["y"], name="l", domain="my.dom")   # no slope: LeakyRelu's own 0.01
    g = h.make_graph([n1, n2, n3, n4], "g", [h.make_tensor_value_info("x", T.FLOAT, [3, 4])],
                     [h.make_tensor_value_info("y", T.FLOAT, [3, 4])])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("my.dom", 1)], ir_version=10,
                     functions=[scale_mul, scale_add, leaky, outer])
    flat = inline_functions(m)
    assert not flat.functions and opset_of(flat) == {"": 18}
    onnx.checker.check_model(flat, full_check=True)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    v = (x * 2 + 0.25) + 10
    w = v * 3 + 0.25
    want = np.where(w >= 0, w, 0.01 * w)
    # (onnxruntime 1.32 cannot run the original: it does not resolve function overloads, hence numpy)
    np.testing.assert_allclose(run(flat, {"x": x})[0], want, rtol=1e-6)
    assert any(n.name.startswith("o/") and n.op_type == "Mul" for n in flat.graph.node)


def test_inline_never_reads_external_weights(tmp_path):
    # The initializer refers to a file that does not exist: inlining and conversion must not touch it.
    w = onnx.TensorProto(name="w", data_type=T.FLOAT, dims=[4])
    w.data_location = T.EXTERNAL
    for k, v in (("location", "missing.bin"), ("offset", "0"), ("length", "16")):
        e = w.external_data.add()
        e.key, e.value = k, v
    f = h.make_function("my.dom", "AddW", ["X", "W"], ["Y"], [h.make_node("Add", ["X", "W"], ["Y"])],
                        [h.make_opsetid("", 20)])
    g = h.make_graph([h.make_node("AddW", ["x", "w"], ["t"], name="c", domain="my.dom"),
                      h.make_node("Gelu", ["t"], ["y"], name="gelu")], "g",
                     [h.make_tensor_value_info("x", T.FLOAT, [2, 4])], [h.make_tensor_value_info("y", T.FLOAT, [2, 4])],
                     [w])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 20), h.make_opsetid("my.dom", 1)], functions=[f])
    low = convert_default_opset(inline_functions(m), 17)
    assert low.graph.initializer[0].name == "w"
    assert low.graph.initializer[0].external_data[0].value == "missing.bin"
    assert {n.op_type for n in low.graph.node} == {"Add", "Div", "Erf", "Mul"}
    same = convert_default_opset(inline_functions(m), 17, in_place=False)
    assert same.graph.initializer[0].data_location == T.EXTERNAL


def test_in_place_returns_the_input_model():
    m = single("Gelu", 20, [("x", T.FLOAT, [2, 3])])
    assert convert_default_opset(m, 17, in_place=True) is m
    assert opset_of(m)[""] == 17 and "Gelu" not in {n.op_type for n in m.graph.node}


# ---- (b) real dynamo exports to ATC opsets --------------------------------------------------------------------

DYNAMO = ["llama_dynamo", "bert_dynamo", "convnext_dynamo", "gpt2_dynamo", "swin_dynamo", "regnet_dynamo_noopt",
          "mobilenetv2_dynamo_noopt", "qwen2_fp16_dynamo"]


@pytest.mark.parametrize("target", [17, 16, 14])
@pytest.mark.parametrize("name", DYNAMO)
def test_dynamo_fixture_to_atc_opset(name, target):
    model = onnx.load(FIXTURES / f"{name}.onnx")
    assert opset_of(model)[""] >= 18
    before = model.SerializeToString()
    low = convert_default_opset(model, target)
    assert model.SerializeToString() == before      # the input is never modified
    assert opset_of(low) == {"": target}
    assert not unregistered(low, target), unregistered(low, target)
    onnx.checker.check_model(low, full_check=True)
    feeds = feeds_for(model, seed=7)
    fp16 = "fp16" in name
    assert_same(run(low, feeds), run(model, feeds), rtol=2e-3 if fp16 else 1e-5, atol=2e-3 if fp16 else 1e-5)
    node_names = [n.name for n in low.graph.node]
    assert len(node_names) == len(set(node_names))


# ---- (c) one op at a time ----------------------------------------------------------------------------------

RNG = np.random.default_rng(11)
X4 = RNG.standard_normal((2, 6, 3, 5)).astype(np.float32) * 3


def _gelu_ref(x: np.ndarray, approximate: str) -> np.ndarray:
    from math import erf, pi, sqrt

    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + np.vectorize(erf)(x / sqrt(2)))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_20(approximate):
    m = single("Gelu", 20, [("x", T.FLOAT, list(X4.shape))], {"approximate": approximate})
    low = lowered_equal(m, 17, {"x": X4}, rtol=1e-6, atol=1e-6)
    expect = {"none": "Erf", "tanh": "Tanh"}[approximate]
    assert expect in {n.op_type for n in low.graph.node}
    np.testing.assert_allclose(run(low, {"x": X4})[0], _gelu_ref(X4.astype(np.float64), approximate), rtol=1e-5,
                               atol=1e-6)
    assert all(n.name.startswith("the_gelu/") for n in low.graph.node)


def test_gelu_fp16_constants_are_fp16():
    x = X4.astype(np.float16)
    m = single("Gelu", 20, [("x", T.FLOAT16, list(x.shape))])
    low = lowered_equal(m, 18, {"x": x}, rtol=2e-3, atol=2e-3)
    assert {t.data_type for t in low.graph.initializer} == {T.FLOAT16}


def _group_norm_ref(x: np.ndarray, g: int, scale: np.ndarray, bias: np.ndarray, eps: float,
                    per_channel: bool) -> np.ndarray:
    n, c = x.shape[:2]
    xg = x.reshape(n, g, -1).astype(np.float64)
    norm = ((xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + eps))
    if per_channel:
        y = norm.reshape(x.shape).reshape(n, c, -1) * scale[:, None] + bias[:, None]
    else:
        y = norm * scale[:, None] + bias[:, None]
    return y.reshape(x.shape)


@pytest.mark.parametrize("version", [18, 21])
def test_group_normalization(version):
    groups, c = 3, X4.shape[1]
    n_aff = groups if version == 18 else c
    scale = RNG.standard_normal(n_aff).astype(np.float32)
    bias = RNG.standard_normal(n_aff).astype(np.float32)
    inits = [onnx.numpy_helper.from_array(scale, "s"), onnx.numpy_helper.from_array(bias, "b")]
    m = single("GroupNormalization", version, [("x", T.FLOAT, list(X4.shape))], {"num_groups": groups,
                                                                                "epsilon": 1e-3}, inits,
               out_shape=list(X4.shape))
    low = lowered_equal(m, 17, {"x": X4}, rtol=1e-5, atol=1e-5)
    assert "InstanceNormalization" in {n.op_type for n in low.graph.node}
    want = _group_norm_ref(X4, groups, scale, bias, 1e-3, per_channel=version == 21)
    np.testing.assert_allclose(run(low, {"x": X4})[0], want, rtol=1e-4, atol=1e-5)


def test_group_normalization_18_kept_at_18_only_without_decomposition():
    inits = [onnx.numpy_helper.from_array(np.ones(3, np.float32), "s"),
             onnx.numpy_helper.from_array(np.zeros(3, np.float32), "b")]
    m = single("GroupNormalization", 18, [("x", T.FLOAT, list(X4.shape))], {"num_groups": 3}, inits)
    assert "GroupNormalization" in {n.op_type for n in convert_default_opset(m, 18, decompose_unregistered=False).graph.node}
    flat = decompose_unregistered(m)
    assert opset_of(flat)[""] == 18 and "GroupNormalization" not in {n.op_type for n in flat.graph.node}
    assert_same(run(flat, {"x": X4}), run(m, {"x": X4}), 1e-5, 1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rms_normalization_23(dtype):
    x = X4.astype(dtype)
    scale = RNG.standard_normal(5).astype(dtype)
    m = single("RMSNormalization", 23, [("x", h.np_dtype_to_tensor_dtype(np.dtype(dtype)), list(x.shape))],
               {"epsilon": 1e-4}, [onnx.numpy_helper.from_array(scale, "s")])
    tol = 1e-5 if dtype == np.float32 else 2e-3
    low = lowered_equal(m, 17, {"x": x}, rtol=tol, atol=tol)
    xf = x.astype(np.float64)
    want = xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-4) * scale
    np.testing.assert_allclose(run(low, {"x": x})[0].astype(np.float64), want, rtol=tol * 10, atol=tol)


@pytest.mark.parametrize("axis,with_bias,outputs", [(-1, True, 1), (-2, False, 1), (2, True, 3)])
def test_layer_normalization_to_16(axis, with_bias, outputs):
    norm_shape = list(X4.shape[axis:])
    scale = RNG.standard_normal(norm_shape).astype(np.float32)
    inits = [onnx.numpy_helper.from_array(scale, "s")]
    if with_bias:
        inits.append(onnx.numpy_helper.from_array(RNG.standard_normal(norm_shape).astype(np.float32), "b"))
    m = single("LayerNormalization", 18, [("x", T.FLOAT, list(X4.shape))], {"axis": axis, "epsilon": 1e-3}, inits,
               outputs=outputs)
    low = lowered_equal(m, 16, {"x": X4}, rtol=1e-5, atol=1e-5)
    assert "LayerNormalization" not in {n.op_type for n in low.graph.node}
    assert len(low.graph.output) == outputs


def test_layer_normalization_fp16_to_14():
    x = X4.astype(np.float16)
    inits = [onnx.numpy_helper.from_array(np.full(5, 1.5, np.float16), "s"),
             onnx.numpy_helper.from_array(np.full(5, 0.5, np.float16), "b")]
    m = single("LayerNormalization", 17, [("x", T.FLOAT16, list(x.shape))], {}, inits)
    low = lowered_equal(m, 14, {"x": x}, rtol=2e-3, atol=2e-3)
    assert "Cast" in {n.op_type for n in low.graph.node}   # computed in float32 (stash_type 1), as the op does


@pytest.mark.parametrize("dim,static", [(10, True), (12, True), (10, False)])
def test_split_18_num_outputs_to_17(dim, static):
    shape = [2, dim if static else "n"]
    x = RNG.standard_normal((2, dim)).astype(np.float32)
    m = single("Split", 18, [("x", T.FLOAT, shape)], {"axis": 1, "num_outputs": 3}, outputs=3)
    low = lowered_equal(m, 17, {"x": x}, rtol=0, atol=0)
    split = next(n for n in low.graph.node if n.op_type == "Split")
    assert not any(a.name == "num_outputs" for a in split.attribute)
    # torch.chunk's sizes: ceil(dim / 3) for all but the last (10 -> 4, 4, 2; 12 -> 4, 4, 4)
    assert [o.shape for o in run(low, {"x": x})] == [o.shape for o in np.split(x, [4, 8], 1)]


@pytest.mark.parametrize("noop,axes", [(0, [1, -1]), (0, None), (1, None)])
def test_reduce_mean_18_to_17(noop, axes):
    inits = [onnx.numpy_helper.from_array(np.array(axes, np.int64), "axes")] if axes else []
    m = single("ReduceMean", 18, [("x", T.FLOAT, list(X4.shape))], {"keepdims": 0, "noop_with_empty_axes": noop},
               inits)
    low = lowered_equal(m, 17, {"x": X4}, rtol=1e-6, atol=1e-6)
    assert not low.graph.initializer        # the axes initializer went with the input
    ops = {n.op_type for n in low.graph.node}
    assert ops == ({"Identity"} if noop else {"ReduceMean"})


def test_reduce_mean_17_to_18_axes_become_an_input():
    m = single("ReduceMean", 17, [("x", T.FLOAT, list(X4.shape))], {"axes": [2, 3]})
    low = convert_default_opset(m, 18)
    assert len(low.graph.node[0].input) == 2
    assert_same(run(low, {"x": X4}), run(m, {"x": X4}), 1e-6, 1e-6)


def test_if_branches_are_converted():
    def branch(name: str, axes: list[int]) -> onnx.GraphProto:
        return h.make_graph([h.make_node("ReduceMean", ["x", f"{name}_axes"], [f"{name}_y"], keepdims=1),
                             h.make_node("Gelu", [f"{name}_y"], [f"{name}_z"])], name, [],
                            [h.make_tensor_value_info(f"{name}_z", T.FLOAT, None)],
                            [onnx.numpy_helper.from_array(np.array(axes, np.int64), f"{name}_axes")])

    node = h.make_node("If", ["c"], ["y"], then_branch=branch("then", [1]), else_branch=branch("else", [2]))
    g = h.make_graph([node], "g", [h.make_tensor_value_info("c", T.BOOL, []),
                                   h.make_tensor_value_info("x", T.FLOAT, list(X4.shape))],
                     [h.make_tensor_value_info("y", T.FLOAT, None)])
    m = shaped(h.make_model(g, opset_imports=[h.make_opsetid("", 20)]))
    for c in (True, False):
        lowered_equal(m, 17, {"c": np.array(c), "x": X4}, rtol=1e-6, atol=1e-6)


def test_cast_like_and_shape_slices_below_15():
    g = h.make_graph([h.make_node("Shape", ["x"], ["s"], start=1, end=-1),
                      h.make_node("CastLike", ["s", "x"], ["y"])], "g",
                     [h.make_tensor_value_info("x", T.FLOAT, list(X4.shape))], [h.make_tensor_value_info("y", T.FLOAT, None)])
    m = shaped(h.make_model(g, opset_imports=[h.make_opsetid("", 19)]))
    low = lowered_equal(m, 14, {"x": X4}, rtol=0, atol=0)
    assert {n.op_type for n in low.graph.node} == {"Shape", "Slice", "Cast"}


def test_no_lowering_raises_one_line_error():
    q = [("q", T.FLOAT, [1, 2, 4, 8]), ("k", T.FLOAT, [1, 2, 4, 8]), ("v", T.FLOAT, [1, 2, 4, 8])]
    g = h.make_graph([h.make_node("Attention", ["q", "k", "v"], ["y"], name=f"attn{i}") for i in range(1)] +
                     [h.make_node("Attention", ["q", "k", "v"], ["y2"], name="attn_b")], "g",
                     [h.make_tensor_value_info(*a) for a in q],
                     [h.make_tensor_value_info("y", T.FLOAT, None), h.make_tensor_value_info("y2", T.FLOAT, None)])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 23)])
    with pytest.raises(LoweringError) as exc:
        convert_default_opset(m, 17)
    msg = str(exc.value)
    assert isinstance(exc.value, InputError)
    assert "\n" not in msg and "'attn0'" in msg and "2 Attention node(s)" in msg and "fix:" in msg


@pytest.mark.parametrize("model,why", [
    (single("Pad", 19, [("x", T.FLOAT, [2, 3])], {"mode": "wrap"},
            [onnx.numpy_helper.from_array(np.array([0, 1, 0, 1], np.int64), "p")]), "wrap"),
    (single("ReduceMean", 18, [("x", T.FLOAT, [2, 3]), ("axes", T.INT64, [1])]), "run time"),
    (single("AveragePool", 19, [("x", T.FLOAT, [1, 1, 6, 6])], {"kernel_shape": [2, 2], "dilations": [2, 2]}),
     "dilated"),
])
def test_inexpressible_nodes_raise(model, why):
    with pytest.raises(LoweringError, match=why):
        convert_default_opset(model, 17)


def test_bad_target_and_functions_left_raise():
    m = single("Relu", 20, [("x", T.FLOAT, [2])])
    with pytest.raises(LoweringError, match="14..18"):
        convert_default_opset(m, 19)
    m.functions.append(h.make_function("d", "F", ["X"], ["Y"], [h.make_node("Relu", ["X"], ["Y"])],
                                       [h.make_opsetid("", 20)]))
    with pytest.raises(LoweringError, match="inline_functions"):
        convert_default_opset(m, 17)


def test_linear_in_node_count():
    # 100k nodes: a chain of Gelu-20 / ReduceMean-18 pairs lowers in seconds (decomposition included).
    n = 50_000
    nodes, prev = [], "x"
    axes = onnx.numpy_helper.from_array(np.array([-1], np.int64), "axes")
    for i in range(n):
        nodes.append(h.make_node("Gelu", [prev], [f"g{i}"], name=f"gelu{i}"))
        nodes.append(h.make_node("ReduceMean", [f"g{i}", "axes"], [f"r{i}"], name=f"mean{i}", keepdims=1))
        prev = f"r{i}"
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 3])],
                     [h.make_tensor_value_info(prev, T.FLOAT, None)], [axes])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 20)])
    start = time.perf_counter()
    low = convert_default_opset(m, 17)
    elapsed = time.perf_counter() - start
    assert len(low.graph.node) == n * 6     # Gelu: Div, Erf, Add, Mul, Mul; ReduceMean stays one node
    assert elapsed < 30, elapsed
