"""MatMul/Gemm -> [bias] -> [activation / norm epilogue]  =>  npufuse.FusedMatMul.

The Cube unit produces the output tile; the epilogue (bias add, LayerNorm/RMSNorm over the row, GELU,
ReLU, SiLU) runs on the Vector unit while the tile is still on chip, so the MatMul's output never makes
a round trip through GM.

`epilogue` is the ordered list of steps applied to `Y = A @ B`:
  bias       Y + bias            bias is a constant broadcast along the last axis only ([N] or [1,..,N])
  layernorm  (Y - mean) / sqrt(var + epsilon) * gamma + beta, over the last axis
  rmsnorm    Y / sqrt(mean(Y^2) + epsilon) * gamma, over the last axis
  gelu       0.5 * Y * (1 + erf(Y / sqrt 2))
  gelu_tanh  0.5 * Y * (1 + tanh(sqrt(2/pi) * (Y + 0.044715 Y^3)))
  relu, silu max(Y, 0), Y * sigmoid(Y)
  tanh       tanh(Y)                               (BERT's pooler: dense -> Tanh)
  sigmoid    sigmoid(Y)                            (gates)
  quick_gelu Y * sigmoid(1.702 Y)                  (CLIP's MLP, after the gelu pattern made it npufuse.Gelu[quick])
The matcher accepts `bias` only first, and then at most one activation and at most one norm in either
order: MatMul -> LayerNorm -> GELU (MLA-prolog-like), dense -> +bias -> GELU -> LayerNorm (BERT's head),
MatMul -> RMSNorm, MatMul + bias + GELU/ReLU/SiLU (FFN, llama's gate).

Rules (see `MatMulEpilogue.match`):
- B must be a constant weight. A MatMul with a dynamic B (Q·Kᵀ) is not this pattern: it is refused as
  `dynamic-weight` only when an epilogue follows it, otherwise ignored.
- The chain grows only through values that have a single consumer and are not graph outputs (SiLU's
  x is read by its Sigmoid and its Mul, both absorbed); it stops at the first op that is not an epilogue.
- A residual Add (dynamic second operand) is not an epilogue, so in BERT's dense -> +bias -> +residual ->
  LayerNorm the chain stops after the bias: the MatMul + bias fuse alone (`[bias]`), the residual Add and
  the norm stay (an AddLayerNorm is their fusion, not this one). A bias-only FusedMatMul is always offered
  for a MatMul + Add; the cost model decides whether it pays. A Gemm whose C is its only "epilogue" is
  already a MatMul with bias and is left alone.
- Gemm: transA must be 0; transB=1 and alpha are folded into a new constant weight, beta into the bias.
- GPT-2's Conv1D export is Reshape(3-D -> 2-D) -> Gemm -> Reshape(2-D -> 3-D) -> GELU. A Reshape right
  after the MatMul/Gemm is looked through when its output's last dim is provably N (rows stay rows, so the
  row-wise epilogue commutes with it). The replacement is FusedMatMul on the 2-D tensor followed by the same
  Reshape, which keeps the name and final shape of the last fused value: semantics are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto as A
from onnx import TensorProto, helper, numpy_helper

from npufuse import FUSED_DOMAIN, FUSED_DOMAIN_VERSION
from npufuse.patterns import kernels
from npufuse.ir.candidates import Match, Refusal, Replacement
from npufuse.ir.graph import Graph, attributes
from npufuse.patterns.base import (
    ERF_OPSET,
    FusedOpDef,
    Pattern,
    float_attr_constant,
    make_body,
    node_with_refs,
    overload_with,
    require_opset,
    unique_name,
)
from npufuse.ir.matching import last_axis_vector_problem, other_operand

EPILOGUE_STEPS = ("bias", "layernorm", "rmsnorm", "gelu", "gelu_tanh", "relu", "silu", "tanh", "sigmoid",
                  "quick_gelu")
NORM_STEPS = frozenset({"layernorm", "rmsnorm"})
ACTIVATION_STEPS = frozenset({"gelu", "gelu_tanh", "relu", "silu", "tanh", "sigmoid", "quick_gelu"})
QUICK_GELU_ALPHA = 1.702
_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16})
_DEFAULT_EPSILON = 1e-5
_STD_DOMAINS = ("", "ai.onnx")

# (domain, op_type) of the single-op norms and GELUs the phase-0 patterns emit (or an exporter wrote).
_LAYERNORM_OPS = frozenset({("", "LayerNormalization"), (FUSED_DOMAIN, "LayerNorm")})
_RMSNORM_OPS = frozenset({("", "RMSNormalization"), (FUSED_DOMAIN, "RMSNorm")})
_GELU_OPS = frozenset({("", "Gelu"), (FUSED_DOMAIN, "Gelu")})


# ---- the fused op ----------------------------------------------------------------------------------

def apply_step(step: str, y: np.ndarray, bias: np.ndarray | None, gamma: np.ndarray | None,
               beta: np.ndarray | None, epsilon: float) -> np.ndarray:
    """One epilogue step in float64 (the semantics an NPU kernel author implements)."""
    if step == "bias":
        return y + bias.astype(np.float64).reshape(-1)
    if step == "relu":
        return np.maximum(y, 0.0)
    if step == "silu":
        return y * kernels.sigmoid(y)
    if step == "tanh":
        return np.tanh(y)
    if step == "sigmoid":
        return kernels.sigmoid(y)
    if step == "quick_gelu":
        return y * kernels.sigmoid(QUICK_GELU_ALPHA * y)
    if step in ("gelu", "gelu_tanh"):
        return kernels.gelu(y, "tanh" if step == "gelu_tanh" else "none")
    g = np.ones(y.shape[-1]) if gamma is None else gamma.astype(np.float64).reshape(-1)
    if step == "layernorm":
        b = np.zeros(y.shape[-1]) if beta is None else beta.astype(np.float64).reshape(-1)
        return kernels.layer_norm(y, epsilon) * g + b
    if step == "rmsnorm":
        return kernels.rms_norm(y, epsilon) * g
    raise ValueError(f"FusedMatMul: unknown epilogue step {step!r}")


def _fused_matmul_reference(inputs: list[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    ins = list(inputs) + [None] * (5 - len(inputs))
    a, b, bias, gamma, beta = ins[:5]
    eps = float(attrs.get("epsilon", _DEFAULT_EPSILON))
    y = np.matmul(a.astype(np.float64), b.astype(np.float64))
    for step in attrs.get("epilogue", []):
        y = apply_step(step, y, bias, gamma, beta, eps)
    return [y.astype(a.dtype)]


class _BodyBuilder:
    """Accumulates function-body nodes with fresh value names."""

    def __init__(self, opset: int, elem_type: int, attrs: dict[str, Any]) -> None:
        self.opset, self.elem_type, self.attrs = opset, elem_type, attrs
        self.tokens: list[str] = []          # what else the overload must name (a baked-in epsilon)
        self.np_type = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
        self.nodes: list[onnx.NodeProto] = []
        self.count = 0

    def fresh(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        out = self.fresh(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def const(self, value: float, hint: str) -> str:
        out = self.fresh(hint)
        self.nodes.append(helper.make_node("Constant", [], [out], value=numpy_helper.from_array(
            np.array(value, dtype=self.np_type), out)))
        return out

    @property
    def stats_type(self) -> int:
        """Precision of norm statistics: float32 for half types (LayerNormalization's stash_type=1)."""
        return TensorProto.FLOAT if self.elem_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16) else self.elem_type

    def epsilon(self) -> str:
        """The caller's `epsilon` attribute as a scalar of the statistics' type."""
        raw = self.fresh("eps_float")
        node, token = float_attr_constant(raw, "epsilon", self.attrs, self.opset, _DEFAULT_EPSILON)
        self.nodes.append(node)
        if token not in self.tokens:
            self.tokens.append(token)
        return raw if self.stats_type == TensorProto.FLOAT else self.op("Cast", [raw], to=self.stats_type)

    def to_stats(self, x: str) -> str:
        return x if self.stats_type == self.elem_type else self.op("Cast", [x], to=self.stats_type)

    def from_stats(self, x: str) -> str:
        return x if self.stats_type == self.elem_type else self.op("Cast", [x], to=self.elem_type)

    def mean_last_axis(self, x: str) -> str:
        if self.opset >= 18:
            axes = self.fresh("axes")
            self.nodes.append(helper.make_node("Constant", [], [axes], value=numpy_helper.from_array(
                np.array([-1], dtype=np.int64), axes)))
            return self.op("ReduceMean", [x, axes], keepdims=1)
        return self.op("ReduceMean", [x], axes=[-1], keepdims=1)


