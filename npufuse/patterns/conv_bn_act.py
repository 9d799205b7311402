"""Conv -> [BatchNormalization] -> [per-channel Mul/Add/Sub/Div] -> [residual Add] -> [activation]
=>  npufuse.FusedConv, or a Conv with the BN (and per-channel affine ops) folded in.

BatchNormalization in inference mode is an affine map per output channel, y = x * s + t with
s = gamma / sqrt(var + eps), t = beta - mean * s; so are Mul/Add by per-channel constants. The whole
chain folds into the conv: W' = W * scale[:, None, ...], B' = B * scale + shift.
The activation runs on the conv's output tile while it is still on chip, so it is fused as an epilogue.

A residual Add (ResNet's `Conv -> BN -> Add(shortcut) -> Relu`; `Sum` of two in old exports) joins the epilogue
as the fused node's fourth input Z: Y = activation(Conv(X, W, B) + Z), attribute residual=1. Z must be a tensor of
exactly the conv output's shape and type (the shortcut of a residual block): a Z that broadcasts (a per-channel or
per-sample tensor, a scalar) is not a residual and is refused as a near-miss ("residual-broadcast"); so is one whose
shape is unknown. When both operands of the Add come from Conv chains (a downsample block), the chain that ends last
in topological order takes the Add and the other stays a (BN-folded) Conv feeding Z: one claimant, no overlap.

In an fp16 or bf16 model the BN (and per-channel affine chain) is NOT folded into the weights: W * scale rounded to
the weight's type changes every product by up to half an ulp, and where the conv output nearly cancels the folded
bias (|B'| >> |y|) that error is many ulps of y (the fuzzer found 6x the unfused model's error against the fp32
truth). Instead the fused node keeps W and B exact and applies the per-channel affine as an fp32 epilogue
(attribute affine=1, inputs Scale and Shift, float32 [C, 1, ...]):
Y = act(cast(cast(Conv(X, W, B), f32) * Scale + Shift) [+ Z]),
which rounds where the unfused model rounds and computes the affine no less precisely than it did.

GELU is an activation too (activation="Gelu", approximate="none" | "tanh" | "quick"): the `Gelu` / `npufuse.Gelu`
the gelu pattern makes in phase 0, or its decomposition (erf, tanh or x * sigmoid(1.702 x), read by that pattern's
matcher) where the gelu pattern did not run. Its body is ONNX's Gelu from opset 20 (quick: always the
decomposition), the decomposition npufuse.Gelu's body spells below (erf: opset 9 up).

A BatchNormalization whose only reader is the Conv (SwiftFormer's MLP: BN -> 1x1 Conv; a pre-activation BN) folds
into the Conv's input channels: Conv(x * s + t) = Conv'(x) with W'[o, i] = W[o, i] * s[i] and
B'[o] = B[o] + sum over i and the kernel window of W[o, i] * t[i]. That is exact only where every tap of the window
reads x: a padded Conv reads zeros at the borders where the unfused graph read the BN's zeros shifted by t, so a BN
before a padded Conv folds only if its shift t is 0, and is otherwise the near-miss `bn-before-padded-conv`. A BN
whose input a Conv, Gemm or MatMul produces is theirs to fold (after the op, exact everywhere), not this one's;
fp16/bf16 models keep such a BN (`bn-low-precision`: no float32 epilogue exists before a conv).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto as A
from onnx import helper, numpy_helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.algebra.dims import dim_str, fresh, value_dims
from npufuse.patterns import kernels
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph, attributes
from npufuse.patterns.base import ERF_OPSET, FusedOpDef, Pattern, make_body, node_with_refs, unique_name
from npufuse.patterns.batchnorm import (
    AFFINE_OPS,
    apply_affine,
    batchnorm_affine,
    batchnorm_problem,
    bn_scale_shift,
    low_precision,
    matmul_behind,
    per_channel_affine_chain,
)
from npufuse.patterns.gelu import APPROXIMATIONS, GeluPattern, gelu_body, gelu_reference

CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
_CONV_ATTR_TYPES = {"auto_pad": A.STRING, "dilations": A.INTS, "group": A.INT, "kernel_shape": A.INTS,
                    "pads": A.INTS, "strides": A.INTS}
# Single-node activations and the attributes each carries.
_UNARY_ACTIVATIONS = {"Relu": (), "LeakyRelu": ("alpha",), "Sigmoid": (), "HardSigmoid": ("alpha", "beta"),
                      "HardSwish": (), "Clip": ("min", "max")}
_ACT_DEFAULTS = {"LeakyRelu": {"alpha": 0.01}, "HardSigmoid": {"alpha": 0.2, "beta": 0.5}}
_GELU_STD_OPSET = 20           # ONNX's Gelu (approximate none / tanh)
_GELU_MATCHER = GeluPattern()  # reads a decomposed GELU where the gelu pattern did not run
_GELU_ANCHORS = ("Erf", "Tanh", "Sigmoid")


@dataclass(frozen=True)
class _Activation:
    op: str                         # Relu, Clip, LeakyRelu, Sigmoid, HardSigmoid, HardSwish, Silu, Gelu
    params: dict[str, Any]          # the float attributes; Gelu: approximate
    nodes: tuple[str, ...]
    output: str


# ---- the fused op ----------------------------------------------------------------------------------

def _fused_conv_reference(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    z = inputs[3] if len(inputs) > 3 else None
    y = kernels.conv(x, w, b, **{k: attrs[k] for k in CONV_ATTRS if k in attrs})
    if int(attrs.get("affine", 0)):
        s, t = (inputs[i] if len(inputs) > i else None for i in (4, 5))
        if s is None or t is None:
            raise ValueError("FusedConv: affine=1 needs the per-channel Scale and Shift")
        y = (y.astype(np.float32) * s.astype(np.float32) + t.astype(np.float32)).astype(y.dtype)
    if int(attrs.get("residual", 0)):
        if z is None:
            raise ValueError("FusedConv: residual=1 needs the residual input Z")
        y = y + z.astype(y.dtype)   # the sum as the unfused graph computes it, in the tensors' own type
    params = {k: attrs[k] for k in ("alpha", "beta", "min", "max") if k in attrs}
    act = attrs.get("activation")
    if not act:
        return [y]
    if act == "Gelu":
        return [gelu_reference(y, str(attrs.get("approximate", "none")))]
    return [kernels.activation(act, y, params)]


def _fused_conv_body(attrs: dict[str, Any], opset: int, elem_type: int) -> onnx.FunctionProto:
    act = attrs.get("activation")
    residual = bool(int(attrs.get("residual", 0)))
    affine = bool(int(attrs.get("affine", 0)))
    conv_out = "C1" if affine else ("C0" if residual else "C")
    head = [node_with_refs("Conv", ["X", "W", "B"], [conv_out], [(k, _CONV_ATTR_TYPES[k]) for k in CONV_ATTRS])]
    if affine:  # the BatchNorm's per-channel affine in float32, rounded once to the model's type
        head += [helper.make_node("Cast", [conv_out], ["C1f"], to=onnx.TensorProto.FLOAT),
                 helper.make_node("Mul", ["C1f", "Scale"], ["C1s"]),
                 helper.make_node("Add", ["C1s", "Shift"], ["C1t"]),
                 helper.make_node("Cast", ["C1t"], ["C0" if residual else "C"], to=elem_type)]
    if residual:
        head.append(helper.make_node("Add", ["C0", "Z"], ["C"]))
    tail, overload = _activation_body(act, attrs, opset, elem_type, residual or affine)
    return make_body(
        FUSED_DOMAIN, "FusedConv", ["X", "W", "B", "Z", "Scale", "Shift"], ["Y"], [*head, *tail],
        [helper.make_opsetid("", opset)],
        # `approximate` only where the node carries it: the other bodies stay as they were before GELU joined
        attributes=list(CONV_ATTRS) + ["activation", "alpha", "beta", "min", "max", "residual", "affine"]
        + (["approximate"] if act == "Gelu" else []),
        overload=("Affine_" if affine else "") + ("Add_" if residual else "") + overload,
        doc_string="Conv, [a float32 per-channel affine], [+ the residual Z], then an elementwise activation "
                   "epilogue.")


def _activation_body(act: str | None, attrs: dict[str, Any], opset: int, elem_type: int, other_epilogue: bool
                     ) -> tuple[list[onnx.NodeProto], str]:
    """The activation's nodes from C to Y, and the overload token naming them."""
    overload = act or "none"
    if not act:
        if not other_epilogue:
            raise ValueError("FusedConv: no activation, no affine and no residual: a plain Conv")
        return [helper.make_node("Identity", ["C"], ["Y"])], overload
    if act in ("Relu", "Sigmoid"):
        tail = [helper.make_node(act, ["C"], ["Y"])]
    elif act == "LeakyRelu":
        tail = [node_with_refs("LeakyRelu", ["C"], ["Y"], [("alpha", A.FLOAT)])]
    elif act == "HardSigmoid":
        tail = [node_with_refs("HardSigmoid", ["C"], ["Y"], [("alpha", A.FLOAT), ("beta", A.FLOAT)])]
    elif act == "HardSwish" and opset >= 14:
        tail = [helper.make_node("HardSwish", ["C"], ["Y"])]
    elif act == "HardSwish":
        tail = [helper.make_node("HardSigmoid", ["C"], ["H"], alpha=1.0 / 6.0, beta=0.5),
                helper.make_node("Mul", ["C", "H"], ["Y"])]
    elif act == "Silu":
        tail = [helper.make_node("Sigmoid", ["C"], ["S"]), helper.make_node("Mul", ["C", "S"], ["Y"])]
    elif act == "Gelu":
        tail, overload = _gelu_tail(str(attrs.get("approximate", "none")), opset, elem_type)
    elif act == "Clip" and opset < 11:
        tail = [node_with_refs("Clip", ["C"], ["Y"], [("min", A.FLOAT), ("max", A.FLOAT)])]
    elif act == "Clip":
        # From opset 11 the bounds are inputs of Clip's own type, which a float attribute cannot feed
        # at every opset; the body is specialised on the bounds instead (named in the overload).
        np_t = helper.tensor_dtype_to_np_dtype(elem_type)
        tail, clip_in = [], ["C"]
        for bound in ("min", "max"):
            if bound in attrs:
                tail.append(helper.make_node("Constant", [], [bound], value=numpy_helper.from_array(
                    np.array(attrs[bound], dtype=np_t), bound)))
                clip_in.append(bound)
            else:
                clip_in.append("")
        tail.append(helper.make_node("Clip", clip_in, ["Y"]))
        overload = f"Clip_{np.dtype(np_t).name}_{attrs.get('min', '-inf')}_{attrs.get('max', 'inf')}"
    else:
        raise ValueError(f"FusedConv: no function body for activation {act!r}")
    return tail, overload


