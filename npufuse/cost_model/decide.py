"""The fuse/skip decision: fuse iff the fused kernel fits on chip and T_unfused - T_fused > margin x T_at_stake.

T_at_stake is the unfused time less the work both sides do alike: where a fused kernel carries the same Cube
work as one unfused kernel (a MatMul or Conv that gains an epilogue, or has a BatchNorm folded into its weights)
and its time is set by the same bound (`shared_cube_us`), that kernel's time is common to both sides and its
modeling error is too, so it cannot turn the fusion into a loss; what can is the error on the part that differs
(the kernels removed, the epilogue added). The same holds for a format conversion both sides run on the same
tensor (`shared_conversions_us`: a LayerNorm's TransData on unaligned rows, fused with its residual Add or not).
Where no Cube work is shared (attention, norms, elementwise chains, a fused GEMM tiled differently) T_at_stake is
the whole unfused time.

Each decision also says how far it stands from the model's error: `confidence` compares the gain (a fraction of
the time at stake) with the profile's validated error (the leave-one-model-out median |error| `npufuse calibrate`
wrote into the profile): high at twice the error or more, medium at once, low below, uncalibrated where the profile
has no validated error, or where its calibration ran with the candidate's pattern disabled (Ascend310P3's rows ran
without flash attention, so a fused attention's price there is the physics alone, and the reason says so). It does
not change the decision (`--margin` does).

The margin (DEFAULT_MARGIN, `--margin`) is room for the model's own error: a fusion whose modeled gain is a sliver
of the time at stake could as well be a loss on the chip, and a rewrite is never free (verification, a kernel the
chip must have), so it is left unfused, the reason saying so.

The unfused nodes are priced as the kernels they are today (each its own launch, every intermediate
written to GM and read back); the replacement is priced as its own kernel(s), intermediates on chip.
Where a fused kernel does not fit (e.g. a norm row larger than UB), the decision is "not fused",
`t_fused_us` is None and `gain_us` is 0.0: the graph keeps running unfused. The fused kernel's record
still carries the time of the part that could run, for information only. The same holds where the target
cannot run the region as its Ascend kernel (`unsupported`: no kernel for its chip, or an attribute the kernel
does not take; see npu_model.ascend_kernels): it is priced as unfused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from npufuse.console.units import format_bytes
from npufuse.cost_model.estimate import estimate_op
from npufuse.cost_model.formats import conversions
from npufuse.cost_model.kernel import KernelEstimate
from npufuse.cost_model.workload import FusionCandidate, OpWork
from npufuse.npu_model.spec import NpuSpec

DEFAULT_MARGIN = 0.05   # fraction of the time at stake a fusion must gain (an assumption until calibrated)


@dataclass(frozen=True)
class FusionDecision:
    """Whether to fuse one candidate on one profile, why, and the numbers behind it."""

    pattern: str
    profile: str
    fuse: bool
    feasible: bool
    forced: bool
    reason: str                      # one sentence
    t_unfused_us: float
    t_fused_us: float | None         # None where the fused kernel does not fit
    gain_us: float                   # t_unfused - t_fused; 0.0 where the fused kernel does not fit
    gm_bytes_saved: int              # unfused GM bytes - fused GM bytes (negative: the fusion moves more)
    launches_saved: int
    tile: str                        # the main fused kernel's tile, in words
    bound_by: str                    # what bounds the main fused kernel
    unfused: tuple[KernelEstimate, ...]
    fused: tuple[KernelEstimate, ...]
    unsupported: str = ""            # why the target's chip cannot run the region as its kernel; "" where it can
    margin: float = DEFAULT_MARGIN   # the fraction of t_at_stake_us the gain had to exceed
    # t_unfused_us less the time of the Cube work both sides share (see the module docstring); the margin's base
    t_at_stake_us: float = 0.0
    # how far the decision stands from the model's own error: the gain as a fraction of t_at_stake, divided by the
    # profile's validated (leave-one-model-out) median error. None where the profile is not calibrated
    validated_error: float | None = None
    gain_over_error: float | None = None
    confidence: str = "uncalibrated"   # 'high' (>= 2x the error) | 'medium' (>= 1x) | 'low' | 'uncalibrated'

    def to_dict(self, kernel_records: dict | None = None) -> dict[str, Any]:
        """JSON-safe plain values, per-kernel records included. `kernel_records`: a dict the caller keeps for one
        document, so that kernels differing only by name (a repeated layer's) share one record, copied and
        renamed (see `_kernel_record`); the copies share their nested values, which the caller must not change."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("unfused", "fused"):
                v = [k.to_dict() if kernel_records is None else _kernel_record(k, kernel_records) for k in v]
            elif isinstance(v, float):
                v = round(v, 6) if math.isfinite(v) else None
            out[f.name] = v
        return out


def _kernel_record(k: KernelEstimate, records: dict) -> dict[str, Any]:
    """`k.to_dict()`, from `records` where a kernel holding the very same field values but its name was recorded
    before: the pricing cache hands each repeated layer's candidate the same kernels renamed (fusion.costing's
    _renamed copies their fields, not the values), so a 100k-node graph's 100k kernel records are a few hundred
    records and their renamed copies. Keyed by the values' identities, each record kept with its kernel, whose
    values then stay alive (an identity is never reused while the key is held)."""
    key = (k.__class__, *[id(v) for name, v in k.__dict__.items() if name != "name"])
    held = records.get(key)
    if held is None:
        held = records[key] = (k, k.to_dict())
    out = dict(held[1])
    out["name"] = k.name
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else ("es" if word.endswith("h") else "s"))


