"""Gated MLP: act(x·W_gate [+ b]) * (x·W_up [+ b])  =>  npufuse.GatedMLP.

The gate and up projections of a SwiGLU / GeGLU / ReGLU feed-forward block (Llama, Mistral, Qwen, Phi-3,
T5 v1.1, diffusers' GEGLU), fused into one Cube+Vector kernel: the Cube computes the gate and up tiles of the
same rows from one read of x, the Vector unit applies the activation to the gate half and multiplies by the
up half while both are on chip, and only the product goes back to GM. The down projection stays separate.

Forms matched (the anchor is the product Mul, either operand order):
- separate: two MatMuls (or Gemms, transA=0) reading the same x, each with an optional constant bias
  (`Add` of a [N] / [1,..,N] vector, or Gemm's C), the activation on one of them;
- merged: one MatMul x·W_gate_up [K, 2N] (+ bias [2N]) cut into halves along the last axis by
  `Split(axis=-1)` (sizes [N, N], `num_outputs=2`, or omitted) or by two `Slice`s ([0, N) and [N, 2N), bounds
  as constants, or as TorchScript's `Shape -> Gather -> Div -> Unsqueeze` arithmetic on a dim that is
  static); the activation on either half (`gate_first` records which).
Activations: SiLU as x*Sigmoid(x) (either order) or `Swish(alpha=1)`; GELU as the single `Gelu` /
`npufuse.Gelu` phase 0 leaves (erf: "gelu", tanh: "gelu_tanh"); `Relu`.

Refusals (near-misses, each with the node): `different-inputs` (gate and up read different tensors),
`dynamic-weight`, `weight-shape-mismatch`, `bias-not-last-axis`, `uneven-split` (a Split or two Slices that
are not exact halves of the last axis), `split-not-last-axis`, `slice-bounds-unknown` (bounds no static
arithmetic proves), `product-not-gated` (the activated projection is multiplied by something that is not
the matching up projection), and `shared-intermediate` / `intermediate-is-output`.

Phase 1: after phase 0 made GELUs single ops, before `matmul_epilogue` (phase 2), which would otherwise take
the gate's activation into the gate projection as FusedMatMul[silu]. Where this pattern refuses, or the cost
model declines it, FusedMatMul still takes the gate projection and its activation.

Ascend: the merged form is MatMul(V3) followed by SwiGlu (silu; the first half is activated, i.e.
gate_first=1, `dim`=-1) or GeGluV2 (gelu / gelu_tanh via `approximate`, the half chosen by `activate_left`),
or GeluMul; the separate form is the same kernels after a MatMul with the two weights concatenated along N.
ReGLU has no dedicated CANN kernel (ATC's MatMul + elementwise UB fusion is the closest).
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
from npufuse.ir.graph import Graph, attributes
from npufuse.patterns.base import ERF_OPSET, FusedOpDef, Pattern, make_body, require_opset, unique_name
from npufuse.ir.matching import MatchRefused, escaping_intermediate, std_op
from npufuse.algebra.shapes import clamp_index, slice_bounds, static_ints

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
_GELU_OPS = frozenset({("", "Gelu"), (FUSED_DOMAIN, "Gelu")})


# ---- the fused op ----------------------------------------------------------------------------------

def activate(name: str, y: np.ndarray) -> np.ndarray:
    """The gate's activation in float64 (the semantics an NPU kernel author implements)."""
    if name == "silu":
        return y * kernels.sigmoid(y)
    if name == "relu":
        return np.maximum(y, 0.0)
    if name in ("gelu", "gelu_tanh"):
        return kernels.gelu(y, "tanh" if name == "gelu_tanh" else "none")
    raise ValueError(f"GatedMLP: unknown activation {name!r}")


