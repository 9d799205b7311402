"""Decomposed LayerNorm and RMSNorm  =>  one normalisation op over the last axis.

LayerNorm, in the forms the exporters and hand-written models produce:
    m = ReduceMean(x); d = x - m; v = ReduceMean(d*d | Pow(d, 2)); ve = v + eps
    n = d / Sqrt(ve)  |  d * Reciprocal(Sqrt(ve))  |  d * (1 / Sqrt(ve))  |  d * Pow(ve, -0.5)
    y = n [* gamma] [+ beta]
and the TF / onnxruntime-doc forms with gamma folded into the inverse std first (g = gamma * rsqrt(ve)):
    y = d * g [+ beta]        y = x*g - m*g [+ beta]        y = x*g + (beta - m*g)
RMSNorm:  n = x / Sqrt(mean(x*x) + eps)  |  x * Reciprocal(Sqrt(...))  |  x * (1 / Sqrt(...));  y = n [* gamma].

Mixed precision. An up-Cast (T -> float32) on x (HF's `x.float()`) or on d (TorchScript's fp16 LayerNorm)
and a down-Cast back to T right after the normalisation, with gamma/beta applied in T, is exactly the
`stash_type` semantics of ONNX's LayerNormalization/RMSNormalization: compute in float32, cast the
normalised value back, then scale and shift in T. Such a pair is absorbed and the fused op gets the
compute type as `stash_type`. (TorchScript's fp16 form computes the mean in T and only the variance in
float32; the fused op computes the mean in float32 too: more precise, never less.) Any other real Cast stays
outside the fused node and only the float32 core is fused, so the fused op always computes in the
precision the original did. Casts to the type a value already has are no-ops and are simply absorbed.

Emitted: LayerNormalization (opset >= 17) else npufuse.LayerNorm; RMSNormalization (opset >= 23;
onnxruntime 1.31 runs it) else npufuse.RMSNorm. The reduction is over the last axis only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.patterns import kernels
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph, attributes, np_dtype
from npufuse.patterns.kernels import optional
from npufuse.patterns.base import FusedOpDef, Pattern, float_attr_constant, make_body, overload_with, unique_name
from npufuse.ir.matching import (
    STD_DOMAINS,
    MatchRefused,
    escaping_intermediate,
    near,
    other_operand,
    reader,
    sole_consumer,
    std_op,
)


def _is_noop_cast(g: Graph, node: onnx.NodeProto) -> bool:
    src = g.elem_type(node.input[0])
    return src != TensorProto.UNDEFINED and attributes(node).get("to") == src


def _cast_to(node: onnx.NodeProto) -> int:
    return int(attributes(node).get("to", TensorProto.UNDEFINED))


# ---- the parsed chain -----------------------------------------------------------------------------------

@dataclass
class _Norm:
    """A normalisation chain as far as it was matched."""

    kind: str                              # "layernorm" | "rmsnorm"
    x: str                                 # the value the statistics are taken of
    nodes: list[str]
    reduces: list[onnx.NodeProto]          # the ReduceMean nodes (axis checks)
    eps_node: onnx.NodeProto
    eps_value: str
    pows: list[tuple[onnx.NodeProto, float]] = field(default_factory=list)   # Pow nodes and required exponents
    normalized: str | None = None          # value of (x - mean) * rsqrt(var + eps), before any affine
    gamma: str | None = None               # constant operand of the scale Mul, where already matched
    beta: str | None = None
    out: str | None = None                 # last value matched where gamma/beta were folded in the core
    center_cast: onnx.NodeProto | None = None   # up-Cast on d (TorchScript fp16 LayerNorm)
    x_readers: list[onnx.NodeProto] = field(default_factory=list)   # nodes in the set reading x


def _inverse_std(g: Graph, ve: str, nodes: list[str], pows: list) -> tuple[str, str] | None:
    """From var + eps: ("std", Sqrt output) or ("inv", 1/sqrt output), recording the nodes."""
    c = reader(g, ve, "Sqrt", "Pow")
    if std_op(c, "Sqrt"):
        nodes.append(c.name)
        s = c.output[0]
        for c2 in g.consumers_of(s):
            if std_op(c2, "Reciprocal") or (std_op(c2, "Div") and c2.input[1] == s and g.is_constant(c2.input[0])
                                            and near(g.scalar(c2.input[0]), 1.0)):
                nodes.append(c2.name)
                return "inv", c2.output[0]
        return "std", s
    if std_op(c, "Pow") and c.input[0] == ve and g.is_constant(c.input[1]):
        nodes.append(c.name)
        pows.append((c, -0.5))
        return "inv", c.output[0]
    return None


def _normalize_step(g: Graph, value: str, kind: str, s: str, nodes: list[str]) -> onnx.NodeProto | None:
    """The node computing value / std (kind "std") or value * inv (kind "inv") among value's consumers."""
    for c in g.consumers_of(value):
        if kind == "std" and std_op(c, "Div") and list(c.input) == [value, s]:
            nodes.append(c.name)
            return c
        if kind == "inv" and std_op(c, "Mul") and other_operand(c, value) == s and s != value:
            nodes.append(c.name)
            return c
    return None


