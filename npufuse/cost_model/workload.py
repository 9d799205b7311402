"""The cost model's input: plain records of the work one node does, independent of ONNX protos."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Bytes per element of the dtype names numpy (and ml_dtypes) use; unknown names fall back to numpy, then 4.
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "uint64": 8, "int32": 4,
             "uint32": 4, "int16": 2, "uint16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1,
             "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "int4": 1, "uint4": 1,
             "complex64": 8, "complex128": 16}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (4 where the name is unknown)."""
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    try:
        return int(np.dtype(dtype).itemsize) or 4
    except TypeError:
        return 4


@dataclass(frozen=True)
class TensorInfo:
    """A value's concrete shape (symbolic dims already replaced by defaults), dtype and constness."""

    shape: tuple[int, ...]
    dtype: str
    is_constant: bool = False

    @property
    def numel(self) -> int:
        return int(math.prod(max(int(d), 0) for d in self.shape)) if self.shape else 1

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class OpWork:
    """One node as work: what it computes on which tensors."""

    name: str
    op_type: str
    domain: str
    inputs: tuple[TensorInfo | None, ...]
    outputs: tuple[TensorInfo, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def input(self, i: int) -> TensorInfo | None:
        return self.inputs[i] if i < len(self.inputs) else None


@dataclass(frozen=True)
class FusionCandidate:
    """The nodes a fusion replaces (each its own kernel today) and their replacement."""

    pattern: str
    unfused: tuple[OpWork, ...]
    fused: tuple[OpWork, ...]