def gated_mlp_reference(inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Y = act(gate) * up in float64, returned in X's dtype.

    merged=0: gate = X @ W_gate + B_gate, up = X @ W_up + B_up.
    merged=1: H = X @ W_gate (the [K, 2N] gate_up weight) + B_gate ([2N]); its first half along the last axis
    is the gate when gate_first=1, else the up projection.
    """
    ins = list(inputs) + [None] * (5 - len(inputs))
    x, w, w_up, b, b_up = ins[:5]
    act = str(attrs.get("activation", "silu"))
    x64 = x.astype(np.float64)
    if int(attrs.get("merged", 0)):
        h = np.matmul(x64, w.astype(np.float64))
        if b is not None:
            h = h + b.astype(np.float64).reshape(-1)
        n = h.shape[-1] // 2
        first, second = h[..., :n], h[..., n:]
        gate, up = (first, second) if int(attrs.get("gate_first", 1)) else (second, first)
    else:
        gate = np.matmul(x64, w.astype(np.float64))
        up = np.matmul(x64, w_up.astype(np.float64))
        if b is not None:
            gate = gate + b.astype(np.float64).reshape(-1)
        if b_up is not None:
            up = up + b_up.astype(np.float64).reshape(-1)
    return [(activate(act, gate) * up).astype(x.dtype)]


class _Body:
    """Function-body nodes with fresh value names and constants typed like X."""

    def __init__(self, elem_type: int) -> None:
        self.elem_type = elem_type
        self.nodes: list[onnx.NodeProto] = []
        self.count = 0

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs: Any) -> str | list[str]:
        outs = []
        for _ in range(n_out):
            self.count += 1
            outs.append(f"{op_type.lower()}_{self.count}")
        self.nodes.append(helper.make_node(op_type, inputs, outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value: float, hint: str) -> str:
        self.count += 1
        name = f"{hint}_{self.count}"
        self.nodes.append(helper.make_node("Constant", [], [name],
                                           value=helper.make_tensor(name, self.elem_type, [], [value])))
        return name


def _body_activation(b: _Body, act: str, x: str, opset: int) -> tuple[str, str]:
    """(output, overload token) of the activation from ops of `opset`."""
    if act == "silu":
        return b.op("Mul", [x, b.op("Sigmoid", [x])]), "silu"
    if act == "relu":
        return b.op("Relu", [x]), "relu"
    if act in ("gelu", "gelu_tanh"):
        approx = "none" if act == "gelu" else "tanh"
        if opset >= 20:
            return b.op("Gelu", [x], approximate=approx), f"{act}_op"
        if act == "gelu":
            require_opset("GatedMLP", opset, ERF_OPSET, "Erf for the exact GELU")
            inner = b.op("Erf", [b.op("Mul", [x, b.const(1.0 / math.sqrt(2.0), "inv_sqrt2")])])
        else:
            cube = b.op("Mul", [b.op("Mul", [x, x]), x])
            poly = b.op("Add", [x, b.op("Mul", [cube, b.const(0.044715, "c_cubic")])])
            inner = b.op("Tanh", [b.op("Mul", [poly, b.const(math.sqrt(2.0 / math.pi), "sqrt_2_over_pi")])])
        one_plus = b.op("Add", [inner, b.const(1.0, "one")])
        return b.op("Mul", [b.op("Mul", [x, one_plus]), b.const(0.5, "half")]), f"{act}_formula"
    raise ValueError(f"GatedMLP: no function body for activation {act!r}")


def gated_mlp_body(attrs: dict[str, Any], opset: int, elem_type: int) -> onnx.FunctionProto:
    """The GatedMLP function body from ops of the default-domain `opset`; one overload per activation, form,
    half order, bias, opset-dependent choice (Split's signature, Gelu op or formula) and, where constants are
    baked in, element type."""
    act = str(attrs.get("activation", "silu"))
    merged = int(attrs.get("merged", 0))
    gate_first = int(attrs.get("gate_first", 1))
    has_bias = int(attrs.get("has_bias", 0))
    b = _Body(elem_type)
    tokens = ["gated", act]
    if merged:
        h = b.op("MatMul", ["X", "W_gate"])
        if has_bias:
            h = b.op("Add", [h, "B_gate"])
        if opset >= 18:
            halves = b.op("Split", [h], 2, axis=-1, num_outputs=2)
        else:   # no sizes: equal halves (2N is even by construction)
            halves = b.op("Split", [h], 2, axis=-1)
        gate, up = halves if gate_first else halves[::-1]
        tokens += ["merged", "gate_first" if gate_first else "up_first", "split18" if opset >= 18 else "split"]
    else:
        gate, up = b.op("MatMul", ["X", "W_gate"]), b.op("MatMul", ["X", "W_up"])
        if has_bias:
            gate, up = b.op("Add", [gate, "B_gate"]), b.op("Add", [up, "B_up"])
        tokens.append("separate")
    if has_bias:
        tokens.append("bias")
    activated, token = _body_activation(b, act, gate, opset)
    tokens[1] = token
    b.nodes.append(helper.make_node("Mul", [activated, up], ["Y"]))
    if token.endswith("_formula"):
        tokens.append(helper.tensor_dtype_to_np_dtype(elem_type).name if elem_type != TensorProto.BFLOAT16
                      else "bfloat16")
    return make_body(
        FUSED_DOMAIN, "GatedMLP", ["X", "W_gate", "W_up", "B_gate", "B_up"], ["Y"], b.nodes,
        [helper.make_opsetid("", opset)], attributes=["activation", "merged", "gate_first", "has_bias"],
        overload="__".join(tokens),
        doc_string="act(X @ W_gate + B_gate) * (X @ W_up + B_up); merged=1: one [K, 2N] weight cut into halves.")


GATED_MLP = FusedOpDef(
    op_type="GatedMLP",
    doc="Y = act(gate) * up. merged=0: gate = X @ W_gate (+ B_gate), up = X @ W_up (+ B_up). merged=1: "
        "H = X @ W_gate (+ B_gate), W_gate being the [K, 2N] gate_up weight and B_gate its [2N] bias (W_up, B_up "
        "absent); gate and up are the halves of H along the last axis, the gate first when gate_first=1. "
        "activation: silu (x * sigmoid(x)), gelu (erf), gelu_tanh, relu. has_bias=1 when the biases are given.",
    inputs=("X", "W_gate", "W_up?", "B_gate?", "B_up?"), outputs=("Y",),
    attributes=("activation", "merged", "gate_first", "has_bias"),
    reference=gated_mlp_reference, body=gated_mlp_body,
)


# ---- matching ------------------------------------------------------------------------------------

@dataclass
class _Projection:
    """x·W [+ bias] made by a MatMul (+ Add) or a Gemm."""

    mm: onnx.NodeProto
    x: str
    w: str
    out: str                       # the projection's value (after the bias)
    bias: str | None = None
    nodes: list[str] = field(default_factory=list)


@dataclass
class _Half:
    """One half (or what claims to be one) of a projection: a Split output or a Slice."""

    node: onnx.NodeProto
    value: str
    proj: _Projection


def _projection(g: Graph, v: str) -> _Projection | None:
    """The projection producing `v`, or None."""
    p = g.producer_of(v)
    if p is None:
        return None
    bias = add = None
    if std_op(p, "Add") and len(p.input) == 2 and p.input[0] != p.input[1]:
        a, c = p.input
        if g.is_constant(a):
            a, c = c, a
        if not g.is_constant(c) or g.is_constant(a):
            return None
        add, bias, p = p, c, g.producer_of(a)
        if p is None:
            return None
    if std_op(p, "MatMul"):
        pass
    elif std_op(p, "Gemm"):
        if attributes(p).get("transA", 0):
            return None
        if len(p.input) > 2 and p.input[2]:
            if add is not None:
                return None       # a bias on top of Gemm's C: two biases, not this pattern
            bias = p.input[2]
    else:
        return None
    if g.is_constant(p.input[0]):
        return None
    nodes = [p.name] + ([add.name] if add is not None else [])
    return _Projection(p, p.input[0], p.input[1], v, bias, nodes)


def _half(g: Graph, v: str) -> _Half | None:
    p = g.producer_of(v)
    if not (std_op(p, "Split") or std_op(p, "Slice")) or not p.input:
        return None
    proj = _projection(g, p.input[0])
    return None if proj is None else _Half(p, v, proj)


def _activation(g: Graph, v: str) -> tuple[str, list[str], str] | None:
    """(activation, its nodes, its input) if `v` is an activation the fused op knows."""
    p = g.producer_of(v)
    if p is None or not p.input:
        return None
    key = ("" if p.domain == "ai.onnx" else p.domain, p.op_type)
    if std_op(p, "Relu"):
        return "relu", [p.name], p.input[0]
    if key in _GELU_OPS:
        approx = attributes(p).get("approximate", "none")
        if approx in ("none", "tanh"):
            return ("gelu" if approx == "none" else "gelu_tanh"), [p.name], p.input[0]
        return None
    if std_op(p, "Swish") and float(attributes(p).get("alpha", 1.0)) == 1.0:
        return "silu", [p.name], p.input[0]
    if std_op(p, "Mul") and len(p.input) == 2:
        for x, s in ((p.input[0], p.input[1]), (p.input[1], p.input[0])):
            sig = g.producer_of(s)
            if x != s and std_op(sig, "Sigmoid") and sig.input[0] == x:
                return "silu", [sig.name, p.name], x
    return None


class GatedMLPPattern(Pattern):
    name = "gated_mlp"
    description = ("SwiGLU / GeGLU / ReGLU: act(x·W_gate) * (x·W_up), separate or one merged gate_up projection "
                   "cut by Split/Slice, into npufuse.GatedMLP")
    anchor_ops = frozenset({"Mul"})
    phase = 1
    fused_ops = (GATED_MLP,)

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if not std_op(node, "Mul") or len(node.input) != 2 or node.input[0] == node.input[1]:
            return None
        refusal: Refusal | None = None
        a, b = node.input
        for act_out, other in ((a, b), (b, a)):
            act = _activation(g, act_out)
            if act is None:
                continue
            nodes = act[1] + [node.name]
            try:
                found = self._gated(g, node, act, other, nodes)
            except MatchRefused as r:
                refusal = refusal or Refusal(self.name, r.node, r.reason, f"gated MLP at {node.name!r}: {r.detail}",
                                             tuple(nodes))
                continue
            if found is not None:
                return found
        return refusal

    # ---- the two forms ----------------------------------------------------------------------
    def _gated(self, g: Graph, mul: onnx.NodeProto, act: tuple[str, list[str], str], other: str,
               nodes: list[str]) -> Match | None:
        activation, _, gate = act
        gate_proj = _projection(g, gate)
        if gate_proj is not None:
            up_proj = _projection(g, other)
            if up_proj is None or up_proj.mm.name == gate_proj.mm.name:
                if g.is_constant(other) or not g.is_constant(gate_proj.w):
                    return None      # a scaled activation, or not a projection by a weight: not this family
                what = "the same projection" if up_proj is not None else "not a projection of the same input"
                raise MatchRefused(mul.name, "product-not-gated", f"{activation}({gate!r}) is multiplied by {other!r}, "
                                   f"{what}; a gated MLP multiplies by the up projection x·W_up")
            return self._separate(g, mul, activation, gate_proj, up_proj, nodes)
        gate_half = _half(g, gate)
        if gate_half is None:
            return None
        up_half = _half(g, other)
        if up_half is None or up_half.proj.out != gate_half.proj.out:
            if g.is_constant(other) or not g.is_constant(gate_half.proj.w):
                return None
            raise MatchRefused(mul.name, "product-not-gated", f"{activation}({gate!r}) is one half of "
                               f"{gate_half.proj.out!r} but is multiplied by {other!r}, not its other half")
        return self._merged(g, mul, activation, gate_half, up_half, nodes)

    def _separate(self, g: Graph, mul: onnx.NodeProto, activation: str, gate: _Projection, up: _Projection,
                  nodes: list[str]) -> Match:
        nodes += gate.nodes + up.nodes
        if gate.x != up.x:
            raise MatchRefused(up.mm.name, "different-inputs", f"the gate projection {gate.mm.name!r} reads {gate.x!r} "
                               f"but the up projection {up.mm.name!r} reads {up.x!r}; both must read the same x")
        n = None
        for proj, role in ((gate, "gate"), (up, "up")):
            k_n = self._weight_shape(g, proj, role)
            if n is not None and k_n != n:
                raise MatchRefused(proj.mm.name, "weight-shape-mismatch", f"the gate weight is {list(n)} but the up "
                                   f"weight {proj.w!r} is {list(k_n)}; both must be [K, N] with the same K and N")
            n = k_n
        assert n is not None
        for proj, role in ((gate, "gate"), (up, "up")):
            self._check_bias(g, proj, n[1], role)
        self._check_escape(g, nodes, mul)
        ordered = tuple(sorted(set(nodes), key=lambda x: g.topo_index[x]))
        has_bias = gate.bias is not None or up.bias is not None
        kind = f"GatedMLP[{activation}{',bias' if has_bias else ''}]"
        return Match(self.name, ordered, g.boundary_inputs(ordered), (mul.output[0],), kind,
                     info={"activation": activation, "merged": 0, "gate": gate, "up": up, "n": n[1]})

    def _merged(self, g: Graph, mul: onnx.NodeProto, activation: str, gate: _Half, up: _Half,
                nodes: list[str]) -> Match:
        proj = gate.proj
        nodes += proj.nodes
        k, width = self._weight_shape(g, proj, "gate_up")
        if width % 2:
            raise MatchRefused(gate.node.name, "uneven-split", f"the gate_up projection {proj.mm.name!r} has an odd "
                               f"width {width}; it has no halves")
        half = width // 2
        h = proj.out
        rank = g.rank(h)
        shape_nodes: list[str] = []
        if gate.node.name == up.node.name:
            gate_first = self._split_halves(g, gate, up, half, rank, shape_nodes)
            nodes.append(gate.node.name)
        else:
            if gate.node.op_type != "Slice" or up.node.op_type != "Slice":
                raise MatchRefused(up.node.name, "uneven-split", f"the halves of {h!r} come from {gate.node.op_type} "
                                   f"{gate.node.name!r} and {up.node.op_type} {up.node.name!r}; one Split or two "
                                   "Slices must cut it")
            ranges = {}
            for part in (gate, up):
                ranges[part.node.name] = self._slice_range(g, part.node, width, rank, shape_nodes)
            if sorted(ranges.values()) != [(0, half), (half, width)]:
                got = ", ".join(f"[{s}, {e})" for s, e in ranges.values())
                raise MatchRefused(gate.node.name, "uneven-split", f"the Slices of {h!r} take {got} of the last "
                                   f"axis (width {width}); exact halves are [0, {half}) and [{half}, {width})")
            gate_first = int(ranges[gate.node.name] == (0, half))
            nodes += [gate.node.name, up.node.name]
        self._check_bias(g, proj, width, "gate_up")
        # Shape arithmetic reading a fused value must go with the fusion; the rest stays and is merely read.
        inside = set(nodes)
        produced = {o for n in nodes for o in g.node(n).output if o}
        for name in sorted(set(shape_nodes), key=lambda x: g.topo_index[x]):
            sn = g.node(name)
            if any(i in produced for i in sn.input):
                inside.add(name)
                produced.update(o for o in sn.output if o)
        nodes[:] = sorted(inside, key=lambda x: g.topo_index[x])
        self._check_escape(g, nodes, mul)
        kind = f"GatedMLP[{activation},merged{',bias' if proj.bias is not None else ''}]"
        return Match(self.name, tuple(nodes), g.boundary_inputs(nodes), (mul.output[0],), kind,
                     info={"activation": activation, "merged": 1, "gate_first": gate_first, "gate": proj,
                           "n": width, "k": k})

    # ---- checks ---------------------------------------------------------------------------------
    @staticmethod
    def _weight_shape(g: Graph, proj: _Projection, role: str) -> tuple[int, int]:
        """(K, N) of the projection's constant 2-D weight as the fused op takes it (Gemm's transB applied)."""
        if not g.is_constant(proj.w):
            raise MatchRefused(proj.mm.name, "dynamic-weight", f"the {role} weight {proj.w!r} of {proj.mm.name!r} is "
                               "not a constant; GatedMLP takes weights")
        shape = g.shape_or_constant(proj.w)
        if shape is None or len(shape) != 2 or not all(isinstance(d, int) for d in shape):
            raise MatchRefused(proj.mm.name, "weight-shape-mismatch", f"the {role} weight {proj.w!r} has shape "
                               f"{None if shape is None else list(shape)}, not a fixed [K, N]")
        k, n = shape
        if proj.mm.op_type == "Gemm" and attributes(proj.mm).get("transB", 0):
            k, n = n, k
        return int(k), int(n)

    @staticmethod
    def _check_bias(g: Graph, proj: _Projection, n: int, role: str) -> None:
        if proj.bias is None:
            return
        arr = g.constant(proj.bias)
        shape = None if arr is None else arr.shape
        rank = g.rank(proj.out)
        if shape is None or (rank is not None and len(shape) > rank) or any(d != 1 for d in shape[:-1]) or \
                (shape and shape[-1] not in (1, n)):
            raise MatchRefused(proj.nodes[-1], "bias-not-last-axis", f"the {role} bias {proj.bias!r} of shape "
                               f"{None if shape is None else list(shape)} is not a vector along the last axis "
                               f"([{n}] or [1,..,{n}])")

    def _check_escape(self, g: Graph, nodes: list[str], mul: onnx.NodeProto) -> None:
        esc = escaping_intermediate(g, nodes, [mul.output[0]])
        if esc is not None:
            raise MatchRefused(esc[1], esc[0], esc[2])

    @staticmethod
    def _last_axis(axis: int, rank: int | None, node: onnx.NodeProto) -> None:
        if axis == -1 or (rank is not None and axis == rank - 1):
            return
        raise MatchRefused(node.name, "split-not-last-axis", f"{node.op_type} {node.name!r} cuts axis {axis} of a "
                           f"rank-{rank} tensor; a gated MLP's halves are along the last axis")

    def _split_halves(self, g: Graph, gate: _Half, up: _Half, half: int, rank: int | None,
                      shape_nodes: list[str]) -> int:
        """gate_first of a Split into exactly two equal halves of the last axis."""
        sp = gate.node
        if sp.op_type != "Split":
            raise MatchRefused(sp.name, "product-not-gated", f"{gate.value!r} and {up.value!r} are the same Slice")
        a = attributes(sp)
        self._last_axis(int(a.get("axis", 0)), rank, sp)
        outs = [o for o in sp.output]
        if len(outs) != 2:
            raise MatchRefused(sp.name, "uneven-split", f"Split {sp.name!r} has {len(outs)} outputs, not the two "
                               "halves of a gated MLP")
        sizes: list[int] | None = None
        if "split" in a:
            sizes = [int(s) for s in a["split"]]
        elif len(sp.input) > 1 and sp.input[1]:
            arr = static_ints(g, sp.input[1], shape_nodes)
            if arr is None:
                raise MatchRefused(sp.name, "slice-bounds-unknown", f"the sizes {sp.input[1]!r} of Split {sp.name!r} "
                                   "are not constant or static shape arithmetic")
            sizes = [int(s) for s in arr.reshape(-1)]
        elif "num_outputs" in a and int(a["num_outputs"]) != 2:
            raise MatchRefused(sp.name, "uneven-split", f"Split {sp.name!r} has num_outputs={a['num_outputs']}")
        if sizes is not None and sizes != [half, half]:
            raise MatchRefused(sp.name, "uneven-split", f"Split {sp.name!r} cuts sizes {sizes}; exact halves are "
                               f"[{half}, {half}]")
        return int(outs.index(gate.value) == 0)

    def _slice_range(self, g: Graph, sl: onnx.NodeProto, width: int, rank: int | None,
                     shape_nodes: list[str]) -> tuple[int, int]:
        """[start, end) a Slice takes of the last axis (of size `width`), clamped as ONNX does."""
        starts, ends, axes, steps = slice_bounds(g, sl, shape_nodes)
        if axes is None:
            axes = list(range(len(starts)))
        if len(starts) != 1 or len(ends) != 1 or len(axes) != 1:
            raise MatchRefused(sl.name, "split-not-last-axis", f"Slice {sl.name!r} cuts axes {axes}; a gated MLP's "
                               "halves are one cut along the last axis")
        self._last_axis(axes[0], rank, sl)
        if steps is not None and steps != [1]:
            raise MatchRefused(sl.name, "uneven-split", f"Slice {sl.name!r} has steps {steps}; halves are contiguous")
        return clamp_index(starts[0], width), clamp_index(ends[0], width)

    # ---- build ------------------------------------------------------------------------------
    def build(self, g: Graph, m: Match) -> Replacement:
        info = m.info
        taken: set[str] = set()
        inits: list[onnx.TensorProto] = []
        gate: _Projection = info["gate"]
        x = gate.x
        dtype = g.dtype(x) or g.dtype(m.outputs[0]) or np.dtype(np.float32)
        n = int(info["n"])
        if info["merged"]:
            projections = [gate]
        else:
            projections = [gate, info["up"]]
        weights = [self._weight(g, p, taken, inits) for p in projections]
        has_bias = any(p.bias is not None for p in projections)
        biases = [self._bias(g, p, n, dtype, taken, inits) for p in projections] if has_bias else []
        if info["merged"]:
            inputs = [x, weights[0], ""] + biases[:1]
        else:
            inputs = [x, *weights, *biases]
        while not inputs[-1]:
            inputs.pop()
        attrs: dict[str, Any] = {"activation": info["activation"], "merged": int(info["merged"]),
                                 "has_bias": int(has_bias)}
        if info["merged"]:
            attrs["gate_first"] = int(info["gate_first"])
        elem = g.elem_type(x) or g.elem_type(m.outputs[0])
        node, fn = GATED_MLP.make_node(inputs, list(m.outputs), gate.mm.name, attrs, g.opset.get("", 1), elem)
        return Replacement([node], inits, [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})

    @staticmethod
    def _weight(g: Graph, p: _Projection, taken: set[str], inits: list[onnx.TensorProto]) -> str:
        """The projection's weight as [K, N]: the value itself, or Gemm's transB/alpha folded into a new one."""
        if p.mm.op_type != "Gemm":
            return p.w
        a = attributes(p.mm)
        alpha, trans_b = float(a.get("alpha", 1.0)), int(a.get("transB", 0))
        if alpha == 1.0 and not trans_b:
            return p.w
        w = g.constant(p.w)
        if w is None:
            raise ValueError(f"Gemm {p.mm.name!r}: weight {p.w!r} cannot be evaluated")
        w = w.T if trans_b else w
        if alpha != 1.0:
            w = (w.astype(np.float64) * alpha).astype(w.dtype)
        name = unique_name(g, f"{p.mm.name}.weight_folded", taken)
        inits.append(numpy_helper.from_array(np.ascontiguousarray(w), name))
        return name

    @staticmethod
    def _bias(g: Graph, p: _Projection, n: int, dtype: np.dtype, taken: set[str],
              inits: list[onnx.TensorProto]) -> str:
        """The projection's bias as a [N] vector (zeros where it has none; Gemm's beta folded in)."""
        scale = float(attributes(p.mm).get("beta", 1.0)) if p.mm.op_type == "Gemm" and p.bias else 1.0
        if p.bias is not None and scale == 1.0 and g.shape(p.bias) == (n,):
            return p.bias
        if p.bias is None:
            vec = np.zeros((n,), dtype=dtype)
        else:
            arr = g.constant(p.bias)
            if arr is None:
                raise ValueError(f"bias {p.bias!r} cannot be evaluated")
            vec = np.broadcast_to(arr.reshape(-1), (n,))
            vec = (vec.astype(np.float64) * scale).astype(arr.dtype) if scale != 1.0 else vec
        name = unique_name(g, f"{p.mm.name}.bias", taken)
        inits.append(numpy_helper.from_array(np.ascontiguousarray(vec), name))
        return name
