"""DeepSeek-style multi-head latent attention prolog  =>  npufuse.MlaProlog.

Everything a DeepSeek-V2/V3 attention computes from the normed hidden state x before its scores, in one
Cube+Vector kernel (CANN's MlaProlog) instead of three GEMMs, two RMSNorms, a head split, two splits and two
rotary kernels each going through GM:

    q:  cq = RMSNorm(x · W_dq, gamma_cq)                     (q_a_proj, q_a_layernorm)
        q  = (cq · W_uq_qr) viewed [B, S, N, dn + dr], transposed to [B, N, S, dn + dr]   (q_b_proj)
        q_nope, q_pe = split(q, [dn, dr]);  q_rope = RotaryEmbedding(q_pe, cos, sin)
    kv: ckv_kr = x · W_dkv_kr                                 (kv_a_proj_with_mqa)
        c, k_pe = split(ckv_kr, [kv_lora_rank, dr]);  ckv = RMSNorm(c, gamma_ckv)     (kv_a_layernorm)
        k_rope = RotaryEmbedding(k_pe viewed [B, 1, S, dr], cos, sin)

The fused op's outputs are q_nope [B, N, S, dn], q_rope [B, N, S, dr], ckv [B, S, kv_lora_rank] (the latent the
KV cache holds) and k_rope [B, 1, S, dr]. The kv up-projection (kv_b_proj: ckv -> k_nope, v) stays a MatMul after
it, as does the concatenation of the nope and rope parts the attention reads.

Composition: phase 1, after phase 0 made the norms single RMSNorm / RMSNormalization nodes and the rotations single
npufuse.RotaryEmbedding nodes, so the matcher walks over those (anchored on the query's RotaryEmbedding), and before
`matmul_epilogue` (phase 2), which would otherwise take q_a_proj and q_a_layernorm as a FusedMatMul[rmsnorm] (a
norm epilogue no Ascend kernel has). Where this pattern refuses or the cost model declines, those fusions still
happen. `rotary` applications are still counted once per rotated tensor (they are applied, then absorbed).

Refusals (near-misses, each with the node): `no-q-down-projection` (the rope part of q is split from a head split
of something that is not x·W_dq -> RMSNorm -> ·W_uq: DeepSeek-V2-Lite's q_lora_rank = None has no q down
projection and no MlaProlog form), `no-q-norm` (the q down and up projections follow each other with no RMSNorm
between them), `no-kv-rope` (no rotated key reads the same cos/sin from a split of x·W_dkv_kr), `rope-width-mismatch`
(the q and k rope parts, or the splits that cut them, differ in width), `no-kv-norm` (the compressed kv part is not
RMSNorm'd), `different-inputs` (the q and kv down projections read different tensors), `rotary-form` (q and k
rotated differently, or partially), `dynamic-weight`, `head-split` (q's view is not a provable [B, S, N, dn + dr]
split transposed to [B, N, S, dn + dr]), and `shared-intermediate` / `intermediate-is-output`.

Ascend: MlaProlog (token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
rmsnorm_gamma_ckv, rope_sin, rope_cos, cache_index, kv_cache, kr_cache; rmsnorm_epsilon_cq / _ckv, cache_mode),
Atlas A2/A3 (ascend910b, ascend910_93) only in the public repositories: on other chips the region stays unfused.
The kernel's query output is q_nope already multiplied by weight_uk (the absorbed form decode uses); the region
keeps q_nope as the model computes it, so the kernel runs with W_uk absorbed at deployment (or an identity
weight_uk), and it writes ckv / k_rope into the caches at cache_index, which the region's outputs stand for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph, attributes
from npufuse.npu_model import ascend_kernels
from npufuse.patterns.base import FusedOpDef, Pattern, float_attr_constant, make_body, overload_with
from npufuse.algebra.layout import Dims, ShapeEval, head_split, is_transpose, reshape_keeps
from npufuse.ir.matching import MatchRefused, escaping_intermediate, std_op
from npufuse.patterns.norms import rms_norm_reference
from npufuse.patterns.rotary import rotary_reference
from npufuse.algebra.shapes import static_ints

_EPSILON = 1e-5   # RMSNorm's default (ONNX RMSNormalization's too): what a norm without the attribute used
_ATTRS = ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank", "epsilon_cq", "epsilon_ckv",
          "stash_type", "interleaved")


# ---- the fused op ----------------------------------------------------------------------------------

def _mm(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.matmul(a.astype(np.float64), w.astype(np.float64)).astype(a.dtype)


def mla_prolog_reference(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """[q_nope, q_rope, ckv, k_rope] of X [B, S, H], each step rounded to X's dtype as the graph it replaces
    rounds it (the norms and rotations by their own reference kernels)."""
    x, w_dq, g_cq, w_uq, w_dkv, g_ckv, cos, sin = inputs[:8]
    if any(v is None for v in (x, w_dq, g_cq, w_uq, w_dkv, g_ckv, cos, sin)):
        raise ValueError("MlaProlog: every input is required")
    n, dn, dr = int(attrs["num_heads"]), int(attrs["qk_nope_head_dim"]), int(attrs["qk_rope_head_dim"])
    r_kv = int(attrs["kv_lora_rank"])
    rot = {"interleaved": int(attrs.get("interleaved", 0)), "rotary_dim": 0}
    cq = rms_norm_reference(_mm(x, w_dq), g_cq, float(attrs.get("epsilon_cq", _EPSILON)))
    q = _mm(cq, w_uq)
    b, s = q.shape[0], q.shape[1]
    q = q.reshape(b, s, n, dn + dr).transpose(0, 2, 1, 3)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    q_rope = rotary_reference([np.ascontiguousarray(q_pe), cos, sin], rot)[0]
    ckv_kr = _mm(x, w_dkv)
    ckv = rms_norm_reference(ckv_kr[..., :r_kv], g_ckv, float(attrs.get("epsilon_ckv", _EPSILON)))
    k_pe = ckv_kr[..., r_kv:].reshape(b, 1, s, dr)
    k_rope = rotary_reference([k_pe, cos, sin], rot)[0]
    return [np.ascontiguousarray(q_nope), q_rope, ckv, k_rope]


def mla_prolog_body(attrs: dict[str, Any], opset: int, elem_type: int) -> onnx.FunctionProto:
    """Standard ops of `opset` (>= 13): the RMSNorms as npufuse.RMSNorm's body computes them (statistics in
    stash_type, rounded back before gamma), the rotations as npufuse.RotaryEmbedding's."""
    n, dn, dr = int(attrs["num_heads"]), int(attrs["qk_nope_head_dim"]), int(attrs["qk_rope_head_dim"])
    r_kv = int(attrs["kv_lora_rank"])
    if opset < 13:
        raise ValueError("MlaProlog's body needs opset >= 13 (Split sizes and Unsqueeze axes as inputs)")
    compute = int(attrs["stash_type"]) if attrs.get("stash_type") is not None else onnx.TensorProto.FLOAT
    nodes: list[onnx.NodeProto] = []
    tokens: list[str] = []           # what else the overload must name (a baked-in epsilon)

    def const(name: str, values: list[int]) -> str:
        nodes.append(helper.make_node("Constant", [], [name], value=helper.make_tensor(
            name, onnx.TensorProto.INT64, [len(values)], values)))
        return name

    def op(op_type: str, ins: list[str], out: str, **kw: Any) -> str:
        nodes.append(helper.make_node(op_type, ins, [out], **kw))
        return out

    def norm(x: str, g: str, eps_key: str, out: str) -> None:
        xc = op("Cast", [x], out + "_xc", to=compute) if compute != elem_type else x
        sq = op("Mul", [xc, xc], out + "_sq")
        var = op("ReduceMean", [sq], out + "_var", axes=[-1], keepdims=1) if opset < 18 else op(
            "ReduceMean", [sq, const(out + "_axes", [-1])], out + "_var", keepdims=1)
        eps = out + "_eps"
        eps_const, token = float_attr_constant(eps, eps_key, attrs, opset, _EPSILON)
        nodes.append(eps_const)
        tokens.append(token)
        if compute != onnx.TensorProto.FLOAT:
            eps = op("Cast", [eps], out + "_eps_c", to=compute)
        normed = op("Div", [xc, op("Sqrt", [op("Add", [var, eps], out + "_ve")], out + "_std")], out + "_n")
        if compute != elem_type:
            normed = op("Cast", [normed], out + "_nc", to=elem_type)
        op("Mul", [normed, g], out)

    def rope(x: str, out: str) -> None:
        if int(attrs.get("interleaved", 0)):
            big = const(out + "_max", [2**62])
            last, two = const(out + "_last", [-1]), const(out + "_two", [2])
            even = op("Slice", [x, const(out + "_s0", [0]), big, last, two], out + "_even")
            odd = op("Slice", [x, const(out + "_s1", [1]), big, last, two], out + "_odd")
            stacked = op("Concat", [op("Unsqueeze", [op("Neg", [odd], out + "_neg"), last], out + "_u0"),
                                    op("Unsqueeze", [even, last], out + "_u1")], out + "_stack", axis=-1)
            rot = op("Reshape", [stacked, op("Shape", [x], out + "_shape")], out + "_rot")
        else:
            nodes.append(helper.make_node("Split", [x, const(out + "_halves", [dr // 2, dr // 2])],
                                          [out + "_h0", out + "_h1"], axis=-1))
            rot = op("Concat", [op("Neg", [out + "_h1"], out + "_neg"), out + "_h0"], out + "_rot", axis=-1)
        op("Add", [op("Mul", [x, "cos"], out + "_xc"), op("Mul", [rot, "sin"], out + "_rs")], out)

    nodes.append(helper.make_node("MatMul", ["X", "W_dq"], ["cq_raw"]))
    norm("cq_raw", "gamma_cq", "epsilon_cq", "cq")
    nodes.append(helper.make_node("MatMul", ["cq", "W_uq_qr"], ["q_flat"]))
    nodes.append(helper.make_node("Reshape", ["q_flat", const("q_shape", [0, 0, n, dn + dr])], ["q_bsnd"]))
    nodes.append(helper.make_node("Transpose", ["q_bsnd"], ["q_bnsd"], perm=[0, 2, 1, 3]))
    nodes.append(helper.make_node("Split", ["q_bnsd", const("q_split", [dn, dr])], ["q_nope", "q_pe"], axis=-1))
    rope("q_pe", "q_rope")
    nodes.append(helper.make_node("MatMul", ["X", "W_dkv_kr"], ["ckv_kr"]))
    nodes.append(helper.make_node("Split", ["ckv_kr", const("kv_split", [r_kv, dr])], ["c_kv", "k_pe"], axis=-1))
    norm("c_kv", "gamma_ckv", "epsilon_ckv", "ckv")
    nodes.append(helper.make_node("Unsqueeze", ["k_pe", const("one", [1])], ["k_pe4"]))
    rope("k_pe4", "k_rope")
    return make_body(
        FUSED_DOMAIN, "MlaProlog", ["X", "W_dq", "gamma_cq", "W_uq_qr", "W_dkv_kr", "gamma_ckv", "cos", "sin"],
        ["q_nope", "q_rope", "ckv", "k_rope"], nodes,
        [helper.make_opsetid("", opset)],
        attributes=list(_ATTRS),
        overload=overload_with(f"mla_n{n}_dn{dn}_dr{dr}_kv{r_kv}_i{int(attrs.get('interleaved', 0))}_t{elem_type}"
                               f"_s{compute}_op{opset}", *tokens),
        doc_string="DeepSeek MLA prolog: RMSNorm'd q/kv down projections, q up projection, rope on the rope parts.")


MLA_PROLOG = FusedOpDef(
    op_type="MlaProlog",
    doc="q_nope, q_rope, ckv, k_rope of DeepSeek's multi-head latent attention from the normed hidden state X "
        "[B, S, H]: cq = RMSNorm(X·W_dq, gamma_cq); q = (cq·W_uq_qr) viewed [B, S, N, dn+dr] and transposed to "
        "[B, N, S, dn+dr]; q_nope = q[..., :dn]; q_rope = RotaryEmbedding(q[..., dn:], cos, sin); "
        "ckv_kr = X·W_dkv_kr; ckv = RMSNorm(ckv_kr[..., :kv_lora_rank], gamma_ckv); "
        "k_rope = RotaryEmbedding(ckv_kr[..., kv_lora_rank:] viewed [B, 1, S, dr], cos, sin).",
    inputs=("X", "W_dq", "gamma_cq", "W_uq_qr", "W_dkv_kr", "gamma_ckv", "cos", "sin"),
    outputs=("q_nope", "q_rope", "ckv", "k_rope"), attributes=_ATTRS,
    reference=mla_prolog_reference, body=mla_prolog_body,
)


@ascend_kernels.register(FUSED_DOMAIN, "MlaProlog")
def _ascend_mla_prolog(node: onnx.NodeProto, ctx: Any) -> dict[str, Any]:
    """npufuse.MlaProlog -> MlaProlog (Atlas A2/A3)."""
    a = attributes(node)
    x, w_dq, g_cq, w_uq, w_dkv, g_ckv, cos, sin = (list(node.input) + [""] * 8)[:8]
    inputs = ascend_kernels.bind(("token_x", "weight_dq", "weight_uq_qr", "weight_dkv_kr", "rmsnorm_gamma_cq",
                                  "rmsnorm_gamma_ckv", "rope_sin", "rope_cos"),
                                 (x, w_dq, w_uq, w_dkv, g_cq, g_ckv, sin, cos))
    inputs.append({"name": "weight_uk", "value": None, "const": "W_uk (kv_b_proj's k_nope half) or identity"})
    notes = ["query is q_nope times weight_uk in the kernel: with W_uk absorbed there (decode's form) kv_b_proj's "
             "k_nope half moves into the kernel; the region keeps q_nope as the model computes it",
             "kv_cache / kr_cache: the kernel writes ckv and k_rope into the caches at cache_index; the region "
             "returns them as values"]
    if int(a.get("interleaved", 0)):
        notes.append("interleaved rope (rotate_every_two) on the rope parts")
    attrs = {"rmsnorm_epsilon_cq": float(a.get("epsilon_cq", _EPSILON)),
             "rmsnorm_epsilon_ckv": float(a.get("epsilon_ckv", _EPSILON)), "cache_mode": "BNSD"}
    return ascend_kernels.kernel_record("MlaProlog", node, attrs, inputs,
                                        ascend_kernels.bind(("query", "query_rope", "kv_cache", "kr_cache"),
                                                            node.output), notes)


# ---- matching ------------------------------------------------------------------------------------

_NORMS = (("", "RMSNormalization"), ("ai.onnx", "RMSNormalization"), (FUSED_DOMAIN, "RMSNorm"))


def _is(node: onnx.NodeProto | None, domain: str, op: str) -> bool:
    return node is not None and node.op_type == op and (node.domain or "") in (
        (domain,) if domain else ("", "ai.onnx"))


def _is_norm(g: Graph, node: onnx.NodeProto | None) -> bool:
    if node is None or ((node.domain or ""), node.op_type) not in _NORMS or len(node.input) < 2:
        return False
    a = attributes(node)
    return int(a.get("axis", -1)) in (-1, (g.rank(node.input[0]) or 0) - 1) and g.is_constant(node.input[1])


def _weight(g: Graph, mm: onnx.NodeProto, role: str) -> tuple[int, int]:
    w = mm.input[1]
    if not g.is_constant(w):
        raise MatchRefused(mm.name, "dynamic-weight", f"the {role} weight {w!r} of {mm.name!r} is not a constant")
    shape = g.shape_or_constant(w)
    if shape is None or len(shape) != 2 or not all(isinstance(d, int) for d in shape):
        raise MatchRefused(mm.name, "dynamic-weight", f"the {role} weight {w!r} is not a 2-D [K, N] matrix")
    return int(shape[0]), int(shape[1])


def _split_sizes(g: Graph, sp: onnx.NodeProto) -> list[int] | None:
    """The static sizes of a 2-way Split along the last axis, else None."""
    if len(sp.output) != 2:
        return None
    a = attributes(sp)
    rank = g.rank(sp.input[0])
    if int(a.get("axis", 0)) not in (-1, (rank or 0) - 1):
        return None
    sizes = a.get("split") if "split" in a else (
        static_ints(g, sp.input[1], []) if len(sp.input) > 1 and sp.input[1] else None)
    if sizes is None:
        return None
    return [int(s) for s in np.asarray(sizes).reshape(-1)]


class MlaPrologPattern(Pattern):
    name = "mla_prolog"
    description = ("DeepSeek MLA prolog (q/kv down projections, RMSNorms, q up projection, rope on the split rope "
                   "parts) into npufuse.MlaProlog")
    anchor_ops = frozenset({"RotaryEmbedding"})
    phase = 1
    fused_ops = (MLA_PROLOG,)

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if not _is(node, FUSED_DOMAIN, "RotaryEmbedding") or len(node.input) < 3:
            return None
        sp = g.producer_of(node.input[0])
        # the query's rope part: output 1 of a last-axis Split of [B, N, S, dn + dr]; anything else is no MLA
        if not std_op(sp, "Split") or len(sp.output) != 2 or sp.output[1] != node.input[0] or g.rank(
                node.input[0]) != 4:
            return None
        nodes: list[str] = [node.name, sp.name]
        try:
            return self._match(g, node, sp, nodes)
        except MatchRefused as r:
            return Refusal(self.name, r.node, r.reason, f"MLA prolog at {node.name!r}: {r.detail}", tuple(nodes))

    def _match(self, g: Graph, rot_q: onnx.NodeProto, sp_q: onnx.NodeProto, nodes: list[str]) -> Match | None:
        sizes = _split_sizes(g, sp_q)
        tr = g.producer_of(sp_q.input[0])
        rs = g.producer_of(tr.input[0]) if is_transpose(tr, (0, 2, 1, 3)) else None
        mm_uq = g.producer_of(rs.input[0]) if std_op(rs, "Reshape") else None
        if sizes is None or tr is None or not std_op(tr, "Transpose") or not std_op(rs, "Reshape") or \
                not std_op(mm_uq, "MatMul"):
            return None     # a split of something else (not a projected, head-split query): not an MLA prolog
        nodes += [tr.name, rs.name, mm_uq.name]
        dn, dr = sizes
        a_q = attributes(rot_q)
        if int(a_q.get("rotary_dim", 0)):
            raise MatchRefused(rot_q.name, "rotary-form", f"{rot_q.name!r} rotates only part of q's rope part")
        ev, dims = ShapeEval(g), Dims(g)
        heads = head_split(g, ev, dims, rs)
        q_in = mm_uq.input[0]
        norm_q = g.producer_of(q_in)
        if std_op(norm_q, "MatMul", "Gemm"):
            raise MatchRefused(mm_uq.name, "no-q-norm", f"the q up projection {mm_uq.name!r} reads the down "
                               f"projection {norm_q.name!r} directly: no RMSNorm between them")
        if not _is_norm(g, norm_q):
            raise MatchRefused(mm_uq.name, "no-q-down-projection", f"the q projection {mm_uq.name!r} reads "
                               f"{q_in!r}, not RMSNorm(x·W_dq): no q down projection (q_lora_rank None)")
        mm_dq = g.producer_of(norm_q.input[0])
        if not std_op(mm_dq, "MatMul"):
            raise MatchRefused(norm_q.name, "no-q-down-projection", f"{norm_q.name!r} normalises {norm_q.input[0]!r}, "
                               "not a down projection x·W_dq")
        nodes += [norm_q.name, mm_dq.name]
        x = mm_dq.input[0]
        if g.rank(x) != 3:
            raise MatchRefused(mm_dq.name, "head-split", f"the hidden state {x!r} is not [B, S, H]")
        hidden, r_q = _weight(g, mm_dq, "q down")
        r_q2, n_qd = _weight(g, mm_uq, "q up")
        if heads is None or r_q2 != r_q or n_qd != heads * (dn + dr) or dn <= 0 or dr <= 0:
            raise MatchRefused(rs.name, "head-split", f"{rs.name!r} -> {tr.name!r} is not a provable head split of "
                               f"the q up projection [B, S, {n_qd}] into [B, N, S, {dn}+{dr}] (heads {heads})")
        # the key side: a RotaryEmbedding on the same cos/sin whose x is the rope part of x·W_dkv_kr
        cos, sin = rot_q.input[1], rot_q.input[2]
        found = None
        widths: list[str] = []
        for c in g.consumers_of(cos):
            if c is rot_q or not _is(c, FUSED_DOMAIN, "RotaryEmbedding") or len(c.input) < 3 or c.input[1] != cos:
                continue
            k = self._key_side(g, c, x, dims, ev, widths)
            if k is not None:
                found = k
                break
        if found is None:
            for mm in g.consumers_of(x):   # a key rotated on tables of another width: name the mismatch
                sp = g.single_consumer(mm.output[0]) if std_op(mm, "MatMul") and mm.input[0] == x else None
                sizes_k = _split_sizes(g, sp) if std_op(sp, "Split") else None
                rs_k = g.single_consumer(sp.output[1]) if sizes_k is not None else None
                rk = g.single_consumer(rs_k.output[0]) if std_op(rs_k, "Reshape") else None
                if _is(rk, FUSED_DOMAIN, "RotaryEmbedding") and sizes_k[1] != dr:
                    raise MatchRefused(sp.name, "rope-width-mismatch", f"the key's rope part ({sp.name!r}) is "
                                       f"{sizes_k[1]} wide and rotated by {rk.name!r} on other tables; the query's "
                                       f"is {dr}")
            if widths:
                raise MatchRefused(rot_q.name, "rope-width-mismatch", widths[0])
            raise MatchRefused(rot_q.name, "no-kv-rope", f"no rotated key reads cos {cos!r} from the rope part of a "
                               f"projection of {x!r}")
        rot_k, rs_k, sp_kv, mm_dkv, r_kv, dr_k = found
        nodes += [rot_k.name, rs_k.name, sp_kv.name, mm_dkv.name]
        if dr_k != dr:
            raise MatchRefused(sp_kv.name, "rope-width-mismatch", f"the key's rope part is {dr_k} wide, the "
                               f"query's {dr}")
        if rot_k.input[2] != sin:
            raise MatchRefused(rot_k.name, "rope-width-mismatch", f"{rot_k.name!r} reads sin {rot_k.input[2]!r}, the "
                               f"query's rotation {sin!r}")
        a_k = attributes(rot_k)
        if int(a_k.get("rotary_dim", 0)) or int(a_k.get("interleaved", 0)) != int(a_q.get("interleaved", 0)):
            raise MatchRefused(rot_k.name, "rotary-form", f"{rot_k.name!r} and {rot_q.name!r} rotate differently")
        h2, n_kv = _weight(g, mm_dkv, "kv down")
        if h2 != hidden or n_kv != r_kv + dr:
            raise MatchRefused(mm_dkv.name, "rope-width-mismatch", f"kv_a_proj_with_mqa gives {n_kv} columns, "
                               f"split into {r_kv} + {dr_k}")
        cons = [c for c in g.consumers_of(sp_kv.output[0])]
        norm_kv = cons[0] if len(cons) == 1 else None
        if not _is_norm(g, norm_kv):
            raise MatchRefused(sp_kv.name, "no-kv-norm", f"the compressed kv {sp_kv.output[0]!r} is not read by one "
                               "RMSNorm over its last axis")
        nodes.append(norm_kv.name)
        a_nq, a_nk = attributes(norm_q), attributes(norm_kv)
        if a_nq.get("stash_type", 1) != a_nk.get("stash_type", 1):
            raise MatchRefused(norm_kv.name, "no-kv-norm", "the q and kv norms compute in different precisions")
        outputs = (sp_q.output[0], rot_q.output[0], norm_kv.output[0], rot_k.output[0])
        ordered = sorted(set(nodes), key=lambda n: g.topo_index[n])
        esc = escaping_intermediate(g, ordered, outputs)
        if esc is not None:
            raise MatchRefused(esc[1], esc[0], esc[2])
        info = {"x": x, "w_dq": mm_dq.input[1], "gamma_cq": norm_q.input[1], "w_uq": mm_uq.input[1],
                "w_dkv": mm_dkv.input[1], "gamma_ckv": norm_kv.input[1], "cos": cos, "sin": sin,
                "attrs": {"num_heads": heads, "qk_nope_head_dim": dn, "qk_rope_head_dim": dr, "kv_lora_rank": r_kv,
                          "epsilon_cq": float(a_nq.get("epsilon", _EPSILON)),
                          "epsilon_ckv": float(a_nk.get("epsilon", _EPSILON)),
                          "stash_type": int(a_nq["stash_type"]) if "stash_type" in a_nq else None,
                          "interleaved": int(a_q.get("interleaved", 0))},
                "anchor": rot_q.name}
        kind = f"MlaProlog[N={heads},dn={dn},dr={dr},kv={r_kv}]"
        return Match(self.name, tuple(ordered), g.boundary_inputs(ordered), outputs, kind, info=info)

    @staticmethod
    def _key_side(g: Graph, rot_k: onnx.NodeProto, x: str, dims: Dims, ev: ShapeEval, widths: list[str]
                  ) -> tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto, onnx.NodeProto, int, int] | None:
        """(rot_k, view, split, kv_a_proj, kv_lora_rank, rope width) where rot_k rotates
        Reshape(Split(x·W_dkv_kr)[1]) viewed [B, 1, S, dr]; None if it does not."""
        rs_k = g.producer_of(rot_k.input[0])
        if not std_op(rs_k, "Reshape"):
            return None
        sp = g.producer_of(rs_k.input[0])
        if not std_op(sp, "Split") or len(sp.output) != 2 or sp.output[1] != rs_k.input[0]:
            return None
        mm = g.producer_of(sp.input[0])
        if not std_op(mm, "MatMul") or mm.input[0] != x:
            return None
        sizes = _split_sizes(g, sp)
        if sizes is None:
            widths.append(f"the kv split {sp.name!r} has no static last-axis sizes")
            return None
        src = rs_k.input[0]
        if g.rank(src) != 3 or not reshape_keeps(g, dims, ev, rs_k, [dims.key(src, 0), 1, dims.key(src, 1),
                                                                      dims.key(src, 2)]):
            widths.append(f"{rs_k.name!r} is not a [B, S, dr] -> [B, 1, S, dr] view")
            return None
        return rot_k, rs_k, sp, mm, sizes[0], sizes[1]

    def build(self, g: Graph, m: Match) -> Replacement:
        info = m.info
        attrs = dict(info["attrs"])
        elem = g.elem_type(info["x"]) or g.elem_type(m.outputs[0])
        opset = g.opset.get("", 1)
        node, fn = MLA_PROLOG.make_node(
            [info[k] for k in ("x", "w_dq", "gamma_cq", "w_uq", "w_dkv", "gamma_ckv", "cos", "sin")],
            list(m.outputs), info["anchor"], attrs, opset, elem)
        return Replacement([node], [], [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})