def _square_of(g: Graph, sq: str) -> tuple[str, onnx.NodeProto, bool] | None:
    """(base, node, is_pow) if `sq` is Pow(base, c) or Mul(base, base)."""
    p = g.producer_of(sq)
    if std_op(p, "Pow") and g.is_constant(p.input[1]) and not g.is_constant(p.input[0]):
        return p.input[0], p, True
    if std_op(p, "Mul") and p.input[0] == p.input[1] and not g.is_constant(p.input[0]):
        return p.input[0], p, False
    return None


def _is_centered(g: Graph, v: str) -> bool:
    """True if `v` is x - ReduceMean(x) (possibly through a Cast): a LayerNorm's business, not RMSNorm's."""
    p = g.producer_of(v)
    if std_op(p, "Cast"):
        p = g.producer_of(p.input[0])
    if not std_op(p, "Sub"):
        return False
    m = g.producer_of(p.input[1])
    return std_op(m, "ReduceMean") and m.input[0] == p.input[0]


def _variance_chain(g: Graph, sq: str, nodes: list[str], reduces: list, pows: list
                    ) -> tuple[onnx.NodeProto, str, str, str] | None:
    """sq -> ReduceMean -> Add(eps) -> inverse std. Returns (eps node, eps value, kind, std-or-inv value)."""
    rm = reader(g, sq, "ReduceMean")
    if rm is None:
        return None
    nodes.append(rm.name)
    reduces.append(rm)
    return _eps_and_std(g, rm, nodes, pows)


def _eps_and_std(g: Graph, rm: onnx.NodeProto, nodes: list[str], pows: list
                 ) -> tuple[onnx.NodeProto, str, str, str] | None:
    add = reader(g, rm.output[0], "Add")
    if add is None:
        return None
    eps = other_operand(add, rm.output[0])
    if eps is None or eps == rm.output[0]:
        return None
    nodes.append(add.name)
    inv = _inverse_std(g, add.output[0], nodes, pows)
    if inv is None:
        return None
    return add, eps, inv[0], inv[1]


