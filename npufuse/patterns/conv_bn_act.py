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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto as A
from onnx import helper, numpy_helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.patterns import kernels
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph, attributes
from npufuse.patterns.base import FusedOpDef, Pattern, make_body, node_with_refs, unique_name

CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
_CONV_ATTR_TYPES = {"auto_pad": A.STRING, "dilations": A.INTS, "group": A.INT, "kernel_shape": A.INTS,
                    "pads": A.INTS, "strides": A.INTS}
# Single-node activations and the attributes each carries.
_UNARY_ACTIVATIONS = {"Relu": (), "LeakyRelu": ("alpha",), "Sigmoid": (), "HardSigmoid": ("alpha", "beta"),
                      "HardSwish": (), "Clip": ("min", "max")}
_ACT_DEFAULTS = {"LeakyRelu": {"alpha": 0.01}, "HardSigmoid": {"alpha": 0.2, "beta": 0.5}}


@dataclass(frozen=True)
class _Activation:
    op: str                         # Relu, Clip, LeakyRelu, Sigmoid, HardSigmoid, HardSwish, Silu
    params: dict[str, float]
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
        attributes=list(CONV_ATTRS) + ["activation", "alpha", "beta", "min", "max", "residual", "affine"],
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


FUSED_CONV = FusedOpDef(
    op_type="FusedConv",
    doc="Y = activation(C [+ Z]) with C = Conv(X, W, B), BatchNormalization folded into W and B; or, affine=1 "
        "(fp16/bf16 models), C = cast(cast(Conv(X, W, B), float32) * Scale + Shift) with the BatchNormalization's "
        "per-channel scale and shift (float32, shape [C, 1, ...]), so W stays exact. residual=1: Z, a tensor of Y's "
        "shape (the shortcut of a residual block), is added before the activation; activation absent: none (only "
        "with residual=1 or affine=1).",
    inputs=("X", "W", "B?", "Z?", "Scale?", "Shift?"),
    outputs=("Y",),
    attributes=CONV_ATTRS + ("activation", "alpha", "beta", "min", "max", "residual", "affine"),
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
        y = node.output[0]
        cons = g.consumers_of(y)
        bn = cons[0] if len(cons) == 1 and cons[0].op_type == "BatchNormalization" else None
        if bn is None and any(c.op_type == "BatchNormalization" for c in cons):
            return self._refuse(g, node, "shared-intermediate", f"conv output {y!r} feeds a BatchNormalization and "
                                f"{len(cons) - 1} other node(s); folding would change what they read",
                                [node.name] + [c.name for c in cons if c.op_type == "BatchNormalization"])
        nodes = [node.name]
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
        affine, z = _per_channel_affine_chain(g, z, g.rank(y))
        nodes.extend(name for name, _ in affine)
        res = _residual_add(g, z)
        residual: tuple[str, str] | None = None
        if res is not None and res[0] == "ok" and not _other_chain_takes_it(g, z, res[2]):
            add, other = res[1], res[2]
            residual = (add.name, other)
            nodes.append(add.name)
            z = add.output[0]
        act = _find_activation(g, z) if z not in g.graph_outputs else None
        if act is None and bn is None and not affine and residual is None:
            return None  # a Conv on its own: nothing to fuse
        refusal = self._check_conv(g, node, nodes + (list(act.nodes) if act else []))
        if refusal is not None:
            return refusal
        if act is not None:
            nodes.extend(act.nodes)
        out = act.output if act else z
        folded = "BN folded" if bn is not None else "affine folded"
        keep_affine = (bn is not None or bool(affine)) and _low_precision(g.elem_type(node.output[0]) or g.elem_type(node.input[1]))
        steps = ((["BN" if bn is not None else "Affine"] if keep_affine else []) + (["Add"] if residual else [])
                 + ([act.op] if act else []))
        kind = f"FusedConv[{','.join(steps)}]" if steps else f"Conv({folded})"
        ordered = tuple(sorted(nodes, key=lambda n: g.topo_index[n]))
        return Match(self.name, ordered, g.boundary_inputs(ordered), (out,), kind,
                     info={"conv": node.name, "bn": bn.name if bn is not None else None, "affine": tuple(affine),
                           "act": act, "residual": residual, "keep_affine": keep_affine})

    def _bn_without_conv(self, g: Graph, bn: onnx.NodeProto) -> Refusal | None:
        """At a BatchNormalization: None where a Conv or Gemm produces its input (their anchors fold it or say why);
        else a near-miss: there is no weight to fold it into (DenseNet's BN after a Concat, a pre-activation BN)."""
        p = g.producer_of(bn.input[0]) if bn.input else None
        if p is not None and p.op_type in ("Conv", "Gemm") and p.domain in ("", "ai.onnx"):
            return None
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
        if m.info["bn"] is not None or m.info["affine"]:
            w = g.constant(w_name)
            cout = w.shape[0]
            b = g.constant(b_name) if b_name else np.zeros(cout, dtype=w.dtype)
            # The folded chain is y = conv_nobias(x) * scale + shift, per output channel (float64); kept as an
            # fp32 epilogue it applies to conv(x) with its own bias, as the unfused graph computes it.
            scale, shift = np.ones(cout), (np.zeros(cout) if keep_affine else b.astype(np.float64))
            if m.info["bn"] is not None:
                bn = g.node(m.info["bn"])
                gamma, beta, mean, var = (g.constant(v).astype(np.float64) for v in bn.input[1:5])
                s, t = batchnorm_affine(gamma, beta, mean, var, float(attributes(bn).get("epsilon", 1e-5)))
                scale, shift = scale * s, shift * s + t
            for name, const in m.info["affine"]:
                scale, shift = _apply_affine(g, g.node(name).op_type, const, scale, shift)
            taken: set[str] = set()
            if keep_affine:
                per_channel = (cout,) + (1,) * (w.ndim - 2)
                s_name = unique_name(g, f"{conv.name}.bn_scale", taken)
                t_name = unique_name(g, f"{conv.name}.bn_shift", taken)
                inits = [numpy_helper.from_array(scale.astype(np.float32).reshape(per_channel), s_name),
                         numpy_helper.from_array(shift.astype(np.float32).reshape(per_channel), t_name)]
            else:
                w_folded, b_folded = fold_into_conv(w, scale, shift)
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


class GemmBatchNorm(Pattern):
    """Gemm -> BatchNormalization (-> per-channel Mul/Add) => a Gemm with the BN folded into B and C.

    What a Linear followed by BatchNorm1d exports to. The activation after it, if any, is left for the
    MatMul-epilogue family (phase 2), which fuses Gemm + bias + activation.
    """

    name = "gemm_bn"
    description = "Gemm -> BatchNormalization into a Gemm with folded weights (Linear + BatchNorm1d)"
    anchor_ops = frozenset({"Gemm"})
    phase = 1

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            return None
        y = node.output[0]
        cons = g.consumers_of(y)
        if not any(c.op_type == "BatchNormalization" for c in cons):
            return None
        nodes = [node.name]
        if len(cons) != 1 or y in g.graph_outputs:
            return Refusal(self.name, node.name, "shared-intermediate", f"Gemm output {y!r} is also used outside "
                           "the BatchNormalization; folding would change what that reads", tuple(nodes))
        bn = cons[0]
        nodes.append(bn.name)
        a = attributes(node)
        b = g.constant(node.input[1]) if g.is_constant(node.input[1]) else None
        if b is None or b.ndim != 2:
            return Refusal(self.name, node.name, "dynamic-weight", f"Gemm weight {node.input[1]!r} is not a constant "
                           "matrix", tuple(nodes))
        n_out = b.shape[0] if a.get("transB", 0) else b.shape[1]
        if len(node.input) > 2 and node.input[2]:
            c = g.constant(node.input[2]) if g.is_constant(node.input[2]) else None
            if c is None or c.size not in (1, n_out) or (c.ndim == 2 and c.shape[0] != 1):
                return Refusal(self.name, node.name, "bias-shape", f"Gemm bias {node.input[2]!r} is not a constant "
                               f"of shape [{n_out}] (or a scalar)", tuple(nodes))
        problem = batchnorm_problem(g, bn, n_out)
        if problem is not None:
            return Refusal(self.name, bn.name, *problem, tuple(nodes))
        affine, z = _per_channel_affine_chain(g, bn.output[0], 2)
        nodes.extend(name for name, _ in affine)
        return Match(self.name, tuple(nodes), g.boundary_inputs(nodes), (z,), "Gemm(BN folded)",
                     info={"gemm": node.name, "bn": bn.name, "affine": tuple(affine), "n_out": n_out})

    def build(self, g: Graph, m: Match) -> Replacement:
        gemm, bn = g.node(m.info["gemm"]), g.node(m.info["bn"])
        a = attributes(gemm)
        alpha, beta, trans_b = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0)), int(a.get("transB", 0))
        b = g.constant(gemm.input[1])
        n_out = m.info["n_out"]
        c = np.zeros(n_out) if len(gemm.input) < 3 or not gemm.input[2] else \
            np.broadcast_to(g.constant(gemm.input[2]).astype(np.float64).reshape(-1), (n_out,))
        # Y = alpha * A @ B + beta * C, then per column y * scale + shift.
        gamma, bn_beta, mean, var = (g.constant(v).astype(np.float64) for v in bn.input[1:5])
        s, t = batchnorm_affine(gamma, bn_beta, mean, var, float(attributes(bn).get("epsilon", 1e-5)))
        scale, shift = alpha * s, beta * c * s + t
        for name, const in m.info["affine"]:
            scale, shift = _apply_affine(g, g.node(name).op_type, const, scale, shift)
        work = np.promote_types(b.dtype, np.float32)
        col = scale.astype(work)
        b_folded = (b.astype(work) * (col[:, None] if trans_b else col[None, :])).astype(b.dtype)
        taken: set[str] = set()
        b_name = unique_name(g, f"{gemm.name}.weight_folded", taken)
        c_name = unique_name(g, f"{gemm.name}.bias_folded", taken)
        attrs = {k: v for k, v in a.items() if k in ("transA", "transB")}
        node = helper.make_node("Gemm", [gemm.input[0], b_name, c_name], [m.outputs[0]], name=gemm.name, **attrs)
        return Replacement([node], [numpy_helper.from_array(b_folded, b_name),
                                    numpy_helper.from_array(shift.astype(b.dtype), c_name)])


