"""Kernel opportunities: the candidates refused only because no shipped kernel runs them, priced as if one did.

A candidate whose decision says `unsupported` (the target's chip has no kernel for the region, or the shipped
kernel does not take its attributes or shapes: "no kernel fuses a MatMul with a row norm") was still priced in
full: the cost model estimated its fused kernel, tile and feasibility, and only then set the gain to zero. Here
that estimate is read back as the kernel author's question: what would such a kernel be worth? (Without the
Transposes ATC would put around the shipped kernel for its layout: a kernel written for the model takes the model's
layout.) Each candidate is
judged by the same rule as any fusion (the fused kernel fits UB/L1/L0 and gains more than the margin of the time at
stake); those that pass are grouped by kernel signature (the fused op, its epilogue or variant, the dtype) and
ranked by their modeled gain summed over the model; those that fail are listed with the reason (would not fit,
would not pay), so a region's absence is explained too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from npufuse.fusion.engine import SKIPPED_COST, FusionRecord, OptimizeResult


@dataclass
class Region:
    """One candidate as an opportunity: its numbers if the kernel existed."""

    candidate: int                   # index into the result's records (the report's candidates)
    nodes: tuple[str, ...]
    unsupported: str                 # why no shipped kernel runs it
    t_unfused_us: float
    t_fused_us: float | None         # None where the fused kernel would not fit
    gain_us: float
    gm_bytes_saved: int
    launches_saved: int
    tile: str
    bound_by: str
    pays: bool
    why_not: str = ""                # where it does not pay or fit: the reason, as a decision says it

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate, "nodes": list(self.nodes), "unsupported": self.unsupported,
                "t_unfused_us": round(self.t_unfused_us, 6),
                "t_fused_us": None if self.t_fused_us is None else round(self.t_fused_us, 6),
                "gain_us": round(self.gain_us, 6), "gm_bytes_saved": self.gm_bytes_saved,
                "launches_saved": self.launches_saved, "tile": self.tile, "bound_by": self.bound_by,
                **({"why_not": self.why_not} if self.why_not else {})}


@dataclass
class Opportunity:
    """The regions one kernel would serve: same fused op, variant and dtype."""

    signature: str                   # e.g. "FusedMatMul[bias,gelu,layernorm] float32"
    fused_op: str                    # e.g. "npufuse.FusedMatMul"
    kind: str                        # the candidate kind, e.g. "FusedMatMul[bias,gelu,layernorm]"
    dtype: str
    unsupported: str                 # the first region's reason (they share the kernel, so the cause)
    regions: list[Region] = field(default_factory=list)

    @property
    def gain_us(self) -> float:
        return sum(r.gain_us for r in self.regions)

    def to_dict(self, model_time_us: float | None = None) -> dict[str, Any]:
        share = (self.gain_us / model_time_us * 100.0) if model_time_us else None
        return {"signature": self.signature, "fused_op": self.fused_op, "kind": self.kind, "dtype": self.dtype,
                "unsupported": self.unsupported, "regions": [r.to_dict() for r in self.regions],
                "count": len(self.regions), "gain_us": round(self.gain_us, 6),
                "gain_pct_of_model": None if share is None else round(share, 3)}


# the Transposes ATC would put around a shipped kernel for its layout (fusion.costing.layout_transposes): a kernel
# written for this model takes the layout the model has, so they are no part of what it would cost
_LAYOUT_MOVE_PREFIX = "atc_transpose_"


def _region(i: int, rec: FusionRecord) -> Region:
    dec = rec.decision
    fused = tuple(k for k in dec.fused if not str(getattr(k, "name", "")).startswith(_LAYOUT_MOVE_PREFIX))
    feasible = all(k.feasible for k in fused)
    t_fused = sum(k.t_total_us for k in fused) if feasible else None
    gain = dec.t_unfused_us - t_fused if t_fused is not None else 0.0
    pays = t_fused is not None and gain > 0 and gain > dec.margin * dec.t_at_stake_us
    why = ""
    if not feasible:
        bad = next(k for k in fused if not k.feasible)
        why = f"would not fit: {bad.infeasible_reason}"
    elif not pays:
        why = (f"would not pay: {t_fused:.2f} µs fused against {dec.t_unfused_us:.2f} µs unfused (gain "
               f"{gain:.2f} µs, the margin asks for more than {dec.margin * dec.t_at_stake_us:.2f} µs)")
    gm_saved = sum(k.gm_bytes for k in dec.unfused) - sum(k.gm_bytes for k in fused)
    launches = sum(k.launches for k in dec.unfused) - sum(k.launches for k in fused)
    return Region(i, tuple(rec.match.nodes), dec.unsupported, dec.t_unfused_us, t_fused, gain,
                  int(gm_saved), int(launches), dec.tile, dec.bound_by, pays, why)


def find_opportunities(result: OptimizeResult, dtype_of: Any = None) -> tuple[list[Opportunity], list[Region]]:
    """(the opportunities, ranked by summed gain; the regions refused for want of a kernel that would not fit or
    pay as one). `dtype_of(record)` names a region's dtype (the report reads it from the graph); None: unknown."""
    groups: dict[tuple[str, str, str], Opportunity] = {}
    left_out: list[Region] = []
    for i, rec in enumerate(result.records):
        dec = rec.decision
        if rec.status != SKIPPED_COST or dec is None or not dec.unsupported or rec.graph:
            continue
        region = _region(i, rec)
        if not region.pays:
            left_out.append(region)
            continue
        fused_op = rec.fused_ops[0] if rec.fused_ops else rec.match.kind
        dtype = (dtype_of(rec) if dtype_of is not None else None) or "?"
        key = (fused_op, rec.match.kind, dtype)
        opp = groups.get(key)
        if opp is None:
            opp = groups[key] = Opportunity(f"{rec.match.kind} {dtype}", fused_op, rec.match.kind, dtype,
                                            dec.unsupported)
        opp.regions.append(region)
    ranked = sorted(groups.values(), key=lambda o: (-o.gain_us, o.signature))
    return ranked, left_out