def _main(kernels: tuple[KernelEstimate, ...]) -> KernelEstimate | None:
    real = [k for k in kernels if k.kind != "view"]
    return max(real, key=lambda k: k.t_total_us) if real else None


def _why_slower(k: KernelEstimate | None, spec: NpuSpec) -> str:
    if k is None:
        return "no kernel to compare"
    starved = [n for n in k.notes if "starved" in n]
    if starved:
        return starved[0]
    tile = f", tile {k.tile.describe()}" if k.tile is not None else ""
    what = {"cube": "the Cube", "vector": "the Vector unit", "mte2": "per-core reads (MTE2)",
            "mte3": "per-core writes (MTE3)", "l2_handoff": f"the Cube->Vector hand-off through L2 on {spec.name}",
            "gm_bandwidth": "GM bandwidth", "l2_bandwidth": "L2 bandwidth", "launch": "launch overhead"}
    return f"the fused {k.op_type} is bound by {what.get(k.bound_by, k.bound_by)}{tile}"


def _bound_value(k: KernelEstimate) -> float:
    """The modeled quantity that sets a kernel's time: its bounding stage's total, its roofline or its launch."""
    stage = {"cube": k.cube_cycles, "vector": k.vector_cycles, "mte2": k.mte2_cycles, "mte3": k.mte3_cycles,
             "l2_handoff": k.handoff_cycles, "launch": k.t_launch_us}
    return stage.get(k.bound_by, k.t_roofline_us)


def shared_cube_us(unfused: tuple[KernelEstimate, ...], fused: tuple[KernelEstimate, ...]) -> float:
    """The time both sides spend on the same Cube work, run the same way: each fused kernel is paired with a not
    yet paired unfused kernel that does the same Cube work (MACs at the dtype's peak) and whose time is set by the
    same thing (the same bounding stage, with the same total), and the pair counts the smaller of the two times.
    An epilogue or a folded BatchNorm usually leaves the anchor's bound as it was; where the fused kernel must tile
    differently and that moves its bound (a norm epilogue that needs whole rows in UB), its time no longer rests on
    the unfused kernel's numbers, its error is not shared, and nothing is paired. A flash-attention kernel does
    both MatMuls' work at once and pairs with neither."""
    return _paired_us(unfused, fused, lambda k: k.cube_peak_us > 0,
                      lambda u, k: (math.isclose(u.cube_peak_us, k.cube_peak_us, rel_tol=1e-9)
                                    and u.bound_by == k.bound_by
                                    and math.isclose(_bound_value(u), _bound_value(k), rel_tol=1e-6)))


