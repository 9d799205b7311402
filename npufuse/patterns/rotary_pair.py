"""The q/k rotary pair: RotaryEmbeddingPair rotates a query and a key by the same cos/sin in one op (Ascend's
ApplyRotaryPosEmb): its reference kernel, function body and pattern. The single-tensor RotaryEmbedding and the
rotation matcher both use are in patterns.rotary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph, attributes
from npufuse.npu_model import ascend_kernels
from npufuse.patterns.base import FusedOpDef, Pattern, make_body
from npufuse.ir.matching import escaping_intermediate, std_op
from npufuse.patterns.rotary import (RotaryPattern, _Body, _rotation_nodes, rotary_reference)


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
_SAME_TABLE_DEPTH = 4
# ops whose output is a function of their inputs and attributes alone (no randomness): two with the same inputs
# and attributes compute the same values
_DETERMINISTIC = frozenset({"Concat", "Cast", "Unsqueeze", "Squeeze", "Reshape", "Gather", "Slice", "Mul", "Neg",
                            "Cos", "Sin", "Expand", "Transpose", "Tile"})


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
    def _same_tables(g: Graph, a: str, b: str, depth: int = 0) -> bool:
        """`a` and `b` hold the same values: one name, equal constants, or the same deterministic op of the same
        inputs (the two Concat(cos, cos) canonicalisation writes for q's and k's rotation; depth-limited)."""
        if a == b:
            return True
        if g.is_constant(a) and g.is_constant(b):
            x, y = g.constant(a), g.constant(b)
            return x is not None and y is not None and x.shape == y.shape and bool(np.array_equal(x, y))
        pa, pb = g.producer_of(a), g.producer_of(b)
        if pa is None or pb is None or depth >= _SAME_TABLE_DEPTH or pa.op_type not in _DETERMINISTIC or \
                (pa.op_type, pa.domain, len(pa.input), list(pa.output).index(a)) != \
                (pb.op_type, pb.domain, len(pb.input), list(pb.output).index(b)) or \
                sorted(x.SerializeToString() for x in pa.attribute) != sorted(x.SerializeToString() for x in pb.attribute):
            return False
        return all(RotaryPairPattern._same_tables(g, x, y, depth + 1) for x, y in zip(pa.input, pb.input))

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