def _parse_layernorm(g: Graph, rm: onnx.NodeProto) -> _Norm | None:
    """Structure only (no value checks): a LayerNorm whose mean is the ReduceMean `rm`."""
    if not rm.input or not rm.output:
        return None
    x, mean = rm.input[0], rm.output[0]
    sub = next((c for c in g.consumers_of(mean) if std_op(c, "Sub") and list(c.input) == [x, mean]), None)
    if sub is None:
        return None
    nodes, reduces, pows = [rm.name, sub.name], [rm], []
    d = sub.output[0]
    center_cast = sole_consumer(g, d, "Cast")
    if center_cast is not None:
        nodes.append(center_cast.name)
        d = center_cast.output[0]
    sq_node = next((c for c in g.consumers_of(d) if (std_op(c, "Pow") and c.input[0] == d)
                    or (std_op(c, "Mul") and list(c.input) == [d, d])), None)
    if sq_node is None:
        raise MatchRefused(sub.name, "incomplete-chain", f"LayerNorm at {rm.name!r}: the centred value {d!r} is "
                           "never squared (no Pow(d, 2) or d*d reads it)")
    nodes.append(sq_node.name)
    if sq_node.op_type == "Pow":
        if not g.is_constant(sq_node.input[1]):
            raise MatchRefused(sq_node.name, "pow-exponent", f"LayerNorm at {rm.name!r}: the exponent of Pow "
                               f"{sq_node.name!r} is not a constant")
        pows.append((sq_node, 2.0))
    var = _variance_chain(g, sq_node.output[0], nodes, reduces, pows)
    if var is None:
        raise MatchRefused(g.node(nodes[-1]).name, "incomplete-chain", f"LayerNorm at {rm.name!r}: after "
                           f"{nodes[-1]!r} no ReduceMean -> Add(eps) -> Sqrt / Pow(-0.5) variance chain follows")
    eps_node, eps, kind, s = var
    norm = _Norm("layernorm", x, nodes, reduces, eps_node, eps, pows, center_cast=center_cast,
                 x_readers=[rm, sub])
    n = _normalize_step(g, d, kind, s, nodes)
    if n is not None:
        norm.normalized = n.output[0]
        return norm
    if kind != "inv":
        raise MatchRefused(g.node(nodes[-1]).name, "incomplete-chain", f"LayerNorm at {rm.name!r}: nothing divides "
                           f"the centred value {d!r} by the standard deviation {s!r}")
    # gamma folded into the inverse std: g = inv * gamma
    gm = reader(g, s, "Mul")
    gamma = other_operand(gm, s) if gm is not None else None
    if gamma is None or gamma == s or not g.is_constant(gamma) or center_cast is not None:
        raise MatchRefused(g.node(nodes[-1]).name, "incomplete-chain", f"LayerNorm at {rm.name!r}: the inverse "
                           f"standard deviation {s!r} neither multiplies the centred value nor a constant gamma")
    nodes.append(gm.name)
    norm.gamma = gamma
    ginv = gm.output[0]
    readers = g.consumers_of(ginv)
    if len(readers) == 1 and std_op(readers[0], "Mul") and other_operand(readers[0], ginv) == d:
        nodes.append(readers[0].name)                      # y = d * (gamma * inv)
        norm.out = readers[0].output[0]
        return _with_beta(g, norm)
    if len(readers) != 2 or not all(std_op(r, "Mul") for r in readers):
        raise MatchRefused(gm.name, "incomplete-chain", f"LayerNorm at {rm.name!r}: gamma * rstd {ginv!r} is not "
                           "applied as d * g or as x * g - mean * g")
    xg = next((r for r in readers if other_operand(r, ginv) == x), None)
    mg = next((r for r in readers if other_operand(r, ginv) == mean), None)
    if xg is None or mg is None or xg is mg:
        raise MatchRefused(gm.name, "incomplete-chain", f"LayerNorm at {rm.name!r}: gamma * rstd {ginv!r} is not "
                           "applied as x * g - mean * g")
    nodes.extend([xg.name, mg.name])
    norm.x_readers.append(xg)
    # x*g - m*g [+ beta]   or   x*g + (beta - m*g)
    c = reader(g, mg.output[0], "Sub")
    if std_op(c, "Sub") and list(c.input) == [xg.output[0], mg.output[0]]:
        nodes.append(c.name)
        norm.out = c.output[0]
        return _with_beta(g, norm)
    if std_op(c, "Sub") and c.input[1] == mg.output[0] and g.is_constant(c.input[0]):
        add = reader(g, c.output[0], "Add")
        if add is not None and other_operand(add, c.output[0]) == xg.output[0]:
            nodes.extend([c.name, add.name])
            norm.beta = c.input[0]
            norm.out = add.output[0]
            return norm
    raise MatchRefused(mg.name, "incomplete-chain", f"LayerNorm at {rm.name!r}: x * g and mean * g are not "
                       "combined as x*g - m*g [+ beta] or x*g + (beta - m*g)")


def _with_beta(g: Graph, norm: _Norm) -> _Norm:
    """Extend a chain that ends at norm.out by a constant Add (beta) where one follows alone."""
    add = sole_consumer(g, norm.out, "Add")
    if add is not None:
        other = other_operand(add, norm.out)
        if other is not None and other != norm.out and g.is_constant(other):
            norm.nodes.append(add.name)
            norm.beta = other
            norm.out = add.output[0]
    return norm


