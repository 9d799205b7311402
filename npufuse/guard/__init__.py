"""The CI guard (`npufuse check`): does a model still compute what it did?

ORIGINAL vs OPTIMIZED on the same seeded, role-aware inputs, or a model vs a golden file of stored inputs
and outputs; per-output tolerances and error statistics; on drift, the rewrites responsible.
"""

from npufuse.guard.api import (
    CheckResult,
    assert_matches_golden,
    assert_no_drift,
    check_golden,
    check_models,
    save_golden,
)
from npufuse.guard.attribution import Culprit
from npufuse.guard.stats import STATISTICS, OutputCheck, OutputTolerance

__all__ = ["CheckResult", "Culprit", "OutputCheck", "OutputTolerance", "STATISTICS", "assert_matches_golden",
           "assert_no_drift", "check_golden", "check_models", "save_golden"]
