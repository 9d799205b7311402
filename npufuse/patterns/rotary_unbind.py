"""The rotary halves spelled through an unbind (diffusers' `apply_rotary_emb`, use_real=True): the rotation's two
parts are picked from a reshaped view of x instead of sliced from x, and `rotary` matches them as the Slices they
are equivalent to.

    unbind(-1) (Flux, CogVideoX, HunyuanDiT): P = x.reshape(..., D/2, 2); x_real, x_imag = P.unbind(-1);
        stack([-x_imag, x_real], -1).flatten(-2)   == rotate_every_two(x)  (x_real = x[..., 0::2], x_imag = 1::2)
    unbind(-2) (Stable Audio, OmniGen, CogView4, Cosmos): P = x.reshape(..., 2, D/2); x_real, x_imag = P.unbind(-2);
        cat([-x_imag, x_real], -1)                 == rotate_half(x)       (x_real = x[..., :D/2], x_imag = D/2:)

Each part is `[Neg](Squeeze(pick k of P))`, the pick a Slice [k, k+1) (dynamo), one output of a Split into ones
(TorchScript) or a Gather of the scalar k; P = Reshape(x, [..., A, B]) with A·B = D, x's last axis. A pick along
P's last axis takes x's columns k::B, one along P's second-to-last axis the columns [k·B, (k+1)·B): the same
(start, end, step) ranges a Slice of x's last axis takes, so the caller checks them as it checks Slices.

Refusals (near-misses): `pair-axis` (the parts are picked along another axis of P, or along different axes),
`pair-shape` (the Reshape does not split x's last axis into two axes, A·B != D), `slice-bounds-unknown`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from npufuse.algebra.shapes import clamp_index, slice_bounds, static_ints
from npufuse.ir.graph import Graph, attributes
from npufuse.ir.matching import MatchRefused, std_op


@dataclass
class UnbindPart:
    """One part of an unbind: `neg` (or None) of pick `k` of `pairs` (P) along its axis `axis` (normalised)."""
    neg: onnx.NodeProto | None
    pick: onnx.NodeProto          # the Slice, Split or Gather
    squeeze: onnx.NodeProto | None
    pairs: str
    axis: int
    k: int


def _axes(g: Graph, node: onnx.NodeProto, rank: int | None, shape_nodes: list[str]) -> list[int] | None:
    a = attributes(node)
    axes = a.get("axes") if "axes" in a else (
        static_ints(g, node.input[1], shape_nodes) if len(node.input) > 1 and node.input[1] else None)
    if axes is None or rank is None:
        return None
    return sorted(int(x) % rank for x in np.asarray(axes).reshape(-1))


def unbind_part(g: Graph, v: str, shape_nodes: list[str]) -> UnbindPart | None:
    """The part `v` is, if it is `[Neg](Squeeze(Slice|Split(P)))` or `[Neg](Gather(P, k))` of P a Reshape's output
    picking one entry of an axis of size 2 (else None)."""
    p = g.producer_of(v)
    neg = None
    if std_op(p, "Neg"):
        neg, p = p, g.producer_of(p.input[0])
    squeeze = None
    if std_op(p, "Gather") and len(p.input) == 2:
        pick, pairs = p, p.input[0]
        idx = static_ints(g, p.input[1], shape_nodes)
        rank = g.rank(pairs)
        if idx is None or idx.ndim != 0 or rank is None:
            return None
        axis = int(attributes(p).get("axis", 0)) % rank
        k = int(idx) + 2 if int(idx) < 0 else int(idx)    # x[..., -1] of a pair: its second entry
    elif std_op(p, "Squeeze"):
        squeeze, pick = p, g.producer_of(p.input[0])
        if not (std_op(pick, "Slice") or std_op(pick, "Split")):
            return None
        pairs = pick.input[0]
        rank = g.rank(pairs)
        axes = _axes(g, squeeze, rank, shape_nodes)
        if axes is None or len(axes) != 1 or rank is None:
            return None
        axis = axes[0]
        if std_op(pick, "Split"):
            if int(attributes(pick).get("axis", 0)) % rank != axis or len(pick.output) != 2:
                return None
            k = list(pick.output).index(p.input[0])
        else:
            starts, ends, s_axes, steps = slice_bounds(g, pick, shape_nodes)
            s_axes = list(range(len(starts))) if s_axes is None else [int(x) % rank for x in s_axes]
            if s_axes != [axis] or (steps is not None and list(steps) != [1]):
                return None
            k, end = clamp_index(starts[0], 2), clamp_index(ends[0], 2)
            if end != k + 1:
                return None
    else:
        return None
    if not std_op(g.producer_of(pairs), "Reshape") or not 0 <= k < 2:
        return None
    shape = g.shape(pairs)
    if shape is None or not isinstance(shape[axis], int) or shape[axis] != 2:
        return None
    return UnbindPart(neg, pick, squeeze, pairs, axis, k)


def unbind_columns(g: Graph, parts: list[UnbindPart], anchor: onnx.NodeProto
                   ) -> tuple[str, int, list[tuple[int, int, int]], list[str]]:
    """(x, D, the (start, end, step) of x's last axis each part takes, the nodes from the Reshape to the parts) of
    parts picked from one P = Reshape(x, [..., A, B]); MatchRefused where the picks are not one unbind of x's last
    axis split in two."""
    reshape = g.producer_of(parts[0].pairs)
    assert reshape is not None
    x = reshape.input[0]
    shape, x_shape = g.shape(parts[0].pairs), g.shape(x)
    if shape is None or x_shape is None or not x_shape or not isinstance(x_shape[-1], int):
        raise MatchRefused(anchor.name, "head-dim-unknown", f"the last axis of {x!r} is not a fixed size")
    width, rank = int(x_shape[-1]), len(shape)
    a, b = shape[-2:] if rank >= 2 else (None, None)
    if rank != len(x_shape) + 1 or not isinstance(a, int) or not isinstance(b, int) or a * b != width:
        raise MatchRefused(reshape.name, "pair-shape", f"Reshape {reshape.name!r} views {x!r} {list(x_shape)} as "
                           f"{list(shape)}; an unbind of the rotated pairs splits the last axis {width} in two")
    axes = {p.axis for p in parts}
    if len(axes) != 1 or not axes <= {rank - 1, rank - 2}:
        raise MatchRefused(parts[0].pick.name, "pair-axis", f"the parts of {parts[0].pairs!r} {list(shape)} are "
                           f"picked along axes {sorted(axes)}; a rotation unbinds one of the last two")
    cols = []
    for p in parts:
        if p.axis == rank - 1:       # x[..., k::B]
            cols.append((p.k, width, b))
        else:                        # x[..., k*B:(k+1)*B]
            cols.append((p.k * b, (p.k + 1) * b, 1))
    nodes = [reshape.name]
    for p in parts:
        nodes += [n.name for n in (p.pick, p.squeeze, p.neg) if n is not None]
    return x, width, cols, list(dict.fromkeys(nodes))