def _body_step(bb: _BodyBuilder, step: str, x: str) -> tuple[str, str]:
    """Nodes for one epilogue step from ops of the model's opset; returns (output, overload token)."""
    if step == "bias":
        return bb.op("Add", [x, "bias"]), "bias"
    if step == "relu":
        return bb.op("Relu", [x]), "relu"
    if step == "silu":
        return bb.op("Mul", [x, bb.op("Sigmoid", [x])]), "silu"
    if step == "tanh":
        return bb.op("Tanh", [x]), "tanh"
    if step == "sigmoid":
        return bb.op("Sigmoid", [x]), "sigmoid"
    if step == "quick_gelu":
        gate = bb.op("Sigmoid", [bb.op("Mul", [x, bb.const(QUICK_GELU_ALPHA, "alpha")])])
        return bb.op("Mul", [x, gate]), "quick_gelu_formula"
    if step in ("gelu", "gelu_tanh"):
        approx = "none" if step == "gelu" else "tanh"
        if bb.opset >= 20:
            return bb.op("Gelu", [x], approximate=approx), f"{step}_op"
        if step == "gelu":
            require_opset("FusedMatMul", bb.opset, ERF_OPSET, "Erf for the exact GELU")
            inner = bb.op("Erf", [bb.op("Mul", [x, bb.const(1.0 / math.sqrt(2.0), "inv_sqrt2")])])
        else:
            cube = bb.op("Mul", [bb.op("Mul", [x, x]), x])
            poly = bb.op("Add", [x, bb.op("Mul", [cube, bb.const(0.044715, "c_cubic")])])
            inner = bb.op("Tanh", [bb.op("Mul", [poly, bb.const(math.sqrt(2.0 / math.pi), "sqrt_2_over_pi")])])
        one_plus = bb.op("Add", [inner, bb.const(1.0, "one")])
        return bb.op("Mul", [bb.op("Mul", [x, one_plus]), bb.const(0.5, "half")]), f"{step}_formula"
    if step == "layernorm":
        if bb.opset >= 17:
            out = bb.fresh("layernorm")
            bb.nodes.append(node_with_refs("LayerNormalization", [x, "gamma", "beta"], [out],
                                           [("epsilon", A.FLOAT)], axis=-1))
            return out, "layernorm_op"
        xs = bb.to_stats(x)
        d = bb.op("Sub", [xs, bb.mean_last_axis(xs)])
        var = bb.mean_last_axis(bb.op("Mul", [d, d]))
        normed = bb.from_stats(bb.op("Div", [d, bb.op("Sqrt", [bb.op("Add", [var, bb.epsilon()])])]))
        return bb.op("Add", [bb.op("Mul", [normed, "gamma"]), "beta"]), "layernorm_formula"
    if step == "rmsnorm":
        if bb.opset >= 23:
            out = bb.fresh("rmsnorm")
            bb.nodes.append(node_with_refs("RMSNormalization", [x, "gamma"], [out], [("epsilon", A.FLOAT)], axis=-1))
            return out, "rmsnorm_op"
        xs = bb.to_stats(x)
        ms = bb.mean_last_axis(bb.op("Mul", [xs, xs]))
        normed = bb.from_stats(bb.op("Div", [xs, bb.op("Sqrt", [bb.op("Add", [ms, bb.epsilon()])])]))
        return bb.op("Mul", [normed, "gamma"]), "rmsnorm_formula"
    raise ValueError(f"FusedMatMul: no function body for epilogue step {step!r}")


