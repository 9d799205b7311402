"""The format conversions (TransData kernels) GE puts in front of a kernel that takes an operand only in a
fractal layout.

On a chip whose MatMul kernels take the B operand (x2) in FRACTAL_NZ only (Ascend310P: hicann/ops-nn registers
MatMulV3 and BatchMatMulV3 for ascend310p with x2 in FRACTAL_NZ alone; profile key `cube.matmul_b_fractal_only`),
a weight B is converted once, while ATC compiles. A B computed at run time (attention's K and V) arrives in the
layout its producer wrote: GE's format propagation has the producer write FRACTAL_NZ where it can, and the layout
kernels between a projection and the attention take FRACTAL_NZ only when the last two dims are multiples of 16
(TBE confusion_transpose_d.py, `_division_sixteen`). So the conversion is a kernel of its own exactly where B's
last two dims are not 16-aligned (ViT's 197 tokens, Swin's 49-token windows), priced as one move of B into the
padded fractal layout (both dims rounded up to the fractal's). BERT's aligned sequences pay none.
"""

from __future__ import annotations

import dataclasses

from npufuse.cost_model.workload import OpWork, TensorInfo
from npufuse.npu_model.spec import NpuSpec

CONVERSION_NOTE = ("GE's format conversion (TransData): the MatMul after it takes B in FRACTAL_NZ only, and a B "
                   "computed at run time with dims that are not multiples of 16 arrives in ND; the whole tensor is "
                   "copied into the padded fractal layout")

# MatMuls whose input 1 is B in (..., K, N) layout (Gemm's transB and the quantized forms keep theirs elsewhere)
_B_IS_INPUT_1 = frozenset({"MatMul", "FusedMatMul"})


def conversions(op: OpWork, spec: NpuSpec) -> tuple[OpWork, ...]:
    """The TransData kernels GE runs before `op` on `spec` (none on most chips and ops)."""
    if not spec.cube_matmul_b_fractal_only or op.op_type not in _B_IS_INPUT_1 or len(op.inputs) < 2:
        return ()
    b = op.inputs[1]
    if b is None or b.is_constant or len(b.shape) < 2 or \
            not all(isinstance(d, int) and d > 0 for d in b.shape[-2:]):   # no size to convert (never raises)
        return ()
    fractal = _fractal(b, spec)
    if b.shape[-2:] == fractal.shape[-2:]:
        return ()
    return (OpWork(f"{op.name}/transdata_b", "TransData", "", (b,), (fractal,)),)


def _fractal(t: TensorInfo, spec: NpuSpec) -> TensorInfo:
    """`t` in FRACTAL_NZ: its last two dims padded to the fractal (16 rows; 32 bytes of columns, and at least 16:
    fp32 runs in fp16 on the Cube, int8 takes 32)."""
    rows, cols = int(t.shape[-2]), int(t.shape[-1])
    c0 = max(spec.cube_block, spec.alignment_bytes // max(t.itemsize, 1))
    padded = (-(-rows // spec.cube_block) * spec.cube_block, -(-cols // c0) * c0)
    return dataclasses.replace(t, shape=tuple(t.shape[:-2]) + padded, is_constant=False)
