"""Reading the user's kernels file (`--kernels FILE`, npu_model.user_kernels) against what npufuse has: its fused
ops and their attributes, FusedMatMul's epilogue steps, the chips the kernel catalogue knows."""

from __future__ import annotations

import os

from npufuse import FUSED_DOMAIN
from npufuse.errors import InputError
from npufuse.npu_model.ascend_kernels import known_chips
from npufuse.npu_model.user_kernels import KernelsFileError, UserKernel, load_kernels
from npufuse.patterns import fused_op_defs
from npufuse.patterns.matmul_epilogue import EPILOGUE_STEPS


def read_kernels_file(path: str | os.PathLike) -> tuple[UserKernel, ...]:
    """The kernels `path` declares; a bad file is an InputError of one line (exit 2)."""
    ops = {op: d.attributes for (dom, op), d in fused_op_defs().items() if dom == FUSED_DOMAIN}
    try:
        return load_kernels(path, ops, EPILOGUE_STEPS, known_chips())
    except KernelsFileError as exc:
        raise InputError(str(exc)) from None
