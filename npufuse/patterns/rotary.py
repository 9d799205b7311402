"""Rotary position embedding: y = x·cos + rotate(x)·sin  =>  npufuse.RotaryEmbedding.

The rotary embedding every decoder applies to its queries and keys (Llama, Mistral, Qwen, Gemma, GPT-NeoX, Phi,
GPT-J), fused into one Vector kernel that reads x, cos and sin once and writes y once, instead of two Slices, a
Neg, a Concat, two Muls and an Add each going through GM.

Forms matched (the anchor is the Add, either operand order, either operand order of each Mul):
- half (rotate_half, HF Llama/Qwen/Mistral/NeoX): rotate(x) = Concat(Neg(x[..., h:]), x[..., :h], axis=-1), the two
  Slices' bounds constants (dynamo) or static `Shape -> Gather -> Div -> Unsqueeze` arithmetic (TorchScript);
- interleaved (GPT-J's rotate_every_two): rotate(x) = Reshape(Concat(Unsqueeze(Neg(x[..., 1::2]), -1),
  Unsqueeze(x[..., ::2], -1), axis=-1)) back to x's shape;
- partial (GPT-NeoX/Phi/GPT-J `rotary_dim`): x itself is X[..., :r] of a head X of width D > r and the result
  is Concat(y, X[..., r:], axis=-1); the fused op then takes X and `rotary_dim` = r. Without that Concat, the
  rotated part alone fuses (rotary_dim 0 on the sliced x).
cos and sin are inputs of the fused op whatever computes them (a constant cache, Gather by position ids, or
inv_freq × positions -> Cos/Sin -> Unsqueeze): their last axis must be the rotated width and the rest must
broadcast to x. q and k sharing one cos/sin become two fused nodes here (phase 0); `rotary_pair` (phase 1, below)
then joins an attention's q and k into one npufuse.RotaryEmbeddingPair where the target's cost model says so. Where shape inference leaves the tables' last
dim symbolic (TorchScript's GPT-J: repeat_interleave as Unsqueeze -> Tile -> Reshape(Concat(Slice(Shape), [-1]))),
the width is proven from how the value is built (`static_dim`: Tile repeats, Split sizes, Expand / Reshape targets,
Gather of a constant table).

QK-norm (Qwen3, Gemma3: RMSNorm over head_dim of q and k before the rotation) is not absorbed: no Ascend kernel
applies a norm and a rope together (RmsNorm, then RotaryPositionEmbedding), so the norm fuses as its own RMSNorm
(Gemma's (1 + w) scale is a constant folded into gamma) and the rotation as RotaryEmbedding; a joint op would be
priced as the same two kernels and never pay. DeepSeek's rope parts are absorbed into `mla_prolog` (phase 1).

Refusals (near-misses, each with the node): `uneven-halves` (the Slices are not the exact halves, or the
even/odd columns, of the last axis), `neg-wrong-half` (the Neg is on the first half / the even columns: the
inverse rotation), `slice-not-last-axis`, `slice-bounds-unknown`, `head-dim-unknown` (x's last axis is not a
fixed size), `different-inputs` (x·cos reads another tensor than the rotation), `cos-sin-shape` (cos or sin does
not end in the rotated width or does not broadcast to x), `reshape-not-flatten` (the interleaved stack is not
flattened back to x's shape), and `shared-intermediate` / `intermediate-is-output`.

Phase 0: before attention (phase 1), which then takes the rotated q and k as its inputs.

ONNX's own `RotaryEmbedding` (opset 23) takes half-width caches ([.., rotary_dim / 2]) indexed by position ids and
its own layouts, not the full-width cos/sin exporters compute, so the npufuse op is emitted at every opset.

Ascend: `RotaryPositionEmbedding` (x, cos, sin; `mode` 0 half, 1 interleave), Atlas A2/A3 only in the public
repositories; elsewhere the per-tensor region stays unfused. `ApplyRotaryPosEmb` (query, key, cos, sin; layout,
rotary_mode), which also ships for ascend310p, rotates a query and a key together: it is the kernel of
npufuse.RotaryEmbeddingPair. Its documented limits on Atlas A2/A3 and 310P: layout 1 (BSND) only, rotary_mode half only,
head dim 64 or 128, the whole head dim rotated, a UB bound on the heads; BNSD q/k (every HF decoder) get four
Transposes from ATC, priced with the kernel (fusion.costing.layout_transposes). On 910B the pair is priced
against the two RotaryPositionEmbedding kernels phase 0 made, so the cheaper form wins by the cost model (BNSD:
per tensor; BSND: the pair); on 310P against the raw rotations, so the pair is the fused form where it fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.fusion.types import Match, Refusal, Replacement
from npufuse.graph import Graph, attributes
from npufuse.npu_model import ascend_kernels
from npufuse.patterns.base import FusedOpDef, Pattern, make_body
from npufuse.patterns.matching import MatchRefused, escaping_intermediate, std_op
from npufuse.patterns.shape_algebra import clamp_index, slice_bounds, static_ints

INT64_MAX = np.iinfo(np.int64).max


# ---- the fused op ----------------------------------------------------------------------------------

def rotate(x: np.ndarray, interleaved: bool) -> np.ndarray:
    """rotate_half (cat(-x2, x1)) or rotate_every_two (pairs (x0, x1) -> (-x1, x0)) along the last axis."""
    if interleaved:
        out = np.empty_like(x)
        out[..., 0::2] = -x[..., 1::2]
        out[..., 1::2] = x[..., 0::2]
        return out
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def rotary_reference(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Y = concat(X_r·cos + rotate(X_r)·sin, X[..., r:]) with X_r = X[..., :r] (r = rotary_dim, 0: the whole last
    axis), in float64, returned in X's dtype. cos and sin broadcast to X_r (their last axis is r)."""
    x, cos, sin = inputs[:3]
    assert x is not None and cos is not None and sin is not None
    width = x.shape[-1]
    r = int(attrs.get("rotary_dim", 0)) or width
    x64 = x.astype(np.float64)
    xr = x64[..., :r]
    y = xr * cos.astype(np.float64) + rotate(xr, bool(int(attrs.get("interleaved", 0)))) * sin.astype(np.float64)
    if r < width:
        xp = x64[..., r:]
        y = np.concatenate([y, np.broadcast_to(xp, y.shape[:-1] + xp.shape[-1:])], axis=-1)
    return [y.astype(x.dtype)]


