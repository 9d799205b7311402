"""The attention matcher's walks out from the core (Q·Kᵀ, Softmax, ·V) over the sides: the head split and merge, the
GQA repeat, scalar scales on Q and Kᵀ, and the dims the stages bind. A mixin of the pattern in patterns.attention,
which supplies `_refuse`."""

from __future__ import annotations

from typing import Any

from npufuse.algebra.layout import (Dims, ShapeEval, flattened_k_transpose, gqa_repeat, head_split, is_transpose,
                                    reshape_keeps, scale_op)
from npufuse.ir.candidates import Refusal
from npufuse.ir.graph import Graph, attributes
from npufuse.patterns.attention_walks import _Stage

_MAX_WALK = 12

_Core = Any   # patterns.attention._Core (that module imports this one)


class AttentionSides:
    """Q, K, V and output sides of a FusedAttention match (see patterns.attention)."""

    _refuse: Any
    # ---- the sides: Q, K, V and the output ----------------------------------------------------------------
    def _walk_sides(self, g: Graph, ev: ShapeEval, dims: Dims, core: _Core) -> dict[str, list[_Stage]] | Refusal:
        q_stages = self._walk_inputs(g, ev, dims, [_Stage(core.qk.input[0], "BNSD")], allow_scale=True,
                                     allow_repeat=False)
        k0 = self._k_base(g, ev, dims, core.qk.input[1])
        if k0 is None:
            return self._refuse(core.qk.name, "qk-structure", f"the second operand of MatMul {core.qk.name!r} is "
                                "not a transposed key (a Transpose of a rank-4 tensor, or the 3-D flattened form "
                                "of Transpose(0,1,3,2))", core.nodes)
        k_stages = [k0] if k0.perm else self._walk_inputs(g, ev, dims, [k0], allow_scale=True, allow_repeat=True)
        if core.pv_transposed:   # V'·Pᵀ: the op reads V = Transpose(V', (0,1,3,2)), made outside
            v_stages = [_Stage(core.pv.input[0], "BNSD", perm=(0, 1, 3, 2))]
        else:
            v0 = g.node(core.v_cast).input[0] if core.v_cast else core.pv.input[1]
            v_stages = self._walk_inputs(g, ev, dims, [_Stage(v0, "BNSD")], allow_scale=False,
                                         allow_repeat=True)
        return {"q": q_stages, "k": k_stages, "v": v_stages}

    def _walk_inputs(self, g: Graph, ev: ShapeEval, dims: Dims, stages: list[_Stage], allow_scale: bool,
                     allow_repeat: bool) -> list[_Stage]:
        """Walk up from the attention operand: scalar scale steps, the GQA repeat, Transpose(0,2,1,3), the head
        split Reshape — each a stage the fused op may absorb."""
        repeated = any(s.rep for s in stages)
        for _ in range(_MAX_WALK):
            cur = stages[-1]
            p = g.producer_of(cur.value)
            if p is None:
                break
            scale = scale_op(g, p) if allow_scale else None
            if scale is not None:
                stages.append(_Stage(scale[0], cur.layout, (p.name,), scale=scale[1]))
                continue
            if cur.layout == "BNSD" and allow_repeat and not repeated:
                rep = gqa_repeat(g, ev, dims, cur.value)
                if rep is not None:
                    x, rep_nodes, n_rep, mode = rep
                    stages.append(_Stage(x, "BNSD", tuple(rep_nodes), rep=(n_rep, mode)))
                    repeated = True
                    continue
            if cur.layout == "BNSD" and is_transpose(p, (0, 2, 1, 3)):
                stages.append(_Stage(p.input[0], "BSND", (p.name,)))
                continue
            if cur.layout == "BSND" and p.op_type == "Reshape":
                heads = head_split(g, ev, dims, p)
                if heads is not None:
                    stages.append(_Stage(p.input[0], "BSH", (p.name,), heads=heads))
                    continue
            break
        return stages

    def _k_base(self, g: Graph, ev: ShapeEval, dims: Dims, kt: str) -> _Stage | None:
        """Kᵀ back to K: the scale steps on Kᵀ and the transposition, as one mandatory stage."""
        nodes: list[str] = []
        scale = 1.0
        v = kt
        for _ in range(_MAX_WALK):
            p = g.producer_of(v)
            s = scale_op(g, p) if p is not None else None
            if s is None:
                break
            nodes.append(p.name)
            scale *= s[1]
            v = s[0]
        p = g.producer_of(v)
        if p is None:
            return None
        if is_transpose(p, (0, 1, 3, 2)):
            return _Stage(p.input[0], "BNSD", tuple(nodes + [p.name]), scale)
        if is_transpose(p, (0, 2, 3, 1)):
            return _Stage(p.input[0], "BSND", tuple(nodes + [p.name]), scale)
        flat = flattened_k_transpose(g, ev, dims, p)
        if flat is not None:
            k, flat_nodes = flat
            return _Stage(k, "BNSD", tuple(nodes + flat_nodes), scale)
        if p.op_type == "Transpose" and p.domain in ("", "ai.onnx") and g.rank(p.input[0]) == 4:
            # Kᵀ = Transpose(X, perm) for any other perm (DeepSeek's slice-assigned [D, H, S, B] key buffer):
            # K = Transpose(X, perm with its last two axes swapped) is [B, H, S, D]; the rewrite makes it outside
            perm = tuple(int(i) for i in attributes(p).get("perm", (3, 2, 1, 0)))
            k_perm = perm[:2] + (perm[3], perm[2])
            if k_perm == (0, 1, 2, 3):
                return _Stage(p.input[0], "BNSD", tuple(nodes + [p.name]), scale)
            if k_perm == (0, 2, 1, 3):
                return _Stage(p.input[0], "BSND", tuple(nodes + [p.name]), scale)
            return _Stage(p.input[0], "BNSD", tuple(nodes + [p.name]), scale, perm=k_perm)
        if g.rank(v) == 4 and not g.is_constant(v):
            # Kᵀ as computed, no Transpose (ultralytics' C2PSA splits q, k, v out of one [B, H, D, S] tensor and
            # multiplies qᵀ·k): K = Transpose(Kᵀ, (0,1,3,2)), made outside
            return _Stage(v, "BNSD", tuple(nodes), scale, perm=(0, 1, 3, 2))
        return None

    def _walk_out(self, g: Graph, ev: ShapeEval, dims: Dims, core: _Core) -> list[_Stage]:
        """Down from ·V: an identity Reshape, Transpose(0,2,1,3), the head-merge Reshape."""
        stages = [_Stage(core.pv.output[0], "BNSD")]
        for _ in range(0 if core.pv_transposed else 4):   # (P·V)ᵀ: the op's output is transposed back outside
            cur = stages[-1]
            data = [c for c in g.consumers_of(cur.value) if c.op_type != "Shape"]
            if cur.value in g.graph_outputs or len(data) != 1 or data[0].input[0] != cur.value:
                break
            c = data[0]
            if cur.layout == "BNSD" and is_transpose(c, (0, 2, 1, 3)):
                dims.bind(c.output[0], ("B", "Sq", "H", "Dv"))
                stages.append(_Stage(c.output[0], "BSND", (c.name,)))
                continue
            if c.op_type != "Reshape":
                break
            if cur.layout == "BNSD" and len(stages) == 1 and g.rank(cur.value) == 4 and \
                    reshape_keeps(g, dims, ev, c, [dims.key(cur.value, i) for i in range(4)]):
                dims.bind(c.output[0], ("B", "H", "Sq", "Dv"))
                stages.append(_Stage(c.output[0], "BNSD", (c.name,)))
                continue
            if cur.layout == "BSND":
                n, d = dims.int_value(dims.key(cur.value, 2)), dims.int_value(dims.key(cur.value, 3))
                if n is not None and d is not None and \
                        reshape_keeps(g, dims, ev, c, [dims.key(cur.value, 0), dims.key(cur.value, 1), n * d]):
                    stages.append(_Stage(c.output[0], "BSH", (c.name,), heads=n))
            break
        return stages

    def _bind_dims(self, g: Graph, dims: Dims, core: _Core, sides: dict[str, list[_Stage]]) -> None:
        """What attention semantics say about the tensors' dimensions (batch and head axes of K and V are
        left alone: they may broadcast)."""
        for v in core.chain_values:
            if g.rank(v) == 4:
                dims.bind(v, ("B", "H", "Sq", "Sk"))
        per_layout = {
            "q": {"BNSD": ("B", "H", "Sq", "D"), "BSND": ("B", "Sq", "H", "D"), "BSH": ("B", "Sq", None)},
            "k": {"BNSD": (None, None, "Sk", "D"), "BSND": (None, "Sk", None, "D"), "BSH": (None, "Sk", None)},
            "v": {"BNSD": (None, None, "Sk", "Dv"), "BSND": (None, "Sk", None, "Dv"), "BSH": (None, "Sk", None)},
        }
        for role, stages in sides.items():
            for s in stages:
                syms = per_layout[role][s.layout]
                if s.perm:   # the op reads Transpose(value, perm): axis i of that is axis perm[i] of value
                    permuted: list[str | None] = [None] * 4
                    for i, a in enumerate(s.perm):
                        permuted[a] = syms[i]
                    syms = tuple(permuted)
                dims.bind(s.value, syms)
        dims.bind(core.qk.input[1], (None, None, "D", "Sk"))

    def _head_facts(self, g: Graph, dims: Dims, sides: dict[str, list[_Stage]]) -> None:
        """Head counts the stages prove: H from a Q split, or from a K/V split (G heads) and its repeat."""
        for s in sides["q"]:
            if s.heads:
                dims.set_int(dims.sym("H"), s.heads)
        for role in ("k", "v"):
            stages = sides[role]
            rep_at = next((i for i, s in enumerate(stages) if s.rep), None)
            if rep_at is None:
                continue
            pre = stages[rep_at]
            g_heads = next((s.heads for s in stages[rep_at:] if s.heads), None)
            if g_heads is None and g.rank(pre.value) == 4:
                g_heads = dims.int_value(dims.key(pre.value, 1))
            if g_heads and dims.int_value(dims.sym("H")) is None:
                dims.set_int(dims.sym("H"), g_heads * stages[rep_at].rep[0])