def _parse_rmsnorm(g: Graph, rm: onnx.NodeProto) -> _Norm | None:
    """Structure only: an RMSNorm whose mean of squares is the ReduceMean `rm`."""
    if not rm.input or not rm.output:
        return None
    sq = _square_of(g, rm.input[0])
    if sq is None:
        return None
    x, sq_node, is_pow = sq
    if _is_centered(g, x):
        return None
    nodes, reduces, pows = [sq_node.name, rm.name], [rm], []
    if is_pow:
        pows.append((sq_node, 2.0))
    var = _eps_and_std(g, rm, nodes, pows)
    if var is None:
        raise MatchRefused(g.node(nodes[-1]).name, "incomplete-chain", f"RMSNorm at {rm.name!r}: the mean of "
                           f"squares is not followed by Add(eps) -> Sqrt / Pow(-0.5)")
    eps_node, eps, kind, s = var
    norm = _Norm("rmsnorm", x, nodes, reduces, eps_node, eps, pows, x_readers=[sq_node])
    n = _normalize_step(g, x, kind, s, nodes)
    if n is not None:
        norm.normalized = n.output[0]
        norm.x_readers.append(n)
        return norm
    stop = MatchRefused(g.node(nodes[-1]).name, "incomplete-chain", f"RMSNorm at {rm.name!r}: nothing "
                        f"divides {x!r} by the root mean square {s!r} (nor multiplies it by its inverse)")
    if kind != "inv":
        raise stop
    gm = reader(g, s, "Mul")                             # y = x * (gamma * inv)
    gamma = other_operand(gm, s) if gm is not None else None
    if gamma is None or gamma == s or not g.is_constant(gamma):
        raise stop
    xm = reader(g, gm.output[0], "Mul")
    if xm is None or other_operand(xm, gm.output[0]) != x:
        raise stop
    nodes.extend([gm.name, xm.name])
    norm.gamma, norm.out = gamma, xm.output[0]
    norm.x_readers.append(xm)
    return norm


DEFAULT_EPSILON = 1e-5   # LayerNormalization's and RMSNormalization's default


# ---- the fused ops: reference kernels ---------------------------------------------------------------------

def layer_norm_reference(x: np.ndarray, gamma: np.ndarray | None, beta: np.ndarray | None, epsilon: float,
                         axis: int = -1, stash_type: int | None = 1) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) over axes [axis, rank), cast back to x's dtype, then * gamma + beta.

    float64 math; the normalised value is rounded to x's dtype before the affine, as ONNX specifies (that is
    what makes stash_type = float32 exact for fp16 inputs)."""
    n = kernels.layer_norm(x, epsilon, axis).astype(x.dtype).astype(np.float64)
    return _affine(n, gamma, beta).astype(x.dtype)


def rms_norm_reference(x: np.ndarray, gamma: np.ndarray | None, epsilon: float, axis: int = -1) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) over axes [axis, rank), cast back to x's dtype, then * gamma (float64 math)."""
    n = kernels.rms_norm(x, epsilon, axis).astype(x.dtype).astype(np.float64)
    return _affine(n, gamma, None).astype(x.dtype)


def _affine(n: np.ndarray, gamma: np.ndarray | None, beta: np.ndarray | None) -> np.ndarray:
    if gamma is not None:
        n = n * gamma.astype(np.float64)
    if beta is not None:
        n = n + beta.astype(np.float64)
    return n