def shared_conversions_us(unfused: tuple[KernelEstimate, ...], fused: tuple[KernelEstimate, ...]) -> float:
    """The time of the format conversions (TransData, cost_model.formats) both sides run alike: each fused side's
    conversion paired with a not yet paired unfused one that moves the same tensor the same way (the same pricing
    basis, so the same time). A LayerNorm between Cube kernels on unaligned rows converts its x and y whether or not
    its residual Add is fused into it; that time, and its error, is common to both sides."""
    return _paired_us(unfused, fused, lambda k: k.op_type == "TransData",
                      lambda u, k: u.basis == k.basis and u.dtype == k.dtype)


def _paired_us(unfused: tuple[KernelEstimate, ...], fused: tuple[KernelEstimate, ...],
               takes: Callable[[KernelEstimate], bool],
               alike: Callable[[KernelEstimate, KernelEstimate], bool]) -> float:
    """Each fused kernel that `takes` paired with the first not yet paired unfused one `alike` it; the pairs'
    smaller times, summed."""
    left = [k for k in unfused if takes(k)]
    shared = 0.0
    for k in fused:
        if not takes(k):
            continue
        twin = next((u for u in left if alike(u, k)), None)
        if twin is not None:
            left.remove(twin)
            shared += min(twin.t_total_us, k.t_total_us)
    return shared


def _kernels(ops: tuple[OpWork, ...], spec: NpuSpec) -> tuple[KernelEstimate, ...]:
    own = [estimate_op(op, spec) for op in ops]
    return tuple(own + [estimate_op(c, spec) for op in ops for c in conversions(op, spec)])


