"""Scaled dot-product attention  =>  npufuse.FusedAttention.

The matcher anchors on Softmax and walks the graph's indices: producers upward through the mask and scale
steps to the Q·Kᵀ MatMul, consumers downward through Cast / Dropout / the NaN guard to the ·V MatMul, then
outward from the two MatMuls over the head split and merge and the grouped-query repeat:

    Q [B,S,H*D] -Reshape-> [B,S,H,D] -Transpose(0,2,1,3)-> [B,H,Sq,D] -[*c]-.
    K [B,S,G*D] -Reshape-> -Transpose-> [B,G,Sk,D] -[repeat ×H/G]- Kᵀ -[*c]-> MatMul -[/c | *c]->
        [+ mask] [Where(bool_mask, ·, fill)] -> [Cast] -> Softmax -> [Cast] [Dropout] [Where(IsNaN(p), 0, p)]
    V [B,S,G*D] -Reshape-> -Transpose-> [B,G,Sk,Dv] -[repeat]-> MatMul(p, V)
        -Transpose(0,2,1,3)-> -Reshape-> [B,Sq,H*Dv]

Kᵀ is recognised as Transpose(0,1,3,2) of [B,H,S,D], Transpose(0,2,3,1) of [B,S,H,D], the dynamo SDPA form
Reshape(Transpose(Reshape(K, [-1,S,D]), (0,2,1)), [B,H,D,S]), or Transpose(X, perm) for any other perm (DeepSeek-V3's
slice-assigned [D,H,S,B] key buffer): then the rewrite makes K = Transpose(X, perm with its last two axes swapped)
outside the fused op, which reads it as [B,H,S,D]; a rank-4 Kᵀ no Transpose wrote (ultralytics' C2PSA splits q, k
and v out of one [B,H,D,S] tensor and multiplies qᵀ·k) is read the same way, K = Transpose(Kᵀ, (0,1,3,2)) made
outside. The probabilities may also come transposed, V'·Pᵀ (C2PSA's v @ attn.transpose(-2, -1)): that is (P·V)ᵀ
with V = V'ᵀ, so the rewrite makes V outside and a Transpose after the op writes the MatMul's value. The repeat is llama's repeat_kv
(Unsqueeze(2) -> Expand | Tile | Concat -> Reshape: q-head h reads kv-head h // (H/G)) or a Tile/Concat along
the head axis (h reads h % G).

The head split, merge and repeat are absorbed where their intermediates are used by nothing else (shape-only
side computations that feed back into the absorbed nodes, as the TorchScript and dynamo SDPA exports emit,
are absorbed with them); otherwise the fused op reads/writes [B,H,S,D] tensors and the Reshape/Transpose
stay outside. Each tensor's layout is recorded in an attribute (q_layout, k_layout, v_layout, out_layout).
Rotary embeddings stay outside: they are applied to Q and K before the attention.

KV cache: the past keys/values concatenated with the new ones on the sequence axis (Concat, its output the
present cache and usually a graph output) is not absorbed: the Concat stays outside and the fused op reads the
whole cache as its K and V (the GQA repeat after it is absorbed as usual). The query and key lengths differ; a
constant causal triangle counts as causal=1 only when aligned to the last key (bottom-right, as HF builds it; the
op's causal is defined that way), any other triangle stays a boolean mask input. The kind tells the forms apart:
`decode` (query length fixed at 1: IncreFlashAttention on Ascend), `prefill` (a cache, query length fixed > 1),
`kvcache` (a cache, query length not known statically); prefill and kvcache map to PromptFlashAttention.

Scale: Div or Mul (either operand order) by a constant scalar after Q·Kᵀ, and/or on Q and Kᵀ before it
(TorchScript's SDPA multiplies both by sqrt(scale)); the factors multiply into `scale`.
Masks and biases: additive terms (Add, either operand order: a float mask, T5's relative position bias, ALiBi,
DeBERTa's c2p + p2c, Swin/BEiT's relative bias) and/or a boolean mask, Where(m, scores, fill) or the masked_fill
form Where(m, fill, scores) (Where(Not(m), fill, scores) reads Not(m) as the positions to drop), in the order the
model applies them. Several additive terms applied one after the other become the op's one `bias` input (Ascend's
kernels take one pse_shift): the rewrite sums them outside the op in the model's order; terms on both sides of the
boolean mask are a near-miss. A mask or bias applied before a scale factor that is a power of two is scaled outside
the op (the fill times the factor), exactly; before any other factor it is a near-miss (scale-after-mask).
Soft-capping (Gemma 2): a * tanh(b * scores) before the masks becomes softcap |a| and scale a * b (the factors after
the Tanh and before it); a mask applied before the Tanh is a near-miss (mask-before-softcap), a second Tanh too
(softcap-form). No shipped Ascend attention kernel takes a softcap: the kernel record says so and the region is priced
unfused on every chip (a kernel opportunity), and the ATC form keeps it standard (attention-softcap).
Precision: scores cast up after Q·Kᵀ set softmax_dtype; probabilities multiplied by V cast up to their type set
out_dtype (the Cast of V is absorbed; TorchScript's SDPA export of fp16 models). a constant causal triangle as
the condition becomes causal=1 with no mask tensor. Fully masked rows keep the original's semantics (a
finite fill: the uniform average of V; -inf: NaN; with the SDPA export's IsNaN guard, nan_guard=1: zeros).
Near-misses (Refusal reasons): shared-intermediate, softmax-axis, nonconstant-scale, nonscalar-scale,
scale-after-mask, mask-shape, mask-fill, multiple-masks, qk-structure, pv-structure, score-chain (the walk up from
the Softmax stopped at the named node before a Q·Kᵀ MatMul), attention-sinks (the scores normalised together with sink columns joined by a Concat and sliced off after the
Softmax: GPT-OSS), probs-chain (the walk down stopped before a ·V MatMul:
heads merged into the batch, probabilities reduced or output), dropout-training, mixed-dtypes, opset (< 13: Softmax
coerced its input to 2-D). Every Softmax ends fused or refused: one that is provably not attention (no MatMul of two
activations computes its input and none multiplies its output by an activation, within 10 elementwise or layout
steps: a classifier's or router's Softmax(x·W)) is refused as not-attention, and any other chain that breaks names
the node where matching stopped (see `_attention_like`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph, attributes
from npufuse.patterns.base import (
    Pattern,
    unique_name,
)
from npufuse.algebra.layout import (Dims, ShapeEval, const_operand, is_transpose, scale_op, shape_closure,
                                            uniform_constant)
from npufuse.patterns.attention_op import (FUSED_ATTENTION, MIN_OPSET,
                                           causal_keep)
from npufuse.patterns.attention_sides import AttentionSides
from npufuse.patterns.attention_walks import (_FLOAT_TYPES, _LAYOUT_OPS, _LIKE_DEPTH, _Stage, _activation_matmul,
                                              _attention_like, _exact_factor, _is_passthrough, _kv_cache_concat,
                                              _nan_guard, _pick_scores_operand, _probs_matmul,
                                              _static_seq, drops_last_column, sink_form)

_MAX_WALK = 12

# ---- the fused op ----------------------------------------------------------------------------------------


# ---- the pattern -----------------------------------------------------------------------------------------


@dataclass
class _Core:
    """The mandatory part: Q·Kᵀ -> scale -> masks -> Softmax -> guard -> ·V."""

    softmax: onnx.NodeProto
    qk: onnx.NodeProto
    pv: onnx.NodeProto
    nodes: list[str] = field(default_factory=list)
    chain_values: list[str] = field(default_factory=list)   # scores ... probabilities, for the dims
    scale: float = 1.0
    add_terms: list[tuple[str, float]] = field(default_factory=list)  # (term, factor) in the order applied
    where: tuple[str, float, str] | None = None            # (condition, fill, "keep" | "drop")
    mask_order: list[str] = field(default_factory=list)
    nan_guard: bool = False
    softmax_type: int = TensorProto.UNDEFINED
    shared: tuple[str, str] | None = None                   # (node, value) of an intermediate used elsewhere
    training_dropout: str | None = None                     # a Dropout that is not an inference no-op
    v_cast: str | None = None                               # Cast(V) up to the probabilities' type, absorbed
    softcap: float | None = None                            # a in a * tanh(b * scores): the factor after the Tanh
    pv_transposed: str | None = None                        # the Transpose of P in V'·Pᵀ (= (P·V)ᵀ with V = V'ᵀ)
    sink: Any = None                                        # attention_walks.SinkForm: GPT-OSS's learned sinks


class FusedAttentionPattern(AttentionSides, Pattern):
    name = "attention"
    description = ("Q·Kᵀ -> scale -> [mask] -> Softmax -> [Dropout] -> [NaN guard] -> ·V (with the head "
                   "split/merge and the GQA repeat around it) into FusedAttention")
    anchor_ops = frozenset({"Softmax"})
    phase = 1
    fused_ops = (FUSED_ATTENTION,)

    # ---- match ---------------------------------------------------------------------------------------
    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if node.domain not in ("", "ai.onnx") or not node.output or not node.input:
            return None
        sink = sink_form(g, node)
        core = self._walk_down(g, node, sink)
        if isinstance(core, tuple):   # the probabilities reach no ·V MatMul through fusible steps
            if not _attention_like(g, node):
                return self._not_attention(node)
            if sink is not None:
                return self._refuse(core[0], "attention-sinks", f"Softmax {node.name!r} normalises the scores with "
                                    f"a sink column ({sink.sinks!r}) that is not sliced off before the ·V MatMul: "
                                    f"{core[1]}", [node.name])
            return self._refuse(core[0], "probs-chain", core[1], [node.name])
        stop = self._walk_up(g, core)
        if isinstance(stop, Refusal):
            return stop
        if core.qk is None:
            if not _attention_like(g, node):
                return self._not_attention(node)
            return self._score_chain(g, core, stop)
        nodes = list(core.nodes)
        if core.shared is not None:
            n, v = core.shared
            why = "is a graph output" if v in g.graph_outputs else \
                f"is also used by {next((c.name for c in g.consumers_of(v) if c.name not in set(nodes)), '?')!r}"
            return self._refuse(n, "shared-intermediate", f"attention intermediate {v!r} (from {n!r}) {why}; "
                                "fusing would hide it", nodes)
        if core.training_dropout is not None:
            return self._refuse(core.training_dropout, "dropout-training", f"Dropout {core.training_dropout!r} on "
                                "the attention probabilities may run in training mode (or its mask is used); "
                                "export the model in eval mode", nodes)
        opset = g.opset.get("", 1)
        if opset < MIN_OPSET:
            return self._refuse(node.name, "opset", f"Softmax {node.name!r} is in an opset-{opset} model; before "
                                f"opset 13 Softmax flattens its input to 2-D (FusedAttention needs >= {MIN_OPSET})",
                                nodes)
        refusal = self._check_structure(g, core)
        if refusal is not None:
            return refusal
        ev, dims = ShapeEval(g), Dims(g)
        sides = self._walk_sides(g, ev, dims, core)
        if isinstance(sides, Refusal):
            return sides
        self._bind_dims(g, dims, core, sides)
        self._head_facts(g, dims, sides)
        sides["out"] = self._walk_out(g, ev, dims, core)
        out_syms = ("B", "H", "Dv", "Sq") if core.pv_transposed else ("B", "H", "Sq", "Dv")
        for v, sym in ((core.qk.output[0], ("B", "H", "Sq", "Sk")), (core.pv.output[0], out_syms)):
            dims.bind(v, sym)
        settled = self._settle(g, dims, core, sides)
        if isinstance(settled, Refusal):
            return settled
        idx, closure, attrs_heads = settled
        refusal = self._check_masks(g, dims, core)
        if refusal is not None:
            return refusal
        return self._make_match(g, dims, core, sides, idx, closure, attrs_heads)

    def _refuse(self, node: str, reason: str, detail: str, nodes: Iterable[str] = ()) -> Refusal:
        return Refusal(self.name, node, reason, detail, tuple(nodes))

    # ---- the core: down to ·V, up to Q·Kᵀ ----------------------------------------------------------------
    def _walk_down(self, g: Graph, softmax: onnx.NodeProto, sink: Any = None) -> _Core | tuple[str, str]:
        """Softmax -> [Cast] [Dropout] [Identity] [Where(IsNaN(p), 0, p)] -> MatMul(p, V); where no ·V MatMul
        follows, (the node the walk stopped at, why). With learned sinks (`sink`), the Slice dropping the sink
        column comes first, through Casts (the values before it are one column wider: not in the chain)."""
        core = _Core(softmax, None, None, [softmax.name])  # type: ignore[arg-type]
        v = softmax.output[0]
        if sink is None:
            core.chain_values.append(v)
        last = softmax
        for _ in range(_MAX_WALK):
            cons = g.consumers_of(v)
            cut = next((c for c in cons if drops_last_column(g, c)), None) if sink is not None and \
                core.sink is None else None
            if cut is not None:
                if len(cons) != 1 and core.shared is None:
                    core.shared = (g.producer_of(v).name, v)
                core.sink = sink
                core.nodes.append(cut.name)
                v = cut.output[0]
                last = cut
                core.chain_values.append(v)
                continue
            if sink is not None and core.sink is None and not any(_is_passthrough(g, c) for c in cons):
                return last.name, (f"the probabilities of Softmax {softmax.name!r} (with a sink column) are not "
                                   "sliced back to the keys")
            if v in g.graph_outputs and core.shared is None:
                core.shared = (g.producer_of(v).name, v)
            guard = _nan_guard(g, v, cons)
            if guard is not None:
                isnan, where = guard
                if len(cons) != 2 and core.shared is None:
                    core.shared = (g.producer_of(v).name, v)
                core.nodes += [isnan.name, where.name]
                core.nan_guard = True
                v = where.output[0]
                last = where
                core.chain_values.append(v)
                continue
            matmul = next((c for c in cons if c.op_type == "MatMul"), None)
            transposed = self._transposed_pv(g, v, cons) if matmul is None else None
            if transposed is not None:
                tr, matmul = transposed
                if len(cons) != 1 and core.shared is None:
                    core.shared = (g.producer_of(v).name, v)
                if (len(g.consumers_of(tr.output[0])) != 1 or tr.output[0] in g.graph_outputs) and core.shared is None:
                    core.shared = (tr.name, tr.output[0])
                core.pv_transposed = tr.name
                core.nodes.append(tr.name)
                core.pv = matmul
                core.nodes.append(matmul.name)
                return core
            if matmul is not None:
                if len(cons) != 1 and core.shared is None:
                    core.shared = (g.producer_of(v).name, v)
                core.pv = matmul
                core.nodes.append(matmul.name)
                return core
            step = next((c for c in cons if _is_passthrough(g, c)), None)
            if step is None:
                step = next((c for c in cons if c.op_type == "Dropout"), None)
                if step is None or core.training_dropout is not None:
                    return self._probs_stop(g, softmax, last, v, cons)
                core.training_dropout = step.name
            if len(cons) != 1 and core.shared is None:
                core.shared = (g.producer_of(v).name, v)
            core.nodes.append(step.name)
            v = step.output[0]
            last = step
            if sink is None or core.sink is not None:
                core.chain_values.append(v)
        return last.name, (f"the probabilities of Softmax {softmax.name!r} pass more than {_MAX_WALK} steps before a "
                           "·V MatMul")

    @staticmethod
    def _transposed_pv(g: Graph, v: str, cons: Sequence[onnx.NodeProto]
                       ) -> tuple[onnx.NodeProto, onnx.NodeProto] | None:
        """V'·Pᵀ: the probabilities `v` transposed over their last two axes, as the second
        operand of a MatMul whose first is an activation (ultralytics' C2PSA attention writes v @ attn.transpose(-2,
        -1)). That is (P·V)ᵀ with V = V'ᵀ: the op reads V made outside and its output is transposed back. A Pᵀ read
        elsewhere too makes the match a shared-intermediate near-miss."""
        tr = next((c for c in cons if is_transpose(c, (0, 1, 3, 2))), None)
        if tr is None:
            return None
        pt = tr.output[0]
        mm = next((c for c in g.consumers_of(pt) if c.op_type == "MatMul" and c.domain in ("", "ai.onnx")
                   and list(c.input[:2]) == [c.input[0], pt] and c.input[0] != pt and not g.is_constant(c.input[0])),
                  None)
        return (tr, mm) if mm is not None else None

    @staticmethod
    def _probs_stop(g: Graph, softmax: onnx.NodeProto, last: onnx.NodeProto, v: str,
                    cons: Sequence[onnx.NodeProto]) -> tuple[str, str]:
        """Why the probabilities `v` reach no ·V MatMul: the node the walk stopped at and a sentence."""
        sm = f"Softmax {softmax.name!r}"
        if not cons:
            return last.name, (f"the probabilities of {sm} are {'a graph output' if v in g.graph_outputs else 'unused'}"
                               " and multiply no V")
        c = next((x for x in cons if x.op_type != "Shape"), cons[0])
        pv = _probs_matmul(g, v)
        if pv is not None and c.op_type in _LAYOUT_OPS:
            rank = g.rank(pv.input[0])
            merged = f" (heads merged into the batch: a rank-{rank} ·V MatMul)" if rank == 3 else ""
            return c.name, (f"the probabilities of {sm} reach the ·V MatMul {pv.name!r} through {c.op_type} "
                            f"{c.name!r}{merged}; FusedAttention needs the [B, H, Sq, Sk] probabilities multiplied "
                            "by V directly")
        if c.op_type == "Dropout":
            return c.name, (f"the probabilities of {sm} pass a second Dropout {c.name!r} that may run in training "
                            "mode")
        what = ", ".join(sorted({f"{x.op_type} {x.name!r}" for x in cons})[:3])
        return c.name, (f"the probabilities of {sm} are read by {what}, not by a ·V MatMul (through Cast, Dropout, "
                        "Identity or the NaN guard)")

    def _walk_up(self, g: Graph, core: _Core) -> Refusal | str | None:
        """Softmax input -> [Cast] [Where / Add masks and biases] [Mul / Div scale] -> the Q·Kᵀ MatMul. Sets
        core.qk; where the chain ends before one, returns the value it stopped at (core.qk stays None)."""
        sm = core.softmax
        v = sm.input[0] if core.sink is None else core.sink.scores
        if core.sink is not None:
            core.nodes += core.sink.nodes
        post_scale = 1.0      # the scale factors applied after the current point (seen so far, walking up)
        scale_node: str | None = None
        order_rev: list[str] = []
        terms_rev: list[tuple[str, float]] = []
        for _ in range(_MAX_WALK):
            if (v in g.graph_outputs or len(g.consumers_of(v)) != 1) and core.shared is None:
                core.shared = (g.producer_of(v).name if g.producer_of(v) else sm.name, v)
            p = g.producer_of(v)
            if p is None:
                return v
            core.chain_values.append(v)
            if p.op_type == "MatMul":
                core.qk = p
                core.nodes.append(p.name)
                core.mask_order = order_rev[::-1]
                core.add_terms = terms_rev[::-1]
                return None
            if p.op_type in ("Cast", "Identity"):
                if p.op_type == "Cast" and attributes(p).get("to") not in _FLOAT_TYPES:
                    return v
                core.nodes.append(p.name)
                v = p.input[0]
                continue
            if p.op_type in ("Mul", "Div"):
                scale = scale_op(g, p)
                if scale is None:
                    return self._refuse_scale(g, p, core)
                scale_node = scale_node or p.name
                core.scale *= scale[1]
                post_scale *= scale[1]
                core.nodes.append(p.name)
                v = scale[0]
                continue
            if p.op_type == "Tanh":
                refusal = self._softcap_step(g, p, core, order_rev)
                if refusal is not None:
                    return refusal
                post_scale = 1.0
                v = p.input[0]
                continue
            if core.softcap is not None and p.op_type in ("Add", "Where"):
                return self._refuse(p.name, "mask-before-softcap", f"{p.op_type} {p.name!r} masks the attention "
                                    "scores before their soft-capping Tanh; FusedAttention caps the scaled scores "
                                    "first and applies its masks to the capped scores", core.nodes + [p.name])
            if p.op_type == "Add":
                a, b = p.input[0], p.input[1]
                chain = _pick_scores_operand(g, [a, b])
                if chain is None:
                    return v
                if not _exact_factor(post_scale):
                    return self._scale_after_mask(scale_node, post_scale, core)
                if order_rev and order_rev[-1] != "add" and "add" in order_rev:
                    return self._refuse(p.name, "multiple-masks", f"Add {p.name!r} adds a term to the attention "
                                        "scores before the boolean mask and another is added after it; "
                                        "FusedAttention adds its one bias on one side of the mask",
                                        core.nodes + [p.name])
                terms_rev.append((b if chain == a else a, post_scale))
                if not order_rev or order_rev[-1] != "add":
                    order_rev.append("add")
                core.nodes.append(p.name)
                v = chain
                continue
            if p.op_type == "Where" and len(p.input) == 3:
                chain = _pick_scores_operand(g, [p.input[1], p.input[2]])
                if chain is None:
                    return v
                fill_value = p.input[2] if chain == p.input[1] else p.input[1]
                fill = uniform_constant(g, fill_value)
                if fill is None:
                    return self._refuse(p.name, "mask-fill", f"Where {p.name!r} masks the attention scores with "
                                        f"{fill_value!r}, which is not a constant scalar", core.nodes + [p.name])
                if core.where is not None:
                    return self._refuse(p.name, "multiple-masks", f"Where {p.name!r} applies a second boolean mask "
                                        "to the attention scores; FusedAttention takes one", core.nodes)
                if not _exact_factor(post_scale):
                    return self._scale_after_mask(scale_node, post_scale, core)
                # Where(Not(m), fill, scores), the masked_fill of an inverted mask, stays "drop" of Not(m): the
                # positions to drop, as Ascend's atten_mask takes them
                core.where = (p.input[0], float(fill) * post_scale, "keep" if chain == p.input[1] else "drop")
                order_rev.append("where")
                core.nodes.append(p.name)
                v = chain
                continue
            return v
        return v
    def _softcap_step(self, g: Graph, tanh: onnx.NodeProto, core: _Core, order_rev: list[str]) -> Refusal | None:
        """The Tanh of logit soft-capping, a * tanh(b * scores): the factors walked so far (between the Tanh and the
        Softmax) are a, the softcap; those below it, to Q·Kᵀ and on Q and Kᵀ, are b. A mask or bias after the Tanh
        stays a mask on the capped scores (scaled by the factors after it, as without a cap)."""
        if core.softcap is not None:
            return self._refuse(tanh.name, "softcap-form", f"Tanh {tanh.name!r} is a second Tanh on the attention "
                                "scores; FusedAttention soft-caps them once", core.nodes + [tanh.name])
        if not np.isfinite(core.scale) or core.scale == 0:
            return self._refuse(tanh.name, "softcap-form", f"Tanh {tanh.name!r} soft-caps the attention scores "
                                f"with a factor {core.scale:g} after it, not a finite non-zero cap",
                                core.nodes + [tanh.name])
        core.softcap = core.scale
        core.scale = 1.0
        core.nodes.append(tanh.name)
        return None

    def _not_attention(self, softmax: onnx.NodeProto) -> Refusal:
        """A Softmax that provably is not attention (see `_attention_like`): said so, so that no Softmax is left
        without a reason."""
        return self._refuse(softmax.name, "not-attention", f"Softmax {softmax.name!r} is not attention: no MatMul of "
                            f"two activations (Q·Kᵀ) computes its input and none multiplies its output by an "
                            f"activation (·V) within {_LIKE_DEPTH} elementwise or layout steps (a classifier's or a "
                            "router's Softmax(x·W))", [softmax.name])

    def _score_chain(self, g: Graph, core: _Core, stop: str | None) -> Refusal:
        """The scores reach the Softmax from no recognised Q·Kᵀ chain: name the node the walk stopped at."""
        sm = core.softmax
        p = g.producer_of(stop) if stop else None
        if p is None:
            return self._refuse(sm.name, "score-chain", f"the scores of Softmax {sm.name!r} are "
                                f"{'the graph input' if stop else 'a value'} {stop!r}, not computed by a Q·Kᵀ "
                                "MatMul", core.nodes)
        mm = _activation_matmul(g, stop)
        where = f" from MatMul {mm.name!r}" if mm is not None else ""
        if p.op_type in _LAYOUT_OPS and mm is not None and g.rank(mm.output[0]) == 3:
            why = " (heads merged into the batch: rank-3 scores reshaped to 4-D)"
        elif p.op_type == "Cast":
            why = " (a Cast to a non-float type)"
        else:
            why = ""
        return self._refuse(p.name, "score-chain", f"{p.op_type} {p.name!r} sits between the scores{where} and "
                            f"Softmax {sm.name!r}{why}; only scale, mask, bias and cast steps can be fused",
                            core.nodes + [p.name])

    def _refuse_scale(self, g: Graph, p: onnx.NodeProto, core: _Core) -> Refusal:
        nodes = core.nodes + [p.name]
        pair = const_operand(g, p)
        if pair is None:
            return self._refuse(p.name, "nonconstant-scale", f"{p.op_type} {p.name!r} scales the attention scores "
                                "by a value that is not a constant", nodes)
        if p.op_type == "Div" and pair[0] != p.input[0]:
            return self._refuse(p.name, "score-chain", f"Div {p.name!r} divides a constant by the attention scores",
                                nodes)
        arr = g.constant(pair[1])
        return self._refuse(p.name, "nonscalar-scale", f"{p.op_type} {p.name!r} scales the attention scores by a "
                            f"constant of shape {None if arr is None else list(arr.shape)} that is not one finite, "
                            "non-zero scalar", nodes)

    def _scale_after_mask(self, scale_node: str | None, factor: float, core: _Core) -> Refusal:
        return self._refuse(scale_node or core.softmax.name, "scale-after-mask", f"{scale_node!r} scales the "
                            f"attention scores by {factor:g} after a mask or bias was applied; the op adds its bias "
                            "to the scaled scores, and scaling the bias instead is exact only for a power of two",
                            core.nodes)

    def _check_structure(self, g: Graph, core: _Core) -> Refusal | None:
        sm, qk, pv = core.softmax, core.qk, core.pv
        nodes = core.nodes
        q, kt = qk.input[0], qk.input[1]
        if g.is_constant(q) or g.is_constant(kt):
            return self._refuse(qk.name, "qk-structure", f"MatMul {qk.name!r} multiplies by a constant; it is a "
                                "projection, not Q·Kᵀ", nodes)
        if g.rank(q) != 4 or g.rank(kt) != 4:
            return self._refuse(qk.name, "qk-structure", f"MatMul {qk.name!r} has operands of rank {g.rank(q)} and "
                                f"{g.rank(kt)}; FusedAttention needs [B, H, S, D] heads", nodes)
        probs_in, v = (pv.input[1], pv.input[0]) if core.pv_transposed else (pv.input[0], pv.input[1])
        producer = g.producer_of(probs_in)
        if producer is None or producer.name not in set(nodes) or producer.name == pv.name:
            return self._refuse(pv.name, "pv-structure", f"MatMul {pv.name!r} takes the probabilities as its second "
                                "operand (V·P); attention multiplies P·V", nodes)
        if g.is_constant(v) or g.rank(v) != 4:
            return self._refuse(pv.name, "pv-structure", f"MatMul {pv.name!r} multiplies the probabilities by "
                                f"{'a constant' if g.is_constant(v) else f'a rank-{g.rank(v)} tensor'}; V must be "
                                "[B, H, S, D] activations", nodes)
        axis = attributes(sm).get("axis", -1)
        if axis not in (-1, 3):
            return self._refuse(sm.name, "softmax-axis", f"Softmax {sm.name!r} normalises over axis {axis}, not "
                                "the keys (last) axis", nodes)
        et = g.elem_type(q)
        cast = g.producer_of(v)
        pt = g.elem_type(probs_in)
        if et in _FLOAT_TYPES and g.elem_type(v) not in (et, TensorProto.UNDEFINED) and cast is not None and \
                cast.op_type == "Cast" and g.elem_type(cast.input[0]) == et and g.elem_type(v) == pt and \
                pt in _FLOAT_TYPES and len(g.consumers_of(v)) == 1 and v not in g.graph_outputs and \
                g.rank(cast.input[0]) == 4:
            # P·Cast(V) in the probabilities' (wider) type: the op reads V as it is and casts it up itself
            core.v_cast = cast.name
            core.nodes.append(cast.name)
            v = cast.input[0]
        if et not in _FLOAT_TYPES or g.elem_type(v) not in (et, TensorProto.UNDEFINED):
            return self._refuse(pv.name, "mixed-dtypes", f"Q ({et}) and V ({g.elem_type(v)}) of {pv.name!r} do "
                                "not share one float type", nodes)
        core.softmax_type = g.elem_type(sm.input[0]) or et
        return None

    # ---- choosing how far to absorb ------------------------------------------------------------------------
    def _settle(self, g: Graph, dims: Dims, core: _Core, sides: dict[str, list[_Stage]]
                ) -> tuple[dict[str, int], set[str], dict[str, Any]] | Refusal:
        """The outermost stage per side whose absorbed values are used by nothing outside (after absorbing
        shape-only side computations that feed back in), with K and V repeated alike and head counts known."""
        idx = {role: len(stages) - 1 for role, stages in sides.items()}
        out_value = lambda: sides["out"][idx["out"]].value  # noqa: E731
        for _ in range(64):
            owner: dict[str, tuple[str, int] | None] = {n: None for n in core.nodes}
            for n in sides["k"][0].nodes:
                owner[n] = None
            for role, stages in sides.items():
                for i in range(1, idx[role] + 1):
                    for n in stages[i].nodes:
                        owner.setdefault(n, (role, i))
            heads = self._heads(dims, sides, idx)
            if isinstance(heads, tuple):   # a side to cut back: (role, index)
                role, i = heads
                idx[role] = i
                continue
            members = set(owner)
            # the values the fused node reads must still be produced outside it
            fused_inputs = {sides[r][idx[r]].value for r in ("q", "k", "v")} | \
                {m for m in [t for t, _ in core.add_terms] + [core.where[0] if core.where else None] if m}
            closure: set[str] = set()
            cut: tuple[str, int] | None = None
            final = out_value()
            for name in sorted(members, key=lambda n: g.topo_index[n]):
                for o in g.node(name).output:
                    if not o or o == final:
                        continue
                    if o in g.graph_outputs or any(c.name not in members and c.name not in closure
                                                   for c in g.consumers_of(o)):
                        extra = shape_closure(g, o, members | closure, fused_inputs)
                        if extra is None:
                            who = owner[name]
                            if who is None:
                                return self._refuse(name, "shared-intermediate", f"attention intermediate {o!r} "
                                                    f"(from {name!r}) is used outside the attention", core.nodes)
                            cut = (who[0], who[1] - 1)
                            break
                        closure |= extra
                if cut is not None:
                    break
            if cut is not None:
                idx[cut[0]] = min(idx[cut[0]], cut[1])
                continue
            return idx, closure, heads
        return self._refuse(core.softmax.name, "shared-intermediate", "could not settle the attention boundary",
                            core.nodes)

    def _heads(self, dims: Dims, sides: dict[str, list[_Stage]], idx: dict[str, int]
               ) -> dict[str, Any] | tuple[str, int]:
        """num_heads, kv_num_heads and kv_repeat for the chosen stages, or a (side, index) to cut back to."""
        def rep_index(role: str) -> int | None:
            return next((i for i in range(1, idx[role] + 1) if sides[role][i].rep), None)

        rk, rv = rep_index("k"), rep_index("v")
        if (rk is None) != (rv is None):
            role = "k" if rk is not None else "v"
            return role, (rk if rk is not None else rv) - 1
        q = sides["q"][idx["q"]]
        num_heads = q.heads or dims.int_value(dims.sym("H")) or 0
        if not num_heads and rk is None:  # no repeat: K and V carry H heads too
            num_heads = next((sides[r][idx[r]].heads for r in ("k", "v") if sides[r][idx[r]].heads), 0)
        kv_heads = 0
        mode = "interleave"
        if rk is not None:
            n_k, mode_k = sides["k"][rk].rep
            n_v, mode_v = sides["v"][rv].rep
            if (n_k, mode_k) != (n_v, mode_v) or not num_heads or num_heads % n_k:
                return ("k", rk - 1) if idx["k"] >= rk else ("v", rv - 1)
            kv_heads, mode = num_heads // n_k, mode_k
        else:
            k = sides["k"][idx["k"]]
            given = k.heads or (dims.int_value(dims.key(k.value, k.perm[1] if k.perm else 1))
                                if k.layout == "BNSD" else None)
            if given == 1 and num_heads != 1:
                kv_heads = 1  # one K/V head that the MatMuls broadcast over the query heads (MQA)
        for role in ("k", "v"):
            s = sides[role][idx[role]]
            if s.layout == "BSH" and s.heads != (kv_heads or num_heads):
                return role, idx[role] - 1
        return {"num_heads": int(num_heads), "kv_num_heads": int(kv_heads or num_heads), "mode": mode}

    # ---- masks -------------------------------------------------------------------------------------------
    def _check_masks(self, g: Graph, dims: Dims, core: _Core) -> Refusal | None:
        # several terms become one bias, summed outside the op: they must share a type (one added before a Cast
        # up and one after it would be an ill-typed Add, or a sum rounded where the model did not round)
        term_types = {t: g.elem_type(t) for t, _ in core.add_terms if g.elem_type(t)}
        if len(set(term_types.values())) > 1:
            names = ", ".join(f"{t!r} ({TensorProto.DataType.Name(et).lower()})" for t, et in term_types.items())
            return self._refuse(core.softmax.name, "mixed-dtypes", f"the additive terms on the scores have different "
                                f"float types ({names}); they cannot be summed into one bias", core.nodes)
        target = [dims.sym(s) for s in ("B", "H", "Sq", "Sk")]
        checks = [("additive mask or bias", t) for t, _ in core.add_terms] + \
            [("boolean mask", core.where[0] if core.where else None)]
        for role, m in checks:
            if m is None:
                continue
            shape = g.shape(m)
            if shape is None and g.is_constant(m) and g.constant(m) is not None:
                shape = tuple(g.constant(m).shape)
            if shape is None:
                continue
            if len(shape) > 4:
                return self._refuse(g.producer_of(m).name if g.producer_of(m) else m, "mask-shape",
                                    f"the attention {role} {m!r} has rank {len(shape)}; it must broadcast to "
                                    "[B, H, Sq, Sk]", core.nodes)
            for j, d in enumerate(shape):
                want = target[4 - len(shape) + j]
                want_int = dims.int_value(want)
                if d == 1 or dims.same(dims.key(m, j), want):
                    continue
                if isinstance(d, int) and want_int is not None and d != want_int:
                    axis = ("B", "H", "Sq", "Sk")[4 - len(shape) + j]
                    return self._refuse(g.producer_of(m).name if g.producer_of(m) else m, "mask-shape",
                                        f"the attention {role} {m!r} has shape {list(shape)}: dim {j} is {d}, "
                                        f"not 1 or {axis}={want_int}", core.nodes)
        return None

    def _causal(self, g: Graph, core: _Core) -> bool:
        """True if the Where's condition is the constant causal triangle (aligned to the last key)."""
        if core.where is None or not g.is_constant(core.where[0]):
            return False
        cond = g.constant(core.where[0])
        if cond is None or cond.ndim < 2 or cond.ndim > 4 or any(d != 1 for d in cond.shape[:-2]):
            return False
        keep = cond.astype(bool) if core.where[2] == "keep" else ~cond.astype(bool)
        sq, sk = keep.shape[-2:]
        return bool(np.array_equal(keep.reshape(sq, sk), causal_keep(sq, sk)))

    # ---- the match -----------------------------------------------------------------------------------------
    def _make_match(self, g: Graph, dims: Dims, core: _Core, sides: dict[str, list[_Stage]], idx: dict[str, int],
                    closure: set[str], heads: dict[str, int]) -> Match:
        chosen = {role: sides[role][idx[role]] for role in sides}
        nodes = set(core.nodes) | set(closure)
        scale = core.scale
        for role, stages in sides.items():
            for s in stages[: idx[role] + 1]:
                nodes.update(s.nodes)
                scale *= s.scale
        ordered = tuple(sorted(nodes, key=lambda n: g.topo_index[n]))
        causal = self._causal(g, core)
        et = g.elem_type(chosen["q"].value) or g.elem_type(core.qk.input[0])
        # values the rewrite computes outside the fused op: K transposed to [B, H, S, D], the bias terms summed
        pre: list[tuple[str, list[str], dict[str, Any]]] = []    # (op, inputs, attrs); output named at build
        k_in = chosen["k"].value
        if chosen["k"].perm:
            pre.append(("Transpose", [k_in], {"perm": list(chosen["k"].perm)}))
            k_in = f"@pre{len(pre) - 1}"
        v_in = chosen["v"].value
        if chosen["v"].perm:   # V'·Pᵀ: V = V'ᵀ
            pre.append(("Transpose", [v_in], {"perm": list(chosen["v"].perm), "@role": "value"}))
            v_in = f"@pre{len(pre) - 1}"
        mask_in = ""
        for term, factor in core.add_terms:
            if factor != 1.0:
                dt = g.elem_type(term) or core.softmax_type or et
                pre.append(("Mul", [term, f"@const:{factor!r}:{dt}"], {}))
                term = f"@pre{len(pre) - 1}"
            if mask_in:
                pre.append(("Add", [mask_in, term], {}))
                term = f"@pre{len(pre) - 1}"
            mask_in = term
        bool_in = core.where[0] if core.where is not None and not causal else ""
        inputs = [chosen["q"].value, k_in, v_in, mask_in, bool_in, core.sink.sinks if core.sink else ""]
        while inputs and not inputs[-1]:
            inputs.pop()
        attrs: dict[str, Any] = {
            "scale": float(scale), "causal": int(causal), "num_heads": heads["num_heads"],
            "kv_num_heads": heads["kv_num_heads"], "q_layout": chosen["q"].layout, "k_layout": chosen["k"].layout,
            "v_layout": chosen["v"].layout, "out_layout": chosen["out"].layout, "nan_guard": int(core.nan_guard),
        }
        if heads["kv_num_heads"] != heads["num_heads"]:
            attrs["kv_repeat"] = heads["mode"]
        if core.mask_order:
            attrs["mask_order"] = ",".join(core.mask_order)
        if core.where is not None:
            attrs["mask_fill"] = float(core.where[1])
            if not causal:
                attrs["bool_mask_mode"] = core.where[2]
        if core.softmax_type not in (et, TensorProto.UNDEFINED):
            attrs["softmax_dtype"] = int(core.softmax_type)
        if core.v_cast:
            attrs["out_dtype"] = int(g.elem_type(core.pv.output[0]))
        if core.sink is not None:
            attrs["sinks"] = 1
        if core.softcap is not None:
            # a * tanh(b * Q·Kᵀ) is softcap * tanh(scale * Q·Kᵀ / softcap) with softcap |a|, scale a * b
            attrs["softcap"] = abs(float(core.softcap))
            attrs["scale"] = float(scale) * float(core.softcap)
        sq = _static_seq(g, dims, "Sq", sides["q"] + sides["out"])
        sk = _static_seq(g, dims, "Sk", sides["k"] + sides["v"])
        decode = sq == 1 and sk != 1     # the kernel mapping's test too: a query of length 1 is a decode step
        cached = all(_kv_cache_concat(g, chosen[r].value, chosen[r].layout) and not chosen[r].perm
                     for r in ("k", "v"))
        tags = [t for t, on in (("gqa", heads["kv_num_heads"] != heads["num_heads"]), ("softcap", bool(core.softcap)),
                                ("sinks", core.sink is not None),
                                ("causal", causal),
                                ("mask", bool(mask_in or bool_in)), ("bias", len(core.add_terms) > 1),
                                ("decode", decode),
                                ("prefill", cached and sq is not None and sq > 1),
                                ("kvcache", cached and sq is None)) if on]
        kind = "FusedAttention" + (f"[{','.join(tags)}]" if tags else "")
        return Match(self.name, ordered, g.boundary_inputs(ordered), (chosen["out"].value,), kind,
                     info={"inputs": inputs, "attrs": attrs, "elem_type": et, "name": core.softmax.name,
                           "pre": pre, "out_transposed": bool(core.pv_transposed)})

    # ---- build ---------------------------------------------------------------------------------------------
    def build(self, g: Graph, m: Match) -> Replacement:
        taken: set[str] = set()
        name = m.info["name"]
        made: list[str] = []
        nodes: list[onnx.NodeProto] = []
        inits: list[onnx.TensorProto] = []

        def resolve(v: str) -> str:
            if v.startswith("@pre"):
                return made[int(v[4:])]
            if v.startswith("@const:"):
                _, value, dt = v.split(":")
                c = unique_name(g, f"{name}.bias_scale", taken)
                inits.append(numpy_helper.from_array(
                    np.array(float(value), dtype=helper.tensor_dtype_to_np_dtype(int(dt))), c))
                return c
            return v

        for i, (op, ins, attrs) in enumerate(m.info.get("pre", ())):
            attrs = dict(attrs)
            role = attrs.pop("@role", "key" if op == "Transpose" else "bias")
            out = unique_name(g, f"{name}.{role}", taken)
            nodes.append(helper.make_node(op, [resolve(x) for x in ins], [out],
                                          name=unique_name(g, f"{name}.{role}_{op.lower()}{i}", taken), **attrs))
            made.append(out)
        outputs = list(m.outputs)
        post: list[onnx.NodeProto] = []
        if m.info.get("out_transposed"):   # V'·Pᵀ is (P·V)ᵀ: the op writes P·V, a Transpose writes the MatMul's value
            pv = unique_name(g, f"{name}.pv", taken)
            post.append(helper.make_node("Transpose", [pv], outputs[:1], perm=[0, 1, 3, 2],
                                         name=unique_name(g, f"{name}.out_transpose", taken)))
            outputs = [pv]
        node, fn = FUSED_ATTENTION.make_node([resolve(x) for x in m.info["inputs"]], outputs, name,
                                             m.info["attrs"], g.opset.get("", 1), m.info["elem_type"])
        return Replacement(nodes + [node] + post, inits, [fn] if fn is not None else [], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})


# ---- matcher helpers -------------------------------------------------------------------------------------


# ---- is a Softmax attention at all? ---------------------------------------------------------------------