def _ln_ref(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    return [layer_norm_reference(inputs[0], optional(inputs, 1), optional(inputs, 2),
                                 attrs.get("epsilon", DEFAULT_EPSILON), attrs.get("axis", -1), attrs.get("stash_type", 1))]


def _rms_ref(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    return [rms_norm_reference(inputs[0], optional(inputs, 1), attrs.get("epsilon", DEFAULT_EPSILON),
                               attrs.get("axis", -1))]


# ---- the fused ops: function bodies --------------------------------------------------------------------------

def _reduce_mean_last(inp: str, out: str, opset: int) -> list[onnx.NodeProto]:
    """ReduceMean over the last axis, keepdims: axes an attribute below opset 18, an input from 18."""
    if opset < 18:
        return [helper.make_node("ReduceMean", [inp], [out], axes=[-1], keepdims=1)]
    return [helper.make_node("Constant", [], [out + "_axes"], value=numpy_helper.from_array(
                np.array([-1], np.int64), out + "_axes")),
            helper.make_node("ReduceMean", [inp, out + "_axes"], [out], keepdims=1)]


def _stats_type(attrs: dict[str, Any], elem_type: int) -> int:
    st = attrs.get("stash_type")
    return int(st) if st is not None else TensorProto.FLOAT


def _norm_body(op: str, attrs: dict[str, Any], opset: int, elem_type: int, *, center: bool,
               has_beta: bool) -> onnx.FunctionProto:
    compute = _stats_type(attrs, elem_type)
    nodes: list[onnx.NodeProto] = []
    xc = "X"
    if compute != elem_type:
        nodes.append(helper.make_node("Cast", ["X"], ["Xc"], to=compute))
        xc = "Xc"
    if center:
        nodes += _reduce_mean_last(xc, "Mean", opset)
        nodes.append(helper.make_node("Sub", [xc, "Mean"], ["D"]))
        xc = "D"
    nodes.append(helper.make_node("Mul", [xc, xc], ["Sq"]))
    nodes += _reduce_mean_last("Sq", "Var", opset)
    eps_const, eps_token = float_attr_constant("EpsF", "epsilon", attrs, opset, DEFAULT_EPSILON)
    nodes.append(eps_const)
    eps = "EpsF"
    if compute != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", ["EpsF"], ["Eps"], to=compute))
        eps = "Eps"
    nodes += [helper.make_node("Add", ["Var", eps], ["VarEps"]),
              helper.make_node("Sqrt", ["VarEps"], ["Std"]),
              helper.make_node("Div", [xc, "Std"], ["Nc"])]
    n = "Nc"
    if compute != elem_type:
        nodes.append(helper.make_node("Cast", ["Nc"], ["N"], to=elem_type))
        n = "N"
    inputs = ["X", "gamma"] + (["beta"] if has_beta else [])
    if has_beta:
        nodes += [helper.make_node("Mul", [n, "gamma"], ["Scaled"]), helper.make_node("Add", ["Scaled", "beta"], ["Y"])]
    else:
        nodes.append(helper.make_node("Mul", [n, "gamma"], ["Y"]))
    overload = overload_with(f"{_type_name(elem_type)}_stats_{_type_name(compute)}"
                             + ("" if has_beta or not center else "_nobeta"), eps_token)
    what = "LayerNorm" if center else "RMSNorm"
    return make_body(
        FUSED_DOMAIN, op, inputs, ["Y"], nodes, [helper.make_opsetid("", opset)],
        attributes=["epsilon", "stash_type"], overload=overload,
        doc_string=f"{what} over the last axis; statistics in the stash_type precision.")


def _type_name(elem_type: int) -> str:
    dt = np_dtype(elem_type)
    return dt.name if dt is not None else f"type{elem_type}"


def layer_norm_body(attrs: dict[str, Any], opset: int, elem_type: int, has_beta: bool = True) -> onnx.FunctionProto:
    """npufuse.LayerNorm as standard ops of `opset` (a second overload serves nodes without beta)."""
    return _norm_body("LayerNorm", attrs, opset, elem_type, center=True, has_beta=has_beta)


def rms_norm_body(attrs: dict[str, Any], opset: int, elem_type: int) -> onnx.FunctionProto:
    """npufuse.RMSNorm as standard ops of `opset`."""
    return _norm_body("RMSNorm", attrs, opset, elem_type, center=False, has_beta=False)


NPU_LAYER_NORM = FusedOpDef(
    op_type="LayerNorm",
    doc="Y = (X - mean) / sqrt(var + epsilon) * gamma [+ beta] over the last axis; mean and var in the "
        "stash_type precision (default float32), the normalised value cast back to X's type before the affine.",
    inputs=("X", "gamma", "beta?"), outputs=("Y",), attributes=("epsilon", "stash_type"),
    reference=_ln_ref, body=layer_norm_body,
)
NPU_RMS_NORM = FusedOpDef(
    op_type="RMSNorm",
    doc="Y = X / sqrt(mean(X^2) + epsilon) * gamma over the last axis; statistics in the stash_type precision.",
    inputs=("X", "gamma"), outputs=("Y",), attributes=("epsilon", "stash_type"),
    reference=_rms_ref, body=rms_norm_body,
)
# Standard ops the patterns emit where the opset has them: declared so the reference executor has kernels.
LAYER_NORMALIZATION = FusedOpDef(
    op_type="LayerNormalization", doc="ONNX LayerNormalization-17 (Y only).",
    inputs=("X", "Scale", "B?"), outputs=("Y",), attributes=("axis", "epsilon", "stash_type"),
    reference=_ln_ref, body=None, domain="",
)
RMS_NORMALIZATION = FusedOpDef(
    op_type="RMSNormalization", doc="ONNX RMSNormalization-23.",
    inputs=("X", "scale"), outputs=("Y",), attributes=("axis", "epsilon", "stash_type"),
    reference=_rms_ref, body=None, domain="",
)


# ---- the patterns ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    """What a validated chain becomes."""

    x: str
    out: str
    nodes: tuple[str, ...]
    gamma: np.ndarray | None
    gamma_name: str | None
    beta: np.ndarray | None
    beta_name: str | None
    epsilon: float
    elem_type: int             # type of the fused node's X and Y
    stats_type: int            # precision of the statistics (stash_type)


class _NormPattern(Pattern):
    """Shared validation and build for LayerNorm and RMSNorm."""

    anchor_ops = frozenset({"ReduceMean"})
    phase = 0
    kind: str

    def _parse(self, g: Graph, node: onnx.NodeProto) -> _Norm | None:
        raise NotImplementedError

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if node.domain not in STD_DOMAINS:
            return None
        try:
            norm = self._parse(g, node)
        except MatchRefused as why:       # a norm's start (x - mean(x), mean(x^2)) whose chain stops short
            return Refusal(self.name, why.node, why.reason, why.detail, (node.name, why.node))
        if norm is None:
            return None
        plan = self._plan(g, norm)
        if isinstance(plan, Refusal):
            return plan
        esc = escaping_intermediate(g, plan.nodes, [plan.out])
        if esc is not None:
            return Refusal(self.name, esc[1], esc[0], f"{self.kind} at {node.name!r}: {esc[2]}", plan.nodes)
        ordered = tuple(sorted(plan.nodes, key=lambda n: g.topo_index[n]))
        op = self._emitted_op(g)
        kind = op.op_type if op.domain == "" else f"npufuse.{op.op_type}"
        return Match(self.name, ordered, g.boundary_inputs(ordered), (plan.out,), kind,
                     info={"plan": plan, "anchor": node.name})

    def _refuse(self, node: onnx.NodeProto, reason: str, detail: str, nodes: Sequence[str]) -> Refusal:
        return Refusal(self.name, node.name, reason, detail, tuple(nodes))

    def _plan(self, g: Graph, norm: _Norm) -> _Plan | Refusal:
        nodes = list(norm.nodes)
        for rm in norm.reduces:
            why = _last_axis_problem(g, rm)
            if why is not None:
                return self._refuse(rm, why[0], f"{self.kind}: ReduceMean {rm.name!r} {why[1]}", nodes)
        for p, want in norm.pows:
            e = g.scalar(p.input[1])
            if not near(e, want):
                return self._refuse(p, "pow-exponent", f"{self.kind}: Pow {p.name!r} has exponent {e}, "
                                    f"not {want:g}", nodes)
        eps = g.scalar(norm.eps_value) if g.is_constant(norm.eps_value) else None
        if eps is None:
            return self._refuse(norm.eps_node, "nonconstant-epsilon", f"{self.kind}: epsilon {norm.eps_value!r} "
                                f"added by {norm.eps_node.name!r} is not a constant scalar", nodes)
        if not (eps >= 0.0 and math.isfinite(eps)):
            return self._refuse(norm.eps_node, "nonconstant-epsilon", f"{self.kind}: epsilon {eps} at "
                                f"{norm.eps_node.name!r} is not a non-negative number", nodes)

        ext = self._casts_and_affine(g, norm, nodes)
        if isinstance(ext, Refusal):
            return ext
        x, out, gamma, beta, elem_type, stats_type = ext
        shape = g.shape(x)
        hidden = shape[-1] if shape else None
        rank = len(shape) if shape is not None else None
        vecs = {}
        for role, v in (("gamma", gamma), ("beta", beta)):
            if v is None:
                vecs[role] = None
                continue
            vec = _affine_vector(g, v, hidden, rank)
            if isinstance(vec, str):
                user = next(g.node(n) for n in nodes if v in g.node(n).input)
                return self._refuse(user, "weight-shape", f"{self.kind}: {role} {v!r} applied by {user.name!r} "
                                    f"{vec}", nodes)
            vecs[role] = vec
            hidden = vec.shape[0]
        if vecs["gamma"] is None and not isinstance(hidden, int):
            return self._refuse(g.node(norm.nodes[0]), "unknown-hidden-size", f"{self.kind}: the hidden size of {x!r} "
                                "is unknown, so ones for the missing gamma cannot be made", nodes)
        return _Plan(x, out, tuple(nodes), vecs["gamma"], gamma, vecs["beta"], beta, eps, elem_type, stats_type)

    def _casts_and_affine(self, g: Graph, norm: _Norm, nodes: list[str]
                          ) -> tuple[str, str, str | None, str | None, int, int] | Refusal:
        """Which Casts are absorbed and which constant scale/shift follow: (fused input, fused output, gamma
        value, beta value, element type, statistics type). Appends the absorbed nodes to `nodes`."""
        x = norm.x
        up = g.producer_of(x)
        up = up if std_op(up, "Cast") else None
        stats_type = g.elem_type(norm.normalized or norm.out)
        out = norm.out
        gamma, beta = norm.gamma, norm.beta
        stash = False
        center_cast = norm.center_cast if norm.center_cast is not None and not _is_noop_cast(g, norm.center_cast) \
            else None
        if norm.normalized is not None:
            cur: str | None = norm.normalized
            down = sole_consumer(g, cur, "Cast")
            if down is not None and _is_noop_cast(g, down):
                nodes.append(down.name)
                cur = down.output[0]
            elif down is not None:
                # A real down-Cast: absorbed together with its up-Cast (stash_type semantics), else the fused
                # core ends before it and the Cast and what follows stay outside.
                if center_cast is not None:
                    pair = center_cast
                elif up is not None and not _is_noop_cast(g, up) and _only_read_by(g, x, norm.x_readers):
                    pair = up
                else:
                    pair = None
                if pair is not None and g.elem_type(pair.input[0]) == _cast_to(down):
                    stash = True
                    nodes.append(down.name)
                    cur = down.output[0]
                    if pair is up:
                        nodes.append(up.name)
                        x = up.input[0]
                else:
                    cur = None
            if center_cast is not None and not stash:
                return self._refuse(center_cast, "mixed-precision", f"{self.kind}: the centred value is cast by "
                                    f"{center_cast.name!r} but not cast back before the affine; no single norm "
                                    "op computes that mix of precisions", nodes)
            if cur is None:
                out = norm.normalized
            else:
                out = cur
                mul = sole_consumer(g, cur, "Mul")
                other = other_operand(mul, cur) if mul is not None else None
                if other is not None and other != cur and g.is_constant(other):
                    nodes.append(mul.name)
                    gamma, out = other, mul.output[0]
                if self.kind == "LayerNorm":
                    add = sole_consumer(g, out, "Add")
                    other = other_operand(add, out) if add is not None else None
                    if other is not None and other != out and g.is_constant(other):
                        nodes.append(add.name)
                        beta, out = other, add.output[0]
        if not stash and up is not None and _is_noop_cast(g, up) and _only_read_by(g, x, norm.x_readers):
            nodes.append(up.name)          # x = Cast(x) to its own type: an identity the fused node absorbs
            x = up.input[0]
        if stash:
            stats_type = g.elem_type((center_cast or up).output[0])
        elem_type = g.elem_type(x)
        if elem_type == TensorProto.UNDEFINED:
            elem_type = g.elem_type(out)

        return x, out, gamma, beta, elem_type, stats_type

    # ---- build ----
    def _emitted_op(self, g: Graph) -> FusedOpDef:
        raise NotImplementedError

    def build(self, g: Graph, m: Match) -> Replacement:
        plan: _Plan = m.info["plan"]
        op = self._emitted_op(g)
        taken: set[str] = set()
        inits: list[onnx.TensorProto] = []
        hidden = (plan.gamma.shape[0] if plan.gamma is not None else
                  plan.beta.shape[0] if plan.beta is not None else int(g.shape(plan.x)[-1]))
        np_t = np_dtype(plan.elem_type) or np.dtype(np.float32)

        def vector(arr: np.ndarray | None, name: str | None, role: str, fill: float) -> str:
            if arr is not None and name is not None and _is_plain_vector(g, name, hidden, np_t):
                return name                  # the model's own weight, as it is
            if arr is None:
                arr = np.full(hidden, fill, dtype=np_t)
            new = unique_name(g, f"{m.info['anchor']}.{role}", taken)
            inits.append(numpy_helper.from_array(np.ascontiguousarray(arr.astype(np_t)), new))
            return new

        inputs = [plan.x, vector(plan.gamma, plan.gamma_name, "gamma", 1.0)]
        center = self.kind == "LayerNorm"
        if center and (plan.beta is not None or op is LAYER_NORMALIZATION):
            inputs.append(vector(plan.beta, plan.beta_name, "beta", 0.0))
        attrs: dict[str, Any] = {"epsilon": plan.epsilon}
        if plan.stats_type not in (TensorProto.FLOAT, TensorProto.UNDEFINED):
            attrs["stash_type"] = plan.stats_type
        if op.domain == "":
            attrs["axis"] = -1
        opset = g.opset.get("", 1)
        node, fn = op.make_node(inputs, [plan.out], m.info["anchor"], attrs, opset, plan.elem_type)
        if fn is not None and center and len(inputs) == 2:
            fn = layer_norm_body(attrs, opset, plan.elem_type, has_beta=False)
            node.overload = fn.overload
        if fn is None:
            return Replacement([node], inits)
        return Replacement([node], inits, [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})


class LayerNormPattern(_NormPattern):
    name = "layernorm"
    description = "ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add into LayerNormalization or npufuse.LayerNorm"
    kind = "LayerNorm"
    fused_ops = (NPU_LAYER_NORM, LAYER_NORMALIZATION)

    def _parse(self, g: Graph, node: onnx.NodeProto) -> _Norm | None:
        return _parse_layernorm(g, node)

    def _emitted_op(self, g: Graph) -> FusedOpDef:
        return LAYER_NORMALIZATION if g.opset.get("", 1) >= 17 else NPU_LAYER_NORM


class RMSNormPattern(_NormPattern):
    name = "rmsnorm"
    description = "Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul into RMSNormalization or npufuse.RMSNorm"
    kind = "RMSNorm"
    fused_ops = (NPU_RMS_NORM, RMS_NORMALIZATION)

    def _parse(self, g: Graph, node: onnx.NodeProto) -> _Norm | None:
        return _parse_rmsnorm(g, node)

    def _emitted_op(self, g: Graph) -> FusedOpDef:
        # onnxruntime 1.31 runs RMSNormalization-23 (fp32 and fp16), so the standard op is used from 23.
        return RMS_NORMALIZATION if g.opset.get("", 1) >= 23 else NPU_RMS_NORM


# ---- value checks --------------------------------------------------------------------------------------------

def _last_axis_problem(g: Graph, rm: onnx.NodeProto) -> tuple[str, str] | None:
    """None if `rm` averages exactly the last axis with keepdims=1, else (reason, phrase)."""
    a = attributes(rm)
    if a.get("keepdims", 1) != 1:
        return "keepdims", "drops the reduced axis (keepdims=0)"
    if "axes" in a:
        axes = list(a["axes"])
    elif len(rm.input) > 1 and rm.input[1]:
        arr = g.constant(rm.input[1])
        if arr is None:
            return "wrong-axis", f"reduces over axes {rm.input[1]!r} that are not a constant"
        axes = [int(v) for v in arr.ravel()]
    else:
        return "wrong-axis", "reduces over all axes"
    rank = g.rank(rm.input[0])
    if len(axes) == 1 and (axes[0] == -1 or (rank is not None and axes[0] == rank - 1)):
        return None
    return "wrong-axis", f"reduces over axes {axes}, not just the last axis"


def _only_read_by(g: Graph, v: str, readers: Sequence[onnx.NodeProto]) -> bool:
    names = {r.name for r in readers}
    return v not in g.graph_outputs and all(c.name in names for c in g.consumers_of(v))


def _affine_vector(g: Graph, v: str, hidden: Any, rank: int | None) -> np.ndarray | str:
    """The weight as a [hidden] vector, or why it is not one (it must broadcast along the last axis only)."""
    arr = g.constant(v)
    if arr is None:
        return "is not a constant"
    if rank is not None and arr.ndim > rank:
        return f"has shape {arr.shape}, more dimensions than the normalised input"
    if arr.ndim > 1 and any(d != 1 for d in arr.shape[:-1]):
        return f"has shape {arr.shape}: it varies along axes other than the last"
    last = arr.shape[-1] if arr.ndim else 1
    if isinstance(hidden, int) and last not in (1, hidden):
        return f"has {last} elements on the last axis, the input has {hidden}"
    if last == 1:
        if not isinstance(hidden, int):
            return "is a scalar and the hidden size is unknown"
        return np.full(hidden, arr.reshape(()), dtype=arr.dtype)
    return arr.reshape(-1)


def _is_plain_vector(g: Graph, name: str, hidden: int, np_t: np.dtype) -> bool:
    t = g.initializers.get(name)
    return (t is not None and name not in g.graph_inputs and list(t.dims) == [hidden]
            and np_dtype(t.data_type) == np_t)
