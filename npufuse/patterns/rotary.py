"""Rotary position embedding: y = x·cos + rotate(x)·sin  =>  npufuse.RotaryEmbedding.

The rotary embedding every decoder applies to its queries and keys (Llama, Mistral, Qwen, Gemma, GPT-NeoX, Phi,
GPT-J), fused into one Vector kernel that reads x, cos and sin once and writes y once, instead of two Slices, a
Neg, a Concat, two Muls and an Add each going through GM.

Forms matched (the anchor is the Add, either operand order, either operand order of each Mul):
- half (rotate_half, HF Llama/Qwen/Mistral/NeoX): rotate(x) = Concat(Neg(x[..., h:]), x[..., :h], axis=-1), the two
  Slices' bounds constants (dynamo) or static `Shape -> Gather -> Div -> Unsqueeze` arithmetic (TorchScript);
- interleaved (GPT-J's rotate_every_two): rotate(x) = Reshape(Concat(Unsqueeze(Neg(x[..., 1::2]), -1),
  Unsqueeze(x[..., ::2], -1), axis=-1)) back to x's shape;
- unbind (diffusers' apply_rotary_emb, use_real=True; `rotary_unbind`): the two parts are picked from a view of x
  instead of sliced from it: Flux's unbind(-1) of x.reshape(..., D/2, 2) stacked as (-x_imag, x_real) and flattened
  is the interleaved form, the unbind(-2) of x.reshape(..., 2, D/2) concatenated is the half form; each part is
  [Neg](Squeeze(Slice | Split)) or Gather of the index. cos/sin need not repeat per pair (Flux's do): the fused op
  multiplies by the full-width tables elementwise, as diffusers does;
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
flattened back to x's shape), and `shared-intermediate` / `intermediate-is-output`; for the unbind forms also
`missing-neg` (the parts swapped with no Neg), `pair-layout` (pairs unbound along the last axis but concatenated, or
halves unbound but stacked: neither rotation), `pair-axis` (picked along another axis of the view) and `pair-shape`
(the view does not split x's last axis in two).

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
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph, attributes
from npufuse.npu_model import ascend_kernels
from npufuse.patterns.base import FusedOpDef, Pattern, make_body
from npufuse.patterns.rotary_unbind import unbind_columns, unbind_part
from npufuse.ir.matching import MatchRefused, escaping_intermediate, is_last_axis, std_op
from npufuse.algebra.shapes import clamp_index, slice_bounds, static_ints

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
        from npufuse.algebra.layout import ShapeEval

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


def _rotation(g: Graph, v: str) -> _Rotation | None:
    """The rotation producing `v` (rotate_half or rotate_every_two of some x), None if `v` is not one."""
    p = g.producer_of(v)
    if std_op(p, "Concat") and len(p.input) == 2 and is_last_axis(g, p, v):
        return _half_rotation(g, p)
    if std_op(p, "Reshape"):
        c = g.producer_of(p.input[0])
        if std_op(c, "Concat") and len(c.input) == 2:
            return _interleaved_rotation(g, p, c)
    return None


def _half_rotation(g: Graph, cat: onnx.NodeProto) -> _Rotation | None:
    (n0, s0), (n1, s1) = _neg_slice(g, cat.input[0]), _neg_slice(g, cat.input[1])
    if s0 is None and s1 is None:
        return _unbind_rotation(g, cat, list(cat.input), None)
    if s0 is None or s1 is None or (n0 is None) == (n1 is None) or s0.input[0] != s1.input[0]:
        return None
    x = s0.input[0]
    width = _last_dim(g, x)
    if width is None:
        raise MatchRefused(cat.name, "head-dim-unknown", f"the last axis of {x!r} is not a fixed size; its halves "
                           "cannot be proven")
    shape_nodes: list[str] = []
    r0, r1 = _slice_range(g, s0, width, shape_nodes), _slice_range(g, s1, width, shape_nodes)
    return _finish_half(cat, x, width, r0, r1, n0, n1, [s0.name, s1.name], shape_nodes)


def _finish_half(cat: onnx.NodeProto, x: str, width: int, r0: tuple[int, int, int], r1: tuple[int, int, int],
                 n0: onnx.NodeProto | None, n1: onnx.NodeProto | None, part_nodes: list[str],
                 shape_nodes: list[str]) -> _Rotation:
    """The checks of rotate_half on the column ranges (start, end, step) of x the two joined parts take."""
    h = width // 2
    if width % 2 or r0[2] != 1 or r1[2] != 1 or sorted([r0[:2], r1[:2]]) != [(0, h), (h, width)]:
        raise MatchRefused(cat.name, "uneven-halves", f"Concat {cat.name!r} joins [{r0[0]}, {r0[1]}) and "
                           f"[{r1[0]}, {r1[1]}) of {x!r} (width {width}); rotate_half joins -x[..., {h}:] and "
                           f"x[..., :{h}]")
    if n0 is None or r0[:2] != (h, width):
        raise MatchRefused((n0 or n1).name, "neg-wrong-half", f"Concat {cat.name!r} is not cat(-x2, x1): the Neg "
                           f"is on [{(r0 if n0 is not None else r1)[0]}, {(r0 if n0 is not None else r1)[1]}) and "
                           f"placed {'first' if n0 is not None else 'second'}; that is the inverse rotation")
    nodes = [*part_nodes, (n0 or n1).name, cat.name]
    return _Rotation(x, 0, list(dict.fromkeys(nodes)), shape_nodes)


def _interleaved_rotation(g: Graph, rs: onnx.NodeProto, cat: onnx.NodeProto) -> _Rotation | None:
    parts = []
    for v in cat.input:
        u = g.producer_of(v)
        if not std_op(u, "Unsqueeze"):
            return None
        parts.append((u, *_neg_slice(g, u.input[0])))
    (u0, n0, s0), (u1, n1, s1) = parts
    if s0 is None and s1 is None:
        return _unbind_rotation(g, cat, [u0.input[0], u1.input[0]], (rs, u0, u1))
    if s0 is None or s1 is None or (n0 is None) == (n1 is None) or s0.input[0] != s1.input[0]:
        return None
    x = s0.input[0]
    width = _last_dim(g, x)
    if width is None:
        raise MatchRefused(cat.name, "head-dim-unknown", f"the last axis of {x!r} is not a fixed size")
    shape_nodes: list[str] = []
    _check_stack(g, u0, u1, cat, g.rank(x), shape_nodes)
    r0, r1 = _slice_range(g, s0, width, shape_nodes), _slice_range(g, s1, width, shape_nodes)
    return _finish_interleaved(g, rs, cat, x, width, r0, r1, n0, n1, [s0.name, s1.name], u0, u1, shape_nodes)


def _check_stack(g: Graph, u0: onnx.NodeProto, u1: onnx.NodeProto, cat: onnx.NodeProto, rank: int | None,
                 shape_nodes: list[str]) -> None:
    """The stack of rotate_every_two: both parts (of rank `rank`) unsqueezed on a new last axis and joined on it."""
    for u in (u0, u1):
        axes = attributes(u).get("axes") if "axes" in attributes(u) else (
            static_ints(g, u.input[1], shape_nodes) if len(u.input) > 1 else None)
        axes = None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
        if axes is None or len(axes) != 1 or rank is None or axes[0] not in (-1, rank):
            raise MatchRefused(u.name, "uneven-halves", f"Unsqueeze {u.name!r} adds axes {axes}, not a new last axis")
    if int(attributes(cat).get("axis", 0)) not in (-1, rank):
        raise MatchRefused(cat.name, "uneven-halves", f"Concat {cat.name!r} does not stack along the new last axis")


def _finish_interleaved(g: Graph, rs: onnx.NodeProto, cat: onnx.NodeProto, x: str, width: int,
                        r0: tuple[int, int, int], r1: tuple[int, int, int], n0: onnx.NodeProto | None,
                        n1: onnx.NodeProto | None, part_nodes: list[str], u0: onnx.NodeProto, u1: onnx.NodeProto,
                        shape_nodes: list[str]) -> _Rotation:
    """The checks of rotate_every_two on the column ranges (start, end, step) of x the two stacked parts take, and
    the flatten back to x's shape."""
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
    nodes = [*part_nodes, (n0 or n1).name, u0.name, u1.name, cat.name, rs.name]
    return _Rotation(x, 1, list(dict.fromkeys(nodes)), shape_nodes)


