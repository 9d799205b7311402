"""GroupNorm, in every spelling the exporters write, [+ SiLU]  =>  npufuse.GroupNorm / npufuse.GroupNormSilu.

GroupNorm normalises x (N, C, *) over each group of C/G channels (with all their spatial positions), then applies a
per-channel affine. The exporters write it as:
    TorchScript and dynamo:  Reshape(x, [0|N, G, -1]) -> InstanceNormalization(ones[G], zeros[G], eps)
                             -> Reshape(Shape(x) | x's static shape) [-> Mul(gamma) ] [-> Add(beta)]
    ONNX op:                 GroupNormalization (opset 18: scale/bias per group; opset 21: per channel)
and diffusers / wav2vec2 follow it with SiLU (y * Sigmoid(y)). The SiLU is absorbed where y feeds nothing else:
Ascend's GroupNormSilu computes exactly that in one kernel, and the norm alone on GroupNormSilu with its SiLU off.

Refusals (near-misses naming their node): `opset` (below 9 the body cannot hold its int64 reshape targets),
`group-reshape` (the InstanceNormalization's input is not x viewed as
(N, G, -1)), `group-affine` (the InstanceNormalization scales or shifts per group: not a plain GroupNorm),
`reshape-back` (its output is not viewed back to x's shape), `groups-divide-channels` (C unknown or not a
multiple of G), `mixed-precision` (GroupNormalization-21 with statistics in another type than x's).
A per-channel affine that is not a constant [C]/[C,1,..]/[1,C,1,..] stays outside the fused op (the norm fuses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph, attributes, np_dtype
from npufuse.ir.matching import (
    STD_DOMAINS,
    escaping_intermediate,
    other_operand,
    sole_consumer,
    std_op,
)
from npufuse.patterns import kernels
from npufuse.patterns.base import (
    FusedOpDef,
    Pattern,
    make_body,
    node_with_refs,
    require_opset,
    unique_name,
)

DEFAULT_EPSILON = 1e-5   # InstanceNormalization's and GroupNormalization's default
INT64_CONSTANT_OPSET = 9  # the body's reshape targets are int64 Constants: Constant holds only floats before 9


# ---- the fused ops ---------------------------------------------------------------------------------------------

def group_norm_reference(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, num_groups: int, epsilon: float,
                         silu: bool) -> np.ndarray:
    """GroupNorm [+ SiLU] in float64, returned in x's dtype: statistics over each group of C/G channels and all
    positions, population variance, then the per-channel affine."""
    n, c = x.shape[:2]
    if num_groups <= 0 or c % num_groups:
        raise ValueError(f"GroupNorm: {num_groups} groups do not divide C={c}")
    xg = x.astype(np.float64).reshape(n, num_groups, -1)
    d = xg - xg.mean(axis=-1, keepdims=True)
    norm = (d / np.sqrt((d * d).mean(axis=-1, keepdims=True) + float(epsilon))).reshape(x.shape)
    per_channel = (1, c) + (1,) * (x.ndim - 2)
    z = norm * scale.astype(np.float64).reshape(per_channel) + bias.astype(np.float64).reshape(per_channel)
    if silu:
        z = z * kernels.sigmoid(z)
    return z.astype(x.dtype)


def _reference(silu: bool):
    def run(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
        x, scale, bias = inputs[0], inputs[1], inputs[2]
        return [group_norm_reference(x, scale, bias, int(attrs["num_groups"]),
                                     float(attrs.get("epsilon", DEFAULT_EPSILON)), silu)]
    return run


def _body(silu: bool):
    def body(attrs: dict[str, Any], opset: int, elem_type: int) -> onnx.FunctionProto:
        """Standard ops of `opset` (>= 7): x viewed (N, G, -1) through InstanceNormalization with unit scale, viewed
        (N, C, -1) for the per-channel affine, then back to x's shape. The group count and the element type are
        baked into the overload (the unit scale is a tensor of G values of x's type); epsilon is forwarded."""
        groups = int(attrs["num_groups"])
        np_t = np_dtype(elem_type) or np.dtype(np.float32)
        require_opset("GroupNorm", opset, INT64_CONSTANT_OPSET, "int64 Constants for the reshape targets")

        def const(name: str, arr: np.ndarray) -> onnx.NodeProto:
            return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(arr, name))

        nodes = [
            const("GroupShape", np.array([0, groups, -1], np.int64)),
            const("ChannelShape", np.array([0, 0, -1], np.int64)),
            const("Column", np.array([-1, 1], np.int64)),
            const("Ones", np.ones(groups, np_t)), const("Zeros", np.zeros(groups, np_t)),
            helper.make_node("Shape", ["X"], ["XShape"]),
            helper.make_node("Reshape", ["X", "GroupShape"], ["XG"]),
            node_with_refs("InstanceNormalization", ["XG", "Ones", "Zeros"], ["NG"],
                           [("epsilon", AttributeProto.FLOAT)]),
            helper.make_node("Reshape", ["NG", "XShape"], ["N"]),
            helper.make_node("Reshape", ["N", "ChannelShape"], ["NC"]),
            helper.make_node("Reshape", ["scale", "Column"], ["S"]),
            helper.make_node("Reshape", ["bias", "Column"], ["B"]),
            helper.make_node("Mul", ["NC", "S"], ["Scaled"]),
            helper.make_node("Add", ["Scaled", "B"], ["Z"]),
        ]
        z = "Z"
        if silu:
            nodes += [helper.make_node("Sigmoid", ["Z"], ["Sig"]), helper.make_node("Mul", ["Z", "Sig"], ["ZS"])]
            z = "ZS"
        nodes.append(helper.make_node("Reshape", [z, "XShape"], ["Y"]))
        op = "GroupNormSilu" if silu else "GroupNorm"
        return make_body(FUSED_DOMAIN, op, ["X", "scale", "bias"], ["Y"], nodes, [helper.make_opsetid("", opset)],
                         attributes=["num_groups", "epsilon"], overload=f"{np_t.name}_g{groups}",
                         doc_string=f"{op}: statistics per group of channels, per-channel affine"
                                    + (", then SiLU." if silu else "."))
    return body


