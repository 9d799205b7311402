"""The mixture-of-experts router: Softmax over the router logits -> TopK [-> w / sum(w)], or TopK over the logits
-> Softmax over the k  =>  npufuse.MoeGatingTopKSoftmax.

A router scores each token against E experts and keeps the k best (transformers' Mixtral, Qwen2/3-MoE, OLMoE, ...):
    probs = softmax(logits, axis=-1); weights, experts = topk(probs, k); [weights /= weights.sum(-1, keepdim=True)]
Both exporters write it as Softmax(axis -1) -> TopK(k constant, axis -1, largest, sorted) [-> ReduceSum(axes -1,
keepdims) -> Div]: TorchScript at opset 17 with k a Constant, dynamo at opset 18+ with k an initializer. The
renormalisation (Mixtral always; Qwen2-MoE and OLMoE with norm_topk_prob) is absorbed where the top-k weights feed
nothing else. One kernel computes it on Ascend: MoeGatingTopKSoftmax (softmax, then the top k), and
MoeGatingTopKSoftmaxV2 with renorm=1 (the top k of the logits, then a softmax over those k: the same weights
p_i / sum_topk p_j).

The other order: GPT-OSS, Aria, Cohere2-MoE route by `values, experts = topk(logits, k); weights = softmax(values)`,
written TopK(axis -1) -> Softmax(axis -1) over the k. That is its own computation (the experts ranked by their
logits, the softmax over k values only), fused with `topk_first=1`: MoeGatingTopKSoftmaxV2's renorm=1 is exactly it.

Precision: fp16 models compute the router in float32 (`softmax(logits.float())`, `softmax(.., dtype=float)`): the
exporters write Cast(fp16 -> fp32) before the Softmax and, for Qwen2-MoE, Cast(fp32 -> fp16) after the weights.
Those Casts stay outside the fused op, which computes in the type of its input (float32 there): what the model does.

Refusals (near-misses naming the Softmax, so no router is left without a reason): `softmax-axis` (not over the last
axis alone), `probs-read-elsewhere` (the probabilities are read by more than the TopK, or are a graph output: the
fused op gives only the top k), `topk-axis`, `topk-smallest` (largest=0), `topk-unsorted` (sorted=0: the kernel
writes them sorted), `k-not-constant`, in the TopK-first order `values-read-elsewhere` (the top-k logits read besides
the Softmax: the fused op gives only the weights), and `sigmoid-scores` for a TopK over sigmoid scores (DeepSeek-style routers,
with or without a correction bias; Ascend's MoeGatingTopK computes those, with expert groups: not fused yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph, attributes, np_dtype
from npufuse.ir.matching import STD_DOMAINS, MatchRefused, escaping_intermediate, std_op
from npufuse.patterns.base import FusedOpDef, Pattern, make_body, unique_name

K_INPUT_OPSET = 10          # TopK's k is an int64 input from opset 10 (an attribute before); largest/sorted from 11
TOPK_FLAGS_OPSET = 11
REDUCE_AXES_INPUT_OPSET = 13    # ReduceSum's axes are an input from opset 13 (an attribute before)
SOFTMAX_LAST_AXIS_OPSET = 13    # Softmax's default axis: 1 before 13 (the input coerced to 2-D), -1 from 13
_SIGMOID_WALK = 4           # steps from a TopK up to the Sigmoid of a sigmoid router (Add bias, Reshape, Where, Cast)


# ---- the fused op ----------------------------------------------------------------------------------------------

def moe_gating_topk_first_reference(x: np.ndarray, k: int) -> list[np.ndarray]:
    """(weights, experts) of the TopK-first router: the k largest logits of the last axis (ties to the lower index,
    as ONNX TopK), the weights their softmax in float64, in x's dtype; experts int64."""
    experts = np.argsort(-x.astype(np.float64), axis=-1, kind="stable")[..., :k]
    top = np.take_along_axis(x.astype(np.float64), experts, axis=-1)
    e = np.exp(top - top.max(axis=-1, keepdims=True))
    return [(e / e.sum(axis=-1, keepdims=True)).astype(x.dtype), experts.astype(np.int64)]


def moe_gating_reference(x: np.ndarray, k: int, renormalize: bool) -> list[np.ndarray]:
    """(weights, experts) of softmax(x) over the last axis, top k, in float64: the experts ranked by their
    probability as x's type holds it (what the model's TopK compares), ties to the lower index as ONNX TopK breaks
    them; the weights the k probabilities, divided by their sum where `renormalize`; weights in x's dtype, experts
    int64."""
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    ranked = p.astype(x.dtype).astype(np.float64)
    experts = np.argsort(-ranked, axis=-1, kind="stable")[..., :k]
    w = np.take_along_axis(p, experts, axis=-1)
    if renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return [w.astype(x.dtype), experts.astype(np.int64)]


