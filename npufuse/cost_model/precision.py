"""An op's work in the dtypes its kernel runs under the spec's ATC precision mode (npu_model.precision).

Every price goes through here (estimate.estimate_op), so report, optimize and calibrate price one graph alike.
"""

from __future__ import annotations

from dataclasses import replace

from npufuse.cost_model.recipes import ATTENTIONS, CONVS, MATMULS
from npufuse.cost_model.workload import OpWork, TensorInfo
from npufuse.npu_model.precision import PrecisionPolicy

# Kernels that run on the Cube: ATC's "matrix" operators (fused Cube + Vector kernels count as matrix: their
# inputs are the Cube's).
MATRIX_OPS = MATMULS | CONVS | ATTENTIONS | {"GatedMLP", "MlaProlog"}
# Ops whose output type is their attribute, not a choice of the precision mode.
_TYPED = frozenset({"Cast", "CastLike"})


def at_precision(op: OpWork, policy: PrecisionPolicy) -> OpWork:
    """`op` with each float tensor in the dtype `policy` runs it in (the op itself where nothing changes)."""
    if policy.changes_nothing or op.op_type in _TYPED:
        return op
    if op.op_type in MATRIX_OPS:
        ins, outs = policy.matrix_in, policy.matrix_out
    else:
        ins = outs = policy.vector
    if not ins and not outs:
        return op
    new_in = tuple(_as(t, policy, ins) for t in op.inputs)
    new_out = tuple(_as(t, policy, outs) for t in op.outputs)
    if new_in == op.inputs and new_out == op.outputs:
        return op
    return replace(op, inputs=new_in, outputs=new_out)


def _as(t: TensorInfo | None, policy: PrecisionPolicy, pairs: tuple[tuple[str, str], ...]) -> TensorInfo | None:
    if t is None:
        return None
    dtype = policy.convert(t.dtype, pairs)
    return t if dtype == t.dtype else replace(t, dtype=dtype)