def decide(candidate: FusionCandidate, spec: NpuSpec, force: bool = False,
           unsupported: str | None = None, margin: float | None = None,
           measured_us: float | None = None) -> FusionDecision:
    """Price the candidate's unfused nodes and its replacement on `spec`; fuse iff it fits and gains more than
    `margin` (a fraction of the time at stake; DEFAULT_MARGIN when None).

    `unsupported`: why the target cannot run the region as one kernel (its chip has no kernel for it, or an
    attribute is outside what the kernel takes; one clause, e.g. "PromptFlashAttention has no kernel for
    ascend910 (Ascend910A)"). Then the candidate is priced as unfused: no fused time, no gain.
    With force=True a candidate the model would refuse is fused anyway (fuse=True, forced=True) and the
    reason says why the model would not have fused it. `measured_us`: the fused kernel's measured time (a user
    kernel's, see npu_model.user_kernels), which replaces the modeled one.
    """
    # each side's kernels in node order, then the format conversions GE runs before them (cost_model.formats: last,
    # so a decision reused for another layer renames its kernels by position)
    unfused = _kernels(candidate.unfused, spec)
    fused = _kernels(candidate.fused, spec)
    t_unfused = sum(k.t_total_us for k in unfused)
    feasible = all(k.feasible for k in fused)
    gm_saved = sum(k.gm_bytes for k in unfused) - sum(k.gm_bytes for k in fused)
    launches_saved = sum(k.launches for k in unfused) - sum(k.launches for k in fused)
    main = _main(fused)
    if feasible and not unsupported:
        t_fused: float | None = sum(k.t_total_us for k in fused) if measured_us is None else float(measured_us)
        gain = t_unfused - t_fused
    else:
        t_fused, gain = None, 0.0
    margin = DEFAULT_MARGIN if margin is None else float(margin)
    converted = shared_conversions_us(unfused, fused)
    at_stake = max(t_unfused - shared_cube_us(unfused, fused) - converted, 0.0)
    would_fuse = feasible and not unsupported and gain > 0 and gain > margin * at_stake
    pct = f"{margin * 100:g}%"
    alike = "the Cube work and format conversions" if converted else "the Cube work"
    shared_words = f"the unfused {t_unfused:.1f} µs less {alike} both sides share"
    if would_fuse:
        saved = (f"{format_bytes(gm_saved)} of GM traffic" if gm_saved >= 0
                 else f"costs {format_bytes(-gm_saved)} more GM traffic")
        launches = f"saves {_plural(launches_saved, 'kernel launch')}" if launches_saved > 0 else "saves no launch"
        joiner = " and " if gm_saved >= 0 else ", "
        of = f"{t_unfused:.1f} µs" if at_stake >= t_unfused else f"the {at_stake:.1f} µs at stake, {shared_words}"
        reason = f"fused: {launches}{joiner}{saved} (gain {gain:.1f} µs of {of}" + \
            (f", above the {pct} margin)" if margin > 0 else ")") + \
            (f"; the fused time is the kernel's measured {measured_us:g} µs" if measured_us is not None else "")
    elif unsupported:
        reason = f"not fused: {unsupported}"
    elif not feasible:
        bad = next(k for k in fused if not k.feasible)
        reason = f"not fused: {bad.infeasible_reason}"
    elif gain > 0:
        base = (f"the {t_unfused:.1f} µs unfused" if at_stake >= t_unfused else
                f"the {at_stake:.1f} µs at stake ({shared_words})")
        reason = (f"not fused: the gain of {gain:.2f} µs is {gain / at_stake * 100:.1f}% of {base}, "
                  f"within the {pct} margin for model error (--margin)")
    else:
        assert t_fused is not None
        reason = (f"not fused: the fused kernel would take {t_fused:.1f} µs against {t_unfused:.1f} µs for the "
                  f"{_plural(len(unfused), 'unfused kernel')} ({_why_slower(main, spec)})")
    err = validated_error(spec)
    if err is not None and t_fused is not None and candidate.pattern in unmeasured_patterns(spec):
        # the calibration's rows ran with this pattern disabled: its kernel was never measured on this profile, so
        # the profile's validated error says nothing about its price
        err = None
        reason += (f"; {spec.name}'s calibration never measured this fusion's kernel (its published rows ran "
                   f"without it), so its time is the physics alone")
    ratio = None if err is None or at_stake <= 0 else abs(gain) / at_stake / err
    confidence = "uncalibrated" if ratio is None else "high" if ratio >= 2 else "medium" if ratio >= 1 else "low"
    forced = force and not would_fuse
    if forced:
        reason = f"forced: fused on request although the model would not ({reason.removeprefix('not fused: ')})"
    return FusionDecision(
        pattern=candidate.pattern, profile=spec.name, fuse=would_fuse or force, feasible=feasible, forced=forced,
        reason=reason, t_unfused_us=t_unfused, t_fused_us=t_fused, gain_us=gain, gm_bytes_saved=int(gm_saved),
        launches_saved=int(launches_saved), tile=main.tile.describe() if main is not None and main.tile else "",
        bound_by=main.bound_by if main is not None else "none", unfused=unfused, fused=fused,
        unsupported=unsupported or "", margin=margin, t_at_stake_us=at_stake, validated_error=err,
        gain_over_error=ratio, confidence=confidence)


def unmeasured_patterns(spec: NpuSpec) -> frozenset[str]:
    """The patterns the profile's calibration ran disabled (`npufuse calibrate --disable`): no published row
    measured the kernels they make."""
    value = spec.calibration_info().get("disabled_patterns") or ()
    return frozenset([value] if isinstance(value, str) else (str(p) for p in value))


def atc_unfused_patterns(spec: NpuSpec) -> frozenset[str] | None:
    """The patterns the profile's calibration priced published whole-model ATC compiles without
    (`unmeasured_patterns`): those compiles did not run them, whatever pass ATC has for them (reporting's
    `atc_alone` leaves them out of ATC's own set). None where the calibration timed no whole compile (single kernels
    only, or none): there the profile says nothing about what ATC fuses by itself."""
    info = spec.calibration_info()
    if info.get("rows") not in ("model", "mixed"):
        return None
    return unmeasured_patterns(spec)


def validated_error(spec: NpuSpec) -> float | None:
    """The profile's leave-one-model-out median |error| as a fraction ([calibration] of a calibrated profile)."""
    value = spec.calibration_info().get("lomo_median_abs_error_pct")
    return float(value) / 100.0 if isinstance(value, (int, float)) and value > 0 else None
