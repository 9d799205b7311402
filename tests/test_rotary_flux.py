"""Rotary through an unbind (diffusers' `apply_rotary_emb`, use_real=True) => npufuse.RotaryEmbedding.

unbind(-1) (Flux): x.reshape(..., D/2, 2).unbind(-1) -> stack([-x_imag, x_real], -1).flatten(3) is rotate_every_two
(interleaved=1); unbind(-2) (Stable Audio, CogView4): x.reshape(..., 2, D/2).unbind(-2) -> cat([-x_imag, x_real], -1)
is rotate_half (interleaved=0). Hand-built graphs in both exporters' spellings (dynamo: Slice + Squeeze, constant
Reshape targets; TorchScript: Split + Squeeze, `Concat(Slice(Shape(stack), 0, -2), [-1])` for the flatten; a Gather
of the index too), near-misses that must not fuse, a numeric check against diffusers' formula written in NumPy, the
tiny Flux fixtures (both exporters) and their ATC form."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import npufuse
from npufuse.fusion.engine import OptimizeOptions, optimize
from npufuse.ir.graph import attributes
from npufuse.ir.modelio import load_model
from npufuse.ir.runtime import IR_VERSION, run
from npufuse.patterns.rotary import rotary_reference

FIXTURES = Path(__file__).parent / "fixtures"
B, S, H, D = 2, 5, 3, 8


def flux_rotary_model(*, unbind: int = -1, pick: str = "slice", opset: int = 18, neg: str = "imag",
                      join: str | None = None, pick_axis: int | None = None, pairs_shape: list[int] | None = None,
                      heads: int = H, dtype=np.float32, flatten: str = "const") -> onnx.ModelProto:
    """X [B, S, heads, D], cos/sin [1, S, 1, D] -> diffusers' apply_rotary_emb(X, (cos, sin), sequence_dim=1).

    unbind: -1 (pairs [.., D/2, 2]) or -2 (halves [.., 2, D/2]); pick: "slice" (dynamo), "split" (TorchScript) or
    "gather"; neg: which part is negated ("imag", "real", "none", "both"); join: "stack" or "cat" (default: what
    the unbind dim goes with); pick_axis: the axis of the pairs the parts are picked along (default: the unbind
    dim); pairs_shape: the view's shape (default [B, S, heads, D/2, 2] or [B, S, heads, 2, D/2]); flatten: "const"
    (dynamo's constant target) or "shape" (TorchScript's Concat(Slice(Shape(stack), 0, -2), [-1]))."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.array(value, dtype=np.int64), name))
        return name

    def node(op, ins, outs, **kw):
        outs = [outs] if isinstance(outs, str) else outs
        nodes.append(helper.make_node(op, ins, outs, name=outs[0] + "_n", **kw))
        return outs[0] if len(outs) == 1 else outs

    join = join or ("stack" if unbind == -1 else "cat")
    view = pairs_shape or ([B, S, heads, D // 2, 2] if unbind == -1 else [B, S, heads, 2, D // 2])
    axis = pick_axis if pick_axis is not None else unbind
    pairs = node("Reshape", ["X", const("view_shape", view)], "pairs")
    if pick == "split":
        split_kw = {"num_outputs": 2} if opset >= 18 else {}
        split_in = [pairs] if opset >= 18 else [pairs, const("split_sizes", [1, 1])]
        p0, p1 = node("Split", split_in, ["p0", "p1"], axis=axis, **split_kw)
    elif pick == "slice":
        p0 = node("Slice", [pairs, const("s0", [0]), const("e0", [1]), const("a0", [axis])], "p0")
        p1 = node("Slice", [pairs, const("s1", [1]), const("e1", [2]), const("a1", [axis])], "p1")
    if pick == "gather":
        real = node("Gather", [pairs, const("i0", 0)], "x_real", axis=axis)
        imag = node("Gather", [pairs, const("i1", 1)], "x_imag", axis=axis)
    else:
        real = node("Squeeze", [p0, const("sq0", [axis])], "x_real")
        imag = node("Squeeze", [p1, const("sq1", [axis])], "x_imag")
    if neg in ("imag", "both"):
        imag = node("Neg", [imag], "neg_imag")
    if neg in ("real", "both"):
        real = node("Neg", [real], "neg_real")
    if join == "stack":
        st = node("Concat", [node("Unsqueeze", [imag, const("u0", [-1])], "ui"),
                             node("Unsqueeze", [real, const("u1", [-1])], "ur")], "stack", axis=-1)
        if flatten == "shape":
            lead = node("Slice", [node("Shape", [st], "stack_shape"), const("fs", [0]), const("fe", [-2]),
                                  const("fa", [0])], "stack_lead")
            target = node("Concat", [lead, const("minus1", [-1])], "flat_shape", axis=0)
        else:
            target = const("flat_shape", [B, S, heads, D])
        rot = node("Reshape", [st, target], "rot")
    else:
        rot = node("Concat", [imag, real], "rot", axis=-1)
    y = node("Add", [node("Mul", ["X", "cos"], "xc"), node("Mul", [rot, "sin"], "rs")], "Y")
    inputs = [helper.make_tensor_value_info("X", elem, [B, S, heads, D]),
              helper.make_tensor_value_info("cos", elem, [1, S, 1, D]),
              helper.make_tensor_value_info("sin", elem, [1, S, 1, D])]
    g = helper.make_graph(nodes, "flux_rotary", inputs, [helper.make_tensor_value_info(y, elem, [B, S, heads, D])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)


def flux_tables(repeated: bool = True, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [1, S, 1, D] as FluxPosEmbed makes them (angles repeat_interleave'd per pair), or arbitrary tables."""
    if repeated:
        inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
        ang = np.repeat(np.arange(S)[:, None] * inv[None, :], 2, axis=-1)
        return np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, S, 1, D)), rng.standard_normal((1, S, 1, D))


def diffusers_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, unbind: int) -> np.ndarray:
    """diffusers.models.embeddings.apply_rotary_emb (use_real=True) in NumPy, as written there."""
    if unbind == -1:
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        x_real, x_imag = pairs[..., 0], pairs[..., 1]
        rot = np.stack([-x_imag, x_real], axis=-1).reshape(x.shape)
    else:
        halves = x.reshape(*x.shape[:-1], 2, -1)
        x_real, x_imag = halves[..., 0, :], halves[..., 1, :]
        rot = np.concatenate([-x_imag, x_real], axis=-1)
    return x * cos + rot * sin


def _feeds(heads: int = H, repeated: bool = True, dtype=np.float32) -> dict[str, np.ndarray]:
    cos, sin = flux_tables(repeated)
    x = np.random.default_rng(0).standard_normal((B, S, heads, D))
    return {"X": x.astype(dtype), "cos": cos.astype(dtype), "sin": sin.astype(dtype)}


def _rotary_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "RotaryEmbedding" and n.domain == "npufuse"]


def _assert_fused(model: onnx.ModelProto, interleaved: int, repeated: bool = True, dtype=np.float32):
    res = optimize(model, None, OptimizeOptions(force_fuse=True))
    nodes = _rotary_nodes(res.model)
    assert len(nodes) == 1, [(f.reason, f.detail) for f in res.refusals]
    assert attributes(nodes[0]) == {"interleaved": interleaved, "rotary_dim": 0}
    assert nodes[0].input[0] == "X" and list(nodes[0].input[1:]) == ["cos", "sin"]
    assert all(r.check is not None and r.check.ok for r in res.applied)
    assert res.model_check is not None and res.model_check.ok, res.model_check
    assert not {"Neg", "Squeeze", "Split", "Gather"} & {n.op_type for n in res.model.graph.node}
    feeds = _feeds(repeated=repeated, dtype=dtype)
    want = diffusers_rotary(*(feeds[k].astype(np.float64) for k in ("X", "cos", "sin")),
                            unbind=-1 if interleaved else -2)
    tol = 1e-5 if dtype == np.float32 else 5e-3
    for m in (model, res.model):
        np.testing.assert_allclose(run(m, feeds)["Y"].astype(np.float64), want, rtol=tol, atol=tol)
    return res


@pytest.mark.parametrize("pick,opset,flatten", [("slice", 18, "const"), ("split", 17, "shape"), ("split", 18, "shape"),
                                                ("gather", 17, "const"), ("slice", 13, "const")])
def test_flux_unbind_last_fuses_as_interleaved(pick, opset, flatten) -> None:
    _assert_fused(flux_rotary_model(unbind=-1, pick=pick, opset=opset, flatten=flatten), interleaved=1)


@pytest.mark.parametrize("pick,opset", [("slice", 18), ("split", 17), ("gather", 18)])
def test_unbind_second_to_last_fuses_as_half(pick, opset) -> None:
    _assert_fused(flux_rotary_model(unbind=-2, pick=pick, opset=opset), interleaved=0)


def test_fp16_and_tables_not_repeated_per_pair() -> None:
    # The fused op multiplies x and rotate(x) by full-width cos/sin elementwise, exactly as diffusers does: a table
    # that is not repeat_interleave'd per pair is computed just as exactly, so it is no reason to refuse.
    _assert_fused(flux_rotary_model(unbind=-1, dtype=np.float16), interleaved=1, dtype=np.float16)
    _assert_fused(flux_rotary_model(unbind=-1), interleaved=1, repeated=False)


@pytest.mark.parametrize("case,reason", [
    (dict(neg="none"), "missing-neg"),                       # the pair swapped without the Neg
    (dict(neg="both"), "neg-wrong-half"),
    (dict(neg="real"), "neg-wrong-half"),                    # stack(-x_real, x_imag): the inverse rotation
    (dict(unbind=-2, neg="real"), "neg-wrong-half"),
    (dict(unbind=-1, join="cat"), "pair-layout"),            # pairs unbound, then concatenated: neither rotation
    (dict(unbind=-2, join="stack"), "pair-layout"),
    (dict(unbind=-2, heads=2, pairs_shape=[B, S, 2, 2, D // 2], pick_axis=2), "pair-axis"),   # unbind over heads
    (dict(unbind=-1, heads=2, pairs_shape=[B, S, 1, D, 2]), "pair-shape"),   # the view does not split D in two
])
def test_near_miss_does_not_fuse(case, reason) -> None:
    model = flux_rotary_model(**case)
    res = optimize(model, None, OptimizeOptions(force_fuse=True))
    assert not _rotary_nodes(res.model)
    assert [f.reason for f in res.refusals if f.pattern == "rotary"] == [reason], res.refusals
    assert res.model_check is None or res.model_check.ok


def test_the_numeric_check_can_fail() -> None:
    """The reference the rewrite is checked with tells the right rotation from its sign flip, from the other form,
    and from swapped tables, on the tables Flux really uses."""
    feeds = _feeds()
    x, cos, sin = (feeds[k].astype(np.float64) for k in ("X", "cos", "sin"))
    want = diffusers_rotary(x, cos, sin, -1)
    got = rotary_reference([x, cos, sin], {"interleaved": 1, "rotary_dim": 0})[0]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for wrong in (rotary_reference([x, cos, -sin], {"interleaved": 1})[0],          # Neg on the other part
                  rotary_reference([x, sin, cos], {"interleaved": 1})[0],           # cos and sin swapped
                  rotary_reference([x, cos, sin], {"interleaved": 0})[0]):          # rotate_half
        assert np.abs(wrong - want).max() > 0.1


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_flux_fixture_rotates_every_q_and_k_interleaved(exporter, tmp_path) -> None:
    """The tiny Flux (one double- and one single-stream block): q and k of both attentions, 4 rotations, each
    npufuse.RotaryEmbedding interleaved=1, no rotary near-miss, attention fused after them; in the ATC form the
    interleaved rotations stay standard ops (RotaryMul rotates halves), and that form verifies too."""
    file = FIXTURES / f"flux_{exporter}.onnx"
    res = optimize(load_model(file), str(FIXTURES), OptimizeOptions())
    # per tensor, or q and k joined into a RotaryEmbeddingPair where the target's cost model prefers it
    nodes = _rotary_nodes(res.model)
    pairs = [n for n in res.model.graph.node if n.op_type == "RotaryEmbeddingPair" and n.domain == "npufuse"]
    assert len(nodes) + 2 * len(pairs) == 4
    assert all(attributes(n)["interleaved"] == 1 for n in nodes + pairs)
    assert not [f for f in res.refusals if f.pattern == "rotary"]
    assert res.model_check is not None and res.model_check.ok
    assert sum(n.op_type == "FusedAttention" for n in res.model.graph.node) == 2
    r = npufuse.optimize(str(file), output=str(tmp_path / "flux.atc.onnx"), emit="atc")
    assert r.report["atc"]["counts"].get("standard:rotary-interleaved") == 4
    assert r.atc_check is not None and r.atc_check.ok
