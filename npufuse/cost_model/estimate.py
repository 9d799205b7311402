"""`estimate_op`: one node's kernel cost on an NpuSpec; `estimate_ops`: a model's totals per op kind.

Which model prices which op:
- MatMul, Gemm, MatMulInteger, QLinearMatMul, FusedMatMul: GEMM on the Cube (batch dims multiply),
  FusedMatMul's epilogue on the Vector (see cube_ops).
- GatedMLP: one Cube+Vector kernel, the gate and up projections as one GEMM x·[W_gate | W_up] of width 2N,
  the activation and the product on the Vector, N columns written (see `gated_mlp`).
- npufuse.MlaProlog: one launch running its stages back to back (three GEMMs, two row norms, two rotations), each
  priced as its own kernel without the launch and without the GM traffic of the intermediates (see `mla_prolog`).
- npufuse.RotaryEmbedding: one streaming Vector kernel (x, cos, sin read, y written; see recipes.ROTARY).
- npufuse.RotaryEmbeddingPair: one streaming Vector kernel over q and k together (q, k, cos, sin read once, both
  outputs written; see `rotary_pair`).
- Conv, ConvTranspose, FusedConv: implicit GEMM on the Cube; FusedConv's activation on the Vector.
- FusedAttention (and ONNX/ORT Attention forms with Q, K, V inputs): flash attention.
- Norms and Softmax (LayerNormalization, LayerNorm, RMSNorm, RMSNormalization,
  SimplifiedLayerNormalization, GroupNormalization, InstanceNormalization, Softmax, LogSoftmax): row ops.
- Elementwise ops, activations, Gelu, BatchNormalization (inference): streaming Vector ops.
- Reductions and pools: streaming Vector ops; Transpose, Concat, Slice, Gather, ...: data movement.
- Reshape, Squeeze, Unsqueeze, Identity, Flatten, Shape, Constant, Size, Dropout: views, priced at zero
  (no kernel launch, no bytes: the runtime aliases the buffer or folds the value).
- Shape arithmetic (Gather, Concat, Slice, Cast, Add, ... whose every tensor is a small int64/int32 one, see
  `HOST_SHAPE_OPS`): computed on the host under ATC, priced at zero like a view, with a note.
- Every op is priced in the dtypes ATC's precision mode runs it in (the spec's `precision_mode`, see
  cost_model.precision): an fp32 export under ATC's default force_fp16 moves and computes fp16.
- Format conversions: on a chip whose MatMul takes B in FRACTAL_NZ only, a run-time B that is not 16-aligned goes
  through a TransData kernel of its own first, and a LayerNorm whose rows the chip's LayerNorm cannot take in
  FRACTAL_NZ runs between two (cost_model.formats; `estimate_ops` and the fusion decisions add them).
- Anything else: a generic elementwise estimate (one add per element of the largest output), with a note;
  a node whose shapes the model cannot read is priced the same way. Nothing raises.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from npufuse.cost_model import cube_ops, vector_ops
from npufuse.cost_model.formats import conversion_note, conversions
from npufuse.cost_model.kernel import KernelEstimate, view
from npufuse.cost_model.precision import at_precision
from npufuse.cost_model.recipes import (
    ATTENTIONS,
    CONVS,
    ELEMENTWISE,
    INPLACE_ATTR,
    MATMULS,
    MOVES,
    POOLS,
    REDUCTIONS,
    ROTARY,
    ROW_OPS,
    VIEWS,
    gated_epilogue,
)
from npufuse.cost_model.workload import OpWork, TensorInfo
from npufuse.npu_model.spec import NpuSpec


def with_conversions(ops: Iterable[OpWork], spec: NpuSpec) -> list[KernelEstimate]:
    """Each op's kernel, preceded by the format conversions (TransData) GE puts in front of it on `spec`."""
    out = []
    for op in ops:
        out.extend(estimate_op(c, spec) for c in conversions(op, spec))
        out.append(estimate_op(op, spec))
    return out


def estimate_op(op: OpWork, spec: NpuSpec) -> KernelEstimate:
    """The modeled cost of `op` as its own kernel on `spec` (never raises on odd shapes or op types).

    Results are memoised on (spec, op type, shapes, dtypes, attributes): a model repeats its layers.
    """
    try:
        key = (op.op_type, op.domain, op.inputs, op.outputs, _freeze(op.attrs))
        hash(key)
    except TypeError:
        return _estimate(op, spec)
    est = _cached(spec, key)
    return est if est.name == op.name else est.renamed(op.name)


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@lru_cache(maxsize=8192)
def _cached(spec: NpuSpec, key: tuple) -> KernelEstimate:
    op_type, domain, inputs, outputs, attrs = key
    return _estimate(OpWork("", op_type, domain, inputs, outputs, dict(attrs)), spec)