def _unbind_rotation(g: Graph, cat: onnx.NodeProto, values: list[str],
                     stack: tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto] | None) -> _Rotation | None:
    """The rotation whose parts `values` are unbound from a reshaped x (diffusers' apply_rotary_emb, see
    rotary_unbind): stacked and flattened (`stack`: the Reshape and the two Unsqueezes) for rotate_every_two,
    joined by `cat` on the last axis (`stack` None) for rotate_half. None if the parts are not such picks."""
    shape_nodes: list[str] = []
    parts = [unbind_part(g, v, shape_nodes) for v in values]
    if parts[0] is None or parts[1] is None or parts[0].pairs != parts[1].pairs:
        return None
    p0, p1 = parts
    x, width, (r0, r1), part_nodes = unbind_columns(g, [p0, p1], cat)
    along_last = p0.axis == (g.rank(p0.pairs) or 0) - 1
    if along_last != (stack is not None):
        axis, joined = ("last", "concatenated") if along_last else ("second-to-last", "stacked")
        raise MatchRefused(cat.name, "pair-layout", f"the parts of {p0.pairs!r} are unbound along its {axis} axis "
                           f"but {joined} by {cat.name!r}: neither rotate_half (unbind(-2) + cat) nor "
                           "rotate_every_two (unbind(-1) + stack)")
    if (p0.neg is None) == (p1.neg is None):
        raise MatchRefused(cat.name, "missing-neg" if p0.neg is None else "neg-wrong-half",
                           f"{cat.name!r} joins the unbound parts of {p0.pairs!r} with "
                           f"{'no Neg' if p0.neg is None else 'both negated'}; a rotation negates exactly one")
    if stack is None:
        out_shape, x_shape = g.shape(cat.output[0]), g.shape(x)
        if out_shape is None or x_shape is None or len(out_shape) != len(x_shape) or any(
                a != b for a, b in zip(out_shape, x_shape)):
            raise MatchRefused(cat.name, "pair-shape", f"{cat.name!r} gives {out_shape}, not x's shape {x_shape}")
        rot = _finish_half(cat, x, width, r0, r1, p0.neg, p1.neg, part_nodes, shape_nodes)
    else:
        rs, u0, u1 = stack
        _check_stack(g, u0, u1, cat, g.rank(values[0]), shape_nodes)
        rot = _finish_interleaved(g, rs, cat, x, width, r0, r1, p0.neg, p1.neg, part_nodes, u0, u1, shape_nodes)
    return rot


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
        shape = g.shape_or_constant(v)
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
                not is_last_axis(g, cat, cat.output[0]):
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