GROUP_NORM = FusedOpDef(
    op_type="GroupNorm",
    doc="Y = (X - mean) / sqrt(var + epsilon) * scale + bias; X (N, C, *), mean and var over each of num_groups "
        "groups of C/num_groups channels and all positions; scale, bias per channel [C].",
    inputs=("X", "scale", "bias"), outputs=("Y",), attributes=("num_groups", "epsilon"),
    reference=_reference(False), body=_body(False),
)
GROUP_NORM_SILU = FusedOpDef(
    op_type="GroupNormSilu",
    doc="Z = GroupNorm(X, scale, bias); Y = Z * sigmoid(Z) (Ascend's GroupNormSilu).",
    inputs=("X", "scale", "bias"), outputs=("Y",), attributes=("num_groups", "epsilon"),
    reference=_reference(True), body=_body(True),
)


# ---- matching --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    x: str
    out: str
    nodes: tuple[str, ...]
    groups: int
    channels: int
    epsilon: float
    scale: np.ndarray | None
    scale_name: str | None
    bias: np.ndarray | None
    bias_name: str | None
    silu: bool
    elem_type: int


class _Refused(Exception):
    def __init__(self, node: str, reason: str, detail: str):
        super().__init__(detail)
        self.node, self.reason, self.detail = node, reason, detail


def _ints(g: Graph, v: str) -> list[int] | None:
    arr = g.constant(v) if v else None
    return None if arr is None else [int(a) for a in np.asarray(arr).ravel()]


def _all_equal(g: Graph, v: str, value: float, length: int) -> bool:
    arr = g.constant(v) if v else None
    return arr is not None and arr.size == length and bool(np.all(np.asarray(arr, np.float64) == value))


def _channel_vector(g: Graph, v: str, channels: int, rank: int) -> np.ndarray | None:
    """`v` as a per-channel [C] vector if it is a constant that broadcasts along axis 1 of a rank-`rank` tensor
    only ([C], [C,1,..,1], [1,C,1,..,1] or a scalar), else None."""
    arr = g.constant(v)
    if arr is None or arr.ndim > rank:
        return None
    if arr.size == 1:
        return np.full(channels, arr.reshape(()), dtype=arr.dtype)
    full = (1,) * (rank - arr.ndim) + tuple(arr.shape)     # numpy broadcasting aligns trailing axes
    if full[1] != channels or any(d != 1 for i, d in enumerate(full) if i != 1):
        return None
    return arr.reshape(-1)


def _reshapes_back(g: Graph, back: onnx.NodeProto, x: str, nodes: list[str]) -> bool:
    """True if Reshape `back` restores x's shape: its target is Shape(x) (taken whole) or x's static shape."""
    if attributes(back).get("allowzero", 0):
        return False
    target = back.input[1]
    p = g.producer_of(target)
    if std_op(p, "Shape") and p.input[0] == x and "start" not in attributes(p) and "end" not in attributes(p):
        if g.single_consumer(target) is back and target not in g.graph_outputs:
            nodes.append(p.name)
        return True
    want = g.shape(x)
    return (want is not None and all(isinstance(d, int) for d in want) and _ints(g, target) == list(want))