def _gelu_tail(approximate: str, opset: int, elem_type: int) -> tuple[list[onnx.NodeProto], str]:
    """GELU from C to Y: ONNX's Gelu where the opset has it (20, none and tanh), else the nodes of npufuse.Gelu's
    body (the one decomposition npufuse writes), its values renamed apart from the conv body's."""
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"FusedConv: unknown GELU approximate={approximate!r}")
    if opset >= _GELU_STD_OPSET and approximate != "quick":
        return [helper.make_node("Gelu", ["C"], ["Y"], approximate=approximate)], f"Gelu_{approximate}"
    fn = gelu_body({"approximate": approximate}, opset, elem_type)   # ValueError below opset 9 for erf
    names = {"X": "C", "Y": "Y"}
    tail = []
    for n in fn.node:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        del c.input[:], c.output[:]
        c.input.extend(names.get(v, f"Gelu_{v}") for v in n.input)
        c.output.extend(names.get(v, f"Gelu_{v}") for v in n.output)
        tail.append(c)
    return tail, f"Gelu_{fn.overload}"


FUSED_CONV = FusedOpDef(
    op_type="FusedConv",
    doc="Y = activation(C [+ Z]) with C = Conv(X, W, B), BatchNormalization folded into W and B; or, affine=1 "
        "(fp16/bf16 models), C = cast(cast(Conv(X, W, B), float32) * Scale + Shift) with the BatchNormalization's "
        "per-channel scale and shift (float32, shape [C, 1, ...]), so W stays exact. residual=1: Z, a tensor of Y's "
        "shape (the shortcut of a residual block), is added before the activation; activation absent: none (only "
        "with residual=1 or affine=1). activation=Gelu: approximate 'none' (erf), 'tanh' or 'quick' "
        "(x * sigmoid(1.702 x)).",
    inputs=("X", "W", "B?", "Z?", "Scale?", "Shift?"),
    outputs=("Y",),
    attributes=CONV_ATTRS + ("activation", "alpha", "beta", "min", "max", "residual", "affine", "approximate"),
    reference=_fused_conv_reference,
    body=_fused_conv_body,
)


