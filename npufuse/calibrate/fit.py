"""Robust least squares on log time (Huber), with bounds, numpy only; and leave-one-model-out validation.

Residual r_i = log(t_model_i(θ)) - log(t_published_i), weighted 1 / (rows of the row's model) so a model with 36
rows counts as much as one with 6. Levenberg-Marquardt on iteratively reweighted residuals (Huber weights,
δ = 0.2 in log ≈ 22%), forward-difference Jacobian, each step clipped to the parameter's bounds. A parameter the
rows do not move (a zero Jacobian column at the solution) is reported not identified and left at its default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from npufuse.calibrate.evaluate import Compiled, row_times_us, with_terms
from npufuse.npu_model.spec import NpuSpec

HUBER_DELTA = 0.2


@dataclass(frozen=True)
class Param:
    key: str
    lo: float
    hi: float
    scale: float           # a typical step: the fit works in units of it

    def start(self, spec: NpuSpec) -> float:
        return {"launch.graph_kernel_us": spec.kernel_launch_us, "launch.eager_kernel_us": spec.kernel_launch_us,
                "launch.kernel_fixed_us": 0.5, "cube.efficiency_max": 0.9, "cube.efficiency_knee_cycles": 1000.0,
                "bandwidth.gm_fraction": 0.8, "vector.cost_factor": 1.0}[self.key]


PARAMS = {p.key: p for p in (
    Param("launch.graph_kernel_us", 0.0, 200.0, 1.0),
    Param("launch.eager_kernel_us", 0.0, 2000.0, 10.0),
    Param("launch.kernel_fixed_us", 0.0, 200.0, 1.0),
    Param("cube.efficiency_max", 0.2, 1.0, 0.1),
    Param("cube.efficiency_knee_cycles", 0.0, 1e7, 1e4),
    Param("bandwidth.gm_fraction", 0.1, 1.0, 0.1),
    Param("vector.cost_factor", 0.25, 8.0, 1.0),      # beyond 4x either way it is no longer the same physics
)}


@dataclass(frozen=True)
class FitResult:
    values: dict[str, float]          # fitted and identified
    not_identified: tuple[str, ...]   # asked for, but the rows do not move them (left at the default)
    cost: float
    iterations: int


def huber_weights(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    a = np.abs(r)
    return np.where(a <= delta, 1.0, delta / np.maximum(a, 1e-300))


def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


def neutral_start(spec: NpuSpec, keys: Sequence[str]) -> dict[str, float]:
    """The profile as it prices today, as a starting point (launch serial at kernel_launch_us, no inefficiency)."""
    from npufuse.calibrate.evaluate import FIELD_OF

    out = {}
    for k in keys:
        v = getattr(spec, FIELD_OF[k])
        out[k] = spec.kernel_launch_us if v is None else float(v)
    return out


def fit(c: Compiled, spec: NpuSpec, published_us: np.ndarray, weights: np.ndarray, keys: Sequence[str],
        mask: np.ndarray | None = None, start: dict[str, float] | None = None, max_iter: int = 80) -> FitResult:
    """Fit `keys` on the rows where `mask` (all rows when None). The max() terms make the objective piecewise
    smooth, with local minima: without `start`, the fit runs from the profile as it is and from typical values and
    keeps the better."""
    if start is None:
        a = _fit(c, spec, published_us, weights, keys, mask, neutral_start(spec, keys), max_iter)
        b = _fit(c, spec, published_us, weights, keys, mask, None, max_iter)
        return a if a.cost <= b.cost else b
    return _fit(c, spec, published_us, weights, keys, mask, start, max_iter)


def _fit(c: Compiled, spec: NpuSpec, published_us: np.ndarray, weights: np.ndarray, keys: Sequence[str],
         mask: np.ndarray | None, start: dict[str, float] | None, max_iter: int) -> FitResult:
    params = [PARAMS[k] for k in keys]
    sel = np.ones(c.n_rows, bool) if mask is None else np.asarray(mask, bool)
    logp = np.log(published_us)
    w = np.where(sel, weights, 0.0)
    lo = np.array([p.lo / p.scale for p in params])
    hi = np.array([p.hi / p.scale for p in params])

    def resid(x: np.ndarray) -> np.ndarray:
        terms = {p.key: float(xi * p.scale) for p, xi in zip(params, x)}
        t = row_times_us(c, with_terms(spec, terms))
        return np.where(sel, np.log(np.maximum(t, 1e-12)) - logp, 0.0)

    def cost(r: np.ndarray) -> float:
        return float(np.sum(w * huber(r)))

    x = np.array([(start or {}).get(p.key, p.start(spec)) / p.scale for p in params])
    x = np.clip(x, lo, hi)
    r = resid(x)
    f = cost(r)
    lam, it = 1e-2, 0
    for it in range(1, max_iter + 1):
        J = _jacobian(resid, x, r, lo, hi)
        ww = w * huber_weights(r)
        A = J.T @ (ww[:, None] * J)
        g = J.T @ (ww * r)
        improved = False
        while lam < 1e12:
            step = np.linalg.solve(A + lam * (np.diag(np.diag(A)) + 1e-12 * np.eye(len(x))), -g)
            x_new = np.clip(x + step, lo, hi)
            r_new = resid(x_new)
            f_new = cost(r_new)
            if f_new < f:
                improved = f - f_new > 1e-12 * max(f, 1e-12)
                x, r, f = x_new, r_new, f_new
                lam = max(lam / 3.0, 1e-9)
                break
            lam *= 4.0
        if not improved:
            break
    J = _jacobian(resid, x, r, lo, hi)
    col = np.sqrt(np.sum((w[:, None] * J) ** 2, axis=0))
    values, missing = {}, []
    for p, xi, ci in zip(params, x, col):
        if ci > 1e-9:
            values[p.key] = float(xi * p.scale)
        else:
            missing.append(p.key)
    return FitResult(values, tuple(missing), f, it)


def _jacobian(resid, x: np.ndarray, r: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    J = np.zeros((len(r), len(x)))
    for j in range(len(x)):
        h = 1e-4 * max(1.0, abs(x[j]))
        xp = x.copy()
        if xp[j] + h > hi[j]:
            h = -h                                  # step inward at the upper bound
        xp[j] += h
        J[:, j] = (resid(xp) - r) / h
    return J


def group_weights(groups: Sequence[str], mask: np.ndarray) -> np.ndarray:
    """1 / (rows of the same model among the fitted ones)."""
    counts: dict[str, int] = {}
    for gname, m in zip(groups, mask):
        if m:
            counts[gname] = counts.get(gname, 0) + 1
    return np.array([1.0 / counts[g] if m else 0.0 for g, m in zip(groups, mask)])


@dataclass(frozen=True)
class Validation:
    full: FitResult
    predicted_us: np.ndarray          # each fitted row: modeled with its model left out; others: the full fit
    held_out: np.ndarray              # bool: predicted_us is a leave-one-model-out prediction


def leave_one_model_out(c: Compiled, spec: NpuSpec, published_us: np.ndarray, groups: Sequence[str],
                        fit_mask: np.ndarray, keys: Sequence[str],
                        hold_out_by: Sequence[str] | None = None) -> Validation:
    """Fit on every fitted row, then once per model (`groups`: each row's model) with that model's rows left out,
    predicting them. `hold_out_by`: leave out by another grouping instead (each row's architecture class: the
    leave-one-family-out validation); every fit still weighs each model alike."""
    fit_mask = np.asarray(fit_mask, bool)
    held_groups = list(hold_out_by) if hold_out_by is not None else list(groups)
    full = fit(c, spec, published_us, group_weights(groups, fit_mask), keys, fit_mask)
    start = dict(full.values)
    predicted = row_times_us(c, with_terms(spec, full.values)).copy()
    held = np.zeros(c.n_rows, bool)
    for gname in sorted({g for g, m in zip(held_groups, fit_mask) if m}):
        out = np.array([g == gname for g in held_groups]) & fit_mask
        rest = fit_mask & ~out
        if not rest.any():
            continue
        part = fit(c, spec, published_us, group_weights(groups, rest), list(full.values), rest, start)
        predicted[out] = row_times_us(c, with_terms(spec, part.values))[out]
        held |= out
    return Validation(full, predicted, held)


def error_pct(modeled: np.ndarray | float, published: np.ndarray | float) -> np.ndarray | float:
    return (np.asarray(modeled) / np.asarray(published) - 1.0) * 100.0


def median_abs(values: Sequence[float]) -> float:
    return float(np.median(np.abs(values))) if len(values) else math.nan
