"""The report document: every candidate with its cost estimate and fate, near-misses, and the model's
modeled time and GM traffic before and after, per op kind. Renderers only format this document."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx

from npufuse import __version__
from npufuse.cost_model import estimate_ops
from npufuse.fusion.costing import model_ops
from npufuse.fusion.engine import OptimizeResult
from npufuse.graph import Graph
from npufuse.normalize import infer_value_types, normalize

REPORT_SCHEMA = "npufuse.report/1"


def build_report(original: onnx.ModelProto, result: OptimizeResult, spec: Any, model_path: str,
                 base_dir: str | None = None, dims: Mapping[str, int] | None = None,
                 verified: bool = True) -> dict[str, Any]:
    """The report of one optimize run on `spec` (documented in docs/report.md)."""
    before_model, types = normalize(original)
    before = estimate_ops(model_ops(Graph(before_model, base_dir, types), dims), spec)
    after_types = dict(types)
    after_types.update({k: v for k, v in infer_value_types(result.model).items() if k not in after_types})
    after = estimate_ops(model_ops(Graph(result.model, base_dir, after_types), dims), spec)
    candidates = [r.to_dict() for r in result.records]
    status_counts: dict[str, int] = {}
    for r in result.records:
        status_counts[r.status] = status_counts.get(r.status, 0) + 1
    gain = before.time_us - after.time_us
    return {
        "schema": REPORT_SCHEMA,
        "npufuse_version": __version__,
        "model": model_path,
        "target": {"name": spec.name, "description": getattr(spec, "description", ""),
                   "numbers": dict(spec.describe())},
        "verified": verified,
        "summary": {
            "candidates": len(result.records),
            "by_status": status_counts,
            "near_misses": len(result.refusals),
            "applied_by_kind": dict(sorted(result.applied_by_kind().items())),
            "not_fused_by_reason": dict(sorted(result.refused_by_reason().items())),
            "modeled_time_us": {"before": round(before.time_us, 3), "after": round(after.time_us, 3),
                                "gain": round(gain, 3),
                                "speedup": round(before.time_us / after.time_us, 4) if after.time_us else None},
            "gm_bytes": {"before": before.gm_bytes, "after": after.gm_bytes},
            "launches": {"before": before.launches, "after": after.launches},
            "nodes": {"before": result.nodes_before, "after": result.nodes_after},
            "model_check": result.model_check.to_dict() if result.model_check else None,
        },
        "model_estimate": {"before": before.to_dict(), "after": after.to_dict()},
        "candidates": candidates,
        "near_misses": [f.to_dict() for f in result.refusals],
    }
