"""GroupNorm [+ SiLU] (patterns/group_norm.py): the exporters' Reshape -> InstanceNormalization -> Reshape -> affine
spelling (TorchScript: the shape back from Shape(x); dynamo: a constant), ONNX's GroupNormalization-18/-21, with and
without the SiLU after it; the near-misses that must not fuse; numerics against onnxruntime on the original graph
(with a large epsilon and random affine, so a reference or body that drops either is caught); and the ATC form,
where GroupNormSilu is the NPUGroupNormSilu plugin and a GroupNorm without SiLU stays standard ops."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from builders import with_output_shapes
from onnx import TensorProto, helper, numpy_helper

import npufuse
from npufuse.emit.atc import reference_kernels
from npufuse.emit.atc.regions import (
    Namer,
    PluginRegion,
    StaysStandard,
    Values,
    map_group_norm,
    map_region,
)
from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.patterns.group_norm import group_norm_reference
from npufuse.verify.compare import compare

N, C, G, HW = 2, 8, 4, 5
EPS = 0.25          # large: a kernel or body that loses epsilon is visibly wrong


def _graph(*, form: str = "torchscript", silu: bool = True, affine: str = "both", opset: int = 17,
           groups: int = G, channels: int = C, inorm_scale: float = 1.0, back: str = "shape",
           extra_reader: bool = False, leading: int | None = 0, dtype=np.float32) -> onnx.ModelProto:
    """x [N, C, HW, HW] -> GroupNorm in the given spelling -> [SiLU] -> y."""
    rng = np.random.default_rng(0)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits, nodes = [], []

    def const(name, value, dt=None):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=dt or dtype), name))
        return name

    gamma = 1 + 0.5 * rng.standard_normal(channels)
    beta = 0.5 * rng.standard_normal(channels)
    if form == "op":
        if opset < 21:   # GroupNormalization-18: scale and bias per group
            gamma, beta = gamma[:groups], beta[:groups]
        nodes.append(helper.make_node("GroupNormalization", ["x", const("gamma", gamma), const("beta", beta)],
                                      ["z"], num_groups=groups, epsilon=EPS))
    else:
        target = [leading if leading is not None else N, groups, -1]
        nodes.append(helper.make_node("Reshape", ["x", const("target", target, np.int64)], ["xg"]))
        nodes.append(helper.make_node("InstanceNormalization",
                                      ["xg", const("ones", np.full(groups, inorm_scale)),
                                       const("zeros", np.zeros(groups))], ["ng"], epsilon=EPS))
        if back == "shape":
            nodes.append(helper.make_node("Shape", ["x"], ["xs"]))
            nodes.append(helper.make_node("Reshape", ["ng", "xs"], ["n"]))
        elif back == "static":
            nodes.append(helper.make_node("Reshape", ["ng", const("xshape", [N, channels, HW, HW], np.int64)], ["n"]))
        else:   # viewed to something else than x's shape
            nodes.append(helper.make_node("Reshape", ["ng", const("flat", [N, channels, -1], np.int64)], ["n"]))
        cur = "n"
        if affine in ("both", "scale"):
            nodes.append(helper.make_node("Mul", [cur, const("gamma", gamma.reshape(channels, 1, 1))], ["scaled"]))
            cur = "scaled"
        if affine in ("both", "shift"):
            nodes.append(helper.make_node("Add", [cur, const("beta", beta.reshape(channels, 1, 1))], ["z"]))
            cur = "z"
        if cur != "z":
            nodes.append(helper.make_node("Identity", [cur], ["z"]))
    out = "z"
    outputs = []
    if silu:
        nodes += [helper.make_node("Sigmoid", ["z"], ["s"]), helper.make_node("Mul", ["z", "s"], ["y"])]
        out = "y"
    if extra_reader:
        nodes.append(helper.make_node("Neg", ["z"], ["neg"]))
        outputs.append(helper.make_tensor_value_info("neg", elem, None))
    for i, n in enumerate(nodes):
        n.name = f"{n.op_type}_{i}"
    shape = [N, channels, HW, HW] if back != "shape" else ["batch", channels, HW, HW]
    out_shape = shape if back != "other" else [N, channels, HW * HW]
    outputs = [helper.make_tensor_value_info(o.name, elem, out_shape) for o in outputs]
    graph = helper.make_graph(nodes, "gn", [helper.make_tensor_value_info("x", elem, shape)],
                              [helper.make_tensor_value_info(out, elem, out_shape), *outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    # onnx.checker calls GroupNormalization-18 deprecated (21 replaced it); exporters and onnxruntime still take it
    return model if form == "op" and opset < 21 else with_output_shapes(model)


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    t = model.graph.input[0].type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else N for d in t.shape.dim]
    rng = np.random.default_rng(3)
    return {"x": (rng.standard_normal(shape) * 2 + 0.5).astype(helper.tensor_dtype_to_np_dtype(t.elem_type))}


def _optimize(model: onnx.ModelProto):
    symbolic = any(d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim)
    res = optimize(model, options=OptimizeOptions(dims={"batch": N} if symbolic else None))
    assert not res.rolled_back
    assert all(r.check is not None and r.check.ok for r in res.applied)
    feeds = _feeds(model)
    want, got = run(model, feeds), run(res.model, feeds)
    for name in want:
        c = compare(name, got[name], want[name])
        assert c.ok, f"{name}: {c.detail}"
    return res


def _fused(res) -> list[str]:
    return [n.op_type for n in res.model.graph.node if n.domain == "npufuse"]


def _reasons(res) -> list[str]:
    return [r.reason for r in res.refusals if r.pattern == "group_norm"]


# ---- positives ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("back", ["shape", "static"])
@pytest.mark.parametrize("opset", [13, 17, 20])
def test_exporter_spelling_with_silu_is_one_group_norm_silu(back, opset):
    res = _optimize(_graph(back=back, opset=opset))
    assert _fused(res) == ["GroupNormSilu"]
    assert len(res.model.graph.node) == 1
    node = res.model.graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["num_groups"] == G and attrs["epsilon"] == pytest.approx(EPS)
    assert unaccounted(res) == []


@pytest.mark.parametrize("affine", ["both", "scale", "shift", "none"])
def test_without_silu_or_part_of_the_affine(affine):
    res = _optimize(_graph(silu=False, affine=affine))
    assert _fused(res) == ["GroupNorm"]


@pytest.mark.parametrize("opset", [18, 21])
def test_group_normalization_op_with_silu(opset):
    res = _optimize(_graph(form="op", opset=opset))
    assert _fused(res) == ["GroupNormSilu"]


def test_fp16():
    res = _optimize(_graph(dtype=np.float16))
    assert _fused(res) == ["GroupNormSilu"]


def test_silu_read_elsewhere_stays_outside():
    """z also feeds a graph output: the norm fuses, the SiLU (which would hide z) does not."""
    res = _optimize(_graph(extra_reader=True))
    assert sorted(_fused(res)) == ["GroupNorm", "Silu"]      # the SiLU on its own (patterns/silu.py), not inside


# ---- near-misses ---------------------------------------------------------------------------------------------------

def test_plain_instance_norm_is_a_named_near_miss():
    model = _graph(silu=False, affine="none")
    graph = model.graph
    keep = [n for n in graph.node if n.op_type == "InstanceNormalization"]
    keep[0].input[0] = "x"
    del graph.node[:]
    graph.node.extend(keep + [helper.make_node("Identity", ["ng"], ["z"], name="id")])
    ones = next(t for t in graph.initializer if t.name == "ones")
    ones.CopyFrom(numpy_helper.from_array(np.ones(C, np.float32), "ones"))
    zeros = next(t for t in graph.initializer if t.name == "zeros")
    zeros.CopyFrom(numpy_helper.from_array(np.zeros(C, np.float32), "zeros"))
    res = _optimize(model)
    assert _fused(res) == [] and _reasons(res) == ["group-reshape"]
    assert unaccounted(res) == []


@pytest.mark.parametrize("kwargs, reason", [
    ({"inorm_scale": 2.0}, "group-affine"),
    ({"back": "other", "affine": "none"}, "reshape-back"),
    ({"channels": 6, "groups": 5}, "groups-divide-channels"),     # 5 divides 6 * 25, not 6
    ({"leading": 1, "back": "static"}, "group-reshape"),      # the batch folded into the groups
    ({"opset": 8}, "opset"),                                  # the body's int64 Constants need opset 9
])
def test_near_misses_do_not_fuse(kwargs, reason):
    res = _optimize(_graph(silu=False, **kwargs))
    assert "GroupNorm" not in _fused(res) and "GroupNormSilu" not in _fused(res)
    assert reason in _reasons(res)
    assert unaccounted(res) == []


# ---- the reference kernel ------------------------------------------------------------------------------------------

def test_reference_matches_onnxruntime_on_the_decomposition():
    model = _graph(silu=True)
    feeds = _feeds(model)
    want = run(model, feeds)["y"]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    got = group_norm_reference(feeds["x"], inits["gamma"].reshape(-1), inits["beta"].reshape(-1), G, EPS, True)
    assert compare("y", got, want).ok
    # and it is not vacuous: another epsilon or no SiLU is caught
    assert not compare("y", group_norm_reference(feeds["x"], inits["gamma"].reshape(-1), inits["beta"].reshape(-1),
                                                 G, 1e-5, True), want).ok
    assert not compare("y", group_norm_reference(feeds["x"], inits["gamma"].reshape(-1), inits["beta"].reshape(-1),
                                                 G, EPS, False), want).ok


def test_plugin_kernel_matches_the_fused_reference():
    """NPUGroupNormSilu's NumPy kernel (what the CANN kernel computes as its plugin configures it) against the
    decomposition it replaces."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((N, C, HW, HW)).astype(np.float32)
    gamma, beta = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    y, mean, rstd = reference_kernels.KERNELS["NPUGroupNormSilu"]([x, gamma, beta], {"group": G, "eps": EPS})
    assert mean.shape == rstd.shape == (N, G)
    assert compare("y", y, group_norm_reference(x, gamma, beta, G, EPS, True)).ok


