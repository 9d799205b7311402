"""What `npufuse optimize` tells a person (text) and a program (JSON, schema `npufuse.optimize/1`)."""

from __future__ import annotations

from typing import Any

from npufuse import __version__
from npufuse.calibrate.provenance import calibration_block
from npufuse.fusion.coverage import unaccounted
from npufuse.fusion.engine import OptimizeResult
from npufuse.reporting.dims import own_dim_names, readable_document, readable_text

OPTIMIZE_SCHEMA = "npufuse.optimize/1"


def optimize_report(result: OptimizeResult, model_path: str, output_path: str | None,
                    target: str | None, verified: bool, spec: Any = None) -> dict[str, Any]:
    """The JSON report of one optimize run; fields are documented in docs/optimize-report.md. Dims shape inference
    made up (`unk__3`) read `?` in its sentences (`reporting.dims`). `spec`: the target, for its calibration block."""
    worst = result.worst_rewrite_error()
    # one kernel record per distinct kernel, renamed for each repeated layer: readable_document below copies the
    # whole document, so the records it shares between fusions are never shared in the result
    kernel_records: dict = {}
    return readable_document(calibration_block(spec) | {
        "schema": OPTIMIZE_SCHEMA,
        "npufuse_version": __version__,
        "model": model_path,
        "output": output_path,
        "target": target,
        "precision_mode": getattr(spec, "precision_mode", None),
        "op_select_implmode": getattr(spec, "op_select_implmode", None),
        "optypelist_for_implmode": list(getattr(spec, "optypelist_for_implmode", ())),
        **({"enable_small_channel": True} if getattr(spec, "enable_small_channel", False) else {}),
        "verified": verified,
        "ok": result.ok,
        "nodes_before": result.nodes_before,
        "nodes_after": result.nodes_after,
        "summary": {
            "applied_by_kind": dict(sorted(result.applied_by_kind().items())),
            "absorbed_by_kind": dict(sorted(result.absorbed_by_kind().items())),
            "refused_by_reason": dict(sorted(result.refused_by_reason().items())),
            "rolled_back": len(result.rolled_back),
            "worst_rewrite_error": worst.to_dict() if worst else None,
            "model_check": result.model_check.to_dict() if result.model_check else None,
            "verify_segments": result.verify_segments,
            "rewrite_checks_run": sum(1 for r in result.records if r.check is not None and not r.check.shared_with),
            "rewrite_checks_shared": sum(1 for r in result.records if r.check is not None and r.check.shared_with),
        },
        "canonical": dict(sorted(result.canonical.items())),
        "unaccounted": [a.to_dict() for a in unaccounted(result)],
        "notes": list(result.notes),
        "fusions": [r.to_dict(kernel_records) for r in result.records],
        "near_misses": [f.to_dict() for f in result.refusals],
        "timings_s": {k: round(v, 4) for k, v in result.timings_s.items()},
    }, own_dim_names(result.model))


def optimize_text(result: OptimizeResult, output_path: str | None, verified: bool) -> str:
    """A short human summary: fusions per kind, refusals per reason, worst error seen."""
    lines = [f"nodes: {result.nodes_before} -> {result.nodes_after}"]
    applied = result.applied_by_kind()
    lines.append("fused: " + (", ".join(f"{n} {k}" for k, n in sorted(applied.items())) if applied else "nothing"))
    absorbed = result.absorbed_by_kind()
    if absorbed:
        lines.append("absorbed into larger fusions (counted there): "
                     + ", ".join(f"{n} {k}" for k, n in sorted(absorbed.items())))
    refused = result.refused_by_reason()
    if refused:
        lines.append("not fused: " + ", ".join(f"{n} {k}" for k, n in sorted(refused.items())))
    for r in result.rolled_back:
        lines.append(f"  rolled back {r.match.kind} at {r.match.nodes[0]}: {r.reason}")
    silent = unaccounted(result)
    if silent:
        lines.append(f"left without a fusion or a reason: {len(silent)} ("
                     + ", ".join(f"{a.op_type} {a.node}" for a in silent[:5]) + (", ..." if len(silent) > 5 else "")
                     + "); please report it")
    if verified:
        worst = result.worst_rewrite_error()
        if worst is not None:
            lines.append(f"worst rewrite error: max abs {worst.max_abs_err:.3g}, max rel {worst.max_rel_err:.3g} "
                         f"(smallest passing rtol {worst.min_passing_rtol:.3g})")
        shared = sum(1 for r in result.applied if r.check is not None and r.check.shared_with)
        if shared:
            lines.append(f"rewrite checks: {len(result.applied) - shared} run, {shared} shared by rewrites with "
                         "the same signature (repeated layers)")
        if result.verify_segments > 1:
            lines.append(f"verified segment by segment: {result.verify_segments} segments under --verify-memory")
        mc = result.model_check
        if mc is not None:
            for c in mc.comparisons:
                lines.append(f"whole model, output {c.name}: max abs {c.max_abs_err:.3g}, max rel "
                             f"{c.max_rel_err:.3g} -> {'ok' if c.ok else 'INCONCLUSIVE' if c.inconclusive else 'DRIFT'}"
                             + (f" ({c.detail})" if c.inconclusive else ""))
            if mc.reason and not mc.comparisons:
                lines.append(f"whole model check failed: {mc.reason}")
    else:
        lines.append("verification skipped (--no-verify)")
    own = own_dim_names(result.model)
    lines.extend(f"note: {readable_text(n, own)}" for n in result.notes)
    if output_path:
        lines.append(f"wrote {output_path}")
    return "\n".join(lines)