def batchnorm_problem(g: Graph, bn: onnx.NodeProto, channels: int) -> tuple[str, str] | None:
    """(reason, detail) if `bn` is not an inference-mode BatchNormalization with constant statistics of
    `channels` channels (so it cannot fold into the op before it), else None."""
    a = attributes(bn)
    if a.get("training_mode", 0) != 0 or any(o for o in bn.output[1:]):
        return "bn-training-mode", (f"BatchNormalization {bn.name!r} runs in training mode (it updates its "
                                    "statistics); export the model in eval mode")
    if a.get("spatial", 1) == 0:
        return "bn-not-spatial", (f"BatchNormalization {bn.name!r} has spatial=0 (per-activation statistics), "
                                  "which does not fold per channel")
    for role, v in zip(("scale", "bias", "mean", "var"), bn.input[1:5]):
        if not g.is_constant(v):
            return "bn-nonconstant-params", f"BatchNormalization {role} {v!r} is not a constant"
    for role, v in zip(("scale", "bias", "mean", "var"), bn.input[1:5]):
        p = g.constant(v)
        if p is None or p.shape != (channels,):
            return "bn-shape-mismatch", (f"BatchNormalization {role} {v!r} has shape {None if p is None else p.shape},"
                                         f" not ({channels},) of the op before it")
    return None