def _parse_instance_form(g: Graph, inorm: onnx.NodeProto) -> tuple[str, str, list[str], int, float]:
    """(x, normalised value, nodes, groups, epsilon) of Reshape -> InstanceNormalization -> Reshape back."""
    pre = g.producer_of(inorm.input[0])
    if not std_op(pre, "Reshape"):
        raise _Refused(inorm.name, "group-reshape", f"InstanceNormalization {inorm.name!r} does not read a Reshape: "
                       "a plain instance norm, not a GroupNorm")
    x = pre.input[0]
    target = _ints(g, pre.input[1])
    shape = g.shape(x)
    lead = shape[0] if shape else None
    if (target is None or len(target) != 3 or target[1] <= 0 or target[2] not in (-1,)
            or not (target[0] == 0 and not attributes(pre).get("allowzero", 0)
                    or (isinstance(lead, int) and target[0] == lead))
            or shape is None or len(shape) < 2):
        raise _Refused(pre.name, "group-reshape", f"Reshape {pre.name!r} before InstanceNormalization "
                       f"{inorm.name!r} does not view its input as (N, G, -1) (target {target}, input shape {shape})")
    groups = target[1]
    if len(inorm.input) < 3 or not _all_equal(g, inorm.input[1], 1.0, groups) \
            or not _all_equal(g, inorm.input[2], 0.0, groups):
        raise _Refused(inorm.name, "group-affine", f"InstanceNormalization {inorm.name!r} scales or shifts per group "
                       "(its scale is not all ones or its bias not all zeros)")
    nodes = [pre.name, inorm.name]
    back = sole_consumer(g, inorm.output[0], "Reshape")
    if back is None or not _reshapes_back(g, back, x, nodes):
        raise _Refused(inorm.name, "reshape-back", f"the output of InstanceNormalization {inorm.name!r} is not "
                       f"viewed back to the shape of {x!r}")
    nodes.append(back.name)
    eps = float(attributes(inorm).get("epsilon", DEFAULT_EPSILON))
    return x, back.output[0], nodes, groups, eps


