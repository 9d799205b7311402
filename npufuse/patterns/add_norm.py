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

The two operands must provably have one shape (Ascend's AddLayerNorm / AddRmsNorm take x2 of x1's shape; see
`_residual_shapes`); one of them may be a constant (a position table of the sum's own shape). Between the Add and
the norm, one Reshape that keeps the last axis (the sum [B*S, H] viewed as [B, S, H]) is absorbed: the fused op
normalises the sum in the Add's shape and the Reshape moves after it (onto S too where the reshaped sum is read;
where both the sum as added and the reshaped sum are read, S is the former and a Reshape of S gives the latter).

Refused (near-misses, each naming the node):
- an operand that broadcasts, even over leading axes only (a [1, S, H] / [S, H] position table or [H] bias added
  to [B, S, H]: BERT / GPT-2 / ViT embedding LayerNorms): operand-broadcast; the Add stays and the norm is fused
  alone. Fusing the broadcast Add would need x2 expanded to x1's shape first: no fewer bytes moved than Add + norm;
- operands whose dims are named differently and cannot be followed to the same dims: residual-shape-unproven;
  unknown shapes, or a last (normalised) axis that differs or is not static: unknown-shape, residual-broadcast;
- a Reshape that does not keep the normalised axis: reshape-changes-last-axis;
- a real Cast between the Add and the norm (mixed precision; norm-in-wider-type where an RMSNorm and its gamma
  are in the wider type, Gemma's RMSNorm in fp16: no fused op rounds as the model does), a norm over another axis,
  a LayerNormalization whose Mean / InvStdDev outputs are used, a gamma/beta that is not a vector of the hidden size.
Ignored: x + x, and an Add of two constants.
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
from npufuse.algebra.dims import dim_str, value_dims
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph, attributes
from npufuse.patterns.kernels import optional
from npufuse.patterns.base import FusedOpDef, Pattern, make_body, node_with_refs, shared_body, unique_name
from npufuse.ir.matching import (
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
    return make_body(
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


# ---- proving that two operands have the same shape ------------------------------------------------------------
#
# Ascend's AddLayerNorm / AddRmsNorm take x2 of exactly x1's shape (ops-nn norm/add_layer_norm: "x2: shape与x1一致";
# only the optional third addend `bias` may be a [H] vector). So the residual must not broadcast at all, and the
# two operands must be *provably* the same shape. Shape inference names the same runtime dim differently on the
# two sides of a residual ('batch' from the graph input, 'unk__21' from a Reshape whose target TorchScript
# computed with Shape/Gather/Concat), and it also names a dim that is 1 at run time 'unk__0' (BERT's position
# embedding, [1, S, H]): equal names prove equality, different names prove nothing. Where the names differ, the
# dims are followed structurally (`algebra.dims`) back to the graph inputs' symbols, constants' shapes, or the axis
# of a value where a broadcast merged two unequal dims.


def _named(d: Any) -> bool:
    """A followed dim that is a number or a dim the model names (`batch`), not one inference made up or a fresh
    one: against a 1 it is a broadcast (as `_unknown`'s complement for inferred dims)."""
    return isinstance(d, int) or d[0] == "sym" and not d[1].startswith("unk__")


def _unknown(d: int | str | None) -> bool:
    """A dim of an inferred shape that says nothing about its size: None, or a name inference made up (unk__N)."""
    return d is None or (isinstance(d, str) and d.startswith("unk__"))


# ---- the patterns --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    add: str                       # the residual Add node
    norm: str                      # the norm node
    a: str                         # operands (provably of one shape)
    b: str
    gamma: str
    beta: str | None
    sum_out: str | None            # the sum value the rest of the graph reads (Add output or a no-op Cast's)
    epsilon: float
    stash_type: int
    elem_type: int
    hidden: int
    reshape_shape: str | None = None   # Add -> Reshape(shape) -> norm: the target shape the result is reshaped to
    sum_reshaped: bool = False         # the value read outside is the reshaped sum (else the sum as added)


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
        # Up from X through Casts and at most one Reshape to the Add.
        chain: list[onnx.NodeProto] = []       # from the norm upwards
        reshape: onnx.NodeProto | None = None
        p = g.producer_of(node.input[0])
        while std_op(p, "Cast") or (reshape is None and std_op(p, "Reshape") and len(p.input) == 2):
            if p.op_type == "Reshape":
                reshape = p
            chain.append(p)
            p = g.producer_of(p.input[0])
        if not std_op(p, "Add") or len(p.input) != 2:
            return None
        add = p
        a, b = add.input
        if not a or not b or a == b or (g.is_constant(a) and g.is_constant(b)):
            return None                        # x + x, or constants only: not a residual
        nodes = [add.name] + [c.name for c in reversed(chain)] + [node.name]
        what = f"Add{self.kind} at {add.name!r} -> {node.name!r}"
        real = next((c for c in chain if c.op_type == "Cast" and not _is_noop_cast(g, c)), None)
        if real is not None:
            wider = self._norm_in_wider_type(g, add, real, node, what, nodes)
            if wider is not None:
                return wider
            return self._refuse(real, "mixed-precision", f"{what}: Cast {real.name!r} changes the sum's type "
                                "before the norm; the fused op normalises the sum in its own type", nodes)
        elem_type = g.elem_type(a)
        if elem_type not in _FLOAT_TYPES or g.elem_type(b) != elem_type:
            return None

        hidden = self._residual_shapes(g, add, node, what, nodes)
        if isinstance(hidden, Refusal):
            return hidden
        if reshape is not None:
            why = self._reshape_problem(g, reshape, hidden, what, nodes)
            if why is not None:
                return why
        why = self._norm_problem(g, node, what, nodes)
        if why is not None:
            return why
        params = self._params(g, node, hidden, what, nodes)
        if isinstance(params, Refusal):
            return params
        gamma, beta = params

        # The sum may leave the set at most once along Add -> Cast/Reshape... -> norm: that value becomes S.
        members = set(nodes)
        chain_values = [add.output[0]] + [c.output[0] for c in reversed(chain)]
        escaping = [v for v in chain_values
                    if v in g.graph_outputs or any(c.name not in members for c in g.consumers_of(v))]
        # Read on both sides of the Reshape (the sum as added and as reshaped: OPT's TorchScript export takes the
        # Add's Shape for the output view and feeds the [B*S, H] view to the norm and the next residual): the fused
        # op's S is the sum as added, and the reshaped one is S reshaped after it, as Y is.
        both_sides = (len(escaping) == 2 and reshape is not None
                      and chain_values.index(escaping[0]) < chain_values.index(reshape.output[0])
                      <= chain_values.index(escaping[1]))
        if len(escaping) > 1 and not both_sides:
            return self._refuse(add, "shared-intermediate", f"{what}: the sum is read outside the pattern both as "
                                f"{escaping[0]!r} and as {escaping[1]!r}; the fused op has one sum output", nodes)
        sum_out = escaping[0] if escaping else None
        sum_reshaped = False
        if sum_out is not None and reshape is not None and not both_sides:
            sum_reshaped = chain_values.index(sum_out) >= chain_values.index(reshape.output[0])
        outputs = (node.output[0],) + tuple(escaping)
        esc = escaping_intermediate(g, nodes, outputs)
        if esc is not None:
            return self._refuse(g.node(esc[1]), esc[0], f"{what}: {esc[2]}", nodes)

        a_attrs = attributes(node)
        plan = _Plan(add.name, node.name, a, b, gamma, beta, sum_out,
                     float(a_attrs.get("epsilon", _DEFAULT_EPSILON)),
                     int(a_attrs.get("stash_type", _DEFAULT_STASH_TYPE)), elem_type, hidden,
                     reshape.input[1] if reshape is not None else None, sum_reshaped)
        ordered = tuple(sorted(nodes, key=lambda n: g.topo_index[n]))
        kind = f"Add{self.kind}" + ("[sum]" if sum_out is not None else "")
        return Match(self.name, ordered, g.boundary_inputs(ordered), outputs, kind,
                     info={"plan": plan, "anchor": node.name})

    # ---- checks ----
    def _norm_in_wider_type(self, g: Graph, add: onnx.NodeProto, cast: onnx.NodeProto, norm: onnx.NodeProto,
                            what: str, nodes: list[str]) -> Refusal | None:
        """Gemma's RMSNorm in an fp16 model: the sum cast up to float32 and normalised *and scaled* there (gamma a
        float32 vector, Gemma's 1 + weight), the result cast back after. No fused op computes that: AddRMSNorm (as
        RMSNormalization) rounds the normalised value to the sum's type before the affine, with gamma in that type,
        and so does Ascend's AddRmsNorm (gamma in x1's type). One rounding more, so a precise near-miss."""
        sum_type, norm_type = g.elem_type(add.output[0]), g.elem_type(norm.input[0])
        gamma = norm.input[1] if len(norm.input) > 1 else ""
        if self.kind != "RMSNorm" or not gamma or sum_type not in _FLOAT_TYPES or norm_type not in _FLOAT_TYPES or \
                sum_type == norm_type or g.elem_type(gamma) != norm_type:
            return None
        name = lambda t: TensorProto.DataType.Name(t).lower()  # noqa: E731
        return self._refuse(cast, "norm-in-wider-type", f"{what}: the sum ({name(sum_type)}) is cast up by "
                            f"{cast.name!r} and normalised and scaled by gamma {gamma!r} in {name(norm_type)} (the "
                            f"norm's affine in the wider type, as Gemma's x * (1 + weight)); Add{self.kind} and "
                            f"Ascend's Add{self.kind.replace('RMSNorm', 'RmsNorm')} round the normalised sum to "
                            f"{name(sum_type)} before a gamma of that type, one rounding the model does not make",
                            nodes)

    def _residual_shapes(self, g: Graph, add: onnx.NodeProto, norm: onnx.NodeProto, what: str,
                         nodes: list[str]) -> int | Refusal:
        """The hidden size H if the two operands provably have one shape with a static last dim H, else a refusal.

        Ascend's AddLayerNorm / AddRmsNorm take x1 and x2 of one shape: an operand that broadcasts, even over the
        leading axes only (a [1, S, H] or [S, H] position table added to [B, S, H] word embeddings, a [H] bias), is
        refused, and the norm stays fused on its own (LayerNormalization / npufuse.LayerNorm, phase 0): the Add
        stays an Add. Equal shapes are proven by equal dims (numbers, or the same symbol) or, where shape
        inference named them differently, by following the dims through the graph (`algebra.dims`)."""
        x, y = add.input
        sa, sb = g.shape(x), g.shape(y)
        if not sa or not sb:
            missing = x if not sa else y
            return self._refuse(add, "unknown-shape", f"{what}: the shape of {missing!r} is unknown, so it cannot "
                                "be shown that the two operands have one shape", nodes)
        la, lb = sa[-1], sb[-1]
        if not isinstance(la, int) or not isinstance(lb, int) or la != lb:
            return self._refuse(add, "residual-broadcast", f"{what}: operands of shapes {list(sa)} and {list(sb)} "
                                "do not have one static size on the last (normalised) axis", nodes)
        if len(sa) == len(sb) and all(p == q and p is not None for p, q in zip(sa, sb)):
            return la
        da, db = value_dims(g, x), value_dims(g, y)
        if da is not None and db is not None and da == db:
            return la
        table = next((v for v in (x, y) if g.is_constant(v)), None)
        role = (f"the constant {table!r} (a position / token-type table or a bias)" if table is not None
                else "one operand")
        # A 1 against an unknown dim (None, or a name shape inference made up: unk__N) is not shown to broadcast
        # (that dim may be 1 as well): unproven, below. Against a dim the model names (batch) it is a broadcast.
        # The followed dims say the same where inference made a name up: [1, S, H] against a [batch, S, H] it
        # named [unk__0, unk__1, H].
        if len(sa) != len(sb) or any(p != q and 1 in (p, q) and not (_unknown(p) or _unknown(q))
                                     for p, q in zip(sa, sb)) or \
                any(isinstance(p, int) and isinstance(q, int) and p != q for p, q in zip(sa, sb)) or \
                (da is not None and db is not None and len(da) == len(db) and
                 any(p != q and 1 in (p, q) and _named(p) and _named(q) for p, q in zip(da, db))):
            return self._refuse(add, "operand-broadcast", f"{what}: {role} broadcasts: shapes {list(sa)} and "
                                f"{list(sb)}; Ascend's Add{self.kind} takes x2 of x1's shape only, so the Add stays "
                                f"and the {self.kind} is fused alone", nodes)
        shown = (f"followed through the graph: [{', '.join(map(dim_str, da))}] vs [{', '.join(map(dim_str, db))}]"
                 if da is not None and db is not None else "their dims could not be followed through the graph")
        return self._refuse(add, "residual-shape-unproven", f"{what}: operands of shapes {list(sa)} and {list(sb)} "
                            f"are not provably equal ({shown}); Ascend's Add{self.kind} takes x2 of x1's shape "
                            "only, and a dim named differently may be 1 at run time", nodes)

    def _reshape_problem(self, g: Graph, reshape: onnx.NodeProto, hidden: int, what: str, nodes: list[str]
                         ) -> Refusal | None:
        """A Reshape between the sum and the norm commutes with a norm over the last axis iff it keeps that axis:
        rows of H stay rows of H. The fused op normalises the sum and reshapes the result."""
        si, so = g.shape(reshape.input[0]), g.shape(reshape.output[0])
        if si and so and si[-1] == hidden and so[-1] == hidden:
            return None
        return self._refuse(reshape, "reshape-changes-last-axis", f"{what}: Reshape {reshape.name!r} from "
                            f"{list(si) if si else 'unknown'} to {list(so) if so else 'unknown'} does not provably "
                            f"keep the normalised axis of size {hidden}; only a Reshape that keeps rows of H "
                            "commutes with the norm", nodes)

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
        after: list[onnx.NodeProto] = []
        if plan.reshape_shape is not None:
            # Add -> Reshape -> norm: normalise the sum in the Add's shape, then reshape Y (and S where the reshaped
            # sum is what the rest of the graph reads) to the shape the norm saw. With the sum read on both sides
            # (outputs Y, S, reshaped S), the fused op writes S as added and the reshaped sum is S reshaped.
            for i, out in enumerate(outputs):
                if i == 1 and not plan.sum_reshaped:
                    continue
                pre = outputs[1] if i == 2 else unique_name(g, f"{out}.unreshaped", taken)
                after.append(helper.make_node("Reshape", [pre, plan.reshape_shape], [out],
                                              name=unique_name(g, f"{plan.norm}.reshape{i}", taken)))
                outputs[i] = pre
            outputs = outputs[:2]
        attrs = {"epsilon": plan.epsilon, "stash_type": plan.stash_type}
        opset = g.opset.get("", 1)
        node, _ = self.fused.make_node(inputs, outputs, plan.norm, attrs, opset, plan.elem_type)
        has_beta, with_sum = beta is not None, len(outputs) == 2
        fn = shared_body((FUSED_DOMAIN, self.fused.op_type, repr(sorted(attrs.items())), opset, plan.elem_type,
                          has_beta, with_sum),
                         lambda: self._body(attrs, opset, plan.elem_type, has_beta=has_beta, with_sum=with_sum))
        node.overload = fn.overload
        return Replacement([node] + after, inits, [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})

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
