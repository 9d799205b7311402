"""Error statistics for `npufuse check`: one verdict per output, and the smallest tolerance that passes.

Every statistic uses the allclose bound `atol + rtol * |want|`, applied to different summaries of the
error (docs/check.md has the exact definitions):

- elementwise: every element passes  |got - want| <= atol + rtol * |want|
- max:         max |got - want|  <= atol + rtol * max |want|
- mean:        mean |got - want| <= atol + rtol * mean |want|
- quantile:    at least a fraction q of the elements pass the elementwise rule, i.e. the q-quantile
               (inverted CDF) of the excess |got - want| - atol - rtol * |want| is <= 0
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from npufuse.errors import InputError
from npufuse.verify.compare import MAX_NON_FINITE_FRACTION, Tolerance, flush_subnormals

STATISTICS = ("elementwise", "max", "mean", "quantile")


@dataclass(frozen=True)
class OutputTolerance:
    """The tolerance one output is judged with. `atol=None` means the dtype default floor
    (atol_scale * max|want|, from npufuse.verify.compare.DEFAULT_TOLERANCES)."""

    rtol: float | None = None
    atol: float | None = None


@dataclass
class OutputCheck:
    """One output's verdict and the figures a person needs to pick a tolerance."""

    name: str
    ok: bool
    statistic: str
    rtol: float                     # the rtol used
    atol: float                     # the absolute floor used (explicit, or atol_scale * max|want|)
    max_abs_err: float              # max |got - want|
    max_rel_err: float              # max |got - want| / |want| over elements where want != 0
    worst_index: tuple[int, ...]    # where the error is worst (see `worst_of` in docs/check.md)
    got_at_worst: float | None
    want_at_worst: float | None
    stat_err: float                 # the statistic's error figure (max/mean abs err, quantile excess, ...)
    min_passing_rtol: float         # smallest rtol that would pass with the same atol
    min_passing_atol: float         # smallest atol that would pass with the same rtol
    quantile: float | None = None
    shape: tuple[int, ...] = ()
    dtype: str = ""
    detail: str = ""
    notes: list[str] = field(default_factory=list)
    # Nothing (or not all) could be compared: empty, or the reference NaN/inf on these inputs (not drift).
    inconclusive: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "ok": self.ok, "statistic": self.statistic, "quantile": self.quantile,
            "rtol": self.rtol, "atol": self.atol, "max_abs_err": _json_float(self.max_abs_err),
            "max_rel_err": _json_float(self.max_rel_err), "worst_index": list(self.worst_index),
            "got_at_worst": _json_float(self.got_at_worst), "want_at_worst": _json_float(self.want_at_worst),
            "stat_err": _json_float(self.stat_err), "min_passing_rtol": _json_float(self.min_passing_rtol),
            "min_passing_atol": _json_float(self.min_passing_atol), "shape": list(self.shape),
            "dtype": self.dtype, "detail": self.detail, "notes": list(self.notes), "inconclusive": self.inconclusive,
        }


def _json_float(x: float | None) -> float | str | None:
    """JSON has no inf/nan: write them as strings."""
    if x is None or math.isfinite(x):
        return x
    return str(x)


def check_statistic(statistic: str, quantile: float) -> None:
    """Refuse an unknown statistic or a quantile outside (0, 1]."""
    if statistic not in STATISTICS:
        raise InputError(f"unknown statistic {statistic!r}; choose one of {', '.join(STATISTICS)}")
    if not (0.0 < quantile <= 1.0):
        raise InputError(f"quantile {quantile!r} is outside (0, 1]; pass e.g. --quantile 0.99")


