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

On a chip whose LayerNorm kernel takes FRACTAL_NZ only where the rows are 16-aligned (Ascend310P: TBE
layer_norm.py `_division_sixteen` offers FRACTAL_NZ only when the second-to-last dim is a multiple of 16 and the
normalised dim is below 4096; profile key `vector.layernorm_nz_needs_aligned_rows`), a LayerNorm between Cube kernels
(which hand each other FRACTAL_NZ) runs in ND with a TransData on each activation it reads and writes: ViT's 197
tokens run MatMul -> TransData -> LayerNorm -> TransData -> MatMul (the OM graph ModelZoo-PyTorch's ONNX
performance guide shows, `ACL_PyTorch/docs/ONNX/05.性能优化.md`, and the reason its ViT recipe pads the tokens to
208). Each is priced as one move of the tensor between ND and the padded fractal layout.
"""

from __future__ import annotations

import dataclasses

from npufuse.cost_model.workload import OpWork, TensorInfo
from npufuse.npu_model.spec import NpuSpec

CONVERSION_NOTE = ("GE's format conversion (TransData): the MatMul after it takes B in FRACTAL_NZ only, and a B "
                   "computed at run time with dims that are not multiples of 16 arrives in ND; the whole tensor is "
                   "copied into the padded fractal layout")

LAYERNORM_NOTE = ("GE's format conversion (TransData): LayerNorm takes FRACTAL_NZ only where its rows are a multiple of "
                  "16 and the normalised dim is below 4096, so between Cube kernels it runs in ND and each activation "
                  "it reads or writes is converted")

_CONVERTS = "npufuse_converts_for"   # a TransData's attribute: which rule made it (`conversion_note`)

# MatMuls whose input 1 is B in (..., K, N) layout (Gemm's transB and the quantized forms keep theirs elsewhere)
_B_IS_INPUT_1 = frozenset({"MatMul", "FusedMatMul"})


# The LayerNorm kernels (ONNX's, npufuse's fused ones and onnxruntime's residual form): TBE layer_norm.py's formats
_LAYERNORMS = frozenset({"LayerNormalization", "LayerNorm", "AddLayerNorm", "SkipLayerNormalization"})
_GAMMA_AT = {"AddLayerNorm": 2, "SkipLayerNormalization": 2}
_NZ_MAX_NORM_DIM = 4096   # layer_norm.py: "Format of NZ is not supported when the size of reduce axis is large than 4096"


def conversions(op: OpWork, spec: NpuSpec) -> tuple[OpWork, ...]:
    """The TransData kernels GE runs around `op` on `spec` (none on most chips and ops)."""
    if op.op_type in _LAYERNORMS:
        return _layernorm_conversions(op, spec)
    if not spec.cube_matmul_b_fractal_only or op.op_type not in _B_IS_INPUT_1 or len(op.inputs) < 2:
        return ()
    b = op.inputs[1]
    if not _sized_run_time(b):
        return ()
    fractal = _fractal(b, spec)
    if b.shape[-2:] == fractal.shape[-2:]:
        return ()
    return (OpWork(f"{op.name}/transdata_b", "TransData", "", (b,), (fractal,)),)


def _layernorm_conversions(op: OpWork, spec: NpuSpec) -> tuple[OpWork, ...]:
    """Two TransData, on the x a LayerNorm reads and the y it writes, where the chip's LayerNorm cannot take them in
    FRACTAL_NZ (see the module's docstring). Those are the tensors a Cube kernel hands over: an AddLayerNorm's other
    addend and its sum pass from norm to norm in ND (ATC's own graph adds the residual in the MatMul before the
    LayerNorm instead), so a fused and an unfused residual norm pay the same two."""
    if not spec.vector_layernorm_nz_needs_aligned_rows or not op.inputs or not op.outputs:
        return ()
    x, y = op.inputs[0], op.outputs[0]
    if not _sized_run_time(x) or y is None or y.shape != x.shape:
        return ()
    if _takes_nz(op, spec):
        return ()
    attrs = {_CONVERTS: "layernorm"}
    return (OpWork(f"{op.name}/transdata_x", "TransData", "", (_fractal(x, spec),), (x,), attrs),
            OpWork(f"{op.name}/transdata_y", "TransData", "", (y,), (_fractal(y, spec),), attrs))


def _takes_nz(op: OpWork, spec: NpuSpec) -> bool:
    """TBE layer_norm.py's test (`_division_sixteen`, and `op_select_format`'s gamma of rank < 2): rows a multiple of
    16, a last dim below 4096, and either a last dim that is a multiple of 16 too or a norm over the last axis
    alone."""
    dims = op.inputs[0].shape
    block = spec.cube_block
    if dims[-2] % block or dims[-1] >= _NZ_MAX_NORM_DIM:
        return False
    at = _GAMMA_AT.get(op.op_type, 1)   # the residual forms read (a, b, gamma, ...)
    gamma = op.inputs[at] if len(op.inputs) > at else None
    if gamma is not None and len(gamma.shape) >= 2:
        return False
    axis = int(op.attrs.get("axis", -1)) if op.op_type != "SkipLayerNormalization" else -1
    return dims[-1] % block == 0 or axis in (-1, len(dims) - 1)


def conversion_note(op: OpWork) -> str:
    """Why the TransData `op` (one of `conversions`) is there, for the report."""
    return LAYERNORM_NOTE if op.attrs.get(_CONVERTS) == "layernorm" else CONVERSION_NOTE


def _sized_run_time(t: TensorInfo | None) -> bool:
    """A tensor computed at run time whose last two dims have sizes: one a conversion can move (never raises on an
    empty or unknown shape, which charges nothing)."""
    return t is not None and not t.is_constant and len(t.shape) >= 2 and \
        all(isinstance(d, int) and d > 0 for d in t.shape[-2:])


def _fractal(t: TensorInfo, spec: NpuSpec) -> TensorInfo:
    """`t` in FRACTAL_NZ: its last two dims padded to the fractal (16 rows; 32 bytes of columns, and at least 16:
    fp32 runs in fp16 on the Cube, int8 takes 32)."""
    rows, cols = int(t.shape[-2]), int(t.shape[-1])
    c0 = max(spec.cube_block, spec.alignment_bytes // max(t.itemsize, 1))
    padded = (-(-rows // spec.cube_block) * spec.cube_block, -(-cols // c0) * c0)
    return dataclasses.replace(t, shape=tuple(t.shape[:-2]) + padded, is_constant=False)
