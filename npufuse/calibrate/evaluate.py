"""Re-price recorded kernels under other profile terms, fast: `cost_model.kernel.price` over numpy arrays.

Every kernel the cost model prices records its basis (stage totals and one step in cycles, the Cube, GM and L2
roofline inputs; see `kernel.price`). The calibrated terms only act on that basis, so a fit re-prices thousands of
kernels per step without re-running the cost model. A kernel whose basis does not reproduce its time (a composite
kernel such as MlaProlog's stages) keeps its time as a constant; views cost nothing.

A row measured as a bare kernel (`mode = "kernel"`: device time of one kernel, no launch) is priced with the fixed
per-kernel cost only; a model row (`om_graph`) with the spec's execution mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from npufuse.cost_model.kernel import BASIS_LEN, STAGES, KernelEstimate, price
from npufuse.npu_model.spec import CALIBRATED_KEYS, NpuSpec

FIELD_OF = {key: fname for key, fname, _rule, _default in CALIBRATED_KEYS}
_CUBE, _VECTOR = STAGES.index("cube"), STAGES.index("vector")
_N = len(STAGES)


def with_terms(spec: NpuSpec, terms: Mapping[str, float]) -> NpuSpec:
    """`spec` with calibrated terms set by their TOML keys ("cube.efficiency_max": 0.87)."""
    return dataclasses.replace(spec, **{FIELD_OF[k]: float(v) for k, v in terms.items()})


@dataclass(frozen=True)
class Compiled:
    """The kernels of many rows as arrays."""

    basis: np.ndarray          # (K, BASIS_LEN) for the kernels priced from their basis
    row_of: np.ndarray         # (K,) row index of each such kernel
    const_us: np.ndarray       # (R,) time of each row's kernels that are not re-priced (composites)
    bare: np.ndarray           # (R,) bool: the row measured one bare kernel (no launch)
    n_rows: int
    unreproduced: int          # kernels kept at their recorded time


def compile_rows(kernels: Sequence[Sequence[KernelEstimate]], bare: Sequence[bool], spec: NpuSpec) -> Compiled:
    """Arrays of every row's kernels; each kernel's basis is checked to reproduce its recorded time on `spec`."""
    rows, bases, const = [], [], np.zeros(len(kernels))
    unreproduced = 0
    for i, ks in enumerate(kernels):
        for k in ks:
            if k.launches == 0 and not k.basis:
                continue                        # a view: no kernel
            if len(k.basis) == BASIS_LEN and _reproduces(k, spec):
                rows.append(i)
                bases.append(k.basis)
            else:
                const[i] += k.t_total_us
                unreproduced += 1
    basis = np.array(bases, dtype=float).reshape(-1, BASIS_LEN)
    return Compiled(basis, np.array(rows, dtype=int), const, np.array(bare, dtype=bool), len(kernels), unreproduced)


def _reproduces(k: KernelEstimate, spec: NpuSpec) -> bool:
    t = price(k.basis, spec).t_total_us
    return abs(t - k.t_total_us) <= 1e-9 * max(1.0, abs(k.t_total_us))


def row_times_us(c: Compiled, spec: NpuSpec) -> np.ndarray:
    """Modeled time of every row on `spec` (its calibrated terms applied): the sum of its kernels."""
    b = c.basis
    st, sp = b[:, :_N].copy(), b[:, _N:2 * _N].copy()
    cube = st[:, _CUBE]
    safe = np.where(cube > 0, cube, 1.0)
    eff = np.where(cube > 0, spec.cube_efficiency_max * safe / (safe + spec.cube_efficiency_knee_cycles), 1.0)
    st[:, _CUBE] /= eff
    sp[:, _CUBE] /= eff
    st[:, _VECTOR] *= spec.vector_cost_factor
    sp[:, _VECTOR] *= spec.vector_cost_factor
    fill = sp.sum(axis=1) - sp.max(axis=1)
    t_pipe = (st.max(axis=1) + fill) / spec.clock_hz * 1e6
    gm = b[:, 2 * _N + 1] / (spec.gm_bandwidth_bytes_per_s * spec.gm_fraction) * 1e6
    body = np.maximum(t_pipe, np.maximum(b[:, 2 * _N], np.maximum(gm, b[:, 2 * _N + 2])))
    serial, overlapped = spec.launch_terms_us()
    bare = c.bare[c.row_of]
    t = np.where(bare, body + spec.launch_kernel_fixed_us,
                 np.maximum(body + serial, overlapped))
    return np.bincount(c.row_of, weights=t, minlength=c.n_rows) + c.const_us
