"""Dtype-aware comparison of two arrays, with the figures a person needs to judge a tolerance."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

# Per dtype: (rtol, atol_scale). A pair passes where |got - want| <= atol_scale * max|want| + rtol * |want|:
# the absolute floor scales with the output's magnitude, so a probability vector is not compared with
# the same absolute slack as a logit.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-9),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (5e-2, 1e-2),
}


# A reference with more non-finite elements than this is refused as evidence (see compare()).
MAX_NON_FINITE_FRACTION = 0.5


def smallest_normal(dtype: np.dtype | type | str) -> float:
    """The smallest positive normal number of a float dtype (bfloat16 through ml_dtypes); 0.0 for other dtypes."""
    try:
        return float(np.finfo(dtype).smallest_normal)
    except (TypeError, ValueError):
        pass
    try:
        import ml_dtypes
        return float(ml_dtypes.finfo(dtype).smallest_normal)
    except (ImportError, TypeError, ValueError):
        return 0.0


def flush_subnormals(a64: np.ndarray, dtype: np.dtype | type | str) -> np.ndarray:
    """`a64` (float64 values of a `dtype` array) with the values below `dtype`'s smallest normal set to 0.

    Below it a float has no relative precision left: two correct kernels (x * sigmoid(x) against a fused SiLU at
    x = -100, say) differ there by whole subnormal steps, and an output that is all subnormal has an absolute
    floor (atol_scale * max|want|) below one such step, so such a difference would fail a correct rewrite. Kernels
    built for speed commonly flush subnormals to zero (FTZ/DAZ) anyway; compared flushed, only what a normal value
    can show counts, and a normal value on either side still counts in full."""
    tiny = smallest_normal(dtype)
    if tiny <= 0.0:
        return a64
    return np.where(np.abs(a64) < tiny, 0.0, a64)


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol_scale: float

    @staticmethod
    def for_dtype(dtype: np.dtype | str) -> Tolerance:
        rtol, atol_scale = DEFAULT_TOLERANCES.get(np.dtype(dtype).name, (0.0, 0.0))
        return Tolerance(rtol, atol_scale)


@dataclass(frozen=True)
class Comparison:
    """How far `got` is from `want`, and whether that is within tolerance."""

    name: str
    ok: bool
    max_abs_err: float
    max_rel_err: float          # max |got - want| / |want| over elements where want != 0
    min_passing_rtol: float     # the smallest rtol that would pass with the same absolute floor
    atol: float                 # the absolute floor used (atol_scale * max|want|)
    rtol: float
    worst_index: tuple[int, ...]
    detail: str = ""
    # Nothing (or not everything) could be compared: the output is empty, or the reference itself is NaN/inf on
    # the generated inputs. Not drift: no evidence either way (see Verdict.inconclusive).
    inconclusive: bool = False

    def to_dict(self) -> dict:
        d = asdict(self)
        d["worst_index"] = list(self.worst_index)
        return d


def compare(name: str, got: np.ndarray, want: np.ndarray, tol: Tolerance | None = None) -> Comparison:
    """Compare element-wise; shapes and dtypes must agree, non-float outputs must match exactly."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return Comparison(name, False, float("inf"), float("inf"), float("inf"), 0.0, 0.0, (),
                          f"shape {got.shape} != {want.shape}")
    if got.dtype != want.dtype:
        return Comparison(name, False, float("inf"), float("inf"), float("inf"), 0.0, 0.0, (),
                          f"dtype {got.dtype} != {want.dtype}")
    tol = tol or Tolerance.for_dtype(want.dtype)
    if got.size == 0:
        return Comparison(name, True, 0.0, 0.0, 0.0, 0.0, tol.rtol, (), f"empty {tuple(want.shape)}: nothing compared",
                          inconclusive=True)
    g64 = flush_subnormals(got.astype(np.float64), want.dtype)
    w64 = flush_subnormals(want.astype(np.float64), want.dtype)
    finite_want = np.isfinite(w64)
    non_finite = 1.0 - float(np.mean(finite_want))
    nan_mismatch = np.isnan(g64) != np.isnan(w64)
    both_nan = np.isnan(g64) & np.isnan(w64)
    with np.errstate(invalid="ignore"):
        err = np.where(both_nan, 0.0, np.abs(g64 - w64))
    err = np.where(nan_mismatch, np.inf, err)
    # Equal infinities are equal; inf - inf is nan otherwise.
    err = np.where(np.isinf(w64) & (g64 == w64), 0.0, err)
    err = np.where(np.isnan(err), np.inf, err)
    # Where the reference itself is NaN/inf and the candidate differs, the inputs left that element undefined:
    # no evidence either way. Drift is judged on the finite part of the reference only.
    unverifiable = (~finite_want) & (err > 0)
    if unverifiable.any():
        err = np.where(unverifiable, 0.0, err)
    mag = np.abs(np.where(np.isfinite(w64), w64, 0.0))
    atol = tol.atol_scale * float(mag.max())
    bound = atol + tol.rtol * mag
    ok = bool(np.all(err <= bound))
    worst = np.unravel_index(int(np.argmax(err - bound)), err.shape)
    nz = mag > 0
    max_rel = float((err[nz] / mag[nz]).max()) if nz.any() else (0.0 if float(err.max()) == 0 else float("inf"))
    over = np.maximum(err - atol, 0.0)
    need = np.where(over > 0, np.divide(over, mag, out=np.full_like(over, np.inf), where=mag > 0), 0.0)
    detail = "" if ok else (f"|got-want| = {err[worst]:.3g} at {tuple(int(i) for i in worst)} exceeds "
                            f"{atol:.3g} + {tol.rtol:g}*|want|")
    if ok and non_finite > MAX_NON_FINITE_FRACTION:
        # NaN against NaN counts as equal above; a reference that is mostly NaN/inf proves little. Out of tolerance
        # on its finite part, though, is drift (below), however little of it there is.
        return Comparison(name, False, float("nan"), float("nan"), float("inf"), 0.0, tol.rtol, (),
                          f"{non_finite:.0%} of the reference is NaN or inf on the generated inputs (the finite part "
                          "agrees), so it was not verified", inconclusive=True)
    if ok and unverifiable.any():
        at = tuple(int(i) for i in np.argwhere(unverifiable)[0])
        return Comparison(name, False, float(err.max()), max_rel, float(need.max()), atol, tol.rtol, at,
                          f"{int(unverifiable.sum())} element(s) where the reference is NaN or inf on the generated "
                          f"inputs differ (first at {at}: got {g64[at]:.6g}, want {w64[at]:.6g}); the finite part "
                          "agrees", inconclusive=True)
    return Comparison(name, ok, float(err.max()), max_rel, float(need.max()), atol, tol.rtol,
                      tuple(int(i) for i in worst), detail)