def fused_matmul_body(attrs: dict[str, Any], opset: int, elem_type: int) -> onnx.FunctionProto:
    """The FusedMatMul function body for `attrs['epilogue']` from ops of the default-domain `opset`.

    The overload names the epilogue, the opset-dependent choice per step (standard op or formula) and
    the element type where constants of that type are baked in, so different epilogues get different bodies.
    """
    epilogue = list(attrs.get("epilogue", []))
    bb = _BodyBuilder(opset, elem_type, attrs)
    cur = bb.op("MatMul", ["A", "B"])
    tokens = []
    for step in epilogue:
        cur, token = _body_step(bb, step, cur)
        tokens.append(token)
    bb.nodes[-1].output[0] = "Y"
    if any(t.endswith("_formula") for t in tokens):
        tokens.append(bb.np_type.name)
    overload = overload_with("__".join(["matmul"] + tokens), *bb.tokens)
    return make_body(
        FUSED_DOMAIN, "FusedMatMul", ["A", "B", "bias", "gamma", "beta"], ["Y"], bb.nodes,
        [helper.make_opsetid("", opset)], attributes=["epilogue", "epsilon"], overload=overload,
        doc_string="MatMul followed by the epilogue steps named in `epilogue`, in order.")


FUSED_MATMUL = FusedOpDef(
    op_type="FusedMatMul",
    doc="Y = epilogue(A @ B): `epilogue` lists, in order, steps from "
        "bias, layernorm, rmsnorm, gelu, gelu_tanh, relu, silu, tanh, sigmoid, quick_gelu; norms reduce over the last axis with `epsilon`. "
        "B is a constant weight; bias, gamma and beta are vectors of the last dim N. "
        "T: float16, float, double, bfloat16.",
    inputs=("A", "B", "bias?", "gamma?", "beta?"),
    outputs=("Y",),
    attributes=("epilogue", "epsilon"),
    reference=_fused_matmul_reference,
    body=fused_matmul_body,
)


