"""Residual Add + LayerNorm / RMSNorm  =>  npufuse.AddLayerNorm / npufuse.AddRMSNorm.

A transformer block ends in `h = norm(x + f(x))` (post-LN: BERT) or feeds `s = x + f(x)` both to the next
block's norm and to the next residual Add (pre-LN: GPT-2, llama, ViT). The fused op reads the two residual
operands once, keeps the sum on chip for the row statistics and writes the normalised value and, where the
rest of the graph reads it, the sum (onnxruntime's SkipLayerNormalization / SkipSimplifiedLayerNormalization
with their optional sum output):

    AddLayerNorm(A, B, gamma, beta?) -> (Y, S?)     S = A + B;  Y = LayerNorm(S) over the last axis
    AddRMSNorm(A, B, gamma)          -> (Y, S?)     S = A + B;  Y = RMSNorm(S) over the last axis

Attributes `epsilon` and `stash_type` have exactly the meaning they have on LayerNormalization /
RMSNormalization (statistics in the stash_type precision, the normalised value cast back to T before the
affine). S is computed in T, as the Add did, and normalised as it is.

The norm is one of the single ops phase 0 emits or an exporter wrote: LayerNormalization (axis -1, Mean and
InvStdDev outputs unused), npufuse.LayerNorm, RMSNormalization (opset 23), npufuse.RMSNorm. Between the Add
and the norm, Casts to the type the value already has (HF llama's `hidden_states.to(float32)` in an fp32
export) are looked through; the value the rest of the graph reads along that chain becomes S.

Refused or ignored:
- an Add with a constant operand: a bias (or a position embedding table), not a residual: ignored;
- operands that may broadcast along the normalised (last) axis, or whose shapes are unknown: refused.
  Broadcasting over the leading axes (a [1, S, H] position embedding added to [B, S, H]) is Add's own
  semantics and the fused op keeps it; A is the operand that carries the sum's full shape where that is known;
- a real Cast between the Add and the norm (mixed precision), a norm over another axis, a LayerNormalization
  whose Mean / InvStdDev outputs are used, a gamma/beta that is not a vector of the hidden size: refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto as A
from onnx import TensorProto, helper, numpy_helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.fusion.types import Match, Refusal, Replacement
from npufuse.graph import Graph, attributes
from npufuse.kernels import optional
from npufuse.patterns.base import FusedOpDef, Pattern, node_with_refs, unique_name
from npufuse.patterns.matching import (
    escaping_intermediate,
    last_axis_vector_problem,
    std_op,
)
from npufuse.patterns.norms import (
    _is_noop_cast,
    layer_norm_body,
    layer_norm_reference,
    rms_norm_body,
    rms_norm_reference,
)

_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16})
_DEFAULT_EPSILON = 1e-5
# Both norm ops default to float32 statistics (LayerNormalization-17, RMSNormalization-23, npufuse's own).
_DEFAULT_STASH_TYPE = TensorProto.FLOAT


# ---- the fused ops: reference kernels ----------------------------------------------------------------------

def residual_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A + B with Add's broadcasting, rounded once to the operands' type (as the Add computed it)."""
    return (a.astype(np.float64) + b.astype(np.float64)).astype(np.result_type(a, b))


