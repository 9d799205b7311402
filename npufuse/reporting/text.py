"""The report as terminal text: what fused, what did not and why, and the modeled gain, at a glance."""

from __future__ import annotations

from typing import Any

from npufuse.calibrate.provenance import calibration_line
from npufuse.npu_model.ascend_kernels import kernel_label
from npufuse.console.units import format_bytes


def _bytes(n: float | None) -> str:
    return "–" if n is None else format_bytes(n)


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [fmt(headers).rstrip(), fmt(["-" * w for w in widths])] + [fmt(r).rstrip() for r in rows]


def _verification(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    rolled = s["by_status"].get("rolled-back", 0)
    tail = f"; {rolled} rewrite(s) rolled back" if rolled else ""
    if not doc.get("verified"):
        return "not run (--no-verify)"
    mc = s.get("model_check")
    if mc is None:
        return "nothing applied to verify" + tail
    if not mc.get("ok"):
        return f"DRIFT: {mc.get('reason') or 'the optimized model differs from the original'}{tail}"
    err = max((o.get("max_abs_err") or 0.0 for o in mc.get("outputs") or []), default=0.0)
    return f"ok, whole model matches the original (max abs err {err:.1e}){tail}"


def assumed_line(a: dict[str, Any]) -> str:
    """The warning a modeled time built on unknown shapes carries (summary.assumed_shapes)."""
    return (f"WARNING: {a['ops']} op(s) carrying {a['share_pct']:.1f}% of the modeled time have shapes no shape "
            f"inference could tell (e.g. {', '.join(a['nodes'][:3])}), priced at size 1: these figures are not the "
            "model's. Fold the shape arithmetic into the export (static input shapes), or set the symbolic sizes "
            "with --dim")


def sigmoid_line(h: dict[str, Any]) -> str:
    """The note a model whose Sigmoids run ATC's high-precision kernel carries (summary.sigmoid_high_precision)."""
    return (f"Sigmoid runs ATC's high-precision kernel (its default): {h['extra_us']:.1f} us ({h['share_pct']:.1f}%) of "
            f"the modeled time; compiled with {h['atc_flags']} it models {h['after_us_with_fast_sigmoid']:.1f} us "
            "(pass the same to npufuse: --op-select-implmode, --optypelist-for-implmode)")


def unmeasured_line(h: dict[str, Any], target: str) -> str:
    """The note a model with fused kernels its profile's calibration never measured carries
    (summary.unmeasured_kernels)."""
    return (f"{h['kernels']} fused kernel(s) of {', '.join(h['patterns'])} carry {h['time_us']:.1f} us "
            f"({h['share_pct']:.1f}%) of the modeled time; {target}'s calibration never measured them (its published "
            "rows ran without these fusions), so that part is the physics alone, outside the validated error")


def atc_alone_line(a: dict[str, Any], after_us: float) -> str:
    """The modeled time of the export as ATC compiles it by itself (summary.atc_alone), against npufuse's."""
    own = ", ".join(a["patterns"]) or "none"
    return (f"ATC alone (its own fusion passes, as the profile's calibration prices its compiles: {own}): "
            f"{a['time_us']:.1f} us; npufuse's model {after_us:.1f} us"
            + (f", {a['speedup']:.2f}x" if a.get("speedup") else ""))


def render_text(doc: dict[str, Any], max_reason: int = 110) -> str:
    """The report as a terminal table: summary lines, one row per candidate, near-misses, per-op-kind totals."""
    s = doc["summary"]
    t = s["modeled_time_us"]
    lines = [
        f"npufuse report: {doc['model']}  on {doc['target']['name']}{_precision(doc)}",
        f"modeled time {t['before']:.1f} us -> {t['after']:.1f} us (gain {t['gain']:.1f} us"
        + (f", {t['speedup']:.2f}x" if t["speedup"] else "") + ")"
        f"   GM traffic {_bytes(s['gm_bytes']['before'])} -> {_bytes(s['gm_bytes']['after'])}"
        f"   launches {s['launches']['before']} -> {s['launches']['after']}",
        "fused: " + (", ".join(f"{n} {k}" for k, n in s["applied_by_kind"].items()) or "nothing"),
    ]
    if s.get("atc_alone"):
        lines.insert(2, atc_alone_line(s["atc_alone"], t["after"]))
    if (s.get("assumed_shapes") or {}).get("ops"):
        lines.insert(2, assumed_line(s["assumed_shapes"]))
    if s.get("sigmoid_high_precision"):
        lines.append(sigmoid_line(s["sigmoid_high_precision"]))
    if s.get("unmeasured_kernels"):
        lines.append(unmeasured_line(s["unmeasured_kernels"], doc["target"]["name"]))
    if s.get("absorbed_by_kind"):
        lines.append("absorbed into larger fusions (counted there): "
                     + ", ".join(f"{n} {k}" for k, n in s["absorbed_by_kind"].items()))
    if s["not_fused_by_reason"]:
        lines.append("not fused: " + ", ".join(f"{n} {k}" for k, n in s["not_fused_by_reason"].items()))
    if s.get("unaccounted"):
        lines.append("left without a fusion or a reason: " + ", ".join(
            f"{a['op_type']} {a['node']}" for a in s["unaccounted"]))
    lines.append("verification: " + _verification(doc))
    if doc["target"].get("calibration"):
        lines.append(calibration_line(doc["target"]["calibration"]))
    lines.append("")
    rows = []
    for c in doc["candidates"]:
        d = c["decision"] or {}
        reason = c["reason"] or ""
        first = c["nodes"][0] + (f" (in {c['graph']})" if c.get("graph") else "")   # a fusion inside a subgraph
        rows.append([c["status"], c["kind"], kernel_label(c.get("ascend_kernel")), first,
                     _us(d.get("t_unfused_us")), _us(d.get("t_fused_us")), _us(d.get("gain_us")),
                     _bytes(d.get("gm_bytes_saved", 0) or 0),
                     reason if len(reason) <= max_reason else reason[: max_reason - 1] + "…"])
    if rows:
        lines += _table(["status", "fusion", "Ascend kernel", "first node", "unfused us", "fused us", "gain us",
                         "GM saved", "why"], rows, right={4, 5, 6, 7})
    if doc["near_misses"]:
        lines += ["", f"near-misses ({len(doc['near_misses'])}):"]
        lines += _table(["pattern", "reason", "node", "detail"],
                        [[f["pattern"], f["reason"], f["node"], f["detail"]] for f in doc["near_misses"]])
    if "opportunities" in doc:
        from npufuse.reporting import opportunities_section as op
        lines += ["", op.opportunities_summary(doc) + (":" if op.opportunity_rows(doc) else "")]
        rows = [[*r[:-1], r[-1] if len(r[-1]) <= max_reason else r[-1][: max_reason - 1] + "…"]
                for r in op.opportunity_rows(doc)]
        if rows:
            lines += _table(op.HEADERS, rows, right={0, 2, 3, 4})
        if op.left_out_rows(doc):
            lines += ["", "refused for want of a kernel, and no opportunity either:"]
            lines += _table(op.LEFT_OUT_HEADERS, op.left_out_rows(doc))
    if doc.get("atc"):
        from npufuse.reporting.atc_section import HEADERS, atc_rows, atc_summary
        lines += ["", atc_summary(doc["atc"]) + ":"]
        lines += _table(HEADERS, [[*r[:3], r[3] if len(r[3]) <= max_reason else r[3][: max_reason - 1] + "…"]
                                  for r in atc_rows(doc["atc"])])
    before, after = doc["model_estimate"]["before"]["by_op_type"], doc["model_estimate"]["after"]["by_op_type"]
    kinds = sorted(set(before) | set(after), key=lambda k: -max(before.get(k, {}).get("time_us", 0),
                                                              after.get(k, {}).get("time_us", 0)))
    rows = []
    for k in kinds:
        b, a = before.get(k, {}), after.get(k, {})
        rows.append([k, str(b.get("count", 0)), str(a.get("count", 0)), _us(b.get("time_us", 0.0)),
                     _us(a.get("time_us", 0.0)), _bytes(b.get("gm_bytes", 0)), _bytes(a.get("gm_bytes", 0))])
    lines += ["", "per op kind (modeled):"]
    lines += _table(["op", "n before", "n after", "us before", "us after", "GM before", "GM after"], rows,
                    right={1, 2, 3, 4, 5, 6})
    return "\n".join(lines)


def _precision(doc: dict) -> str:
    """The ATC precision mode the times are priced under, as the header says it."""
    mode = doc["target"].get("precision_mode")
    impl = doc["target"].get("op_select_implmode")
    ops = doc["target"].get("optypelist_for_implmode") or []
    impl_text = f", op_select_implmode {impl}" + (f" for {','.join(ops)}" if ops else "") if impl else ""
    if doc["target"].get("enable_small_channel"):
        impl_text += ", enable_small_channel"
    return f"  (priced in ATC precision mode {mode}{impl_text})" if mode else ""