# ---- the pattern -----------------------------------------------------------------------------------

@dataclass
class _Chain:
    """The epilogue found after a MatMul/Gemm."""

    steps: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)       # epilogue nodes (plus a looked-through Reshape)
    output: str = ""
    bias: str | None = None          # value of the bias (Gemm's C or the Add's constant operand)
    bias_from_gemm: bool = False
    gamma: str | None = None
    beta: str | None = None
    epsilon: float | None = None
    reshape: str | None = None       # a Reshape right after the MatMul that the epilogue looked through
    near_miss: Refusal | None = None  # why the chain stopped, where it stopped at a would-be epilogue


class MatMulEpilogue(Pattern):
    name = "matmul_epilogue"
    description = "MatMul/Gemm -> [bias] -> LayerNorm/RMSNorm/GELU/ReLU/SiLU/Tanh/Sigmoid epilogue into FusedMatMul"
    anchor_ops = frozenset({"MatMul", "Gemm"})
    phase = 2
    fused_ops = (FUSED_MATMUL,)

    def match(self, g: Graph, node: onnx.NodeProto) -> Match | Refusal | None:
        if node.domain not in _STD_DOMAINS or len(node.input) < 2 or not node.output[0]:
            return None
        y = node.output[0]
        if g.elem_type(y) not in _FLOAT_TYPES and g.elem_type(node.input[0]) not in _FLOAT_TYPES:
            return None
        n_cols = self._output_cols(g, node)
        chain = _Chain(output=y)
        gemm_refusal = None
        if node.op_type == "Gemm":
            gemm_refusal = self._gemm_bias(g, node, chain, n_cols)
        self._walk(g, node, chain, n_cols)
        nodes = [node.name] + chain.nodes
        if not [s for s in chain.steps if not (s == "bias" and chain.bias_from_gemm)]:
            # Nothing after the matmul (a Gemm's own C is already a fused bias).
            if chain.near_miss is not None and g.is_constant(node.input[1]):
                return chain.near_miss
            return None
        if not g.is_constant(node.input[1]):
            return self._refuse(node, "dynamic-weight", f"{node.op_type} {node.name!r} multiplies by "
                                f"{node.input[1]!r}, which is not a constant weight (e.g. Q·Kᵀ); "
                                "FusedMatMul needs B to be a weight", nodes)
        if gemm_refusal is not None:
            return gemm_refusal
        if n_cols is None:
            return self._refuse(node, "unknown-shape", f"the weight of {node.op_type} {node.name!r} has no "
                                "known column count N; the epilogue vectors cannot be checked", nodes)
        ordered = tuple(sorted(nodes, key=lambda n: g.topo_index[n]))
        kind = f"FusedMatMul[{','.join(chain.steps)}]"
        return Match(self.name, ordered, g.boundary_inputs(ordered), (chain.output,), kind,
                     info={"anchor": node.name, "chain": chain, "n_cols": n_cols})

    # ---- matching helpers -------------------------------------------------------------------
    def _refuse(self, node: onnx.NodeProto, reason: str, detail: str, nodes: list[str]) -> Refusal:
        return Refusal(self.name, node.name, reason, detail, tuple(nodes))

    @staticmethod
    def _output_cols(g: Graph, node: onnx.NodeProto) -> int | None:
        """N, the last dim of the MatMul/Gemm output, from the (constant) weight or inferred shapes."""
        b_shape = g.shape_or_constant(node.input[1])
        if b_shape is not None and len(b_shape) >= 2:
            trans_b = node.op_type == "Gemm" and attributes(node).get("transB", 0)
            n = b_shape[-2] if trans_b else b_shape[-1]
            if isinstance(n, int):
                return n
        out = g.shape(node.output[0])
        if out and isinstance(out[-1], int):
            return out[-1]
        return None

    def _gemm_bias(self, g: Graph, node: onnx.NodeProto, chain: _Chain, n_cols: int | None) -> Refusal | None:
        """Gemm's C as the first epilogue step; a refusal where the Gemm itself cannot be a FusedMatMul."""
        a = attributes(node)
        if a.get("transA", 0):
            return self._refuse(node, "gemm-transA", f"Gemm {node.name!r} has transA=1; FusedMatMul takes A "
                                "as is (transpose A first to fuse)", [node.name])
        if len(node.input) > 2 and node.input[2]:
            c = node.input[2]
            why = self._bias_problem(g, c, n_cols, 2)
            if why is not None:
                return self._refuse(node, why[0], f"Gemm {node.name!r}: {why[1]}", [node.name])
            chain.steps.append("bias")
            chain.bias, chain.bias_from_gemm = c, True
        return None

    @staticmethod
    def _bias_problem(g: Graph, value: str, n_cols: int | None, out_rank: int | None) -> tuple[str, str] | None:
        """(reason, detail) if `value` is not a constant vector broadcast along the last axis only."""
        if not g.is_constant(value):
            return "dynamic-bias", f"bias {value!r} is not a constant"
        arr = g.constant(value)
        if arr is None:
            return "dynamic-bias", f"bias {value!r} cannot be evaluated"
        shape = arr.shape
        if out_rank is not None and len(shape) > out_rank:
            return "bias-not-last-axis", f"bias {value!r} of shape {list(shape)} has a higher rank than the output"
        if any(d != 1 for d in shape[:-1]) or (shape and n_cols is not None and shape[-1] not in (1, n_cols)):
            return "bias-not-last-axis", (f"bias {value!r} of shape {list(shape)} broadcasts along an axis other "
                                          f"than the last (N={n_cols}); only [N] or [1,..,N] is a bias")
        return None

    def _walk(self, g: Graph, mm: onnx.NodeProto, chain: _Chain, n_cols: int | None) -> None:
        """Grow `chain` from the matmul output through epilogue ops (see the module docstring)."""
        cur = chain.output
        out_rank = g.rank(cur)
        # A Reshape right after the matmul that keeps rows as rows (GPT-2's Conv1D export).
        nxt = g.single_consumer(cur)
        if nxt is not None and nxt.op_type == "Reshape" and nxt.domain in _STD_DOMAINS and nxt.input[0] == cur:
            r_shape = g.shape(nxt.output[0])
            if r_shape and n_cols is not None and r_shape[-1] == n_cols and self._next_step(g, nxt.output[0], chain,
                                                                                          n_cols, len(r_shape), True):
                chain.reshape = nxt.name
                chain.nodes.append(nxt.name)
                cur = nxt.output[0]
                out_rank = len(r_shape)
        chain.output = cur
        while True:
            step = self._next_step(g, cur, chain, n_cols, out_rank, False)
            if step is None:
                return
            kind, nodes, out, params = step
            chain.steps.append(kind)
            chain.nodes.extend(nodes)
            if kind == "bias":
                chain.bias = params["bias"]
            elif kind in NORM_STEPS:
                chain.gamma, chain.beta, chain.epsilon = params["gamma"], params.get("beta"), params["epsilon"]
            cur = chain.output = out

    def _next_step(self, g: Graph, cur: str, chain: _Chain, n_cols: int | None, out_rank: int | None,
                   probe: bool) -> tuple[str, list[str], str, dict[str, Any]] | None:
        """The epilogue step consuming `cur`, or None (recording a near-miss on `chain` unless probing)."""
        cons = g.consumers_of(cur)
        if not cons or cur in g.graph_outputs:
            if cons and not probe and not chain.steps and any(self._looks_like_step(g, c, cur) for c in cons):
                chain.near_miss = Refusal(self.name, cons[0].name, "intermediate-is-output",
                                          f"matmul output {cur!r} is a graph output; the epilogue cannot absorb it",
                                          (cons[0].name,))
            return None
        has_norm = any(s in NORM_STEPS for s in chain.steps)
        has_act = any(s in ACTIVATION_STEPS for s in chain.steps)
        if len(cons) == 2 and not has_act:
            silu = self._silu(g, cur, cons)
            if silu is not None:
                return silu
        if len(cons) != 1:
            if not probe and not chain.steps and any(self._looks_like_step(g, c, cur) for c in cons):
                chain.near_miss = Refusal(self.name, cons[0].name, "shared-intermediate",
                                          f"matmul output {cur!r} feeds {len(cons)} nodes; an epilogue must be "
                                          "its only reader", tuple(c.name for c in cons))
            return None
        n = cons[0]
        key = ("" if n.domain == "ai.onnx" else n.domain, n.op_type)
        if n.op_type == "Add" and n.domain in _STD_DOMAINS and not chain.steps:
            bias = other_operand(n, cur)
            if bias is None or bias == cur or not g.is_constant(bias):
                return None  # a residual Add: not an epilogue
            why = self._bias_problem(g, bias, n_cols, out_rank)
            if why is not None:
                if not probe:
                    chain.near_miss = Refusal(self.name, n.name, why[0], f"Add {n.name!r}: {why[1]}", (n.name,))
                return None
            return "bias", [n.name], n.output[0], {"bias": bias}
        if has_act and has_norm:
            return None
        if not has_act:
            if n.op_type == "Relu" and n.domain in _STD_DOMAINS:
                return "relu", [n.name], n.output[0], {}
            if key in _GELU_OPS and n.input[0] == cur:
                approx = attributes(n).get("approximate", "none")
                step = {"none": "gelu", "tanh": "gelu_tanh"}.get(approx)
                if key == (FUSED_DOMAIN, "Gelu") and approx == "quick":
                    step = "quick_gelu"
                if step is None:
                    if not probe:
                        chain.near_miss = Refusal(self.name, n.name, "unknown-approximation",
                                                  f"{n.op_type} {n.name!r} has approximate={approx!r}, which no "
                                                  "epilogue step computes", (n.name,))
                    return None
                return step, [n.name], n.output[0], {}
            if n.op_type in ("Tanh", "Sigmoid") and n.domain in _STD_DOMAINS:
                return n.op_type.lower(), [n.name], n.output[0], {}
            if n.op_type == "Swish" and n.domain in _STD_DOMAINS and float(attributes(n).get("alpha", 1.0)) == 1.0:
                return "silu", [n.name], n.output[0], {}
        if not has_norm and (key in _LAYERNORM_OPS or key in _RMSNORM_OPS) and n.input[0] == cur:
            return self._norm(g, n, cur, chain, n_cols, out_rank, probe)
        return None

    def _looks_like_step(self, g: Graph, n: onnx.NodeProto, cur: str) -> bool:
        key = ("" if n.domain == "ai.onnx" else n.domain, n.op_type)
        if key in _GELU_OPS | _LAYERNORM_OPS | _RMSNORM_OPS or n.op_type in ("Relu", "Swish", "Tanh", "Sigmoid"):
            return True
        if n.op_type == "Add":
            other = other_operand(n, cur)
            return other is not None and other != cur and g.is_constant(other)
        return False

    def _silu(self, g: Graph, x: str, cons: list[onnx.NodeProto]) -> tuple[str, list[str], str, dict] | None:
        """x * Sigmoid(x), either operand order: x read by exactly that Sigmoid and that Mul."""
        sig = next((c for c in cons if c.op_type == "Sigmoid" and c.domain in _STD_DOMAINS), None)
        mul = next((c for c in cons if c.op_type == "Mul" and c.domain in _STD_DOMAINS), None)
        if sig is None or mul is None or sig.input[0] != x:
            return None
        if other_operand(mul, x) != sig.output[0] or g.single_consumer(sig.output[0]) is not mul:
            return None
        return "silu", [sig.name, mul.name], mul.output[0], {}

    def _norm(self, g: Graph, n: onnx.NodeProto, cur: str, chain: _Chain, n_cols: int | None,
              out_rank: int | None, probe: bool) -> tuple[str, list[str], str, dict] | None:
        kind = "layernorm" if ("" if n.domain == "ai.onnx" else n.domain, n.op_type) in _LAYERNORM_OPS else "rmsnorm"
        a = attributes(n)
        axis = int(a.get("axis", -1))

        def miss(reason: str, detail: str) -> None:
            if not probe:
                chain.near_miss = Refusal(self.name, n.name, reason, f"{n.op_type} {n.name!r}: {detail}", (n.name,))

        if not (axis == -1 or (out_rank is not None and axis == out_rank - 1)):
            miss("norm-not-last-axis", f"normalises from axis {axis} of a rank-{out_rank} tensor; a fused norm "
                 "epilogue reduces over the last axis of the matmul output only")
            return None
        if any(o and (g.consumers_of(o) or o in g.graph_outputs) for o in n.output[1:]):
            miss("norm-extra-outputs", "its mean/inv-std-dev outputs are used; the fused op does not produce them")
            return None
        params: dict[str, Any] = {"epsilon": float(a.get("epsilon", _DEFAULT_EPSILON))}
        for role, v in zip(("gamma", "beta"), list(n.input[1:3])):
            if not v:
                continue
            why = last_axis_vector_problem(g, v, n_cols)
            if why is not None:
                miss("norm-param-shape", f"{role} {v!r} {why}")
                return None
            params[role] = v
        if kind == "rmsnorm":
            params.pop("beta", None)
        params.setdefault("gamma", None)
        return kind, [n.name], n.output[0], params

    # ---- build ------------------------------------------------------------------------------
    def build(self, g: Graph, m: Match) -> Replacement:
        mm = g.node(m.info["anchor"])
        chain: _Chain = m.info["chain"]
        n_cols: int = m.info["n_cols"]
        taken: set[str] = set()
        inits: list[onnx.TensorProto] = []
        a_in, w_name = mm.input[0], mm.input[1]
        if mm.op_type == "Gemm":
            ga = attributes(mm)
            alpha, beta_c, trans_b = float(ga.get("alpha", 1.0)), float(ga.get("beta", 1.0)), int(ga.get("transB", 0))
            if alpha != 1.0 or trans_b:
                w = g.constant(w_name)
                if w is None:
                    raise ValueError(f"Gemm {mm.name!r}: weight {w_name!r} cannot be evaluated")
                w = (w.T if trans_b else w)
                if alpha != 1.0:
                    w = (w.astype(np.float64) * alpha).astype(w.dtype)
                w_name = unique_name(g, f"{mm.name}.weight_folded", taken)
                inits.append(numpy_helper.from_array(np.ascontiguousarray(w), w_name))
        else:
            beta_c = 1.0

        def vector(value: str | None, role: str, scale: float = 1.0) -> str:
            """`value` as a length-N vector: reused when it already is one, else a new initializer."""
            if value is None:
                return ""
            shape = g.shape(value)
            if shape == (n_cols,) and scale == 1.0:
                return value
            arr = g.constant(value)
            if arr is None:
                raise ValueError(f"{role} {value!r} is not a constant and not of shape [{n_cols}]")
            vec = np.broadcast_to(arr.reshape(-1), (n_cols,))
            if scale != 1.0:
                vec = vec.astype(np.float64) * scale
            name = unique_name(g, f"{mm.name}.{role}", taken)
            inits.append(numpy_helper.from_array(np.ascontiguousarray(vec.astype(arr.dtype)), name))
            return name

        bias = vector(chain.bias, "bias", beta_c if chain.bias_from_gemm else 1.0)
        gamma, beta = "", ""
        if "layernorm" in chain.steps or "rmsnorm" in chain.steps:
            gamma = vector(chain.gamma, "gamma") if chain.gamma else self._filled(g, mm, a_in, n_cols, 1.0, "gamma",
                                                                                  taken, inits)
            if "layernorm" in chain.steps:
                beta = vector(chain.beta, "beta") if chain.beta else self._filled(g, mm, a_in, n_cols, 0.0, "beta",
                                                                                   taken, inits)
        inputs = [a_in, w_name, bias, gamma, beta]
        while inputs and not inputs[-1]:
            inputs.pop()
        attrs: dict[str, Any] = {"epilogue": list(chain.steps)}
        if chain.epsilon is not None:
            attrs["epsilon"] = chain.epsilon
        out = m.outputs[0]
        nodes: list[onnx.NodeProto] = []
        fused_out = out
        if chain.reshape is not None:
            fused_out = unique_name(g, f"{mm.name}.fused_output", taken)
        elem = g.elem_type(a_in) or g.elem_type(mm.output[0])
        node, fn = FUSED_MATMUL.make_node(inputs, [fused_out], mm.name, attrs, g.opset.get("", 1), elem)
        nodes.append(node)
        if chain.reshape is not None:
            r = g.node(chain.reshape)
            nodes.append(helper.make_node("Reshape", [fused_out, r.input[1]], [out], name=r.name, **attributes(r)))
        return Replacement(nodes, inits, [fn], {FUSED_DOMAIN: FUSED_DOMAIN_VERSION})

    @staticmethod
    def _filled(g: Graph, mm: onnx.NodeProto, a_in: str, n_cols: int, value: float, role: str, taken: set[str],
                inits: list[onnx.TensorProto]) -> str:
        """A constant [N] vector of `value` for a norm that had no gamma/beta input."""
        dtype = g.dtype(a_in) or np.dtype(np.float32)
        name = unique_name(g, f"{mm.name}.{role}", taken)
        inits.append(numpy_helper.from_array(np.full((n_cols,), value, dtype=dtype), name))
        return name