def _add_ln_ref(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    s = residual_sum(inputs[0], inputs[1])
    y = layer_norm_reference(s, optional(inputs, 2), optional(inputs, 3), attrs.get("epsilon", _DEFAULT_EPSILON), -1,
                             attrs.get("stash_type", _DEFAULT_STASH_TYPE))
    return [y, s]


def _add_rms_ref(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    s = residual_sum(inputs[0], inputs[1])
    return [rms_norm_reference(s, optional(inputs, 2), attrs.get("epsilon", _DEFAULT_EPSILON), -1), s]


# ---- the fused ops: function bodies ------------------------------------------------------------------------

def _add_norm_body(op_type: str, attrs: dict[str, Any], opset: int, elem_type: int, *, center: bool,
                   has_beta: bool, with_sum: bool) -> onnx.FunctionProto:
    """S = Add(A, B), then the norm of S: the standard op where the opset has it, else npufuse's decomposition
    of it (the same nodes the npufuse.LayerNorm / RMSNorm bodies hold, reading S)."""
    has_beta = has_beta and center
    std_opset = 17 if center else 23
    nodes = [helper.make_node("Add", ["A", "B"], ["S"])]
    if opset >= std_opset:
        norm_in = ["S", "gamma"] + (["beta"] if has_beta else [])
        nodes.append(node_with_refs("LayerNormalization" if center else "RMSNormalization", norm_in, ["Y"],
                                    [("epsilon", A.FLOAT), ("stash_type", A.INT)], axis=-1))
        token = "op" + ("" if has_beta or not center else "_nobeta")
    else:
        body = (layer_norm_body(attrs, opset, elem_type, has_beta=has_beta) if center
                else rms_norm_body(attrs, opset, elem_type))
        assert "S" not in {o for n in body.node for o in n.output}, "AddNorm body: value name S is taken"
        for n in body.node:
            n2 = onnx.NodeProto()
            n2.CopyFrom(n)
            n2.input[:] = ["S" if v == "X" else v for v in n.input]
            nodes.append(n2)
        token = body.overload
    overload = f"{token}__{'y_s' if with_sum else 'y'}"
    what = "LayerNorm" if center else "RMSNorm"
    return helper.make_function(
        FUSED_DOMAIN, op_type, ["A", "B", "gamma"] + (["beta"] if has_beta else []),
        ["Y"] + (["S"] if with_sum else []), nodes, [helper.make_opsetid("", opset)],
        attributes=["epsilon", "stash_type"], overload=overload,
        doc_string=f"S = A + B; Y = {what}(S) over the last axis" + ("; S is an output too." if with_sum else "."))


def add_layer_norm_body(attrs: dict[str, Any], opset: int, elem_type: int, has_beta: bool = True,
                        with_sum: bool = True) -> onnx.FunctionProto:
    """npufuse.AddLayerNorm from ops of `opset`; overloads per beta / no beta and (Y, S) / (Y) forms."""
    return _add_norm_body("AddLayerNorm", attrs, opset, elem_type, center=True, has_beta=has_beta,
                          with_sum=with_sum)


def add_rms_norm_body(attrs: dict[str, Any], opset: int, elem_type: int, with_sum: bool = True
                      ) -> onnx.FunctionProto:
    """npufuse.AddRMSNorm from ops of `opset`; overloads per (Y, S) / (Y) form."""
    return _add_norm_body("AddRMSNorm", attrs, opset, elem_type, center=False, has_beta=False, with_sum=with_sum)


ADD_LAYER_NORM = FusedOpDef(
    op_type="AddLayerNorm",
    doc="S = A + B (Add's broadcasting over the leading axes; both have the hidden size H on the last axis); "
        "Y = (S - mean) / sqrt(var + epsilon) * gamma [+ beta] over the last axis, statistics in the stash_type "
        "precision (default float32), the normalised value cast back to T before the affine. Optional output S. "
        "T: float16, float, double, bfloat16; gamma, beta: [H].",
    inputs=("A", "B", "gamma", "beta?"), outputs=("Y", "S?"), attributes=("epsilon", "stash_type"),
    reference=_add_ln_ref, body=add_layer_norm_body,
)
ADD_RMS_NORM = FusedOpDef(
    op_type="AddRMSNorm",
    doc="S = A + B (as AddLayerNorm); Y = S / sqrt(mean(S^2) + epsilon) * gamma over the last axis, statistics "
        "in the stash_type precision. Optional output S. T: float16, float, double, bfloat16; gamma: [H].",
    inputs=("A", "B", "gamma"), outputs=("Y", "S?"), attributes=("epsilon", "stash_type"),
    reference=_add_rms_ref, body=add_rms_norm_body,
)


# ---- the patterns --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    add: str                       # the residual Add node
    norm: str                      # the norm node
    a: str                         # operands, A first (the one with the sum's full shape where known)
    b: str
    gamma: str
    beta: str | None
    sum_out: str | None            # the sum value the rest of the graph reads (Add output or a no-op Cast's)
    epsilon: float
    stash_type: int
    elem_type: int
    hidden: int | str


def _key(node: onnx.NodeProto) -> tuple[str, str]:
    return ("" if node.domain == "ai.onnx" else node.domain, node.op_type)


class _AddNormPattern(Pattern):
    """Shared matcher and build of AddLayerNorm and AddRMSNorm; anchored on the norm (one X, one producer)."""

    phase = 3
    kind: str                                  # "LayerNorm" | "RMSNorm"
    norm_ops: frozenset[tuple[str, str]]
    standard_op: str                           # the ONNX op of this norm (it has an `axis` attribute)
    fused: FusedOpDef

    def _refuse(self, node: onnx.NodeProto, reason: str, detail: str, nodes: Sequence[str]) -> Refusal:
        return Refusal(self.name, node.name, reason, detail, tuple(nodes))

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if _key(node) not in self.norm_ops or not node.input or not node.input[0]:
            return None
        # Up from X through Casts to the Add.
        casts: list[onnx.NodeProto] = []
        p = g.producer_of(node.input[0])
        while std_op(p, "Cast"):
            casts.append(p)
            p = g.producer_of(p.input[0])
        if not std_op(p, "Add") or len(p.input) != 2:
            return None
        add = p
        a, b = add.input
        if not a or not b or g.is_constant(a) or g.is_constant(b) or a == b:
            return None                        # a bias (or a table), not a residual
        nodes = [add.name] + [c.name for c in reversed(casts)] + [node.name]
        what = f"Add{self.kind} at {add.name!r} -> {node.name!r}"
        real = next((c for c in casts if not _is_noop_cast(g, c)), None)
        if real is not None:
            return self._refuse(real, "mixed-precision", f"{what}: Cast {real.name!r} changes the sum's type "
                                "before the norm; the fused op normalises the sum in its own type", nodes)
        elem_type = g.elem_type(a)
        if elem_type not in _FLOAT_TYPES or g.elem_type(b) != elem_type:
            return None

        hidden = self._residual_shapes(g, add, node, what, nodes)
        if isinstance(hidden, Refusal):
            return hidden
        why = self._norm_problem(g, node, what, nodes)
        if why is not None:
            return why
        params = self._params(g, node, hidden, what, nodes)
        if isinstance(params, Refusal):
            return params
        gamma, beta = params

        # The sum may leave the set at most once along Add -> Cast... -> norm: that value becomes S.
        members = set(nodes)
        chain_values = [add.output[0]] + [c.output[0] for c in reversed(casts)]
        escaping = [v for v in chain_values
                    if v in g.graph_outputs or any(c.name not in members for c in g.consumers_of(v))]
        if len(escaping) > 1:
            return self._refuse(add, "shared-intermediate", f"{what}: the sum is read outside the pattern both as "
                                f"{escaping[0]!r} and as {escaping[1]!r}; the fused op has one sum output", nodes)
        sum_out = escaping[0] if escaping else None
        outputs = (node.output[0],) + ((sum_out,) if sum_out is not None else ())
        esc = escaping_intermediate(g, nodes, outputs)
        if esc is not None:
            return self._refuse(g.node(esc[1]), esc[0], f"{what}: {esc[2]}", nodes)

        first, second = self._operand_order(g, add)
        a_attrs = attributes(node)
        plan = _Plan(add.name, node.name, first, second, gamma, beta, sum_out,
                     float(a_attrs.get("epsilon", _DEFAULT_EPSILON)),
                     int(a_attrs.get("stash_type", _DEFAULT_STASH_TYPE)), elem_type, hidden)
        ordered = tuple(sorted(nodes, key=lambda n: g.topo_index[n]))
        kind = f"Add{self.kind}" + ("[sum]" if sum_out is not None else "")
        return Match(self.name, ordered, g.boundary_inputs(ordered), outputs, kind,
                     info={"plan": plan, "anchor": node.name})

    # ---- checks ----
    def _residual_shapes(self, g: Graph, add: onnx.NodeProto, norm: onnx.NodeProto, what: str,
                         nodes: list[str]) -> int | str | Refusal:
        """The hidden size H if both operands provably have it on the last axis (no broadcast along the
        normalised axis), else a refusal."""
        sa, sb = g.shape(add.input[0]), g.shape(add.input[1])
        if not sa or not sb:
            missing = add.input[0] if not sa else add.input[1]
            return self._refuse(add, "unknown-shape", f"{what}: the shape of {missing!r} is unknown, so it cannot "
                                "be shown that the residual does not broadcast along the normalised axis", nodes)
        la, lb = sa[-1], sb[-1]
        if la is None or lb is None or la != lb:
            return self._refuse(add, "residual-broadcast", f"{what}: operands of shapes {list(sa)} and {list(sb)} "
                                "are not provably equal on the last (normalised) axis; a residual of the fused "
                                "op may broadcast over leading axes only", nodes)
        return la

    def _norm_problem(self, g: Graph, norm: onnx.NodeProto, what: str, nodes: list[str]) -> Refusal | None:
        a = attributes(norm)
        if norm.op_type == self.standard_op and "axis" in a:
            axis, rank = int(a["axis"]), g.rank(norm.input[0])
            if not (axis == -1 or (rank is not None and axis == rank - 1)):
                return self._refuse(norm, "norm-not-last-axis", f"{what}: {norm.op_type} {norm.name!r} normalises "
                                    f"from axis {axis} of a rank-{rank} tensor, not over the last axis only", nodes)
        if any(o and (g.consumers_of(o) or o in g.graph_outputs) for o in norm.output[1:]):
            return self._refuse(norm, "norm-extra-outputs", f"{what}: the Mean / InvStdDev outputs of "
                                f"{norm.name!r} are used; the fused op does not produce them", nodes)
        return None

    def _params(self, g: Graph, norm: onnx.NodeProto, hidden: int | str, what: str, nodes: list[str]
                ) -> tuple[str, str | None] | Refusal:
        """(gamma, beta) value names: vectors [H], or constants that flatten to one."""
        gamma = norm.input[1] if len(norm.input) > 1 else ""
        beta = norm.input[2] if self.kind == "LayerNorm" and len(norm.input) > 2 else ""
        if not gamma:
            return self._refuse(norm, "norm-param-shape", f"{what}: {norm.name!r} has no scale input", nodes)
        for role, v in (("gamma", gamma), ("beta", beta)):
            if not v:
                continue
            why = last_axis_vector_problem(g, v, hidden)
            if why is not None:
                return self._refuse(norm, "norm-param-shape", f"{what}: {role} {v!r} of {norm.name!r} {why}", nodes)
        return gamma, beta or None

    @staticmethod
    def _operand_order(g: Graph, add: onnx.NodeProto) -> tuple[str, str]:
        """A first: the operand whose shape is the sum's where it is known (the cost model reads rows off A)."""
        a, b = add.input
        out = g.shape(add.output[0])
        sa, sb = g.shape(a), g.shape(b)
        if out is not None and sb == out and sa != out:
            return b, a
        if out is None and sa is not None and sb is not None and len(sb) > len(sa):
            return b, a
        return a, b

    # ---- build ----
    def build(self, g: Graph, m: Match) -> Replacement:
        plan: _Plan = m.info["plan"]
        taken: set[str] = set()
        inits: list[onnx.TensorProto] = []

        def vector(v: str | None, role: str) -> str | None:
            if v is None:
                return None
            shape = g.shape(v)
            if shape is not None and len(shape) == 1:
                return v
            arr = g.constant(v)
            if arr is None:
                raise ValueError(f"{role} {v!r} is not a [H] vector and not a constant")
            name = unique_name(g, f"{plan.norm}.{role}", taken)
            inits.append(numpy_helper.from_array(np.ascontiguousarray(arr.reshape(-1)), name))
            return name

        gamma, beta = vector(plan.gamma, "gamma"), vector(plan.beta, "beta")
        inputs = [plan.a, plan.b, gamma] + ([beta] if beta else [])
        outputs = list(m.outputs)
        attrs = {"epsilon": plan.epsilon, "stash_type": plan.stash_type}
        opset = g.opset.get("", 1)
        node, _ = self.fused.make_node(inputs, outputs, plan.norm, attrs, opset, plan.elem_type)
        fn = self._body(attrs, opset, plan.elem_type, has_beta=beta is not None, with_sum=len(outputs) == 2)
        node.overload = fn.overload
        return Replacement([node], inits, [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})

    def _body(self, attrs: dict[str, Any], opset: int, elem_type: int, *, has_beta: bool, with_sum: bool
              ) -> onnx.FunctionProto:
        raise NotImplementedError


class AddLayerNormPattern(_AddNormPattern):
    name = "add_layernorm"
    description = "residual Add -> LayerNormalization / npufuse.LayerNorm into npufuse.AddLayerNorm (sum as 2nd output)"
    anchor_ops = frozenset({"LayerNormalization", "LayerNorm"})
    kind = "LayerNorm"
    norm_ops = frozenset({("", "LayerNormalization"), (FUSED_DOMAIN, "LayerNorm")})
    standard_op = "LayerNormalization"
    fused = ADD_LAYER_NORM
    fused_ops = (ADD_LAYER_NORM,)

    def _body(self, attrs: dict[str, Any], opset: int, elem_type: int, *, has_beta: bool, with_sum: bool
              ) -> onnx.FunctionProto:
        return add_layer_norm_body(attrs, opset, elem_type, has_beta=has_beta, with_sum=with_sum)


class AddRMSNormPattern(_AddNormPattern):
    name = "add_rmsnorm"
    description = "residual Add -> RMSNormalization / npufuse.RMSNorm into npufuse.AddRMSNorm (sum as 2nd output)"
    anchor_ops = frozenset({"RMSNormalization", "RMSNorm"})
    kind = "RMSNorm"
    norm_ops = frozenset({("", "RMSNormalization"), (FUSED_DOMAIN, "RMSNorm")})
    standard_op = "RMSNormalization"
    fused = ADD_RMS_NORM
    fused_ops = (ADD_RMS_NORM,)

    def _body(self, attrs: dict[str, Any], opset: int, elem_type: int, *, has_beta: bool, with_sum: bool
              ) -> onnx.FunctionProto:
        return add_rms_norm_body(attrs, opset, elem_type, with_sum=with_sum)
