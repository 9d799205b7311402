"""What a report says about its target's calibration: the profile's [calibration] table as a block, and one line."""

from __future__ import annotations

from typing import Any


def calibration_block(spec: Any) -> dict[str, Any]:
    """{"calibration": ...}: which of the target's terms are calibrated and against what (the profile's
    [calibration] table; `calibrated: false` where it has none); {} without a target."""
    if spec is None:
        return {}
    info = spec.calibration_info()
    if not info:
        return {"calibration": {"calibrated": False, "profile": spec.name}}
    return {"calibration": {"calibrated": True, "profile": spec.name} | info}


def calibration_line(block: dict[str, Any] | None) -> str:
    """One line for people: what the target's prices are validated against."""
    if not block:
        return ""
    if not block.get("calibrated"):
        return (f"calibration: {block.get('profile')} is not calibrated (sourced or assumed terms only; "
                "decisions carry no validated confidence)")
    values = block.get("values") or {}
    terms = ", ".join(f"{k} = {v:g}" for k, v in values.items()) or "none"
    return (f"calibration: {block.get('profile')} {terms}; against {', '.join(block.get('data') or [])} "
            f"({block.get('rows_used')} rows, {block.get('models')} models), leave-one-model-out median |error| "
            f"{block.get('lomo_median_abs_error_pct')}%"
            + (f", leave-one-family-out {block['lofo_median_abs_error_pct']}%"
               if block.get("lofo_median_abs_error_pct") is not None else ""))