# ---- the ATC form --------------------------------------------------------------------------------------------------

def _values(model: onnx.ModelProto) -> Values:
    return Values({"x": (N, C, HW, HW)}, {"x": TensorProto.FLOAT}, 17, "ascend910b")


def test_atc_group_norm_silu_is_the_plugin_with_group_and_eps(tmp_path):
    out = tmp_path / "m.atc.onnx"
    src = tmp_path / "m.onnx"
    onnx.save(_graph(back="static"), str(src))
    r = npufuse.optimize(str(src), output=str(out), emit="atc")
    model = onnx.load(str(out))
    plugin = [n for n in model.graph.node if n.domain == "npu"]
    assert [n.op_type for n in plugin] == ["NPUGroupNormSilu"]
    attrs = {a.name: a for a in plugin[0].attribute}
    assert attrs["group"].type == onnx.AttributeProto.INT and attrs["group"].i == G
    assert attrs["eps"].type == onnx.AttributeProto.FLOAT and attrs["eps"].f == pytest.approx(EPS)
    assert r.report["atc"]["counts"] == {"plugin:GroupNormSilu": 1}
    assert r.atc_check is not None and r.atc_check.ok


def test_atc_group_norm_without_silu_stays_standard():
    node = helper.make_node("GroupNorm", ["x", "s", "b"], ["y"], name="gn", domain="npufuse", num_groups=G,
                            epsilon=EPS)
    got = map_region(node, _values(onnx.ModelProto()), Namer(set()))
    assert isinstance(got, StaysStandard) and got.reason == "groupnorm-no-silu"
    assert map_group_norm(node, _values(onnx.ModelProto()), Namer(set())).reason == "groupnorm-no-silu"
    silu = helper.make_node("GroupNormSilu", ["x", "s", "b"], ["y"], name="gns", domain="npufuse", num_groups=G,
                            epsilon=EPS)
    assert isinstance(map_region(silu, _values(onnx.ModelProto()), Namer(set())), PluginRegion)


def test_atc_groups_that_do_not_divide_channels_break_the_contract():
    silu = helper.make_node("GroupNormSilu", ["x", "s", "b"], ["y"], name="gns", domain="npufuse", num_groups=3,
                            epsilon=EPS)
    got = map_region(silu, _values(onnx.ModelProto()), Namer(set()))
    assert isinstance(got, StaysStandard) and got.reason == "plugin-constraint"