@dataclass
class Verdict:
    """Whether a set of outputs matched their reference (one rewrite, or the whole model), with the
    figures per output and, when it failed, why."""

    ok: bool
    comparisons: list[Comparison] = field(default_factory=list)
    reason: str = ""
    shared_with: str = ""   # a rewrite with the same signature whose check this one shares (its first node)
    # Not ok, but not drift either: no output was out of tolerance where the reference is defined, and some output
    # could not be checked (its reference NaN/inf on the generated inputs) or none could (all empty).
    inconclusive: bool = False

    @classmethod
    def of(cls, comparisons: list[Comparison]) -> Verdict:
        """The verdict on a set of comparisons: drift where a defined element is out of tolerance; inconclusive
        where nothing drifts but an output's reference is NaN/inf, or every output is empty; else ok."""
        drift = [c for c in comparisons if not c.ok and not c.inconclusive]
        if drift:
            return cls(False, comparisons, "; ".join(f"{c.name}: {c.detail}" for c in drift))
        unknown = [c for c in comparisons if not c.ok]
        if not unknown and comparisons and all(c.inconclusive for c in comparisons):
            unknown = comparisons   # every output empty: nothing was computed, so nothing was checked
        if unknown:
            return cls(False, comparisons, "inconclusive: " + "; ".join(f"{c.name}: {c.detail}" for c in unknown),
                       inconclusive=True)
        return cls(True, comparisons)

    def to_dict(self) -> dict:
        d = {"ok": self.ok, "reason": self.reason, "outputs": [c.to_dict() for c in self.comparisons]}
        if self.inconclusive:
            d["inconclusive"] = True
        if self.shared_with:
            d["shared_with"] = self.shared_with
        return d
