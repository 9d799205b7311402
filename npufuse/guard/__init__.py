"""The CI guard (`npufuse check`): does a model still compute what it did?

ORIGINAL vs OPTIMIZED on the same seeded, role-aware inputs, or a model vs a golden file of stored inputs
and outputs; per-output tolerances and error statistics; on drift, the rewrites responsible.

The names below are imported on first use: `npufuse` starts without onnxruntime, so a usage error is answered
at once.
"""

from __future__ import annotations

from typing import Any

_FROM = {
    "CheckResult": "api", "assert_matches_golden": "api", "assert_no_drift": "api", "check_golden": "api",
    "check_models": "api", "save_golden": "api", "Culprit": "attribution", "STATISTICS": "stats",
    "OutputCheck": "stats", "OutputTolerance": "stats",
}

__all__ = ["CheckResult", "Culprit", "OutputCheck", "OutputTolerance", "STATISTICS", "assert_matches_golden",
           "assert_no_drift", "check_golden", "check_models", "save_golden"]


def __getattr__(name: str) -> Any:
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module 'npufuse.guard' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"npufuse.guard.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
