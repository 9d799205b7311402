"""Refuse, before allocating anything, verification data that cannot fit in memory: a fixed dim of 100000 or
`--dim N=99999999999` would otherwise end in numpy's MemoryError (a traceback) or the OOM killer."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import numpy as np

from npufuse.errors import InputError
from npufuse.ir.graph import Graph
from npufuse.console.units import format_bytes
from npufuse.verify.dim_sizes import concrete_shape

# numpy draws floats in float64 and then casts: generating an input briefly holds 8 bytes an element more.
_GENERATION_BYTES_PER_ELEMENT = 8


def available_memory_bytes() -> int:
    """Memory this process may still take: MemAvailable, capped by a cgroup v2/v1 limit (containers)."""
    candidates = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    candidates.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
            if text.isdigit():
                candidates.append(int(text))
        except OSError:
            pass
    if not candidates:
        try:
            candidates.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return 1 << 62  # unknown: refuse nothing
    return min(candidates)


def _nbytes(shape: tuple[int, ...], dtype: np.dtype | None) -> int:
    itemsize = dtype.itemsize if dtype is not None and dtype.itemsize else 8
    return math.prod(shape) * itemsize


def check_fits_memory(g: Graph, dims: Mapping[str, int] | None, available: int | None = None, *,
                      skip_hint: str = "skip the numeric checks (optimize/report --no-verify)") -> None:
    """InputError naming the value and its size when the generated inputs together, or any one value of the
    graph on its own (with the dims verification uses), need more memory than is available."""
    available = available_memory_bytes() if available is None else available
    def hint(shape: tuple) -> str:
        fix = skip_hint
        return f"pass smaller --dim values, or {fix}" if any(isinstance(d, str) for d in shape) else fix

    total = 0
    for name in g.graph_inputs:
        if name in g.initializers:
            continue
        shape = g.shape(name)
        if shape is None:
            continue
        concrete = concrete_shape(shape, dims)
        if any(d < 0 for d in concrete):
            continue  # refused where the model is loaded; nothing to estimate
        need = _nbytes(concrete, g.dtype(name)) + math.prod(concrete) * _GENERATION_BYTES_PER_ELEMENT
        total += need
        if total > available:
            raise InputError(f"input {name!r} of shape {concrete} needs {format_bytes(need)} to generate, more than "
                             f"the {format_bytes(available)} of memory available; {hint(shape)}")
    inputs = set(g.graph_inputs)
    for name, t in g.value_types.items():
        if name in inputs or name in g.initializers or not t.tensor_type.HasField("shape"):
            continue
        shape = g.shape(name)
        if shape is None or any(isinstance(d, int) and d < 0 for d in shape):
            continue
        concrete = concrete_shape(shape, dims)
        need = _nbytes(concrete, g.dtype(name))
        if need > available:
            raise InputError(f"value {name!r} of shape {concrete} needs {format_bytes(need)}, more than the "
                             f"{format_bytes(available)} of memory available; {hint(shape)}")