def _estimate(op: OpWork, spec: NpuSpec) -> KernelEstimate:
    op = at_precision(op, spec.precision)   # the dtypes ATC compiles the op in
    t = op.op_type
    try:
        if t in VIEWS or _is_identity_cast(op):
            return view(op, spec)
        if op.attrs.get(INPLACE_ATTR) and spec.chip is not None:   # GE's layout: an Ascend chip, not a CPU
            return replace(view(op, spec), notes=(
                f"GE's {t.lower()} optimize: the {'producers write' if t == 'Concat' else 'consumers read'} one "
                "buffer along C in place, no kernel launch and no data movement",))
        if _is_host_shape_arithmetic(op):
            return replace(view(op, spec), notes=(
                "shape arithmetic on small integer tensors: ATC computes it on the host, no kernel launch and "
                "no device time",))
        if t in ATTENTIONS and len(op.inputs) >= 3:
            return cube_ops.attention(op, spec)
        if t == "FusedMatMul":
            return cube_ops.fused_matmul(op, spec)
        if t == "GatedMLP":
            return gated_mlp(op, spec)
        if t == "MlaProlog" and op.domain == "npufuse":
            return mla_prolog(op, spec)
        if t == "RotaryEmbedding" and op.domain == "npufuse":
            # one streaming Vector kernel: x read once, cos/sin broadcast over the heads, y written once
            return vector_ops.elementwise(op, spec, recipe=ROTARY, temps=1)
        if t == "RotaryEmbeddingPair" and op.domain == "npufuse":
            return rotary_pair(op, spec)
        if t in MATMULS:
            return cube_ops.matmul(op, spec)
        if t in CONVS:
            return cube_ops.conv(op, spec)
        if t in ROW_OPS:
            return vector_ops.row_op(op, spec)
        if t in ELEMENTWISE or t in ("Sum", "Mean"):
            return vector_ops.elementwise(op, spec)
        if t in REDUCTIONS:
            return vector_ops.reduction(op, spec)
        if t in POOLS:
            return vector_ops.pool(op, spec)
        if t == "TransData":
            return replace(vector_ops.move(op, spec), notes=(conversion_note(op),))
        if t in MOVES:
            return vector_ops.move(op, spec)
    except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError, AssertionError, OverflowError) as exc:
        return vector_ops.generic(op, spec, f"shapes of this {t} not understood ({exc}); priced as a generic "
                                            "elementwise op")
    return vector_ops.generic(op, spec)