# ---- the pattern -----------------------------------------------------------------------------------

class ConvBnActivation(Pattern):
    name = "conv_bn_act"
    description = ("Conv -> [BatchNormalization] -> [residual Add] -> [activation] into FusedConv or a BN-folded "
                   "Conv")
    anchor_ops = frozenset({"Conv", "Add", "Sum", "BatchNormalization"})
    phase = 1
    fused_ops = (FUSED_CONV,)

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if node.domain not in ("", "ai.onnx") or not node.output:
            return None
        if node.op_type == "BatchNormalization":
            return self._bn_without_conv(g, node)
        if len(node.input) < 2:
            return None
        if node.op_type != "Conv":
            return self._residual_near_miss(g, node)
        found = self._conv_chain(g, node)
        if isinstance(found, Refusal):
            pre_bn = _input_bn(g, node)
            if pre_bn is not None and pre_bn.name not in found.nodes and _pre_bn_problem(g, pre_bn, node) is None:
                # the BN before the conv is left to the conv by its own anchor: the conv's refusal names it too
                found = dataclasses.replace(found, nodes=(pre_bn.name,) + tuple(found.nodes))
        return found

    def _conv_chain(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        """The chain around Conv `node` (see the module doc): a match, a near-miss, or None for a lone Conv."""
        y = node.output[0]
        cons = g.consumers_of(y)
        bn = cons[0] if len(cons) == 1 and cons[0].op_type == "BatchNormalization" else None
        if bn is None and any(c.op_type == "BatchNormalization" for c in cons):
            return self._refuse(g, node, "shared-intermediate", f"conv output {y!r} feeds a BatchNormalization and "
                                f"{len(cons) - 1} other node(s); folding would change what they read",
                                [node.name] + [c.name for c in cons if c.op_type == "BatchNormalization"])
        nodes = [node.name]
        pre_bn = _input_bn(g, node)
        if pre_bn is not None and _pre_bn_problem(g, pre_bn, node) is None:
            nodes.insert(0, pre_bn.name)
        else:
            pre_bn = None
        if bn is not None:
            if y in g.graph_outputs:
                return self._refuse(g, bn, "intermediate-is-output",
                                    f"conv output {y!r} is a graph output; folding BN would change it", nodes)
            refusal = self._check_bn(g, node, bn)
            if refusal is not None:
                return refusal
            nodes.append(bn.name)
            z = bn.output[0]
        else:
            z = y
        affine, z = per_channel_affine_chain(g, z, g.rank(y))
        nodes.extend(name for name, _ in affine)
        res = _residual_add(g, z)
        residual: tuple[str, str] | None = None
        if res is not None and res[0] == "ok" and not _other_chain_takes_it(g, z, res[2]):
            add, other = res[1], res[2]
            residual = (add.name, other)
            nodes.append(add.name)
            z = add.output[0]
        act = _find_activation(g, z) if z not in g.graph_outputs else None
        if act is None and bn is None and not affine and residual is None and pre_bn is None:
            gelu = _shared_gelu(g, z)
            if gelu is not None:
                return self._refuse(g, g.node(gelu[0]), "shared-intermediate",
                                    f"GELU {gelu[0]!r} after Conv {node.name!r} reads {z!r}, which {gelu[1]!r} also "
                                    "reads: as the conv's epilogue it would leave that reader without the value",
                                    [node.name, gelu[0]])
            return None  # a Conv on its own: nothing to fuse
        refusal = self._check_conv(g, node, nodes + (list(act.nodes) if act else []))
        if refusal is not None:
            return refusal
        if act is not None:
            nodes.extend(act.nodes)
        out = act.output if act else z
        folded = "BN folded" if bn is not None else "affine folded" if affine else "input BN folded"
        keep_affine = (bn is not None or bool(affine)) and low_precision(g.elem_type(node.output[0]) or g.elem_type(node.input[1]))
        steps = ((["BN" if bn is not None else "Affine"] if keep_affine else []) + (["Add"] if residual else [])
                 + ([_act_label(act)] if act else []))
        # a kind with "(...)" is a standard op with something folded in; a FusedConv lists the BN before it as a step
        kind = f"FusedConv[{','.join((['input BN'] if pre_bn is not None else []) + steps)}]" if steps \
            else f"Conv({folded})"
        ordered = tuple(sorted(nodes, key=lambda n: g.topo_index[n]))
        return Match(self.name, ordered, g.boundary_inputs(ordered), (out,), kind,
                     info={"conv": node.name, "bn": bn.name if bn is not None else None, "affine": tuple(affine),
                           "act": act, "residual": residual, "keep_affine": keep_affine,
                           "pre_bn": pre_bn.name if pre_bn is not None else None})

    def _bn_without_conv(self, g: Graph, bn: onnx.NodeProto) -> Refusal | None:
        """At a BatchNormalization: None where a Conv or Gemm produces its input or a MatMul's columns reach it (their
        anchors fold it or say why), or where the Conv that alone reads it folds it; else a near-miss: there is no
        weight to fold it into (DenseNet's BN after a Concat, RepViT's BN after the Add of its branches), or the
        Conv after it cannot take it (padding and a non-zero shift, fp16)."""
        p = g.producer_of(bn.input[0]) if bn.input else None
        if p is not None and p.op_type in ("Conv", "Gemm") and p.domain in ("", "ai.onnx"):
            return None
        if matmul_behind(g, bn) is not None:
            return None   # matmul_bn folds it, or names why not
        conv = _absorbing_conv(g, bn)
        if conv is not None:
            problem = _pre_bn_problem(g, bn, conv)
            if problem is None:
                return None   # the Conv's anchor folds it into the conv's input channels
            return Refusal(self.name, bn.name, problem[0], problem[1], (bn.name, conv.name))
        what = f"{p.op_type} {p.name!r}" if p is not None else "a graph input"
        return Refusal(self.name, bn.name, "bn-without-conv",
                       f"BatchNormalization reads {bn.input[0]!r} from {what}, not from a Conv or Gemm: no weights to "
                       "fold it into; it stays a per-channel scale and shift", (bn.name,))

    def _residual_near_miss(self, g: Graph, add: onnx.NodeProto) -> Refusal | None:
        """At an Add/Sum: a refusal where it follows a Conv chain as a residual would but cannot join it (the
        Conv anchor then fuses the chain without it); None otherwise (the Conv anchor takes it, or no conv)."""
        for v in add.input:
            conv = _conv_behind(g, v)
            if conv is None:
                continue
            res = _residual_add(g, v)
            if res is not None and res[0] == "refused" and res[1] is add:
                return self._refuse(g, add, res[2], f"residual {add.op_type} {add.name!r} after Conv "
                                    f"{conv.name!r}: {res[3]}", [conv.name, add.name])
        return None

    def _refuse(self, g: Graph, node: onnx.NodeProto, reason: str, detail: str, nodes: list[str]) -> Refusal:
        return Refusal(self.name, node.name, reason, detail, tuple(nodes))

    def _check_conv(self, g: Graph, conv: onnx.NodeProto, nodes: list[str]) -> Refusal | None:
        w = conv.input[1]
        if not g.is_constant(w):
            return self._refuse(g, conv, "dynamic-weight", f"conv weight {w!r} is not a constant", nodes)
        if len(conv.input) > 2 and conv.input[2] and not g.is_constant(conv.input[2]):
            return self._refuse(g, conv, "dynamic-weight", f"conv bias {conv.input[2]!r} is not a constant", nodes)
        return None

    def _check_bn(self, g: Graph, conv: onnx.NodeProto, bn: onnx.NodeProto) -> Refusal | None:
        nodes = [conv.name, bn.name]
        if not g.is_constant(conv.input[1]) or g.constant(conv.input[1]) is None:
            return self._refuse(g, conv, "dynamic-weight", f"conv weight {conv.input[1]!r} is not a constant", nodes)
        problem = batchnorm_problem(g, bn, g.constant(conv.input[1]).shape[0])
        return self._refuse(g, bn, *problem, nodes) if problem else None

    def build(self, g: Graph, m: Match) -> Replacement:
        conv = g.node(m.info["conv"])
        act: _Activation | None = m.info["act"]
        conv_attrs = {k: v for k, v in attributes(conv).items() if k in CONV_ATTRS}
        x, w_name = conv.input[0], conv.input[1]
        b_name = conv.input[2] if len(conv.input) > 2 and conv.input[2] else None
        inits: list[onnx.TensorProto] = []
        keep_affine = bool(m.info.get("keep_affine"))
        pre_bn = m.info.get("pre_bn")
        if pre_bn is not None:
            x = g.node(pre_bn).input[0]   # the conv reads what the BN read, through weights that apply the BN
        if m.info["bn"] is not None or m.info["affine"] or pre_bn is not None:
            w = g.constant(w_name)
            cout, w_dtype = w.shape[0], w.dtype
            b = g.constant(b_name) if b_name else np.zeros(cout, dtype=w.dtype)
            if pre_bn is not None:
                w, b = fold_input_bn(w, b, *bn_scale_shift(g, g.node(pre_bn)), int(conv_attrs.get("group", 1)))
            # The folded chain is y = conv_nobias(x) * scale + shift, per output channel (float64); kept as an
            # fp32 epilogue it applies to conv(x) with its own bias, as the unfused graph computes it.
            scale, shift = np.ones(cout), (np.zeros(cout) if keep_affine else b.astype(np.float64))
            if m.info["bn"] is not None:
                bn = g.node(m.info["bn"])
                gamma, beta, mean, var = (g.constant(v).astype(np.float64) for v in bn.input[1:5])
                s, t = batchnorm_affine(gamma, beta, mean, var, float(attributes(bn).get("epsilon", 1e-5)))
                scale, shift = scale * s, shift * s + t
            for name, const in m.info["affine"]:
                scale, shift = apply_affine(g, g.node(name).op_type, const, scale, shift)
            taken: set[str] = set()
            if keep_affine:
                per_channel = (cout,) + (1,) * (w.ndim - 2)
                s_name = unique_name(g, f"{conv.name}.bn_scale", taken)
                t_name = unique_name(g, f"{conv.name}.bn_shift", taken)
                inits = [numpy_helper.from_array(scale.astype(np.float32).reshape(per_channel), s_name),
                         numpy_helper.from_array(shift.astype(np.float32).reshape(per_channel), t_name)]
            else:
                w_folded, b_folded = fold_into_conv(w, scale, shift, w_dtype)
                w_name = unique_name(g, f"{conv.name}.weight_folded", taken)
                b_name = unique_name(g, f"{conv.name}.bias_folded", taken)
                inits = [numpy_helper.from_array(w_folded, w_name), numpy_helper.from_array(b_folded, b_name)]
        inputs = [x, w_name] + ([b_name] if b_name else [])
        out = m.outputs[0]
        residual = m.info.get("residual")
        if act is None and residual is None and not keep_affine:
            node = helper.make_node("Conv", inputs, [out], name=conv.name, **conv_attrs)
            return Replacement([node], inits)
        attrs: dict[str, Any] = dict(conv_attrs)
        if act is not None:
            attrs.update(activation=act.op, **act.params)
        if residual is not None or keep_affine:
            inputs = inputs + [""] * (3 - len(inputs)) + [residual[1] if residual is not None else ""]
        if residual is not None:
            attrs["residual"] = 1
        if keep_affine:
            inputs = inputs + [s_name, t_name]
            attrs["affine"] = 1
        node, fn = FUSED_CONV.make_node(inputs, [out], conv.name, attrs, g.opset.get("", 1), g.elem_type(x))
        return Replacement([node], inits, [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})


def fold_into_conv(w: np.ndarray, scale: np.ndarray, shift: np.ndarray, dtype: np.dtype | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Weight and bias of a conv computing conv_nobias(x, w) * scale + shift (per output channel), in `dtype`
    (default w's: a weight a BN before the conv already scaled comes in float64 and goes out in the model's type).

    The per-channel vectors are composed in float64; the weight product runs in float32 (or wider if `w`
    is), one rounding per element, which is as exact as the float32 result can be and 3x faster than a
    float64 round trip of every weight."""
    dtype = w.dtype if dtype is None else dtype
    work = np.promote_types(w.dtype, np.float32)
    s = scale.astype(work).reshape((-1,) + (1,) * (w.ndim - 1))
    return (w.astype(work, copy=False) * s).astype(dtype, copy=False), shift.astype(dtype)


def fold_input_bn(w: np.ndarray, b: np.ndarray, s: np.ndarray, t: np.ndarray, group: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Weight and bias (float64) of a conv computing Conv(x * s + t, w, b) with no padding, s and t per input
    channel: W'[o, j] = W[o, j] * s[c], B'[o] = B[o] + sum over j and the window of W[o, j] * t[c], where
    c = (o // (M / group)) * (C / group) + j is the input channel tap j of output channel o reads."""
    m, cg = w.shape[0], w.shape[1]
    channel = (np.arange(m) // (m // group))[:, None] * cg + np.arange(cg)[None, :]   # [M, C/group]
    w64 = w.astype(np.float64)
    window = tuple(range(2, w.ndim))
    b_new = b.astype(np.float64) + (w64.sum(axis=window) * t[channel]).sum(axis=1)
    return w64 * s[channel].reshape(channel.shape + (1,) * len(window)), b_new


_RESIDUAL_OPS = ("Add", "Sum")
_PER_CHANNEL_STEPS = ("BatchNormalization",) + AFFINE_OPS


def _residual_add(g: Graph, z: str) -> tuple | None:
    """The residual Add that alone reads `z` (the end of a Conv chain):
    ("ok", add node, the other operand), ("refused", add node, reason, detail), or None where `z`'s reader is no
    residual Add (a constant operand is a per-channel shift or bias, not a residual)."""
    if z in g.graph_outputs:
        return None
    n = g.single_consumer(z)
    if n is None or n.domain not in ("", "ai.onnx") or n.op_type not in _RESIDUAL_OPS or len(n.output) != 1:
        return None
    ins = list(n.input)
    if len(ins) != 2 or not all(ins):
        if n.op_type == "Sum" and len(ins) > 2:
            return "refused", n, "residual-arity", (f"Sum {n.name!r} adds {len(ins)} tensors; a FusedConv takes one "
                                                    "residual")
        return None
    other = ins[1] if ins[0] == z else ins[0]
    if other == z or g.is_constant(other):
        return None
    zs, os_ = g.shape(z), g.shape(other)
    # One shape, proven: the same dims term by term (`algebra.dims` follows a dim inference named afresh, `unk__N`
    # or `?`, back to where it comes from: a TorchScript UNet's batch through a skip Concat). Then the Add's output
    # has that shape too.
    named = zs is not None and os_ is not None and tuple(zs) == tuple(os_) and \
        all(d is not None and not (isinstance(d, str) and d.startswith("unk__")) for d in zs)
    dz, do = value_dims(g, z), value_dims(g, other)
    if named or dz is not None and do is not None and len(dz) == len(do) and all(p == q for p, q in zip(dz, do)):
        if g.elem_type(other) != g.elem_type(z):
            return "refused", n, "residual-dtype", f"the residual {other!r} and the conv output {z!r} differ in type"
        return "ok", n, other
    if dz is not None and do is not None and (len(dz) != len(do) or any(
            p != q and (isinstance(p, int) and isinstance(q, int) or 1 in (p, q) and not (fresh(p) or fresh(q)) and
                        not _made_up(p) and not _made_up(q)) for p, q in zip(dz, do))):
        return "refused", n, "residual-broadcast", (f"the residual {other!r} has shape {_fmt(os_)}, the conv output "
                                                    f"{z!r} {_fmt(zs)}: it broadcasts, so it is not a residual of "
                                                    "the conv's shape")
    shown = ("" if dz is None or do is None else
             f" (followed through the graph: [{', '.join(map(dim_str, dz))}] vs [{', '.join(map(dim_str, do))}])")
    return "refused", n, "residual-shape-unknown", (f"the shapes of the conv output {z!r} ({_fmt(zs)}) and of the "
                                                    f"residual {other!r} ({_fmt(os_)}) are not provably one shape"
                                                    f"{shown}; a residual must have the conv output's shape")


def _made_up(d: Any) -> bool:
    """A term for a dim inference named without knowing it (`unk__N`): it may be 1 at run time."""
    return isinstance(d, tuple) and d[0] == "sym" and d[1].startswith("unk__")


def _other_chain_takes_it(g: Graph, z: str, other: str) -> bool:
    """True where the Add's other operand `other` ends a Conv chain too (ResNet's downsample block) and that chain
    ends later in topological order: that Conv takes the Add (it runs last, when the residual is ready), this one
    folds its BN only. One claimant per Add, so the two candidates never overlap."""
    conv = _conv_behind(g, other)
    if conv is None or not g.is_constant(conv.input[1]):
        return False
    mine, theirs = g.producer_of(z), g.producer_of(other)
    return mine is not None and theirs is not None and g.topo_index[theirs.name] > g.topo_index[mine.name]


def _fmt(shape: Any) -> str:
    return "unknown" if shape is None else str(list(shape))


def _conv_behind(g: Graph, v: str) -> onnx.NodeProto | None:
    """The Conv whose chain (Conv -> [BN] -> [per-channel ops]) ends at `v`, walking back through single-reader
    values; None where `v` is not such a chain's end."""
    for _ in range(8):
        p = g.producer_of(v)
        if p is None or p.domain not in ("", "ai.onnx"):
            return None
        if p.op_type == "Conv":
            return p
        if p.op_type not in _PER_CHANNEL_STEPS or not p.input:
            return None
        if p.op_type == "BatchNormalization":
            nxt = p.input[0]
        else:   # a per-channel op by a constant: exactly one operand is dynamic
            dyn = [i for i in p.input if i and not g.is_constant(i)]
            if len(dyn) != 1 or len(p.input) != 2:
                return None
            nxt = dyn[0]
        if g.single_consumer(nxt) is not p:
            return None
        v = nxt
    return None


def _find_activation(g: Graph, z: str) -> _Activation | None:
    """The activation that alone consumes `z`: a unary op, SiLU written as z * Sigmoid(z), or a GELU (one op or
    its decomposition)."""
    cons = g.consumers_of(z)
    if len(cons) == 1 and cons[0].op_type in _UNARY_ACTIVATIONS and cons[0].input[0] == z:
        n = cons[0]
        params = _activation_params(g, n)
        if params is None:
            return None
        return _Activation(n.op_type, params, (n.name,), n.output[0])
    if len(cons) == 2:
        sig = next((c for c in cons if c.op_type == "Sigmoid"), None)
        mul = next((c for c in cons if c.op_type == "Mul"), None)
        if sig is not None and mul is not None and sorted(mul.input) == sorted([z, sig.output[0]]) \
                and g.single_consumer(sig.output[0]) is mul:
            return _Activation("Silu", {}, (sig.name, mul.name), mul.output[0])
    gelu = _gelu_on(g, z)
    if gelu is not None and set(c.name for c in cons) <= set(gelu.nodes):
        return gelu
    return None


def _gelu_on(g: Graph, z: str) -> _Activation | None:
    """A GELU of `z`, whoever else reads z: ONNX's Gelu or npufuse.Gelu (what the gelu pattern made in phase 0), or
    the decomposition that pattern's matcher reads (erf, tanh or quick), anchored on an Erf/Tanh/Sigmoid at most
    five arithmetic ops from z (tanh's x + 0.044715 x^3 is four)."""
    for c in g.consumers_of(z):
        if c.op_type == "Gelu" and c.domain in ("", "ai.onnx", FUSED_DOMAIN) and list(c.input[:1]) == [z]:
            approximate = str(attributes(c).get("approximate", "none"))
            if approximate in APPROXIMATIONS and (approximate != "none" or g.opset.get("", 1) >= ERF_OPSET):
                return _Activation("Gelu", {"approximate": approximate}, (c.name,), c.output[0])
    frontier, seen = [z], {z}
    for _ in range(5):
        nxt = []
        for v in frontier:
            for c in g.consumers_of(v):
                if c.domain not in ("", "ai.onnx") or not c.output:
                    continue
                if c.op_type in _GELU_ANCHORS:
                    found = _GELU_MATCHER.match(g, c)
                    if isinstance(found, Match) and found.info["x"] == z and len(found.outputs) == 1:
                        return _Activation("Gelu", {"approximate": found.info["approximate"]}, found.nodes,
                                           found.outputs[0])
                if c.op_type in ("Mul", "Div", "Pow", "Add") and c.output[0] not in seen:
                    seen.add(c.output[0])
                    nxt.append(c.output[0])
        frontier = nxt
    return None


def _shared_gelu(g: Graph, z: str) -> tuple[str, str] | None:
    """(the GELU's first node, another reader of z) where a GELU reads the conv chain's end `z` but is not its only
    reader (the near-miss that keeps it out of the epilogue)."""
    cons = g.consumers_of(z)
    if len(cons) < 2:
        return None
    gelu = _gelu_on(g, z)
    if gelu is None:
        return None
    other = next((c.name for c in cons if c.name not in gelu.nodes), None)
    return (gelu.nodes[0], other) if other is not None else None


def _act_label(act: _Activation) -> str:
    """The activation as the match's kind names it: Relu, Silu, Gelu, Gelu(tanh), Gelu(quick)..."""
    approximate = act.params.get("approximate")
    return act.op if approximate in (None, "none") else f"{act.op}({approximate})"


def _input_bn(g: Graph, conv: onnx.NodeProto) -> onnx.NodeProto | None:
    """The BatchNormalization whose output this Conv alone reads as X and which no op before it folds (its input
    not from a Conv or Gemm, and no MatMul's columns behind it); else None."""
    bn = g.producer_of(conv.input[0]) if conv.input else None
    if bn is None or bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx") or not bn.input:
        return None
    if _absorbing_conv(g, bn) is not conv:
        return None
    p = g.producer_of(bn.input[0])
    if p is not None and p.op_type in ("Conv", "Gemm") and p.domain in ("", "ai.onnx"):
        return None
    return None if matmul_behind(g, bn) is not None else bn


def _absorbing_conv(g: Graph, bn: onnx.NodeProto) -> onnx.NodeProto | None:
    """The Conv that is the only reader of `bn`'s output, reading it as X; else None."""
    c = g.single_consumer(bn.output[0]) if bn.output else None
    if c is None or c.op_type != "Conv" or c.domain not in ("", "ai.onnx") or len(c.input) < 2:
        return None
    return c if c.input[0] == bn.output[0] and c.input[1] != bn.output[0] else None


def _pre_bn_problem(g: Graph, bn: onnx.NodeProto, conv: onnx.NodeProto) -> tuple[str, str] | None:
    """(reason, detail) where the BN before `conv` does not fold into its input channels exactly, else None."""
    w = g.constant(conv.input[1]) if g.is_constant(conv.input[1]) else None
    if w is None or (len(conv.input) > 2 and conv.input[2] and not g.is_constant(conv.input[2])):
        return "dynamic-weight", (f"BatchNormalization {bn.name!r} before Conv {conv.name!r}: the conv's weight or "
                                  "bias is not a constant, so there is nothing to fold the BN into")
    a = attributes(conv)
    group = int(a.get("group", 1))
    problem = batchnorm_problem(g, bn, w.shape[1] * group)
    if problem is not None:
        return problem
    if low_precision(g.elem_type(conv.output[0]) or g.elem_type(conv.input[1])):
        return "bn-low-precision", (f"BatchNormalization {bn.name!r} before Conv {conv.name!r} in a float16/bfloat16 "
                                    "model: its scale rounded into the conv's weights can exceed the model's own "
                                    "error, and there is no float32 epilogue before a conv to keep it exact")
    auto_pad = str(a.get("auto_pad", "NOTSET"))
    pads = [int(p) for p in a.get("pads", [])]
    padded = auto_pad in ("SAME_UPPER", "SAME_LOWER") or (auto_pad in ("NOTSET", "") and any(pads))
    if padded:
        _, t = bn_scale_shift(g, bn)
        if np.any(t != 0):
            where = f"pads {pads}" if auto_pad in ("NOTSET", "") else f"auto_pad {auto_pad}"
            return "bn-before-padded-conv", (
                f"BatchNormalization {bn.name!r} before Conv {conv.name!r} ({where}): folded, its shift would enter "
                "the conv's bias through every tap of the window, but at the borders the taps read the conv's zero "
                "padding, not a shifted value; the fold is exact only for an unpadded conv or a zero shift (this "
                f"one's reaches {float(np.max(np.abs(t))):.3g}); it stays a per-channel scale and shift")
    return None


def _activation_params(g: Graph, n: onnx.NodeProto) -> dict[str, float] | None:
    """The activation's parameters as floats, or None if one is not a constant (then it is not fused)."""
    a = attributes(n)
    params = dict(_ACT_DEFAULTS.get(n.op_type, {}))
    if n.op_type == "Clip":
        bounds = {k: a[k] for k in ("min", "max") if k in a}  # opset < 11: attributes
        for k, v in zip(("min", "max"), list(n.input[1:3])):  # opset >= 11: optional inputs
            if v:
                s = g.scalar(v)
                if s is None:
                    return None
                bounds[k] = s
        return {k: float(v) for k, v in bounds.items()}
    params.update({k: float(a[k]) for k in _UNARY_ACTIVATIONS[n.op_type] if k in a})
    return params