def batchnorm_affine(gamma: np.ndarray, beta: np.ndarray, mean: np.ndarray, var: np.ndarray,
                     eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Inference-mode BatchNormalization as y = x * s + t per channel."""
    s = gamma / np.sqrt(var + eps)
    return s, beta - mean * s


def _low_precision(elem_type: int | None) -> bool:
    """fp16 / bf16: a folded weight's rounding can exceed the model's own error (see the module doc)."""
    return elem_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def fold_into_conv(w: np.ndarray, scale: np.ndarray, shift: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weight and bias of a conv computing conv_nobias(x, w) * scale + shift (per output channel).

    The per-channel vectors are composed in float64; the weight product runs in float32 (or wider if `w`
    is), one rounding per element, which is as exact as the float32 result can be and 3x faster than a
    float64 round trip of every weight."""
    work = np.promote_types(w.dtype, np.float32)
    s = scale.astype(work).reshape((-1,) + (1,) * (w.ndim - 1))
    return (w.astype(work, copy=False) * s).astype(w.dtype, copy=False), shift.astype(w.dtype)


_AFFINE_OPS = ("Mul", "Add", "Sub", "Div")


def _per_channel_affine_chain(g: Graph, z: str, rank: int | None) -> tuple[list[tuple[str, str]], str]:
    """Mul/Add/Sub/Div by per-channel constants right after the conv (or its BN), as exporters emit for
    a learned channel scale and shift (light_inception_v2: BN -> Mul -> Add -> Relu). They fold into W, B.
    Returns [(node name, constant operand)] and the chain's output value."""
    chain: list[tuple[str, str]] = []
    while rank is not None and z not in g.graph_outputs:
        n = g.single_consumer(z)
        if n is None or n.op_type not in _AFFINE_OPS or len(n.input) != 2:
            break
        # Sub and Div fold only as x - c and x / c; Mul and Add commute.
        if n.op_type in ("Sub", "Div") and n.input[0] != z:
            break
        other = n.input[1] if n.input[0] == z else n.input[0]
        if other == z or not _is_per_channel(g.constant(other) if g.is_constant(other) else None, rank):
            break
        if n.op_type == "Div" and np.any(g.constant(other) == 0):
            break
        chain.append((n.name, other))
        z = n.output[0]
    return chain, z


def _is_per_channel(c: np.ndarray | None, rank: int) -> bool:
    """True if constant `c` broadcasts against [N, C, spatial...] along the channel axis only."""
    if c is None or c.ndim > rank or not (np.issubdtype(c.dtype, np.floating) or c.dtype.name == "bfloat16"):
        return False
    shape = (1,) * (rank - c.ndim) + c.shape
    return shape[0] == 1 and all(d == 1 for d in shape[2:])


def _apply_affine(g: Graph, op_type: str, const: str, scale: np.ndarray, shift: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Compose (x * scale + shift) with one more per-channel op by a constant."""
    c = np.broadcast_to(g.constant(const).astype(np.float64).reshape(-1), scale.shape)
    if op_type == "Mul":
        return scale * c, shift * c
    if op_type == "Div":
        return scale / c, shift / c
    if op_type == "Add":
        return scale, shift + c
    return scale, shift - c  # Sub, as x - c


_RESIDUAL_OPS = ("Add", "Sum")
_PER_CHANNEL_STEPS = ("BatchNormalization",) + _AFFINE_OPS


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
    zs, os_, ys = g.shape(z), g.shape(other), g.shape(n.output[0])
    known = zs is not None and all(d is not None and not (isinstance(d, str) and d.startswith("unk__")) for d in zs)
    if not known or os_ is None:
        return "refused", n, "residual-shape-unknown", (f"the shapes of the conv output {z!r} ({_fmt(zs)}) and of "
                                                        f"the residual {other!r} ({_fmt(os_)}) are not both known; "
                                                        "a residual must have the conv output's shape")
    if tuple(os_) != tuple(zs) or (ys is not None and tuple(ys) != tuple(zs)):
        return "refused", n, "residual-broadcast", (f"the residual {other!r} has shape {_fmt(os_)}, the conv output "
                                                    f"{z!r} {_fmt(zs)}: it broadcasts, so it is not a residual of "
                                                    "the conv's shape")
    if g.elem_type(other) != g.elem_type(z):
        return "refused", n, "residual-dtype", f"the residual {other!r} and the conv output {z!r} differ in type"
    return "ok", n, other


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
    """The activation that alone consumes `z`: a unary op, or SiLU written as z * Sigmoid(z)."""
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