def gated_mlp(op: OpWork, spec: NpuSpec) -> KernelEstimate:
    """npufuse.GatedMLP(X, W_gate, W_up?, B_gate?, B_up?) as one Cube+Vector kernel.

    The Cube computes the gate and up tiles of the same rows (a GEMM of width 2N: [W_gate | W_up], or the merged
    [K, 2N] weight), each row panel of X read once for both; biases are added by FixPipe on the way out of L0C;
    the Vector applies the activation to the gate columns and multiplies by the up columns; only N columns go
    back to GM. The per-tile MTE3 stage is charged for the 2N-wide tile, an upper bound (the kernel writes N):
    the estimate never favours the fusion there. The down projection is a MatMul of its own.
    """
    x, w, w_up = op.input(0), op.input(1), op.input(2)
    if x is None or w is None or not x.shape or len(w.shape) != 2:
        raise ValueError("GatedMLP needs X and a 2-D weight")
    xd = tuple(max(int(d), 1) for d in x.shape)
    k = xd[-1]
    width = int(w.shape[-1]) + (int(w_up.shape[-1]) if w_up is not None else 0)
    m = xd[-2] if len(xd) >= 2 else 1
    batch = max(1, math.prod(xd[:-2])) if len(xd) > 2 else 1
    out = op.outputs[0] if op.outputs else TensorInfo((batch, m, width // 2), x.dtype)
    b_bytes = float(w.nbytes + (w_up.nbytes if w_up is not None else 0))
    gemm = cube_ops.Gemm(batch=batch, m=m, n=width, k=k, in_dtype=x.dtype, a_row_bytes=k * x.itemsize,
                         a_bytes=float(x.nbytes), b_bytes=b_bytes, b_itemsize=b_bytes / max(k * width, 1),
                         out_itemsize=out.itemsize, out_bytes=float(out.nbytes),
                         extra_read=float(sum(t.nbytes for t in op.inputs[3:5] if t is not None)))
    activation = str(op.attrs.get("activation", "silu"))
    notes: tuple[str, ...] = ()
    if activation not in ("silu", "gelu", "gelu_tanh", "relu"):
        notes = (f"activation {activation!r} is not modeled; priced as two adds",)
    epilogue = cube_ops.Epilogue(gated_epilogue(activation), None, (), (activation, "mul"))
    return cube_ops.price_gemm(op, spec, gemm, epilogue, notes)


def rotary_pair(op: OpWork, spec: NpuSpec) -> KernelEstimate:
    """npufuse.RotaryEmbeddingPair(Q, K, cos, sin) as one launch (CANN's ApplyRotaryPosEmb): q and k stream through
    UB as one sequence of q.numel + k.numel elements (the rotary recipe per element), cos and sin are read once for
    both (each core loads them once where they are small, else they stream alongside), both outputs are written."""
    q, k, cos, sin = (list(op.inputs) + [None] * 4)[:4]
    if q is None or k is None:
        raise ValueError("RotaryEmbeddingPair needs Q and K")
    elems = q.numel + k.numel
    ins, fixed = [float(q.itemsize)], []
    for t in (cos, sin):
        if t is None:
            continue
        if t.nbytes <= spec.ub_bytes // 16:
            fixed.append(float(t.nbytes))
        else:
            ins.append(t.nbytes / max(elems, 1))
    read = float(sum(t.nbytes for t in (q, k, cos, sin) if t is not None))
    write = float(sum(t.nbytes for t in op.outputs))
    out_b = [write / max(elems, 1)]
    return vector_ops.stream_kernel(op, spec, elems=elems, recipe=ROTARY, compute_bytes=vector_ops._compute_bytes(op),
                                    read_bytes=read, write_bytes=write, in_bytes=ins, out_bytes=out_b, temps=1,
                                    fixed_bytes=fixed)


def mla_prolog(op: OpWork, spec: NpuSpec) -> KernelEstimate:
    """npufuse.MlaProlog(X, W_dq, gamma_cq, W_uq_qr, W_dkv_kr, gamma_ckv, cos, sin) as one kernel (CANN's MlaProlog).

    Priced as its stages run one after another in one launch: x·W_dq, RMSNorm, ·W_uq_qr, the q rope, x·W_dkv_kr,
    RMSNorm, the k rope, each stage's pipeline time as it would take as a kernel of its own (no overlap between
    stages is assumed, and each stage still pays its own GM reads and writes of the intermediates: an upper bound
    that never favours the fusion beyond the launches, head-split transposes and splits it removes). GM bytes
    counted are the region's inputs and outputs only."""
    x, w_dq, g_cq, w_uq, w_dkv, g_ckv, cos, sin = (list(op.inputs) + [None] * 8)[:8]
    if x is None or w_dq is None or w_uq is None or w_dkv is None or len(x.shape) != 3:
        raise ValueError("MlaProlog needs X [B, S, H] and 2-D weights")
    n, dn, dr = int(op.attrs["num_heads"]), int(op.attrs["qk_nope_head_dim"]), int(op.attrs["qk_rope_head_dim"])
    r_kv = int(op.attrs["kv_lora_rank"])
    b, s_len, _ = (max(int(d), 1) for d in x.shape)
    dt = x.dtype

    def t(*shape: int) -> TensorInfo:
        return TensorInfo(tuple(shape), dt)

    r_q = int(w_dq.shape[-1])
    stages = [
        OpWork("dq", "MatMul", "", (x, w_dq), (t(b, s_len, r_q),)),
        OpWork("norm_cq", "RMSNormalization", "", (t(b, s_len, r_q), g_cq), (t(b, s_len, r_q),), {"axis": -1}),
        OpWork("uq", "MatMul", "", (t(b, s_len, r_q), w_uq), (t(b, s_len, n * (dn + dr)),)),
        OpWork("q_rope", "RotaryEmbedding", "npufuse", (t(b, n, s_len, dr), cos, sin), (t(b, n, s_len, dr),)),
        OpWork("dkv", "MatMul", "", (x, w_dkv), (t(b, s_len, r_kv + dr),)),
        OpWork("norm_ckv", "RMSNormalization", "", (t(b, s_len, r_kv), g_ckv), (t(b, s_len, r_kv),), {"axis": -1}),
        OpWork("k_rope", "RotaryEmbedding", "npufuse", (t(b, 1, s_len, dr), cos, sin), (t(b, 1, s_len, dr),)),
    ]
    parts = [estimate_op(st, spec) for st in stages]
    body = sum(p.t_total_us - p.t_launch_us for p in parts)
    serial, overlapped = spec.launch_terms_us()
    total = max(body + serial, overlapped)
    launch = serial if not overlapped else total - body
    gm_read = int(sum(ti.nbytes for ti in op.inputs if ti is not None))
    gm_write = int(sum(ti.nbytes for ti in op.outputs if ti is not None))
    big = max(parts, key=lambda p: p.t_total_us)
    return replace(big, op_type=op.op_type, name=op.name, kind="cube+vector",
                   flops=sum(p.flops for p in parts), cube_cycles=sum(p.cube_cycles for p in parts),
                   vector_cycles=sum(p.vector_cycles for p in parts), mte2_cycles=sum(p.mte2_cycles for p in parts),
                   mte3_cycles=sum(p.mte3_cycles for p in parts), handoff_cycles=sum(p.handoff_cycles for p in parts),
                   gm_bytes_read=gm_read, gm_bytes_written=gm_write,
                   t_pipeline_us=sum(p.t_pipeline_us for p in parts), t_launch_us=launch, t_total_us=total,
                   launches=1, bound_by=big.bound_by, feasible=all(p.feasible for p in parts),
                   infeasible_reason=next((p.infeasible_reason for p in parts if not p.feasible), ""),
                   notes=("stages run back to back in one launch, each priced as its own kernel",), basis=())


# Ops that compute shapes (Shape -> Gather -> Concat -> Reshape, as exports do for every head split). On small
# integer tensors ATC evaluates them on the host while it builds the graph (or per call in dynamic shape mode):
# they never run as device kernels.
HOST_SHAPE_OPS = frozenset({"Gather", "Concat", "Slice", "Cast", "Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs",
                            "Max", "Min", "Equal", "Less", "Greater", "Not", "Where", "ReduceProd", "ReduceSum",
                            "Expand", "Tile", "Range", "Squeeze", "Unsqueeze", "Reshape", "Shape", "Size"})
SHAPE_TENSOR_MAX_ELEMS = 16   # a shape has at most 8 dims; two shapes side by side (a Concat) fit too
_SHAPE_DTYPES = frozenset({"int64", "int32"})


def _is_host_shape_arithmetic(op: OpWork) -> bool:
    """Shape arithmetic: a shape op whose inputs and outputs are all small int64/int32 tensors of known shape."""
    tensors = [x for x in op.inputs + op.outputs if x is not None]
    return (op.op_type in HOST_SHAPE_OPS and op.domain in ("", "ai.onnx") and bool(op.outputs) and
            all(x.dtype in _SHAPE_DTYPES and x.numel <= SHAPE_TENSOR_MAX_ELEMS for x in tensors))


def _is_identity_cast(op: OpWork) -> bool:
    """A Cast to the type its input already has (exporters emit `.float()` on float32 values): a no-op."""
    return (op.op_type in ("Cast", "CastLike") and bool(op.inputs) and op.inputs[0] is not None
            and bool(op.outputs) and op.inputs[0].dtype == op.outputs[0].dtype)


@dataclass(frozen=True)
class ModelEstimate:
    """A model's modeled time and GM traffic, in total and per op type."""

    profile: str
    time_us: float
    gm_bytes: int
    gm_bytes_read: int
    gm_bytes_written: int
    launches: int
    flops: float
    op_count: int
    by_op_type: dict[str, dict[str, Any]] = field(default_factory=dict)
    kernels: tuple[KernelEstimate, ...] = ()

    def to_dict(self, include_kernels: bool = False) -> dict[str, Any]:
        """JSON-safe plain values (per-kernel records only when asked: a big model has thousands)."""
        d: dict[str, Any] = {
            "profile": self.profile, "time_us": round(self.time_us, 6), "gm_bytes": self.gm_bytes,
            "gm_bytes_read": self.gm_bytes_read, "gm_bytes_written": self.gm_bytes_written,
            "launches": self.launches, "flops": self.flops, "op_count": self.op_count,
            "by_op_type": {k: dict(v) for k, v in self.by_op_type.items()},
        }
        if include_kernels:
            d["kernels"] = [k.to_dict() for k in self.kernels]
        return d


def estimate_ops(ops: Iterable[OpWork], spec: NpuSpec) -> ModelEstimate:
    """Sum of every op's own kernel, and of the format conversions GE runs before it (cost_model.formats): the
    model's time with no further fusion (kernels run back to back)."""
    ops = list(ops)
    kernels = tuple(with_conversions(ops, spec))
    by: dict[str, dict[str, Any]] = {}
    for k in kernels:
        row = by.setdefault(k.op_type, {"count": 0, "time_us": 0.0, "gm_bytes": 0, "launches": 0, "flops": 0.0})
        row["count"] += 1
        row["time_us"] += k.t_total_us
        row["gm_bytes"] += k.gm_bytes
        row["launches"] += k.launches
        row["flops"] += k.flops
    for row in by.values():
        row["time_us"] = round(row["time_us"], 6)
    by = dict(sorted(by.items(), key=lambda kv: -kv[1]["time_us"]))
    return ModelEstimate(
        profile=spec.name, time_us=sum(k.t_total_us for k in kernels), gm_bytes=sum(k.gm_bytes for k in kernels),
        gm_bytes_read=sum(k.gm_bytes_read for k in kernels), gm_bytes_written=sum(k.gm_bytes_written for k in kernels),
        launches=sum(k.launches for k in kernels), flops=sum(k.flops for k in kernels), op_count=len(ops),
        by_op_type=by, kernels=kernels)