class _Body:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.count = 0

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs: Any) -> Any:
        outs = []
        for _ in range(n_out):
            self.count += 1
            outs.append(f"{op_type.lower()}_{self.count}")
        self.nodes.append(helper.make_node(op_type, inputs, outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def ints(self, values: list[int]) -> str:
        self.count += 1
        name = f"ints_{self.count}"
        self.nodes.append(helper.make_node("Constant", [], [name], value=helper.make_tensor(
            name, TensorProto.INT64, [len(values)], values)))
        return name

    def slice_last(self, x: str, start: int, end: int, step: int, opset: int) -> str:
        if opset < 10:
            if step != 1:
                raise ValueError("RotaryEmbedding: a strided Slice needs opset >= 10")
            return self.op("Slice", [x], starts=[start], ends=[end], axes=[-1])
        return self.op("Slice", [x, self.ints([start]), self.ints([end]), self.ints([-1]), self.ints([step])])

    def unsqueeze_last(self, x: str, opset: int) -> str:
        if opset >= 13:
            return self.op("Unsqueeze", [x, self.ints([-1])])
        return self.op("Unsqueeze", [x], axes=[-1])


def _rotation_nodes(b: _Body, x: str, y: str, interleaved: int, r: int, opset: int, tokens: list[str]) -> None:
    """Nodes of `b` computing y = RotaryEmbedding(x, cos, sin) (the body's `cos` and `sin`), appending to `tokens`
    what makes the overload distinct (form, rotary_dim, opset-dependent signatures)."""
    xr = x
    if r:
        xr = b.slice_last(x, 0, r, 1, opset)
        tokens.append(f"r{r}")
    tokens.append("slice10" if opset >= 10 else "slice1")
    if interleaved:
        even = b.slice_last(xr, 0, INT64_MAX, 2, opset)
        odd = b.slice_last(xr, 1, INT64_MAX, 2, opset)
        stacked = b.op("Concat", [b.unsqueeze_last(b.op("Neg", [odd]), opset), b.unsqueeze_last(even, opset)],
                       axis=-1)
        rot = b.op("Reshape", [stacked, b.op("Shape", [xr])])
        tokens.append("unsq13" if opset >= 13 else "unsq1")
    else:
        kw = {"num_outputs": 2} if opset >= 18 else {}
        first, second = b.op("Split", [xr], 2, axis=-1, **kw)
        rot = b.op("Concat", [b.op("Neg", [second]), first], axis=-1)
        tokens.append("split18" if opset >= 18 else "split")
    out = b.op("Add", [b.op("Mul", [xr, "cos"]), b.op("Mul", [rot, "sin"])])
    if r:
        passed = b.slice_last(x, r, INT64_MAX, 1, opset)
        b.nodes.append(helper.make_node("Concat", [out, passed], [y], axis=-1))
    else:
        b.nodes.append(helper.make_node("Identity", [out], [y]))


def rotary_body(attrs: dict[str, Any], opset: int, elem_type: int) -> onnx.FunctionProto:
    """The RotaryEmbedding function body from ops of the default-domain `opset`; one overload per form, rotary_dim
    and opset-dependent signature (Slice, Split, Unsqueeze). No float constants: the element type does not matter."""
    interleaved = int(attrs.get("interleaved", 0))
    b = _Body()
    tokens = ["rotary", "interleaved" if interleaved else "half"]
    _rotation_nodes(b, "X", "Y", interleaved, int(attrs.get("rotary_dim", 0)), opset, tokens)
    return make_body(
        FUSED_DOMAIN, "RotaryEmbedding", ["X", "cos", "sin"], ["Y"], b.nodes, [helper.make_opsetid("", opset)],
        attributes=["interleaved", "rotary_dim"], overload="__".join(tokens),
        doc_string="Y = X_r * cos + rotate(X_r) * sin, X_r = X[..., :rotary_dim], the rest of X passed through.")


ROTARY = FusedOpDef(
    op_type="RotaryEmbedding",
    doc="Y = concat(X_r * cos + rotate(X_r) * sin, X[..., r:], axis=-1) with X_r = X[..., :r], r = rotary_dim "
        "(0: the whole last axis, no pass-through part). rotate: interleaved=0 rotate_half, cat(-x[..., r/2:], "
        "x[..., :r/2]); interleaved=1 rotate_every_two, (x0, x1, x2, x3, ..) -> (-x1, x0, -x3, x2, ..). cos and sin "
        "have last axis r and broadcast to X_r (e.g. [B, 1, S, r] against [B, H, S, D]).",
    inputs=("X", "cos", "sin"), outputs=("Y",), attributes=("interleaved", "rotary_dim"),
    reference=rotary_reference, body=rotary_body,
)


@ascend_kernels.register(FUSED_DOMAIN, "RotaryEmbedding")
def _ascend_rotary(node: onnx.NodeProto, ctx: Any) -> dict[str, Any]:
    """npufuse.RotaryEmbedding -> RotaryPositionEmbedding (mode 0 half, 1 interleave)."""
    a = attributes(node)
    mode = int(a.get("interleaved", 0))
    r = int(a.get("rotary_dim", 0))
    notes = ["x in its own layout (BNSD, BSND or SBND), cos and sin broadcast over the heads"]
    if r:
        notes.append(f"partial rotary: the kernel rotates x[..., :{r}] (a strided view of the head) and the other "
                     "columns are copied through")
    return ascend_kernels.kernel_record("RotaryPositionEmbedding", node, {"mode": mode},
                                        ascend_kernels.bind(("x", "cos", "sin"), node.input),
                                        ascend_kernels.bind(("y",), node.output[:1]), notes)


# ---- matching ------------------------------------------------------------------------------------

@dataclass
class _Rotation:
    x: str
    interleaved: int
    nodes: list[str] = field(default_factory=list)
    shape_nodes: list[str] = field(default_factory=list)


def _last_dim(g: Graph, v: str) -> int | None:
    shape = g.shape(v)
    if shape is None or not shape or not isinstance(shape[-1], int):
        return None
    return int(shape[-1])


_DIM_KEEPING = frozenset({"Cast", "Neg", "Cos", "Sin", "Identity", "Relu", "Sqrt", "Exp"})
_DIM_BROADCASTING = frozenset({"Mul", "Add", "Sub", "Div", "Where"})


def static_dim(g: Graph, v: str, axis: int, depth: int = 0) -> int | None:
    """Dim `axis` (negative: from the end) of `v` proven from how `v` is built, where shape inference left it
    symbolic: GPT-J's repeat_interleave'd cos/sin (Split of a constant table -> Unsqueeze -> Tile ->
    Reshape(Concat(Slice(Shape(t), 0, -2), [-1]))), Expand to a static target, Gather of a constant table, ...
    None where the construction does not fix it."""
    shape = g.shape(v)
    rank = len(shape) if shape is not None else g.rank(v)
    if g.is_constant(v):
        arr = g.constant(v)
        if arr is not None:
            shape, rank = arr.shape, arr.ndim
    if rank is None or not -rank <= axis < rank:
        return None
    ax = axis % rank
    if shape is not None and isinstance(shape[ax], int):
        return int(shape[ax])
    p = g.producer_of(v)
    if p is None or depth > 16 or p.domain not in ("", "ai.onnx"):
        return None
    op, a, nxt = p.op_type, attributes(p), depth + 1
    local: list[str] = []
    if op in _DIM_KEEPING:
        return static_dim(g, p.input[0], ax - rank, nxt)
    if op in _DIM_BROADCASTING:
        sizes = [static_dim(g, i, ax - rank, nxt) if (g.rank(i) or 0) >= rank - ax else 1 for i in p.input if i]
        known = [s for s in sizes if s is not None]
        if len(known) == len(sizes) or any(s != 1 for s in known):
            big = [s for s in known if s != 1]
            return big[0] if big and all(s == big[0] for s in big) else (1 if not big and len(known) == len(sizes)
                                                                         else None)
        return None
    if op == "Unsqueeze":
        axes = a.get("axes") if "axes" in a else (static_ints(g, p.input[1], local) if len(p.input) > 1 else None)
        if axes is None:
            return None
        axes = sorted(int(x) % rank for x in np.asarray(axes).reshape(-1))
        if ax in axes:
            return 1
        return static_dim(g, p.input[0], ax - sum(1 for x in axes if x < ax), nxt)
    if op == "Tile" and len(p.input) > 1:
        reps = static_ints(g, p.input[1], local)
        d = static_dim(g, p.input[0], ax - rank, nxt)
        return None if reps is None or reps.size != rank or d is None else d * int(reps.reshape(-1)[ax])
    if op == "Expand" and len(p.input) > 1:
        target = static_ints(g, p.input[1], local)
        t = None if target is None or ax - rank < -target.size else int(target.reshape(-1)[ax - rank])
        if t is not None and t != 1:
            return t
        return static_dim(g, p.input[0], ax - rank, nxt) if (g.rank(p.input[0]) or 0) >= rank - ax else t
    if op == "Split":
        split_axis = int(a.get("axis", 0)) % rank
        if split_axis != ax:
            return static_dim(g, p.input[0], ax - rank, nxt)
        sizes = a.get("split") if "split" in a else (
            static_ints(g, p.input[1], local) if len(p.input) > 1 and p.input[1] else None)
        if sizes is None:
            whole = static_dim(g, p.input[0], ax - rank, nxt)
            n = len(p.output)
            return whole // n if whole is not None and whole % n == 0 else None
        return int(np.asarray(sizes).reshape(-1)[list(p.output).index(v)])
    if op == "Gather" and g.is_constant(p.input[0]):
        data = g.constant(p.input[0])
        gaxis = int(a.get("axis", 0)) % max(data.ndim, 1) if data is not None else 0
        tail = data.ndim - gaxis - 1 if data is not None else -1
        if data is not None and rank - ax <= tail:       # an axis after the gathered one: the table's own
            return int(data.shape[ax - rank])
        return None
    if op == "Transpose":
        perm = a.get("perm")
        return None if perm is None else static_dim(g, p.input[0], int(perm[ax]) - rank, nxt)
    if op == "Reshape" and len(p.input) > 1:
        from npufuse.patterns.layout_algebra import ShapeEval

        terms = ShapeEval(g).terms(p.input[1])
        if terms is None or len(terms) != rank:
            return None
        t = terms[ax]
        if isinstance(t, int) and not isinstance(t, bool) and t > 0:
            return t
        if isinstance(t, tuple) and t[0] == "dim":
            return static_dim(g, t[1], t[2] - (g.rank(t[1]) or 0), nxt) if g.rank(t[1]) else None
        src, src_rank = p.input[0], g.rank(p.input[0])
        # [d0, .., d(k-1), -1] with d_i = dim i of the input copied: the last axis merges the input's tail

        def copies(i: int, u: Any) -> bool:
            if isinstance(u, tuple):
                return u[0] == "dim" and u[1] in (src, v) and u[2] == i
            if u == 0:
                return not a.get("allowzero", 0)
            return isinstance(u, int) and u > 0 and static_dim(g, src, i - (src_rank or 0), nxt) == u

        if t == -1 and ax == rank - 1 and src_rank is not None and src_rank >= rank and all(
                copies(i, u) for i, u in enumerate(terms[:-1])):
            total = 1
            for i in range(rank - 1, src_rank):
                d = static_dim(g, src, i - src_rank, nxt)
                if d is None:
                    return None
                total *= d
            return total
        return None
    return None


def _slice_range(g: Graph, sl: onnx.NodeProto, width: int, shape_nodes: list[str]) -> tuple[int, int, int]:
    """(start, end, step) a Slice takes of the last axis (of size `width`), clamped as ONNX does (step > 0)."""
    starts, ends, axes, steps = slice_bounds(g, sl, shape_nodes)
    rank = g.rank(sl.input[0])
    axes = axes if axes is not None else list(range(len(starts)))
    if len(starts) != 1 or len(ends) != 1 or len(axes) != 1 or not (
            axes[0] == -1 or (rank is not None and axes[0] == rank - 1)):
        raise MatchRefused(sl.name, "slice-not-last-axis", f"Slice {sl.name!r} cuts axes {axes}; a rotary embedding "
                           "cuts the last axis once")
    step = 1 if steps is None else steps[0]
    if len(steps or [1]) != 1 or step <= 0:
        raise MatchRefused(sl.name, "uneven-halves", f"Slice {sl.name!r} has steps {steps}")
    return clamp_index(starts[0], width), clamp_index(ends[0], width), step


def _slice_of(g: Graph, v: str) -> onnx.NodeProto | None:
    p = g.producer_of(v)
    return p if std_op(p, "Slice") else None


def _neg_slice(g: Graph, v: str) -> tuple[onnx.NodeProto | None, onnx.NodeProto | None]:
    """(Neg, Slice) if `v` = Neg(Slice(..)), (None, Slice) if `v` = Slice(..), else (None, None)."""
    p = g.producer_of(v)
    if std_op(p, "Neg"):
        return p, _slice_of(g, p.input[0])
    return None, _slice_of(g, v)


def _is_last_axis(g: Graph, node: onnx.NodeProto, v: str) -> bool:
    axis = int(attributes(node).get("axis", 0))
    rank = g.rank(v)
    return axis == -1 or (rank is not None and axis == rank - 1)


def _rotation(g: Graph, v: str) -> _Rotation | None:
    """The rotation producing `v` (rotate_half or rotate_every_two of some x), None if `v` is not one."""
    p = g.producer_of(v)
    if std_op(p, "Concat") and len(p.input) == 2 and _is_last_axis(g, p, v):
        return _half_rotation(g, p)
    if std_op(p, "Reshape"):
        c = g.producer_of(p.input[0])
        if std_op(c, "Concat") and len(c.input) == 2:
            return _interleaved_rotation(g, p, c)
    return None


def _half_rotation(g: Graph, cat: onnx.NodeProto) -> _Rotation | None:
    (n0, s0), (n1, s1) = _neg_slice(g, cat.input[0]), _neg_slice(g, cat.input[1])
    if s0 is None or s1 is None or (n0 is None) == (n1 is None) or s0.input[0] != s1.input[0]:
        return None
    x = s0.input[0]
    width = _last_dim(g, x)
    if width is None:
        raise MatchRefused(cat.name, "head-dim-unknown", f"the last axis of {x!r} is not a fixed size; its halves "
                           "cannot be proven")
    shape_nodes: list[str] = []
    r0, r1 = _slice_range(g, s0, width, shape_nodes), _slice_range(g, s1, width, shape_nodes)
    h = width // 2
    if width % 2 or r0[2] != 1 or r1[2] != 1 or sorted([r0[:2], r1[:2]]) != [(0, h), (h, width)]:
        raise MatchRefused(cat.name, "uneven-halves", f"Concat {cat.name!r} joins [{r0[0]}, {r0[1]}) and "
                           f"[{r1[0]}, {r1[1]}) of {x!r} (width {width}); rotate_half joins -x[..., {h}:] and "
                           f"x[..., :{h}]")
    if n0 is None or r0[:2] != (h, width):
        raise MatchRefused((n0 or n1).name, "neg-wrong-half", f"Concat {cat.name!r} is not cat(-x2, x1): the Neg "
                           f"is on [{(r0 if n0 is not None else r1)[0]}, {(r0 if n0 is not None else r1)[1]}) and "
                           f"placed {'first' if n0 is not None else 'second'}; that is the inverse rotation")
    nodes = [s0.name, s1.name, (n0 or n1).name, cat.name]
    return _Rotation(x, 0, nodes, shape_nodes)


def _interleaved_rotation(g: Graph, rs: onnx.NodeProto, cat: onnx.NodeProto) -> _Rotation | None:
    parts = []
    for v in cat.input:
        u = g.producer_of(v)
        if not std_op(u, "Unsqueeze"):
            return None
        parts.append((u, *_neg_slice(g, u.input[0])))
    (u0, n0, s0), (u1, n1, s1) = parts
    if s0 is None or s1 is None or (n0 is None) == (n1 is None) or s0.input[0] != s1.input[0]:
        return None
    x = s0.input[0]
    width = _last_dim(g, x)
    if width is None:
        raise MatchRefused(cat.name, "head-dim-unknown", f"the last axis of {x!r} is not a fixed size")
    rank = g.rank(x)
    shape_nodes: list[str] = []
    for u in (u0, u1):
        axes = attributes(u).get("axes") if "axes" in attributes(u) else (
            static_ints(g, u.input[1], shape_nodes) if len(u.input) > 1 else None)
        axes = None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
        if axes is None or len(axes) != 1 or rank is None or axes[0] not in (-1, rank):
            raise MatchRefused(u.name, "uneven-halves", f"Unsqueeze {u.name!r} adds axes {axes}, not a new last axis")
    if int(attributes(cat).get("axis", 0)) not in (-1, rank):
        raise MatchRefused(cat.name, "uneven-halves", f"Concat {cat.name!r} does not stack along the new last axis")
    r0, r1 = _slice_range(g, s0, width, shape_nodes), _slice_range(g, s1, width, shape_nodes)
    if width % 2 or r0[2] != 2 or r1[2] != 2 or r0[1] < width - 1 or r1[1] < width - 1 or \
            sorted([r0[0], r1[0]]) != [0, 1]:
        raise MatchRefused(cat.name, "uneven-halves", f"the stacked Slices of {x!r} take [{r0[0]}:{r0[1]}:{r0[2]}] and "
                           f"[{r1[0]}:{r1[1]}:{r1[2]}]; rotate_every_two stacks -x[..., 1::2] and x[..., ::2]")
    if n0 is None or r0[0] != 1:
        neg = n0 or n1
        raise MatchRefused(neg.name, "neg-wrong-half", f"the stack {cat.name!r} is not (-x[..., 1::2], x[..., ::2]); "
                           "that is the inverse rotation")
    out_shape, x_shape = g.shape(rs.output[0]), g.shape(x)
    if _flattens_last_two(g, rs, cat, width, shape_nodes):
        out_shape = x_shape
    if out_shape is None or x_shape is None or len(out_shape) != len(x_shape) or out_shape[-1] != width or any(
            isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(out_shape, x_shape)):
        raise MatchRefused(rs.name, "reshape-not-flatten", f"Reshape {rs.name!r} gives {out_shape}, not x's shape "
                           f"{x_shape}: the stack must be flattened back")
    nodes = [s0.name, s1.name, (n0 or n1).name, u0.name, u1.name, cat.name, rs.name]
    return _Rotation(x, 1, nodes, shape_nodes)


def _flattens_last_two(g: Graph, rs: onnx.NodeProto, cat: onnx.NodeProto, width: int, shape_nodes: list[str]) -> bool:
    """True if Reshape `rs` of the stack `cat` has the target TorchScript writes for `.flatten(-2)`:
    Concat(Slice(Shape(stack), 0, -2), [-1 or width]) (the leading dims copied, the last two merged)."""
    t = g.producer_of(rs.input[1]) if len(rs.input) > 1 else None
    if not std_op(t, "Concat") or len(t.input) != 2 or int(attributes(t).get("axis", 0)) != 0:
        return False
    sl = g.producer_of(t.input[0])
    tail = static_ints(g, t.input[1], [])
    if not std_op(sl, "Slice") or tail is None or tail.reshape(-1).tolist() not in ([-1], [width]):
        return False
    sh = g.producer_of(sl.input[0])
    rank = g.rank(cat.output[0])
    if not std_op(sh, "Shape") or sh.input[0] != cat.output[0] or attributes(sh) or len(sl.input) < 3:
        return False
    local: list[str] = []
    starts, ends = static_ints(g, sl.input[1], local), static_ints(g, sl.input[2], local)
    axes = static_ints(g, sl.input[3], local) if len(sl.input) > 3 and sl.input[3] else None
    steps = static_ints(g, sl.input[4], local) if len(sl.input) > 4 and sl.input[4] else None
    if starts is None or ends is None or starts.reshape(-1).tolist() != [0] or (
            ends.reshape(-1).tolist() not in ([-2], [rank - 2] if rank is not None else [-2])) or (
            axes is not None and axes.reshape(-1).tolist() != [0]) or (
            steps is not None and steps.reshape(-1).tolist() != [1]):
        return False
    shape_nodes += local + [sh.name, sl.name, t.name]
    return True


class RotaryPattern(Pattern):
    name = "rotary"
    description = ("rotary position embedding x·cos + rotate(x)·sin (rotate_half or interleaved, partial "
                   "rotary_dim) into npufuse.RotaryEmbedding")
    anchor_ops = frozenset({"Add"})
    phase = 0
    fused_ops = (ROTARY,)

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if not std_op(node, "Add") or len(node.input) != 2:
            return None
        refusal: Refusal | None = None
        for cos_v, sin_v in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
            m_sin, m_cos = g.producer_of(sin_v), g.producer_of(cos_v)
            if not std_op(m_sin, "Mul") or not std_op(m_cos, "Mul") or len(m_sin.input) != 2:
                continue
            for rot_v, sin in ((m_sin.input[0], m_sin.input[1]), (m_sin.input[1], m_sin.input[0])):
                nodes = [m_sin.name, m_cos.name, node.name]
                try:
                    rot = _rotation(g, rot_v)
                    if rot is None:
                        continue
                    return self._complete(g, node, m_cos, m_sin, rot, sin, nodes)
                except MatchRefused as r:
                    refusal = refusal or Refusal(self.name, r.node, r.reason,
                                                 f"rotary embedding at {node.name!r}: {r.detail}", tuple(nodes))
        return refusal

    def _complete(self, g: Graph, add: onnx.NodeProto, m_cos: onnx.NodeProto, m_sin: onnx.NodeProto,
                  rot: _Rotation, sin: str, nodes: list[str]) -> Match:
        x = rot.x
        if x not in m_cos.input or len(m_cos.input) != 2:
            raise MatchRefused(m_cos.name, "different-inputs", f"{m_cos.name!r} multiplies {list(m_cos.input)}, "
                               f"but the rotation reads {x!r}; a rotary embedding adds x·cos to rotate(x)·sin")
        cos = m_cos.input[1] if m_cos.input[0] == x else m_cos.input[0]
        width = _last_dim(g, x)
        assert width is not None
        for v, role in ((cos, "cos"), (sin, "sin")):
            self._check_table(g, v, x, width, role, m_cos if role == "cos" else m_sin)
        nodes += rot.nodes
        shape_nodes = list(rot.shape_nodes)
        out, big_x, rotary_dim = add.output[0], x, 0
        partial = self._partial(g, add, x, width, shape_nodes)
        if partial is not None:
            big_x, rotary_dim, extra, out = partial
            nodes += extra
        # Shape arithmetic reading a fused value goes with the fusion; the rest stays and is merely read.
        inside = set(nodes)
        produced = {o for n in nodes for o in g.node(n).output if o}
        for name in sorted(set(shape_nodes), key=lambda n: g.topo_index[n]):
            sn = g.node(name)
            if any(i in produced for i in sn.input):
                inside.add(name)
                produced.update(o for o in sn.output if o)
        ordered = sorted(inside, key=lambda n: g.topo_index[n])
        esc = escaping_intermediate(g, ordered, [out])
        if esc is not None:
            raise MatchRefused(esc[1], esc[0], esc[2])
        kind = f"RotaryEmbedding[{'interleaved' if rot.interleaved else 'half'}{',partial' if rotary_dim else ''}]"
        return Match(self.name, tuple(ordered), g.boundary_inputs(ordered), (out,), kind,
                     info={"x": big_x, "cos": cos, "sin": sin, "interleaved": rot.interleaved,
                           "rotary_dim": rotary_dim, "anchor": add.name})

    @staticmethod
    def _check_table(g: Graph, v: str, x: str, width: int, role: str, mul: onnx.NodeProto) -> None:
        shape = g.shape(v)
        if shape is None and g.is_constant(v):
            arr = g.constant(v)
            shape = None if arr is None else arr.shape
        if shape and not isinstance(shape[-1], int):
            # shape inference left the width symbolic: prove it from how the table is built
            last = static_dim(g, v, -1)
            if last is not None:
                shape = tuple(shape[:-1]) + (last,)
        x_shape = g.shape(x)
        if shape is None or x_shape is None:
            raise MatchRefused(mul.name, "cos-sin-shape", f"{role} {v!r} or x {x!r} has an unknown shape")
        if not shape or shape[-1] != width or len(shape) > len(x_shape):
            raise MatchRefused(mul.name, "cos-sin-shape", f"{role} {v!r} has shape {list(shape)}; it must end in the "
                               f"rotated width {width} and broadcast to x {list(x_shape)}")
        for d, xd in zip(reversed(shape[:-1]), reversed(x_shape[:-1])):
            if isinstance(d, int) and d != 1 and isinstance(xd, int) and d != xd:
                raise MatchRefused(mul.name, "cos-sin-shape", f"{role} {v!r} has shape {list(shape)}, which does not "
                                   f"broadcast to x {list(x_shape)}")

    @staticmethod
    def _partial(g: Graph, add: onnx.NodeProto, x: str, r: int,
                 shape_nodes: list[str]) -> tuple[str, int, list[str], str] | None:
        """(X, rotary_dim, nodes, output) where x = X[..., :r] and the result is Concat(y, X[..., r:])."""
        sl = _slice_of(g, x)
        cat = g.single_consumer(add.output[0])
        if sl is None or not std_op(cat, "Concat") or len(cat.input) != 2 or cat.input[0] != add.output[0] or \
                not _is_last_axis(g, cat, cat.output[0]):
            return None
        big = sl.input[0]
        pas = _slice_of(g, cat.input[1])
        width = _last_dim(g, big)
        if pas is None or pas.input[0] != big or width is None or width <= r:
            return None
        try:
            local: list[str] = []
            rot_range, pass_range = _slice_range(g, sl, width, local), _slice_range(g, pas, width, local)
        except MatchRefused:
            return None
        if rot_range != (0, r, 1) or pass_range != (r, width, 1):
            return None
        shape_nodes += local
        return big, r, [sl.name, pas.name, cat.name], cat.output[0]

    def build(self, g: Graph, m: Match) -> Replacement:
        info = m.info
        x = info["x"]
        attrs = {"interleaved": int(info["interleaved"]), "rotary_dim": int(info["rotary_dim"])}
        elem = g.elem_type(x) or g.elem_type(m.outputs[0])
        node, fn = ROTARY.make_node([x, info["cos"], info["sin"]], list(m.outputs), info["anchor"], attrs,
                                    g.opset.get("", 1), elem)
        return Replacement([node], [], [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})


# ---- the q/k pair ----------------------------------------------------------------------------------

def rotary_pair_reference(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """[Q_out, K_out]: RotaryEmbedding of Q and of K with the same cos, sin and attributes."""
    q, k, cos, sin = inputs[:4]
    return [rotary_reference([q, cos, sin], attrs)[0], rotary_reference([k, cos, sin], attrs)[0]]


def rotary_pair_body(attrs: dict[str, Any], opset: int, elem_type: int) -> onnx.FunctionProto:
    """RotaryEmbedding's body applied to Q and to K, reading the one cos and sin."""
    interleaved = int(attrs.get("interleaved", 0))
    r = int(attrs.get("rotary_dim", 0))
    b = _Body()
    tokens = ["rotary_pair", "interleaved" if interleaved else "half"]
    _rotation_nodes(b, "Q", "Q_out", interleaved, r, opset, tokens)
    _rotation_nodes(b, "K", "K_out", interleaved, r, opset, [])
    return make_body(
        FUSED_DOMAIN, "RotaryEmbeddingPair", ["Q", "K", "cos", "sin"], ["Q_out", "K_out"], b.nodes,
        [helper.make_opsetid("", opset)], attributes=["interleaved", "rotary_dim"], overload="__".join(tokens),
        doc_string="Q_out, K_out = RotaryEmbedding(Q, cos, sin), RotaryEmbedding(K, cos, sin).")


ROTARY_PAIR = FusedOpDef(
    op_type="RotaryEmbeddingPair",
    doc="Q_out = RotaryEmbedding(Q, cos, sin) and K_out = RotaryEmbedding(K, cos, sin) with the same interleaved "
        "and rotary_dim (see RotaryEmbedding): an attention's query and key rotated by one kernel that reads cos "
        "and sin once. Q and K may differ in their head count (grouped-query attention).",
    inputs=("Q", "K", "cos", "sin"), outputs=("Q_out", "K_out"), attributes=("interleaved", "rotary_dim"),
    reference=rotary_pair_reference, body=rotary_pair_body,
)

# ApplyRotaryPosEmb's documented limits (aclnnApplyRotaryPosEmb / V2 in Ascend/ops-transformer) on Atlas A2/A3 and
# the Atlas inference cards (310P): layout 1 (BSND, 4-D) or 4 (TND) only, rotary_mode "half" only, head dim D 64 or
# 128, cos/sin [B, S, 1, D] as wide as query; the UB bound below. ascend910_95 takes BNSD (layout 3), every mode and
# D <= 1024. The kernel computes in place (queryRef / keyRef).
APPLY_ROPE_HEAD_DIMS = (64, 128)
APPLY_ROPE_LAYOUT = {"BSND": 1, "SBND": 2, "BNSD": 3, "TND": 4}
_ROPE_FULL_CHIPS = frozenset({"ascend910_95"})


def rope_layout(q: tuple | None, k: tuple | None, cos: tuple | None) -> str | None:
    """BNSD or BSND for a 4-D query: the heads axis is the one cos / sin broadcast over (size 1 there), else the
    one query and key differ on (grouped-query heads), else the fixed one next to a symbolic sequence."""
    if q is None or len(q) != 4:
        return None
    if cos:
        c = (1,) * (4 - len(cos)) + tuple(cos)
        if c[1] == 1 and c[2] != 1:
            return "BNSD"
        if c[2] == 1 and c[1] != 1:
            return "BSND"
    if k is not None and len(k) == 4:
        for ax, lay in ((1, "BNSD"), (2, "BSND")):
            if isinstance(q[ax], int) and isinstance(k[ax], int) and q[ax] != k[ax]:
                return lay
    if isinstance(q[2], int) and not isinstance(q[1], int):
        return "BSND"
    return "BNSD"


def apply_rope_ub_bytes(q_heads: int, k_heads: int, head_dim: int, itemsize: int = 2) -> int:
    """UB the kernel needs for one token (aclnnApplyRotaryPosEmb's constraints, fp16 / fp32 where castSize is the
    dtype size and no cast): (qN + kN)·D·castSize·5 + D·dtypeSize·4. fp16 by default: ATC's precision modes run a
    float32 model in float16."""
    return (q_heads + k_heads) * head_dim * itemsize * 5 + head_dim * itemsize * 4


@ascend_kernels.register(FUSED_DOMAIN, "RotaryEmbeddingPair")
def _ascend_rotary_pair(node: onnx.NodeProto, ctx: Any) -> dict[str, Any]:
    """npufuse.RotaryEmbeddingPair -> ApplyRotaryPosEmb (query, key, cos, sin; layout, rotary_mode)."""
    a = attributes(node)
    q, k, cos, sin = (list(node.input) + [""] * 4)[:4]
    interleaved, r = int(a.get("interleaved", 0)), int(a.get("rotary_dim", 0))
    q_shape, k_shape, cos_shape = ctx.shape(q), ctx.shape(k), ctx.shape(cos)
    where = ctx.where or "Atlas A2/A3 and 310P"
    full = ctx.chip in _ROPE_FULL_CHIPS
    layout = rope_layout(q_shape, k_shape, cos_shape)
    notes: list[str] = ["one launch rotates query and key in place, reading cos and sin once"]
    problems: list[str] = []
    transposes: list[dict[str, Any]] = []
    if ctx.chip == "ascend910":
        problems.append(f"ApplyRotaryPosEmb's documentation lists no support for the Atlas training series "
                        f"({ctx.where}), although the catalogue has a kernel built for it")
    if r:
        problems.append(f"ApplyRotaryPosEmb rotates the whole head dim (cos and sin as wide as query); this region "
                        f"rotates the first {r} columns only (partial rotary)")
    if interleaved and not full:
        problems.append(f"ApplyRotaryPosEmb on {where} takes rotary_mode 'half' only (this region: interleave)")
    d = q_shape[-1] if q_shape else None
    d = d if isinstance(d, int) else None
    kd = k_shape[-1] if k_shape else None
    if isinstance(kd, int) and d is not None and kd != d:
        problems.append(f"ApplyRotaryPosEmb takes query and key of one head dim (query {d}, key {kd})")
    if d is not None and not full and d not in APPLY_ROPE_HEAD_DIMS:
        problems.append(f"ApplyRotaryPosEmb on {where} takes a head dim of 64 or 128 (this region: {d})")
    if d is not None and full and d > 1024:
        problems.append(f"ApplyRotaryPosEmb takes a head dim of at most 1024 (this region: {d})")
    if layout is None:
        problems.append(f"ApplyRotaryPosEmb takes 4-D query and key [B, S, N, D] (this region: "
                        f"{list(q_shape) if q_shape else 'unknown shape'})")
    kernel_layout = layout or "BSND"
    if layout == "BNSD" and not full:
        kernel_layout = "BSND"
        perm = [0, 2, 1, 3]
        transposes = [{"value": v, "perm": perm, "side": side} for v, side in
                      ((q, "in"), (k, "in"), (node.output[0], "out"), (node.output[1] if len(node.output) > 1
                                                                       else "", "out")) if v]
        notes.append(f"query and key are [B, N, S, D]; the kernel on {where} takes layout 1 (BSND) only, so ATC "
                     "transposes them to [B, S, N, D] before it and back after (four Transposes, priced with the "
                     "fused kernel); cos and sin [.., 1, S, D] are [.., S, 1, D] as they lie (N = 1: a view). Where "
                     "query and key come from the head split's Transpose, feeding the kernel the projection's BSND "
                     "view instead saves the first two")
    if layout is not None and q_shape is not None:
        heads = q_shape[2] if layout == "BSND" else q_shape[1]
        k_heads = (k_shape[2] if layout == "BSND" else k_shape[1]) if k_shape is not None and len(k_shape) == 4 \
            else None
        c = (1,) * (4 - len(cos_shape)) + tuple(cos_shape) if cos_shape else None
        if c is not None and c[0] == 1 and q_shape[0] != 1:
            notes.append("cos and sin broadcast over the batch: the kernel takes them [B, S, 1, D], so they are "
                         "expanded to the batch (small: S x D per sequence)")
        ub = getattr(ctx, "ub_bytes", None)
        if not full and ub and isinstance(heads, int) and isinstance(k_heads, int) and d is not None:
            need = apply_rope_ub_bytes(heads, k_heads, d)
            if need > ub:
                problems.append(f"ApplyRotaryPosEmb on {where} needs (qN + kN)·D·10 + 8·D bytes of UB in fp16, "
                                f"{need} for {heads} + {k_heads} heads of {d}, above the {ub} a core has")
    notes.append("query, key, cos and sin share one dtype in the kernel (ATC casts cos and sin where they differ)")
    attrs = {"layout": APPLY_ROPE_LAYOUT[kernel_layout], "rotary_mode": "interleave" if interleaved else "half"}
    rec = ascend_kernels.kernel_record("ApplyRotaryPosEmb", node, attrs,
                                       ascend_kernels.bind(("query", "key", "cos", "sin"), (q, k, cos, sin)),
                                       ascend_kernels.bind(("query", "key"), node.output[:2]), notes)
    if transposes:
        rec["layout_transposes"] = transposes
    rec["_problems"] = problems
    return rec


@dataclass(frozen=True)
class _Side:
    """One rotated tensor: a raw rotation (the nodes `rotary` matches) or an npufuse.RotaryEmbedding node."""

    anchor: str
    x: str
    cos: str
    sin: str
    interleaved: int
    rotary_dim: int
    out: str
    nodes: tuple[str, ...]


# ops a rotated q or k passes through on its way to the scores (layout, GQA repeat, scale, KV-cache concat, casts,
# TorchScript's in-place slice assignment of the rope part into the head: ScatterND)
_TO_SCORES = frozenset({"Transpose", "Reshape", "Unsqueeze", "Squeeze", "Expand", "Tile", "Concat", "Mul", "Div",
                        "Cast", "Identity", "ScatterND"})
_WALK_DEPTH = 8


class RotaryPairPattern(Pattern):
    """q and k rotated with the same cos/sin and form => one npufuse.RotaryEmbeddingPair (Ascend ApplyRotaryPosEmb).

    Phase 1, over what phase 0 left: two npufuse.RotaryEmbedding nodes where the target has the per-tensor kernel
    (the pair then fuses only where the cost model prices one ApplyRotaryPosEmb, with the layout transposes ATC
    needs, below the two RotaryPositionEmbedding kernels: the better of the two forms, by the cost model), or the
    raw rotations where it has not (310P: there the pair is the only fused form). The partner of a rotation is the
    rotation on the other side of the same Q·Kᵀ MatMul (or FusedAttention), reached through layout, GQA-repeat,
    scale and cache ops; where no scores are found, the one other rotation reading the same cos and sin.
    Refusals (the per-tensor form stays): `pair-different-cos-sin`, `pair-different-form` (half vs interleaved),
    `pair-different-rotary-dim`."""

    name = "rotary_pair"
    description = ("an attention's q and k rotated with the same cos/sin and form into one "
                   "npufuse.RotaryEmbeddingPair (Ascend ApplyRotaryPosEmb)")
    anchor_ops = frozenset({"Add", "RotaryEmbedding"})
    phase = 1
    fused_ops = (ROTARY_PAIR,)
    _single = RotaryPattern()

    def _side(self, g: Graph, node: onnx.NodeProto | None) -> _Side | None:
        if node is None:
            return None
        if node.op_type == "RotaryEmbedding" and node.domain == FUSED_DOMAIN and len(node.input) >= 3:
            a = attributes(node)
            return _Side(node.name, node.input[0], node.input[1], node.input[2], int(a.get("interleaved", 0)),
                         int(a.get("rotary_dim", 0)), node.output[0], (node.name,))
        if not std_op(node, "Add"):
            return None
        m = self._single.match(g, node)
        if not isinstance(m, Match):
            return None
        i = m.info
        return _Side(node.name, i["x"], i["cos"], i["sin"], int(i["interleaved"]), int(i["rotary_dim"]),
                     m.outputs[0], m.nodes)

    @staticmethod
    def _scores(g: Graph, v: str) -> list[tuple[onnx.NodeProto, int]]:
        """(MatMul or FusedAttention, input index) where `v` arrives on its way to the scores."""
        out: list[tuple[onnx.NodeProto, int]] = []
        frontier, seen = [(v, 0)], {v}
        while frontier:
            val, depth = frontier.pop()
            for c in g.consumers_of(val):
                if std_op(c, "MatMul") or (c.op_type == "FusedAttention" and c.domain == FUSED_DOMAIN):
                    out.extend((c, i) for i, x in enumerate(c.input[:2]) if x == val)
                elif std_op(c, *_TO_SCORES) and depth < _WALK_DEPTH:
                    for o in c.output:
                        if o and o not in seen:
                            seen.add(o)
                            frontier.append((o, depth + 1))
        return out

    def _rotations_into(self, g: Graph, v: str) -> list[_Side]:
        """The rotations whose output reaches `v` backwards through the ops of _TO_SCORES."""
        found: list[_Side] = []
        frontier, seen = [(v, 0)], {v}
        while frontier:
            val, depth = frontier.pop()
            p = g.producer_of(val)
            side = self._side(g, p) if p is not None and p.op_type in ("Add", "RotaryEmbedding") else None
            if side is None and p is not None and std_op(p, "Concat") and len(p.input) == 2:
                side = self._side(g, g.producer_of(p.input[0]))   # a partial rotation ends in its Concat
                side = side if side is not None and side.out == val else None
            if side is not None:
                found.append(side)
                continue
            if p is None or not std_op(p, *_TO_SCORES) or depth >= _WALK_DEPTH:
                continue
            for i in p.input:
                if i and i not in seen and not g.is_constant(i):
                    seen.add(i)
                    frontier.append((i, depth + 1))
        return found

    def _sharing_tables(self, g: Graph, side: _Side) -> list[_Side]:
        """Every rotation reading exactly `side`'s cos and sin (fused nodes, or raw rotations through their Mul)."""
        sides: dict[str, _Side] = {}
        for c in g.consumers_of(side.cos):
            cands = [c] if c.op_type == "RotaryEmbedding" else [a for a in g.consumers_of(c.output[0])] \
                if std_op(c, "Mul") else []
            for n in cands:
                s = self._side(g, n)
                if s is not None and s.cos == side.cos and s.sin == side.sin:
                    sides[s.anchor] = s
        return sorted(sides.values(), key=lambda s: g.topo_index[s.anchor])

    def _partner(self, g: Graph, side: _Side) -> tuple[_Side, _Side] | None:
        """(q side, k side) of the pair `side` belongs to, None where it has no partner."""
        for mm, idx in self._scores(g, side.out):
            other = mm.input[1 - idx] if len(mm.input) > 1 else ""
            cands = [s for s in self._rotations_into(g, other) if s.anchor != side.anchor] if other else []
            if cands:
                k = min(cands, key=lambda s: g.topo_index[s.anchor])
                return (side, k) if idx == 0 else (k, side)
        group = self._sharing_tables(g, side)
        if len(group) == 2 and not self._scores(g, group[0].out) and not self._scores(g, group[1].out):
            return group[0], group[1]
        return None

    @staticmethod
    def _same_tables(g: Graph, a: str, b: str) -> bool:
        if a == b:
            return True
        if g.is_constant(a) and g.is_constant(b):
            x, y = g.constant(a), g.constant(b)
            return x is not None and y is not None and x.shape == y.shape and bool(np.array_equal(x, y))
        return False

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        side = self._side(g, node)
        if side is None:
            return None
        pair = self._partner(g, side)
        if pair is None:
            return None
        q, k = pair
        if q.anchor != side.anchor or set(q.nodes) & set(k.nodes):
            return None                       # the pair is matched once, at its query's rotation
        nodes = tuple(sorted(set(q.nodes) | set(k.nodes), key=lambda n: g.topo_index[n]))
        why = None
        if q.interleaved != k.interleaved:
            forms = ["half", "interleaved"]
            why = ("pair-different-form", f"q is rotated {forms[q.interleaved]}, k {forms[k.interleaved]}")
        elif q.rotary_dim != k.rotary_dim:
            why = ("pair-different-rotary-dim", f"q rotates {q.rotary_dim or 'all its'} columns, k "
                   f"{k.rotary_dim or 'all its'}")
        elif not (self._same_tables(g, q.cos, k.cos) and self._same_tables(g, q.sin, k.sin)):
            why = ("pair-different-cos-sin", f"q reads cos/sin {q.cos!r}/{q.sin!r}, k {k.cos!r}/{k.sin!r}")
        if why is not None:
            return Refusal(self.name, k.anchor, why[0], f"q/k rotary pair at {q.anchor!r} and {k.anchor!r}: {why[1]}; "
                           "each is rotated on its own", nodes)
        esc = escaping_intermediate(g, nodes, [q.out, k.out])
        if esc is not None:
            return Refusal(self.name, esc[1], esc[0], esc[2], nodes)
        kind = (f"RotaryEmbeddingPair[{'interleaved' if q.interleaved else 'half'}"
                f"{',partial' if q.rotary_dim else ''}]")
        return Match(self.name, nodes, g.boundary_inputs(nodes), (q.out, k.out), kind,
                     info={"q": q.x, "k": k.x, "cos": q.cos, "sin": q.sin, "interleaved": q.interleaved,
                           "rotary_dim": q.rotary_dim, "anchor": q.anchor})

    def build(self, g: Graph, m: Match) -> Replacement:
        info = m.info
        attrs = {"interleaved": int(info["interleaved"]), "rotary_dim": int(info["rotary_dim"])}
        elem = g.elem_type(info["q"]) or g.elem_type(m.outputs[0])
        node, fn = ROTARY_PAIR.make_node([info["q"], info["k"], info["cos"], info["sin"]], list(m.outputs),
                                         info["anchor"], attrs, g.opset.get("", 1), elem)
        return Replacement([node], [], [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})