def _parse_group_normalization(g: Graph, node: onnx.NodeProto, channels: int | None
                               ) -> tuple[np.ndarray | None, np.ndarray | None, int, float]:
    """(scale [C], bias [C], groups, epsilon) of an ONNX GroupNormalization (18: per-group affine, 21: per-channel)."""
    a = attributes(node)
    groups = int(a.get("num_groups", 0))
    eps = float(a.get("epsilon", DEFAULT_EPSILON))
    opset = g.opset.get("", 1)
    if opset >= 21 and int(a.get("stash_type", TensorProto.FLOAT)) != g.elem_type(node.input[0]):
        raise _Refused(node.name, "mixed-precision", f"GroupNormalization {node.name!r} computes its statistics in "
                       "another type than its input's; npufuse.GroupNorm computes in the input's type")
    vecs = []
    for v in node.input[1:3]:
        arr = g.constant(v) if v else None
        if arr is None or channels is None or groups <= 0:
            vecs.append(None)
            continue
        arr = np.asarray(arr).reshape(-1)
        if opset < 21 and arr.size == groups:
            arr = np.repeat(arr, channels // groups)          # per group -> per channel
        vecs.append(arr if arr.size == channels else None)
    if any(v is None for v in vecs):
        raise _Refused(node.name, "group-affine", f"GroupNormalization {node.name!r}: scale or bias is not a constant "
                       "that can be read per channel")
    return vecs[0], vecs[1], groups, eps


class GroupNormPattern(Pattern):
    name = "group_norm"
    description = ("Reshape/InstanceNormalization/Reshape/Mul/Add or GroupNormalization [+ Sigmoid/Mul SiLU] into "
                   "npufuse.GroupNorm / npufuse.GroupNormSilu")
    anchor_ops = frozenset({"InstanceNormalization", "GroupNormalization"})
    phase = 0
    fused_ops = (GROUP_NORM, GROUP_NORM_SILU)

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if node.domain not in STD_DOMAINS or not node.input or not node.output:
            return None
        if g.opset.get("", 1) < INT64_CONSTANT_OPSET:
            return Refusal(self.name, node.name, "opset", f"GroupNorm at {node.name!r}: the model's opset "
                           f"{g.opset.get('', 1)} is below {INT64_CONSTANT_OPSET}, which npufuse.GroupNorm's body "
                           "needs", (node.name,))
        try:
            plan = self._plan(g, node)
        except _Refused as why:
            return Refusal(self.name, why.node, why.reason, why.detail, (node.name,))
        esc = escaping_intermediate(g, plan.nodes, [plan.out])
        if esc is not None:
            return Refusal(self.name, esc[1], esc[0], f"GroupNorm at {node.name!r}: {esc[2]}", plan.nodes)
        ordered = tuple(sorted(plan.nodes, key=lambda n: g.topo_index[n]))
        kind = f"npufuse.{'GroupNormSilu' if plan.silu else 'GroupNorm'}"
        return Match(self.name, ordered, g.boundary_inputs(ordered), (plan.out,), kind,
                     info={"plan": plan, "anchor": node.name})

    def _plan(self, g: Graph, node: onnx.NodeProto) -> _Plan:
        if node.op_type == "InstanceNormalization":
            x, out, nodes, groups, eps = _parse_instance_form(g, node)
            scale = bias = None
        else:
            x, out, nodes = node.input[0], node.output[0], [node.name]
        shape = g.shape(x)
        rank = len(shape) if shape else 0
        channels = shape[1] if rank >= 2 and isinstance(shape[1], int) else None
        if node.op_type == "GroupNormalization":
            scale, bias, groups, eps = _parse_group_normalization(g, node, channels)
        scale_name = bias_name = None
        if node.op_type == "InstanceNormalization" and channels is not None:
            scale, scale_name, out = self._affine(g, out, "Mul", channels, rank, nodes)
            bias, bias_name, out = self._affine(g, out, "Add", channels, rank, nodes)
        if channels is None or groups <= 0 or channels % groups:
            raise _Refused(node.name, "groups-divide-channels", f"GroupNorm at {node.name!r}: {groups} groups and "
                           f"{channels if channels is not None else 'an unknown number of'} channels")
        silu = self._silu(g, out, nodes)
        if silu is not None:
            out = silu
        elem_type = g.elem_type(x)
        return _Plan(x, out, tuple(nodes), groups, channels, eps, scale, scale_name, bias, bias_name,
                     silu is not None, elem_type)

    @staticmethod
    def _affine(g: Graph, v: str, op: str, channels: int, rank: int, nodes: list[str]
                ) -> tuple[np.ndarray | None, str | None, str]:
        """The per-channel Mul (gamma) or Add (beta) applied to `v`, if its sole consumer is one."""
        n = sole_consumer(g, v, op)
        other = other_operand(n, v) if n is not None else None
        if other is None or other == v or not g.is_constant(other):
            return None, None, v
        vec = _channel_vector(g, other, channels, rank)
        if vec is None:
            return None, None, v
        nodes.append(n.name)
        return vec, other, n.output[0]

    @staticmethod
    def _silu(g: Graph, z: str, nodes: list[str]) -> str | None:
        """The output of z * Sigmoid(z) when those two nodes are all that read z."""
        if z in g.graph_outputs:
            return None
        cons = g.consumers_of(z)
        sig = next((c for c in cons if std_op(c, "Sigmoid")), None)
        mul = next((c for c in cons if std_op(c, "Mul")), None)
        if len(cons) != 2 or sig is None or mul is None or sorted(mul.input) != sorted([z, sig.output[0]]) \
                or g.single_consumer(sig.output[0]) is not mul or sig.output[0] in g.graph_outputs:
            return None
        nodes += [sig.name, mul.name]
        return mul.output[0]

    def build(self, g: Graph, m: Match) -> Replacement:
        plan: _Plan = m.info["plan"]
        op = GROUP_NORM_SILU if plan.silu else GROUP_NORM
        np_t = np_dtype(plan.elem_type) or np.dtype(np.float32)
        taken: set[str] = set()
        inits: list[onnx.TensorProto] = []

        def vector(arr: np.ndarray | None, name: str | None, role: str, fill: float) -> str:
            t = g.initializers.get(name) if name else None
            if t is not None and list(t.dims) == [plan.channels] and np_dtype(t.data_type) == np_t \
                    and name not in g.graph_inputs:
                return name                               # the model's own [C] weight, as it is
            if arr is None:
                arr = np.full(plan.channels, fill, np_t)
            new = unique_name(g, f"{m.info['anchor']}.{role}", taken)
            inits.append(numpy_helper.from_array(np.ascontiguousarray(np.asarray(arr).astype(np_t)), new))
            return new

        inputs = [plan.x, vector(plan.scale, plan.scale_name, "scale", 1.0),
                  vector(plan.bias, plan.bias_name, "bias", 0.0)]
        attrs = {"num_groups": plan.groups, "epsilon": plan.epsilon}
        node, fn = op.make_node(inputs, [plan.out], m.info["anchor"], attrs, g.opset.get("", 1), plan.elem_type)
        return Replacement([node], inits, [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})

