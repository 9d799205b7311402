"""The report as GitHub-flavoured Markdown, to paste into a pull-request comment.

Stable and diff-friendly: no timestamps, fixed ordering (candidates in engine order, tables sorted by
name or count), one row per line, numbers rounded to what a reader compares. Model strings (node and
value names, reasons) are escaped: names go into code spans with `|` escaped (GFM tables split on it
even there); free text has Markdown and HTML metacharacters backslash- or entity-escaped.
"""

from __future__ import annotations

import re
from html import escape as html_escape
from typing import Any

from npufuse.npu_model.ascend_kernels import kernel_label
from npufuse.console.units import format_bytes

COLLAPSE_OVER = 10          # tables longer than this go inside <details>
MAX_NODES_SHOWN = 1


def md_text(s: Any) -> str:
    """Free text safe in a Markdown table cell: no table break, no HTML, no emphasis or links."""
    s = " ".join(str(s).split())
    s = s.replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([|*_`\[\]#~])", r"\\\1", s)


def md_code(s: Any) -> str:
    """A name as an inline code span, safe in a table cell (backticks in the name get a longer fence)."""
    s = " ".join(str(s).split()).replace("|", "\\|")
    if not s:
        return "` `"
    longest = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if s.startswith("`") or s.endswith("`") or longest else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def _bytes(n: float | None) -> str:
    return "–" if n is None else format_bytes(n)


def _us(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


def _pct(before: float, after: float) -> str:
    return f"{(after - before) / before * 100:+.1f}%" if before else "–"


def _table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    align = ["---:" if i in right else "---" for i in range(len(headers))]
    return ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"] + \
        ["| " + " | ".join(r) + " |" for r in rows]


def _collapsible(summary: str, lines: list[str], n_rows: int) -> list[str]:
    if n_rows <= COLLAPSE_OVER:
        return lines
    return [f"<details><summary>{html_escape(summary)}</summary>", ""] + lines + ["", "</details>"]


def _check(c: dict[str, Any]) -> str:
    chk = c.get("check")
    if chk is None:
        return "–"
    if not chk.get("ok"):
        return "❌ " + md_text(chk.get("reason") or "failed")
    worst = max((o.get("max_abs_err") or 0.0 for o in chk.get("outputs") or []), default=0.0)
    return f"✅ {worst:.1e}" if worst else "✅ 0"


def _nodes(names: list[str], graph: str | None = None) -> str:
    shown = ", ".join(md_code(n) for n in names[:MAX_NODES_SHOWN])
    shown += f" +{len(names) - MAX_NODES_SHOWN}" if len(names) > MAX_NODES_SHOWN else ""
    return shown + (f" (in {md_code(graph)})" if graph else "")   # a fusion inside a subgraph


def _kernel(rec: dict[str, Any] | None) -> str:
    """The Ascend kernel a region becomes (its attributes are in the JSON report)."""
    return md_code(kernel_label(rec)) if rec else "–"


def _ops(ops: list[str]) -> str:
    return md_text(" → ".join(ops))


def render_markdown(doc: dict[str, Any]) -> str:
    """The report document as Markdown (docs/report.md)."""
    s = doc["summary"]
    t, gm, ln, nd = s["modeled_time_us"], s["gm_bytes"], s["launches"], s["nodes"]
    cands = doc["candidates"]
    mode = doc["target"].get("precision_mode")
    out = [f"## npufuse report: {md_code(doc['model'])} on {md_text(doc['target']['name'])}"
           + (f" (priced in ATC precision mode {md_code(mode)})" if mode else ""), ""]
    speed = f", **{t['speedup']:.2f}×**" if t.get("speedup") else ""
    out.append(f"**Modeled time {t['before']:.1f} µs → {t['after']:.1f} µs** ({-t['gain']:+.1f} µs{speed}) · "
               f"GM traffic {_bytes(gm['before'])} → {_bytes(gm['after'])} ({_pct(gm['before'], gm['after'])}) · "
               f"launches {ln['before']} → {ln['after']} · nodes {nd['before']} → {nd['after']}")
    if s.get("atc_alone"):
        a = s["atc_alone"]
        out.append("")
        out.append(f"ATC alone (its own fusion passes, as the profile's calibration prices its compiles: "
                   f"{md_text(', '.join(a['patterns']) or 'none')}): "
                   f"**{a['time_us']:.1f} µs**" + (f", npufuse **{a['speedup']:.2f}×** faster" if a.get("speedup")
                                                   else ""))
    out.append("")
    applied = s["by_status"].get("applied", 0)
    fused = ", ".join(f"{n} {md_text(k)}" for k, n in sorted(s["applied_by_kind"].items(),
                                                             key=lambda kv: (-kv[1], kv[0])))
    out.append(f"Fused {applied} of {s['candidates']} candidates" + (f"; in the output: {fused}." if fused else "."))
    if s.get("absorbed_by_kind"):
        out.append("Absorbed into larger fusions (counted there): " + ", ".join(
            f"{n} {md_text(k)}" for k, n in s["absorbed_by_kind"].items()) + ".")
    if s["not_fused_by_reason"]:
        out.append("Not fused: " + ", ".join(f"{n} {md_text(k)}" for k, n in sorted(
            s["not_fused_by_reason"].items(), key=lambda kv: (-kv[1], kv[0]))) + ".")
    if s.get("unaccounted"):
        out.append("Left without a fusion or a reason: " + ", ".join(
            f"{md_text(a['op_type'])} `{md_text(a['node'])}`" for a in s["unaccounted"]) + ".")
    if (s.get("assumed_shapes") or {}).get("ops"):
        from npufuse.reporting.text import assumed_line
        out.append("**" + md_text(assumed_line(s["assumed_shapes"])) + "**")
    if s.get("sigmoid_high_precision"):
        from npufuse.reporting.text import sigmoid_line
        out.append(md_text(sigmoid_line(s["sigmoid_high_precision"])))
    if s.get("unmeasured_kernels"):
        from npufuse.reporting.text import unmeasured_line
        out.append(md_text(unmeasured_line(s["unmeasured_kernels"], doc["target"]["name"])))
    out.append(_verification_line(doc))
    out.append("")

    rows = []
    for i, c in enumerate(cands):
        d = c.get("decision") or {}
        rows.append([str(i), md_text(c["status"]), md_text(c["kind"]), _kernel(c.get("ascend_kernel")),
                     _nodes(c["nodes"], c.get("graph")), _ops(c.get("node_ops") or []), _us(d.get("t_unfused_us")),
                     _us(d.get("t_fused_us")), _us(d.get("gain_us")), _bytes(d.get("gm_bytes_saved")) if d else "–",
                     str(d.get("launches_saved", "–")) if d else "–", _check(c)])
    out.append(f"### Fusion candidates ({len(cands)})")
    out.append("")
    if rows:
        table = _table(["#", "status", "fusion", "Ascend kernel", "nodes", "replaced ops", "unfused µs", "fused µs",
                        "gain µs", "GM saved", "launches saved", "check"], rows, right={0, 6, 7, 8, 9, 10})
        total_gain = sum((c.get("decision") or {}).get("gain_us") or 0.0 for c in cands if c["status"] == "applied")
        out += _collapsible(f"{len(cands)} candidates, {applied} fused (modeled gain {total_gain:.1f} µs)",
                            table, len(rows))
    else:
        out.append("No fusion candidates.")
    out.append("")

    off = [(i, c) for i, c in enumerate(cands) if c["status"] != "applied"]
    if off:
        out.append(f"### Not fused ({len(off)})")
        out.append("")
        table = _table(["#", "status", "fusion", "nodes", "why"],
                       [[str(i), md_text(c["status"]), md_text(c["kind"]), _nodes(c["nodes"], c.get("graph")),
                         md_text(c.get("reason") or "")] for i, c in off], right={0})
        out += _collapsible(f"{len(off)} candidates not fused", table, len(off))
        out.append("")

    nm = doc.get("near_misses") or []
    out.append(f"### Near-misses ({len(nm)})")
    out.append("")
    if nm:
        table = _table(["pattern", "reason", "node", "detail"],
                       [[md_text(f["pattern"]), md_code(f["reason"]), md_code(f["node"]), md_text(f["detail"])]
                        for f in nm])
        out += _collapsible(f"{len(nm)} near-misses", table, len(nm))
    else:
        out.append("None.")
    out.append("")

    if "opportunities" in doc:
        from npufuse.reporting import opportunities_section as op
        rows = [[md_text(c) for c in r] for r in op.opportunity_rows(doc)]
        out += [f"### Kernel opportunities ({len(rows)})", "", md_text(op.opportunities_summary(doc)) + ".", ""]
        if rows:
            out += _table(op.HEADERS, rows, right={0, 2, 3, 4})
            out.append("")
        left = [[md_text(c) for c in r] for r in op.left_out_rows(doc)]
        if left:
            out += _collapsible(f"{len(left)} regions refused for want of a kernel that would not fit or pay",
                                _table(op.LEFT_OUT_HEADERS, left), len(left))
            out.append("")
    if doc.get("atc"):
        from npufuse.reporting.atc_section import HEADERS, atc_rows, atc_summary
        rows = [[md_code(r[0]), md_code(r[1]), md_code(r[2]), md_text(r[3])] for r in atc_rows(doc["atc"])]
        out += [f"### ATC form ({len(rows)} fused regions)", "", md_text(atc_summary(doc["atc"])) + ".", ""]
        out += _collapsible(f"{len(rows)} fused regions in the ATC form", _table(HEADERS, rows), len(rows))
        out.append("")

    before, after = doc["model_estimate"]["before"]["by_op_type"], doc["model_estimate"]["after"]["by_op_type"]
    kinds = sorted(set(before) | set(after))
    rows = []
    for k in kinds:
        b, a = before.get(k, {}), after.get(k, {})
        rows.append([md_code(k), str(b.get("count", 0)), str(a.get("count", 0)), _us(b.get("time_us", 0.0)),
                     _us(a.get("time_us", 0.0)), _bytes(b.get("gm_bytes", 0)), _bytes(a.get("gm_bytes", 0))])
    out.append(f"### Per op kind, modeled on {md_text(doc['target']['name'])}")
    out.append("")
    table = _table(["op", "n before", "n after", "µs before", "µs after", "GM before", "GM after"], rows,
                   right={1, 2, 3, 4, 5, 6})
    out += _collapsible(f"{len(rows)} op kinds", table, len(rows))
    out.append("")
    out.append(f"<sub>npufuse {md_text(doc.get('npufuse_version', ''))} · schema {md_text(doc.get('schema', ''))} · "
               f"times are modeled, not measured</sub>")
    return "\n".join(out) + "\n"


def _verification_line(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    if not doc.get("verified"):
        return "Verification: not run (`--no-verify`)."
    mc = s.get("model_check")
    rolled = s["by_status"].get("rolled-back", 0)
    tail = f"; {rolled} rewrite(s) rolled back" if rolled else ""
    if mc is None:
        return f"Verification: nothing applied to verify{tail}."
    if not mc.get("ok"):
        return f"Verification: ❌ drift: {md_text(mc.get('reason') or 'the optimized model differs')}{tail}."
    err = max((o.get("max_abs_err") or 0.0 for o in mc.get("outputs") or []), default=0.0)
    return f"Verification: ✅ whole model matches the original (max abs err {err:.1e}){tail}."