def _reference(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    x = inputs[0]
    assert x is not None
    if int(attrs.get("topk_first", 0)):
        return moe_gating_topk_first_reference(x, int(attrs["k"]))
    return moe_gating_reference(x, int(attrs["k"]), bool(int(attrs.get("renormalize", 0))))


def _const(name: str, arr: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(arr, name))


def _body(attrs: dict[str, Any], opset: int, elem_type: int) -> onnx.FunctionProto:
    """Standard ops of `opset` (>= 7): Softmax over the last axis (before 13 Softmax coerces its input to 2-D at
    `axis`, which for -1 is the last axis too), TopK (k an attribute before 10, an int64 input from 10; largest and
    sorted are the defaults), and for renormalize=1 ReduceSum (axes an attribute before 13) and Div. k and
    renormalize are baked into the overload."""
    k = int(attrs["k"])
    renorm = bool(int(attrs.get("renormalize", 0)))
    first = bool(int(attrs.get("topk_first", 0)))
    np_t = np_dtype(elem_type) or np.dtype(np.float32)
    values = "V" if renorm or first else "Y"
    selected = "X" if first else "P"
    nodes = [] if first else [helper.make_node("Softmax", ["X"], ["P"], axis=-1)]
    if opset < K_INPUT_OPSET:
        nodes.append(helper.make_node("TopK", [selected], [values, "Indices"], axis=-1, k=k))
    else:
        flags = {"largest": 1, "sorted": 1} if opset >= TOPK_FLAGS_OPSET else {}
        nodes += [_const("K", np.array([k], np.int64)),
                  helper.make_node("TopK", [selected, "K"], [values, "Indices"], axis=-1, **flags)]
    if first:   # the softmax over the k selected logits (before 13 over the 2-D coercion at the last axis: the same)
        nodes.append(helper.make_node("Softmax", ["V"], ["Y"], axis=-1))
        return make_body(FUSED_DOMAIN, "MoeGatingTopKSoftmax", ["X"], ["Y", "Indices"], nodes,
                         [helper.make_opsetid("", opset)], attributes=["k", "renormalize", "topk_first"],
                         overload=f"{np_t.name}_k{k}_topk_first",
                         doc_string="MoeGatingTopKSoftmax, TopK first: the k largest logits of the last axis and "
                                    "their indices, the weights a softmax over those k.")
    if renorm:
        if opset < REDUCE_AXES_INPUT_OPSET:
            nodes.append(helper.make_node("ReduceSum", ["V"], ["S"], axes=[-1], keepdims=1))
        else:
            nodes += [_const("Axes", np.array([-1], np.int64)),
                      helper.make_node("ReduceSum", ["V", "Axes"], ["S"], keepdims=1)]
        nodes.append(helper.make_node("Div", ["V", "S"], ["Y"]))
    overload = f"{np_t.name}_k{k}" + ("_renorm" if renorm else "")
    return make_body(FUSED_DOMAIN, "MoeGatingTopKSoftmax", ["X"], ["Y", "Indices"], nodes,
                     [helper.make_opsetid("", opset)], attributes=["k", "renormalize"], overload=overload,
                     doc_string="MoeGatingTopKSoftmax: softmax over the last axis, the k largest probabilities "
                                "and their indices" + (", the k weights divided by their sum." if renorm else "."))


MOE_GATING = FusedOpDef(
    op_type="MoeGatingTopKSoftmax",
    doc="P = softmax(X, axis=-1); (Y, Indices) = TopK(P, k, axis=-1, largest, sorted); with renormalize=1 "
        "Y = Y / sum(Y, axis=-1). With topk_first=1: (V, Indices) = TopK(X, k, axis=-1, largest, sorted); "
        "Y = softmax(V, axis=-1). X [.., E] router logits; Y [.., k] in X's type, Indices [.., k] int64 "
        "(Ascend's MoeGatingTopKSoftmax; MoeGatingTopKSoftmaxV2 renorm=1 for renormalize=1 and topk_first=1).",
    inputs=("X",), outputs=("Y", "Indices"), attributes=("k", "renormalize", "topk_first"),
    reference=_reference, body=_body,
)


# ---- matching --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    x: str                   # the router logits (the Softmax's input)
    out: str                 # the weights: the TopK's values, or the renormalisation's Div
    indices: str             # the TopK's indices ("" where the model omits them)
    nodes: tuple[str, ...]
    k: int
    renormalize: bool
    elem_type: int
    topk_first: bool = False


def _is_last_axis(axis: int, rank: int | None) -> bool:
    return axis == -1 or (rank is not None and axis == rank - 1)


def _ints(g: Graph, v: str) -> list[int] | None:
    arr = g.constant(v) if v else None
    return None if arr is None else [int(a) for a in np.asarray(arr).ravel()]


def _check_topk(topk: onnx.NodeProto, rank: int | None, scores: str, last: str) -> None:
    """The TopK the gating kernel is: over the last axis (`last`: what it holds), the largest, sorted; raises the
    near-miss otherwise. `scores`: what it selects from (probabilities, logits)."""
    a = attributes(topk)
    if not _is_last_axis(int(a.get("axis", -1)), rank):
        raise MatchRefused(topk.name, "topk-axis", f"TopK {topk.name!r} selects along axis {a.get('axis')}, not "
                           f"the last ({last})")
    if int(a.get("largest", 1)) != 1:
        raise MatchRefused(topk.name, "topk-smallest", f"TopK {topk.name!r} takes the k smallest {scores} "
                           "(largest=0); the gating kernel takes the largest")
    if int(a.get("sorted", 1)) != 1:
        raise MatchRefused(topk.name, "topk-unsorted", f"TopK {topk.name!r} leaves its k values unsorted "
                           "(sorted=0): their order is the exporter's choice; the gating kernel sorts them")


class MoeGatingPattern(Pattern):
    name = "moe_gating"
    description = ("a router's Softmax over the last axis -> TopK (k constant) [-> ReduceSum/Div renormalisation], "
                   "or TopK over the logits -> Softmax over the k, into npufuse.MoeGatingTopKSoftmax")
    anchor_ops = frozenset({"TopK"})
    phase = 0
    fused_ops = (MOE_GATING,)

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if node.domain not in STD_DOMAINS or not node.input or not node.output or not node.output[0]:
            return None
        softmax = g.producer_of(node.input[0])
        after = g.consumers_of(node.output[0])
        try:
            if std_op(softmax, "Softmax"):
                assert softmax is not None
                plan = self._plan(g, softmax, node)
            elif any(std_op(c, "Softmax") for c in after):
                softmax = next(c for c in after if std_op(c, "Softmax"))
                plan = self._plan_topk_first(g, node, softmax)
            else:
                return self._sigmoid_router(g, node)
        except MatchRefused as why:
            return Refusal(self.name, why.node, why.reason, why.detail, (softmax.name, node.name))
        outputs = (plan.out,) + ((plan.indices,) if plan.indices else ())
        esc = escaping_intermediate(g, plan.nodes, outputs)
        if esc is not None:
            return Refusal(self.name, esc[1], esc[0], f"router at {node.name!r}: {esc[2]}", plan.nodes)
        ordered = tuple(sorted(plan.nodes, key=lambda n: g.topo_index[n]))
        kind = "npufuse.MoeGatingTopKSoftmax" + ("[topk_first]" if plan.topk_first else
                                                 "[renorm]" if plan.renormalize else "")
        return Match(self.name, ordered, g.boundary_inputs(ordered), outputs, kind,
                     info={"plan": plan, "anchor": node.name})

    def _plan(self, g: Graph, softmax: onnx.NodeProto, topk: onnx.NodeProto) -> _Plan:
        opset = g.opset.get("", 1)
        x, probs = softmax.input[0], softmax.output[0]
        rank = g.rank(x)
        axis = int(attributes(softmax).get("axis", -1 if opset >= SOFTMAX_LAST_AXIS_OPSET else 1))
        if not _is_last_axis(axis, rank):
            raise MatchRefused(softmax.name, "softmax-axis", f"Softmax {softmax.name!r} normalises over axis {axis} of "
                               f"a rank-{rank if rank is not None else '?'} tensor, not over the last axis (the "
                               "experts) alone")
        if probs in g.graph_outputs or len(g.consumers_of(probs)) != 1:
            others = [c.name for c in g.consumers_of(probs) if c is not topk]
            where = f"read by {others[0]!r}" if others else "a graph output"
            raise MatchRefused(softmax.name, "probs-read-elsewhere", f"the router probabilities of {softmax.name!r} "
                               f"are {where} besides TopK {topk.name!r}; MoeGatingTopKSoftmax gives only the top k")
        _check_topk(topk, rank, "probabilities", "the experts Softmax normalised")
        k = self._k(g, topk, opset)
        out, extra, renorm = self._renormalisation(g, topk.output[0], rank)
        indices = topk.output[1] if len(topk.output) > 1 else ""
        return _Plan(x, out, indices, (softmax.name, topk.name, *extra), k, renorm, g.elem_type(x))

    def _plan_topk_first(self, g: Graph, topk: onnx.NodeProto, softmax: onnx.NodeProto) -> _Plan:
        """TopK(logits, k) -> Softmax over the k values: the experts by their logits, the weights a softmax of
        those k (GPT-OSS, Aria, Cohere2-MoE)."""
        opset = g.opset.get("", 1)
        x, values = topk.input[0], topk.output[0]
        rank = g.rank(x)
        _check_topk(topk, rank, "logits", "the experts")
        axis = int(attributes(softmax).get("axis", -1 if opset >= SOFTMAX_LAST_AXIS_OPSET else 1))
        if not _is_last_axis(axis, rank):
            raise MatchRefused(softmax.name, "softmax-axis", f"Softmax {softmax.name!r} normalises the top-k "
                               f"logits over axis {axis}, not over the k of each token")
        if values in g.graph_outputs or len(g.consumers_of(values)) != 1:
            others = [c.name for c in g.consumers_of(values) if c is not softmax]
            where = f"read by {others[0]!r}" if others else "a graph output"
            raise MatchRefused(softmax.name, "values-read-elsewhere", f"the top-k logits of TopK {topk.name!r} are "
                               f"{where} besides Softmax {softmax.name!r}; MoeGatingTopKSoftmax gives only the "
                               "weights")
        k = self._k(g, topk, opset)
        indices = topk.output[1] if len(topk.output) > 1 else ""
        return _Plan(x, softmax.output[0], indices, (topk.name, softmax.name), k, False, g.elem_type(x),
                     topk_first=True)

    @staticmethod
    def _k(g: Graph, topk: onnx.NodeProto, opset: int) -> int:
        if opset < K_INPUT_OPSET:
            return int(attributes(topk).get("k", 0))
        ks = _ints(g, topk.input[1]) if len(topk.input) > 1 else None
        if ks is None or len(ks) != 1 or ks[0] < 1:
            raise MatchRefused(topk.name, "k-not-constant", f"TopK {topk.name!r}: k "
                               f"({topk.input[1] if len(topk.input) > 1 else 'missing'!r}) is not a constant >= 1: "
                               "the gating kernel takes k as an attribute")
        return ks[0]

    @staticmethod
    def _renormalisation(g: Graph, values: str, rank: int | None) -> tuple[str, tuple[str, ...], bool]:
        """(weights, nodes, renormalised): the Div of w / ReduceSum(w, last axis, keepdims) where those two nodes
        are all that read the top-k values `values`; else the values themselves (any renormalisation stays out)."""
        readers = g.consumers_of(values)
        if values in g.graph_outputs or len(readers) != 2:
            return values, (), False
        red = next((c for c in readers if std_op(c, "ReduceSum")), None)
        div = next((c for c in readers if std_op(c, "Div")), None)
        if red is None or div is None or red.input[0] != values or list(div.input) != [values, red.output[0]]:
            return values, (), False
        a = attributes(red)
        axes = a.get("axes") if "axes" in a else (_ints(g, red.input[1]) if len(red.input) > 1 and red.input[1]
                                                   else None)
        if int(a.get("keepdims", 1)) != 1 or axes is None or len(axes) != 1 or not _is_last_axis(int(axes[0]), rank):
            return values, (), False
        if g.single_consumer(red.output[0]) is not div:
            return values, (), False
        return div.output[0], (red.name, div.name), True

    def _sigmoid_router(self, g: Graph, topk: onnx.NodeProto) -> Refusal | None:
        """A TopK over sigmoid scores (through a correction-bias Add, Reshape, Where, Cast): a DeepSeek-style router,
        named so that its Sigmoid is accounted for."""
        chain = [topk.name]
        v = topk.input[0]
        for _ in range(_SIGMOID_WALK):
            p = g.producer_of(v)
            if p is None or p.domain not in STD_DOMAINS:
                return None
            if p.op_type == "Sigmoid":
                chain.append(p.name)
                return Refusal(self.name, p.name, "sigmoid-scores", f"TopK {topk.name!r} selects experts by sigmoid "
                               f"scores ({p.name!r}), a DeepSeek-style router: Ascend's MoeGatingTopK computes those "
                               "(with its correction bias and expert groups); npufuse.MoeGatingTopKSoftmax is softmax "
                               "routing only", tuple(chain))
            if p.op_type in ("Reshape", "Cast"):
                dynamic = [p.input[0]]
            elif p.op_type in ("Add", "Where"):      # a constant bias added; a mask's constant fill
                operands = p.input[:2] if p.op_type == "Add" else p.input[1:3]
                dynamic = [i for i in operands if i and not g.is_constant(i)]
            else:
                return None
            if len(dynamic) != 1:
                return None
            chain.append(p.name)
            v = dynamic[0]
        return None

    def build(self, g: Graph, m: Match) -> Replacement:
        plan: _Plan = m.info["plan"]
        indices = plan.indices or unique_name(g, f"{m.info['anchor']}.indices", set())
        attrs = {"k": plan.k, "renormalize": int(plan.renormalize)}
        if plan.topk_first:
            attrs["topk_first"] = 1
        node, fn = MOE_GATING.make_node([plan.x], [plan.out, indices], m.info["anchor"], attrs, g.opset.get("", 1),
                                        plan.elem_type)
        return Replacement([node], [], [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})