def measure(name: str, got: np.ndarray, want: np.ndarray, tol: OutputTolerance | None = None,
            statistic: str = "elementwise", quantile: float = 0.99) -> OutputCheck:
    """Judge `got` against `want` with `statistic`; non-float outputs default to exact equality."""
    check_statistic(statistic, quantile)
    tol = tol or OutputTolerance()
    got, want = np.asarray(got), np.asarray(want)
    q = quantile if statistic == "quantile" else None
    default = Tolerance.for_dtype(want.dtype)
    rtol = default.rtol if tol.rtol is None else float(tol.rtol)
    inf = float("inf")
    if got.shape != want.shape or got.dtype != want.dtype:
        what = f"shape {got.shape} != {want.shape}" if got.shape != want.shape else f"dtype {got.dtype} != {want.dtype}"
        return OutputCheck(name, False, statistic, rtol, 0.0 if tol.atol is None else tol.atol, inf, inf, (),
                           None, None, inf, inf, inf, q, tuple(want.shape), want.dtype.name, what)
    if want.size == 0:
        return OutputCheck(name, True, statistic, rtol, 0.0 if tol.atol is None else tol.atol, 0.0, 0.0, (),
                           None, None, 0.0, 0.0, 0.0, q, tuple(want.shape), want.dtype.name,
                           f"empty {tuple(want.shape)}: nothing compared", inconclusive=True)
    # Subnormals compared as 0, as the optimizer's own checks do (see verify.compare.flush_subnormals).
    g64 = flush_subnormals(got.astype(np.float64), want.dtype)
    w64 = flush_subnormals(want.astype(np.float64), want.dtype)
    finite_want = np.isfinite(w64)
    non_finite = 1.0 - float(np.mean(finite_want))
    if non_finite > MAX_NON_FINITE_FRACTION:   # a reference that is mostly NaN/inf proves nothing
        nan = float("nan")
        return OutputCheck(name, False, statistic, rtol, 0.0 if tol.atol is None else tol.atol, nan, nan, (), None,
                           None, nan, inf, inf, q, tuple(want.shape), want.dtype.name,
                           f"{non_finite:.0%} of the reference is NaN or inf on these inputs, so nothing was "
                           "verified", inconclusive=True)
    err = _abs_error(g64, w64)
    # Elements where the reference itself is NaN/inf and the candidate differs are undefined on these inputs: no
    # evidence either way; drift is judged on the finite part of the reference.
    unverifiable = (~finite_want) & (err > 0)
    err = np.where(unverifiable, 0.0, err)
    mag = np.abs(np.where(np.isfinite(w64), w64, 0.0))
    atol = default.atol_scale * float(mag.max()) if tol.atol is None else float(tol.atol)

    if statistic in ("elementwise", "quantile"):
        q_eff = 1.0 if statistic == "elementwise" else quantile
        excess = err - (atol + rtol * mag)
        stat_err = _quantile(excess, q_eff)
        ok = stat_err <= 0.0
        # Per element: the smallest rtol (same atol) and atol (same rtol) at which it passes.
        over = np.maximum(err - atol, 0.0)
        need_rtol = np.where(over > 0, np.divide(over, mag, out=np.full_like(over, np.inf), where=mag > 0), 0.0)
        need_atol = np.maximum(err - rtol * mag, 0.0)
        min_rtol, min_atol = _quantile(need_rtol, q_eff), _quantile(need_atol, q_eff)
        flat = int(np.argmax(np.where(np.isnan(excess), np.inf, excess)))
        rule = (f"{'every element' if statistic == 'elementwise' else f'{quantile:g} of the elements'} "
                f"within {atol:.3g} + {rtol:g}*|want|")
    else:
        reduce = np.max if statistic == "max" else np.mean
        err_s, mag_s = float(reduce(err)), float(reduce(mag))
        stat_err = err_s - (atol + rtol * mag_s)
        ok = bool(stat_err <= 0.0)
        min_rtol = 0.0 if err_s <= atol else (err_s - atol) / mag_s if mag_s > 0 else inf
        min_atol = max(err_s - rtol * mag_s, 0.0)
        flat = int(np.argmax(err))
        rule = f"{statistic} |got-want| = {err_s:.3g} within {atol:.3g} + {rtol:g}*{statistic} |want| ({mag_s:.3g})"
    worst = tuple(int(i) for i in np.unravel_index(flat, err.shape))
    nz = mag > 0
    max_abs = float(err.max())
    max_rel = float((err[nz] / mag[nz]).max()) if nz.any() else (0.0 if max_abs == 0 else inf)
    detail = "" if ok else (f"{rule} fails: |got-want| = {err[worst]:.3g} at {worst} "
                            f"(got {g64[worst]:.6g}, want {w64[worst]:.6g})")
    inconclusive = bool(ok and unverifiable.any())
    if inconclusive:
        ok = False
        at = tuple(int(i) for i in np.argwhere(unverifiable)[0])
        detail = (f"{int(unverifiable.sum())} element(s) where the reference is NaN or inf on these inputs differ "
                  f"(first at {at}: got {g64[at]:.6g}, want {w64[at]:.6g}); the finite part agrees")
    return OutputCheck(name, bool(ok), statistic, rtol, atol, max_abs, max_rel, worst, float(g64[worst]),
                       float(w64[worst]), float(stat_err), float(min_rtol), float(min_atol), q,
                       tuple(want.shape), want.dtype.name, detail, inconclusive=inconclusive)


def _abs_error(g64: np.ndarray, w64: np.ndarray) -> np.ndarray:
    """|got - want| with NaN == NaN, equal infinities equal, and a NaN on one side only infinitely wrong."""
    nan_mismatch = np.isnan(g64) != np.isnan(w64)
    both_nan = np.isnan(g64) & np.isnan(w64)
    with np.errstate(invalid="ignore"):
        err = np.abs(g64 - w64)
    err = np.where(both_nan, 0.0, err)
    err = np.where(nan_mismatch, np.inf, err)
    err = np.where(np.isinf(w64) & (g64 == w64), 0.0, err)
    return np.where(np.isnan(err), np.inf, err)  # inf - inf of opposite signs


def _quantile(x: np.ndarray, q: float) -> float:
    """The q-quantile by the inverted CDF: the smallest v with at least a fraction q of x <= v."""
    flat = np.sort(np.ravel(x))
    k = max(int(math.ceil(q * flat.size)), 1) - 1
    return float(flat[min(k, flat.size - 1)])


def resolve_tolerances(outputs: list[str], rtol: float | None, atol: float | None,
                       per_output: Mapping[str, Mapping[str, float] | OutputTolerance] | None
                       ) -> dict[str, OutputTolerance]:
    """The tolerance of each output: per-output values over global ones over dtype defaults."""
    per_output = dict(per_output or {})
    unknown = [n for n in per_output if n not in outputs]
    if unknown:
        raise InputError(f"per-output tolerance for {unknown[0]!r}, which is not an output of the model; "
                         f"outputs are: {', '.join(outputs)}")
    out = {}
    for name in outputs:
        spec = per_output.get(name)
        if isinstance(spec, OutputTolerance):
            spec = {"rtol": spec.rtol, "atol": spec.atol}
        spec = dict(spec or {})
        bad = set(spec) - {"rtol", "atol"}
        if bad:
            raise InputError(f"per-output tolerance for {name!r} has unknown key(s) {sorted(bad)}; use rtol and atol")
        r = spec.get("rtol", rtol)
        a = spec.get("atol", atol)
        for label, v in (("rtol", r), ("atol", a)):
            if v is not None and (not math.isfinite(float(v)) or float(v) < 0):
                raise InputError(f"{label} {v!r} for output {name!r} must be a finite number >= 0")
        out[name] = OutputTolerance(None if r is None else float(r), None if a is None else float(a))
    return out
