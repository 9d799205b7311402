"""The report as one self-contained HTML page: summary, fused regions drawn as graphs, the modeled cost of
every candidate as a chart, what did not fuse and why, near-misses, and per-op-kind totals.

Everything is inline (CSS, a few lines of JS, SVG drawn here in Python); a Content-Security-Policy forbids
any fetch, so the page opens the same offline, from a CI artifact or an e-mail. Every string taken from
the model (node and value names, reasons) goes through html.escape: names are untrusted input.
"""

from __future__ import annotations

import base64
import hashlib
import math
from collections import OrderedDict
from typing import Any

from npufuse.reporting.region_svg import short_name
from npufuse.reporting.html_regions import (REGION_LEGEND, _bytes, _drawing_and_detail, _e, _n, _num, _region_detail,
                                            _region_signature, _region_tools, _signed, _us, shape_cards)

# Segments of a kernel's modeled time: its bounding pipe, fill/drain, roofline excess, launch.
SEGMENTS = OrderedDict([
    ("mte2", ("MTE2 (GM → on-chip reads)", "#4c8bf5")),
    ("compute", ("Compute (Cube / Vector)", "#f29d38")),
    ("mte3", ("MTE3 (writes to GM)", "#34a66b")),
    ("handoff", ("Cube → Vector hand-off (L2)", "#9b6ad6")),
    ("fill", ("Pipeline fill / drain", "#b9c2cf")),
    ("roof", ("Roofline excess (bandwidth / peak)", "#e0607e")),
    ("launch", ("Kernel launch", "#5f6b7a")),
    ("other", ("Not attributed to a stage", "#d9c36a")),
])
STATUS_LABEL = {"applied": "applied", "skipped-by-cost": "skipped by cost", "rolled-back": "rolled back",
                "dropped": "dropped (overlap)"}
CHART_ROWS_SHOWN = 40


def _pct(before: float, after: float) -> str:
    if not before:
        return ""
    return _signed((after - before) / before * 100) + "%"


def breakdown(kernels: list[dict[str, Any]]) -> dict[str, float]:
    """Modeled time of `kernels` split by what bounds it, summing exactly to Σ t_total_us.

    Per kernel: the longest pipe stage (MTE2, compute, MTE3 or the hand-off) + fill/drain = the pipeline
    time; if the roofline (GM, L2 bandwidth or peak flops) is longer, the excess; then the launch.
    """
    out = {k: 0.0 for k in SEGMENTS}
    for k in kernels or []:
        if k.get("kind") == "view":
            continue
        stages = {"mte2": k.get("t_mte2_us", 0.0), "compute": k.get("t_compute_us", 0.0),
                  "mte3": k.get("t_mte3_us", 0.0), "handoff": k.get("t_handoff_us", 0.0)}
        top = max(stages, key=lambda s: stages[s])
        pipe = k.get("t_pipeline_us", 0.0)
        fill = k.get("t_fill_drain_us", 0.0)
        out[top] += max(pipe - fill, 0.0)
        out["fill"] += fill
        out["roof"] += max(k.get("t_roofline_us", 0.0) - pipe, 0.0)
        out["launch"] += k.get("t_launch_us", 0.0)
        rest = k.get("t_total_us", 0.0) - (max(pipe, k.get("t_roofline_us", 0.0)) + k.get("t_launch_us", 0.0))
        if rest > 1e-9:   # a kernel priced some other way: keep the bar's length true, and say so
            out["other"] += rest
    return out


def _kernels_title(kernels: list[dict[str, Any]]) -> str:
    lines = []
    for k in kernels or []:
        if k.get("kind") == "view":
            continue
        lines.append(f"{k.get('op_type')} {k.get('name', '')}: {k.get('t_total_us', 0):.2f} µs, bound by "
                     f"{k.get('bound_by')} (MTE2 {k.get('t_mte2_us', 0):.2f}, compute {k.get('t_compute_us', 0):.2f},"
                     f" MTE3 {k.get('t_mte3_us', 0):.2f}, launch {k.get('t_launch_us', 0):.2f})")
    return "\n".join(lines)


# ---- pieces ------------------------------------------------------------------------------------------


def _regions_section(doc: dict[str, Any]) -> str:
    if _layered(doc):
        from npufuse.reporting.html_layers import layered_regions_section
        return layered_regions_section(doc)
    cands = doc["candidates"]
    regions = [r for r in doc.get("regions") or [] if r["status"] == "applied"]
    if not regions:
        return ("<section id='regions'><h2>Fused regions</h2><p class='muted'>Nothing was fused.</p></section>")
    cards = shape_cards(regions, cands, "group")
    return (f"<section id='regions'><h2>Fused regions <span class='h2n'>{_n(len(regions), 'region')} in "
            f"{_n(len(cards), 'shape')}</span></h2><p class='lead'>Each drawing shows the nodes a fusion replaced, "
            f"inside "
            f"the region's boundary (dashed), the values that cross it, and the fused op it became. Identical "
            f"shapes are grouped; every region has its own entry.</p>{REGION_LEGEND}{_region_tools('regions')}"
            f"{''.join(cards)}</section>")


def _layered(doc: dict[str, Any]) -> bool:
    """Whether the page reads layer by layer (html_layers): a model with enough layers to need it."""
    from npufuse.reporting.html_layers import wants_layers
    return wants_layers(doc)


def _axis(max_us: float) -> tuple[float, list[float]]:
    if max_us <= 0:
        return 1.0, [0.0, 1.0]
    raw = max_us / 5
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    top = step * math.ceil(max_us / step)
    return top, [step * i for i in range(int(round(top / step)) + 1)]


def _bar(parts: dict[str, float], scale: float, title: str) -> str:
    segs = []
    for key, v in parts.items():
        if v <= 0:
            continue
        segs.append(f"<span class='seg s-{key}' style='width:{v / scale * 100:.3f}%' "
                    f"title='{_e(SEGMENTS[key][0])}: {v:.2f} µs'></span>")
    return f"<div class='bar' title='{_e(title)}'>{''.join(segs)}</div>"


def _cost_section(doc: dict[str, Any]) -> str:
    cands = [(i, c) for i, c in enumerate(doc["candidates"]) if c.get("decision")]
    if not cands:
        return ("<section id='cost'><h2>Modeled cost per candidate</h2><p class='muted'>No candidate was priced "
                "(no target profile).</p></section>")
    max_us = max(max(c["decision"].get("t_unfused_us") or 0.0, c["decision"].get("t_fused_us") or 0.0)
                 for _, c in cands)
    top, ticks = _axis(max_us)
    cands.sort(key=lambda t: (t[1]["status"] != "applied", -(t[1]["decision"].get("gain_us") or 0.0), t[0]))
    rows = []
    for i, c in cands:
        d = c["decision"]
        un, fu = d.get("unfused") or [], d.get("fused") or []
        first = c["nodes"][0] if c["nodes"] else ""
        gain = d.get("gain_us") or 0.0
        n_un = sum(1 for k in un if k.get("kind") != "view")
        n_fu = sum(1 for k in fu if k.get("kind") != "view")
        nope = "no kernel" if d.get("unsupported") else "infeasible"
        fused_bar = (_bar(breakdown(fu), top, _kernels_title(fu)) if d.get("t_fused_us") is not None else
                     f"<div class='bar infeasible' title='{_e(d.get('unsupported') or '')}'>{nope}</div>")
        rows.append(
            f"<div class='crow st-{_e(c['status'])}' data-candidate='{i}'>"
            f"<div class='clabel'><a href='#region-{i}'>#{i}</a> <b>{_e(c['kind'])}</b>"
            f"<span class='sub' title='{_e(first)}'>{_e(short_name(first, 40))}</span></div>"
            f"<div class='cbars'><span class='bl'>unfused</span>{_bar(breakdown(un), top, _kernels_title(un))}"
            f"<span class='bl'>fused</span>{fused_bar}</div>"
            f"<div class='cnums'><span>{_us(d.get('t_unfused_us'))} → {_us(d.get('t_fused_us'))}</span>"
            + (f"<span class='{'good' if gain > 0 else 'bad'}'>{_signed(-gain)} µs</span>"
               if d.get("t_fused_us") is not None else f"<span class='bad'>{nope}</span>") +
            f"<span class='sub'>{n_un} → {n_fu} kernel{'s' if n_fu != 1 else ''} · "
            f"{_e(STATUS_LABEL.get(c['status'], c['status']))}</span></div></div>")
    shown, rest = rows[:CHART_ROWS_SHOWN], rows[CHART_ROWS_SHOWN:]
    more = (f"<details class='more'><summary>{len(rest)} more candidates</summary>{''.join(rest)}</details>"
            if rest else "")
    axis = "".join(f"<span style='left:{t / top * 100:.3f}%'>{t:g}</span>" for t in ticks)
    grid = "".join(f"<i style='left:{t / top * 100:.3f}%'></i>" for t in ticks)
    legend = "".join(f"<span class='lg'><i class='s-{k}'></i>{_e(name)}</span>" for k, (name, _) in SEGMENTS.items())
    return (f"<section id='cost'><h2>Modeled cost per candidate <span class='h2n'>{len(cands)} priced on "
            f"{_e(doc['target']['name'])}</span></h2><p class='lead'>Per candidate, the upper bar is the unfused "
            f"kernels, the lower bar the fused kernel (µs, same scale). Each kernel's time is attributed to the "
            f"pipe that bounds it (the MTE2, compute and MTE3 stages overlap under double buffering), plus "
            f"pipeline fill/drain, any roofline excess and the launch; hover a bar for each kernel's figures."
            f"</p><div class='legend'>{legend}</div><div class='chart'><div class='crow axis'><div class='clabel'>"
            f"</div><div class='cbars ticks'>{axis}</div><div class='cnums sub'>unfused → fused · gain</div></div>"
            f"<div class='plot'><div class='grid'>{grid}</div>{''.join(shown)}{more}</div></div></section>")


def _not_fused_section(doc: dict[str, Any]) -> str:
    cands = doc["candidates"]
    regions = {r["candidate"]: r for r in doc.get("regions") or []}
    off = [(i, c) for i, c in enumerate(cands) if c["status"] != "applied"]
    if not off:
        return ("<section id='not-fused'><h2>Candidates not fused</h2><p class='muted'>Every candidate that reached "
                "the cost model was fused.</p></section>")
    items = []
    layered = _layered(doc)
    drawn: dict[tuple, int] = {}   # on a layered page, one drawing per region shape and fate
    for i, c in off:
        d = c.get("decision") or {}
        r = regions.get(i)
        key = (c["status"], _region_signature(r)) if r else None
        if r and layered and key in drawn:
            drawing = (f"<p class='caption'>Same shape as region <a href='#region-{drawn[key]}'>#{drawn[key]}</a>, "
                       f"drawn there.</p>{_region_detail(r, c)}")
        else:
            drawing = _drawing_and_detail(r, c) if r else ""
            if key is not None:
                drawn.setdefault(key, i)
        items.append(f"<details class='region off' id='region-{i}' data-region='{i}'><summary>"
                     f"<span class='rid'>#{i}</span><span class='badge st-{_e(c['status'])}'>"
                     f"{_e(STATUS_LABEL.get(c['status'], c['status']))}</span><b>{_e(c['kind'])}</b>"
                     f"<span class='rname'>{_e(short_name(c['nodes'][0] if c['nodes'] else '', 40))}</span>"
                     f"<span class='rtime'>{_us(d.get('t_unfused_us'))} → {_us(d.get('t_fused_us'))}</span>"
                     f"<span class='why'>{_e(c.get('reason') or '')}</span></summary>{drawing}</details>")
    return (f"<section id='not-fused'><h2>Candidates not fused <span class='h2n'>{len(off)}</span></h2>"
            f"<p class='lead'>Matched, but skipped by the cost model, rolled back by the numeric check, or dropped "
            f"for an overlapping candidate with more gain.</p>{''.join(items)}</section>")


def _near_miss_section(doc: dict[str, Any]) -> str:
    nm = doc.get("near_misses") or []
    if not nm:
        return ("<section id='near-misses'><h2>Near-misses</h2><p class='muted'>No near-misses: no chain looked "
                "fusible and was refused.</p></section>")
    rows = []
    for f in nm:
        chain = f.get("nodes") or []
        chain_html = (f"<details><summary>{len(chain)} node{'s' if len(chain) != 1 else ''}</summary>"
                      f"<ol>{''.join(f'<li>{_e(n)}</li>' for n in chain)}</ol></details>" if chain else "–")
        rows.append(f"<tr><td>{_e(f['pattern'])}</td><td><span class='badge reason'>{_e(f['reason'])}</span></td>"
                    f"<td class='name'>{_e(f['node'])}</td><td>{_e(f['detail'])}</td><td>{chain_html}</td></tr>")
    return (f"<section id='near-misses'><h2>Near-misses <span class='h2n'>{len(nm)}</span></h2>"
            f"<p class='lead'>Chains that looked fusible but were refused, with the node that made the pattern "
            f"refuse.</p><table class='tbl'><thead><tr><th>pattern</th><th>reason</th><th>node</th><th>detail</th>"
            f"<th>chain</th></tr></thead><tbody>{''.join(rows)}</tbody></table></section>")


def _opportunity_section(doc: dict[str, Any]) -> str:
    if "opportunities" not in doc:
        return ""
    from npufuse.reporting import opportunities_section as op

    def table(headers: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{_e(h)}</th>" for h in headers)
        body = "".join("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in r) + "</tr>" for r in rows)
        return f"<table class='tbl'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    rows, left = op.opportunity_rows(doc), op.left_out_rows(doc)
    return (f"<section id='opportunities'><h2>Kernel opportunities <span class='h2n'>{len(rows)}</span></h2>"
            f"<p class='lead'>{_e(op.opportunities_summary(doc))}. Each is priced as if the kernel existed, with "
            f"the same tiling and UB/L1/L0 checks as any fusion.</p>"
            + (table(op.HEADERS, rows) if rows else "")
            + (f"<details><summary>{len(left)} refused for want of a kernel, no opportunity either</summary>"
               f"{table(op.LEFT_OUT_HEADERS, left)}</details>" if left else "") + "</section>")


def _atc_section(doc: dict[str, Any]) -> str:
    if not doc.get("atc"):
        return ""
    from npufuse.reporting.atc_section import HEADERS, atc_rows, atc_summary
    rows = "".join("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in r) + "</tr>" for r in atc_rows(doc["atc"]))
    head = "".join(f"<th>{_e(h)}</th>" for h in HEADERS)
    return (f"<section id='atc'><h2>ATC form</h2><p class='lead'>{_e(atc_summary(doc['atc']))}</p>"
            f"<table class='tbl'><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></section>")


def _op_kind_section(doc: dict[str, Any]) -> str:
    before = doc["model_estimate"]["before"]["by_op_type"]
    after = doc["model_estimate"]["after"]["by_op_type"]
    kinds = sorted(set(before) | set(after), key=lambda k: (-max(before.get(k, {}).get("time_us", 0),
                                                                  after.get(k, {}).get("time_us", 0)), k))
    top = max([v.get("time_us", 0) for v in list(before.values()) + list(after.values())] + [1e-9])
    rows = []
    for k in kinds:
        b, a = before.get(k, {}), after.get(k, {})
        tb, ta = b.get("time_us", 0.0), a.get("time_us", 0.0)
        rows.append(f"<tr><td class='op'>{_e(k)}</td><td class='r'>{b.get('count', 0)}</td>"
                    f"<td class='r'>{a.get('count', 0)}</td><td class='r'>{_us(tb)}</td><td class='r'>{_us(ta)}</td>"
                    f"<td class='mini'><div class='mb b' style='width:{tb / top * 100:.2f}%'></div>"
                    f"<div class='mb a' style='width:{ta / top * 100:.2f}%'></div></td>"
                    f"<td class='r'>{_bytes(b.get('gm_bytes', 0))}</td>"
                    f"<td class='r'>{_bytes(a.get('gm_bytes', 0))}</td>"
                    f"<td class='r'>{b.get('launches', 0)} → {a.get('launches', 0)}</td></tr>")
    return (f"<section id='op-kinds'><h2>Per op kind, before and after <span class='h2n'>modeled on "
            f"{_e(doc['target']['name'])}</span></h2><table class='tbl kinds'><thead><tr><th>op</th><th class='r'>"
            f"n before</th><th class='r'>n after</th><th class='r'>time before</th><th class='r'>time after</th>"
            f"<th>time <span class='key b'></span> before <span class='key a'></span> after</th><th class='r'>GM "
            f"before</th><th class='r'>GM after</th><th class='r'>launches</th></tr></thead><tbody>{''.join(rows)}"
            f"</tbody></table></section>")


def _verification(doc: dict[str, Any]) -> tuple[str, str, str]:
    s = doc["summary"]
    rolled = s["by_status"].get("rolled-back", 0)
    if not doc.get("verified"):
        return "muted", "not verified", "run without --no-verify to check every rewrite numerically"
    mc = s.get("model_check")
    worst_rw = max((o.get("min_passing_rtol") or 0.0 for c in doc["candidates"] if c["status"] == "applied"
                    and c.get("check") for o in c["check"].get("outputs") or []), default=0.0)
    if mc is None:
        return "muted", "nothing to verify", "no rewrite was applied"
    if not mc.get("ok"):
        return "bad", "drift", mc.get("reason") or "the optimized model differs from the original"
    err = max((o.get("max_abs_err") or 0.0 for o in mc.get("outputs") or []), default=0.0)
    sub = f"whole model: max abs err {_num(err)}; every rewrite passes at rtol {_num(worst_rw)}"
    if rolled:
        sub += f" · {rolled} rewrite{'s' if rolled != 1 else ''} rolled back"
    return "ok", "verified", sub


def _summary_section(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    t, gm, ln, nd = s["modeled_time_us"], s["gm_bytes"], s["launches"], s["nodes"]
    speed = f"{t['speedup']:.2f}× faster" if t.get("speedup") else ""
    alone = s.get("atc_alone")
    if alone and alone.get("speedup"):   # the export as ATC compiles it by itself (docs/report.md)
        speed += f" · {alone['speedup']:.2f}× over ATC alone ({alone['time_us']:,.1f} µs)"
    vcls, vhead, vsub = _verification(doc)
    applied = s["by_status"].get("applied", 0)
    cards = [
        ("Modeled time", f"{t['before']:,.1f} → {t['after']:,.1f} µs",
         f"{speed} · {_signed(-t['gain'])} µs ({_pct(t['before'], t['after'])})", "good" if t["gain"] > 0 else ""),
        ("GM traffic", f"{_bytes(gm['before'])} → {_bytes(gm['after'])}", _pct(gm["before"], gm["after"]), ""),
        ("Kernel launches", f"{ln['before']} → {ln['after']}", _pct(ln["before"], ln["after"]), ""),
        ("Nodes", f"{nd['before']} → {nd['after']}", _pct(nd["before"], nd["after"]), ""),
        ("Fusions", f"{applied} of {s['candidates']}", f"candidates applied · {s['near_misses']} near-misses", ""),
        ("Verification", vhead, vsub, vcls),
    ]
    kpis = "".join(f"<div class='kpi {cls}'><div class='kt'>{_e(title)}</div><div class='kv'>{_e(value)}</div>"
                   f"<div class='ks'>{_e(sub)}</div></div>" for title, value, sub, cls in cards)
    if (s.get("assumed_shapes") or {}).get("ops"):
        from npufuse.reporting.text import assumed_line
        kpis += f"<p class='lead'><b>{_e(assumed_line(s['assumed_shapes']))}</b></p>"
    if s.get("sigmoid_high_precision"):
        from npufuse.reporting.text import sigmoid_line
        kpis += f"<p class='lead'>{_e(sigmoid_line(s['sigmoid_high_precision']))}</p>"
    if s.get("unmeasured_kernels"):
        from npufuse.reporting.text import unmeasured_line
        kpis += f"<p class='lead'>{_e(unmeasured_line(s['unmeasured_kernels'], doc['target']['name']))}</p>"
    cands = doc["candidates"]
    by_kind: dict[str, list[float]] = {}
    for c in cands:
        if c["status"] == "applied":
            by_kind.setdefault(c["kind"], []).append((c.get("decision") or {}).get("gain_us") or 0.0)
    kind_rows = "".join(f"<tr><td>{_e(k)}</td><td class='r'>{n}</td><td class='r'>{_us(sum(by_kind.get(k, [])))}"
                        f"</td></tr>" for k, n in sorted(s["applied_by_kind"].items(), key=lambda kv: (-kv[1], kv[0])))
    kind_rows += "".join(f"<tr class='absorbed'><td>{_e(k)} <span class='muted'>absorbed into a larger fusion, "
                         f"counted there</span></td><td class='r muted'>({n})</td><td></td></tr>"
                         for k, n in s.get("absorbed_by_kind", {}).items())
    reason_rows = "".join(f"<tr><td><span class='badge reason'>{_e(k)}</span></td><td class='r'>{n}</td></tr>"
                          for k, n in sorted(s["not_fused_by_reason"].items(), key=lambda kv: (-kv[1], kv[0])))
    fused_tbl = (f"<table class='tbl'><thead><tr><th>fused, per kind (in the output)</th><th class='r'>n</th><th class='r'>modeled gain"
                 f"</th></tr></thead><tbody>{kind_rows or '<tr><td colspan=3 class=muted>nothing fused</td></tr>'}"
                 f"</tbody></table>")
    reason_tbl = (f"<table class='tbl'><thead><tr><th>not fused, per reason</th><th class='r'>n</th></tr></thead>"
                  f"<tbody>{reason_rows or '<tr><td colspan=2 class=muted>none</td></tr>'}</tbody></table>")
    return (f"<section id='summary'><div class='kpis'>{kpis}</div><div class='two'>{fused_tbl}{reason_tbl}</div>"
            f"</section>")


def _target_section(doc: dict[str, Any]) -> str:
    rows = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in doc["target"].get("numbers", {}).items())
    return (f"<section id='target'><details><summary><h2>Target profile: {_e(doc['target']['name'])}</h2></summary>"
            f"<p>{_e(doc['target'].get('description') or '')}</p><table class='tbl'>{rows}</table></details></section>")


# ---- the page ----------------------------------------------------------------------------------------

def render_html(doc: dict[str, Any]) -> str:
    """The report document as one self-contained HTML page."""
    model = doc["model"] or "(a model given in memory)"
    base = model.replace("\\", "/").rstrip("/").split("/")[-1] or model
    applied = doc["summary"]["by_status"].get("applied", 0)
    nav_items = [("summary", "Summary"), ("regions", f"Fused regions ({applied})"),
                 ("cost", "Cost per candidate"),
                 ("not-fused", f"Not fused ({sum(1 for c in doc['candidates'] if c['status'] != 'applied')})"),
                 ("near-misses", f"Near-misses ({len(doc.get('near_misses') or [])})"), ("op-kinds", "Per op kind"),
                 ("target", "Target")]
    if (doc.get("opportunities") or {}).get("kernels"):
        nav_items.insert(-2, ("opportunities", f"Kernel opportunities ({len(doc['opportunities']['kernels'])})"))
    if doc.get("atc"):
        nav_items.insert(-2, ("atc", "ATC form"))
    layered = _layered(doc)
    if layered:
        nav_items.insert(1, ("overview", f"Layers ({len(doc['layers'])})"))
    nav = "".join(f"<a href='#{k}'>{_e(v)}</a>" for k, v in nav_items)
    script_hash = base64.b64encode(hashlib.sha256(_JS.encode()).digest()).decode()
    csp = (f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
           f"script-src 'sha256-{script_hash}'; base-uri 'none'; form-action 'none'")
    overview = ""
    if layered:
        from npufuse.reporting.html_layers import overview_section
        overview = overview_section(doc)
    body = "".join([
        _summary_section(doc), overview, _regions_section(doc), _cost_section(doc), _not_fused_section(doc),
        _near_miss_section(doc), _opportunity_section(doc), _atc_section(doc), _op_kind_section(doc),
        _target_section(doc)])
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<meta http-equiv='Content-Security-Policy' content=\"{csp}\">"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        "<link rel='icon' href='data:,'>"
        f"<title>npufuse report: {_e(base)} on {_e(doc['target']['name'])}</title>"
        f"<style>{_CSS}</style></head><body>"
        f"<header class='top'><div class='brand'>npufuse report</div><h1 title='{_e(model)}'>{_e(base)}</h1>"
        f"<div class='meta'><span>model <code>{_e(model)}</code></span><span>target <b>{_e(doc['target']['name'])}"
        f"</b></span><span>ATC precision mode <b>{_e(doc['target'].get('precision_mode') or '-')}</b></span><span>{_e(doc['target'].get('description') or '')}</span><span>npufuse "
        f"{_e(doc.get('npufuse_version', ''))} · schema {_e(doc.get('schema', ''))}</span></div>"
        f"<nav>{nav}</nav></header><main>{body}</main>"
        f"<footer>Generated by npufuse {_e(doc.get('npufuse_version', ''))}. Times are modeled by the npufuse cost "
        f"model on the {_e(doc['target']['name'])} profile, not measured.</footer>"
        f"<script>{_JS}</script></body></html>\n")


_JS = """
(function () {
  'use strict';
  function openTo(id) {
    var el = document.getElementById(id);
    if (!el) { return; }
    for (var p = el; p; p = p.parentElement) { if (p.tagName === 'DETAILS') { p.open = true; } }
    el.scrollIntoView({block: 'start', behavior: 'instant'});
  }
  function onHash() {
    if (location.hash.length > 1) { openTo(decodeURIComponent(location.hash.slice(1))); }
  }
  window.addEventListener('hashchange', onHash);
  onHash();
  Array.prototype.forEach.call(document.querySelectorAll('button[data-toggle]'), function (b) {
    b.addEventListener('click', function () {
      var open = b.getAttribute('data-toggle') === 'open';
      var scope = document.querySelector(b.getAttribute('data-target'));
      Array.prototype.forEach.call(scope.querySelectorAll('details'), function (d) { d.open = open; });
    });
  });
  var filter = document.getElementById('filter-regions');
  if (filter) {
    filter.addEventListener('input', function () {
      var q = filter.value.trim().toLowerCase();
      Array.prototype.forEach.call(document.querySelectorAll('#regions [data-search]'), function (el) {
        var hit = !q || el.getAttribute('data-search').indexOf(q) >= 0;
        el.hidden = !hit;
        if (q && hit && el.classList.contains('group')) {
          var m = el.querySelector('details.members');
          if (m) { m.open = true; }
        }
      });
      // a layer group stays when its layers or a region inside it match, and opens to show them
      Array.prototype.forEach.call(document.querySelectorAll('#regions details.layer-run'), function (run) {
        var inner = run.querySelector('[data-search]:not([hidden])');
        run.hidden = !!q && !inner && run.getAttribute('data-label').indexOf(q) < 0;
        if (q && !run.hidden) { run.open = true; }
      });
    });
  }
  document.documentElement.classList.add('js');
})();
"""

_SEG_CSS = "".join(f".s-{k}{{background:{color}}}" for k, (_, color) in SEGMENTS.items())

_CSS = """
:root{--fg:#1f2430;--muted:#667085;--line:#e3e7ee;--bg:#f6f7fb;--card:#fff;--accent:#3b5bdb;--good:#1e8e4f;
--bad:#c92a2a;--warn:#b7791f;--mono:'DejaVu Sans Mono',ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
*{box-sizing:border-box}
html{scroll-behavior:smooth}
body{margin:0;background:var(--bg);color:var(--fg);font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,
'DejaVu Sans',Helvetica,Arial,sans-serif}
header.top{background:#1d2433;color:#e9edf5;padding:18px 32px 0}
header.top .brand{font-size:12px;letter-spacing:.12em;text-transform:uppercase;color:#9fb0d0}
header.top h1{margin:2px 0 6px;font-size:26px;font-weight:650;word-break:break-all}
header.top .meta{display:flex;flex-wrap:wrap;gap:6px 22px;font-size:12.5px;color:#b8c3d9}
header.top .meta code{color:#e9edf5;font-family:var(--mono);font-size:12px;word-break:break-all}
header.top .meta b{color:#fff}
nav{display:flex;flex-wrap:wrap;gap:4px;margin-top:14px}
nav a{color:#cfd8ea;text-decoration:none;padding:8px 12px;border-radius:6px 6px 0 0;font-size:13px}
nav a:hover{background:#2b3449;color:#fff}
main{max-width:1360px;margin:0 auto;padding:20px 24px 40px}
section{margin:0 0 34px}
h2{font-size:19px;margin:0 0 6px;font-weight:650}
h2 .h2n{font-size:13px;font-weight:500;color:var(--muted);margin-left:8px}
h3{font-size:16px;margin:0}
h5{margin:10px 0 4px;font-size:12px;text-transform:uppercase;letter-spacing:.06em;color:var(--muted)}
p.lead{margin:0 0 12px;color:var(--muted);max-width:980px}
.muted{color:var(--muted)}
.kpis{display:grid;grid-template-columns:repeat(6,1fr);gap:12px;margin-bottom:14px}
.kpi{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:12px 14px;
border-top:3px solid #c9d2e3}
.kpi .kt{font-size:11.5px;text-transform:uppercase;letter-spacing:.07em;color:var(--muted)}
.kpi .kv{font-size:20px;font-weight:650;margin:4px 0 2px;white-space:nowrap}
.kpi .ks{font-size:12px;color:var(--muted)}
.kpi.good{border-top-color:var(--good)} .kpi.good .ks{color:var(--good)}
.kpi.ok{border-top-color:var(--good)} .kpi.ok .kv{color:var(--good)}
.kpi.bad{border-top-color:var(--bad)} .kpi.bad .kv{color:var(--bad)}
.kpi.muted .kv{color:var(--muted)}
.two{display:grid;grid-template-columns:1.3fr 1fr;gap:14px}
table.tbl{width:100%;border-collapse:collapse;background:var(--card);border:1px solid var(--line);border-radius:10px;
overflow:hidden;font-size:13px}
.tbl th{text-align:left;font-weight:600;font-size:12px;color:var(--muted);background:#fafbfd;
border-bottom:1px solid var(--line);padding:7px 10px}
.tbl td{padding:6px 10px;border-bottom:1px solid #eef1f6;vertical-align:top}
.tbl tr:last-child td{border-bottom:0}
.r{text-align:right;white-space:nowrap}
td.name,.name{font-family:var(--mono);font-size:12px;word-break:break-all}
td.op{font-weight:600;white-space:nowrap}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:11.5px;font-weight:600;background:#eef1f6;
color:#3d4656;white-space:nowrap}
.badge.reason{background:#fff4e5;color:#8a4b00}
.badge.st-skipped-by-cost{background:#fff4e5;color:#8a4b00}
.badge.st-rolled-back{background:#fdecec;color:var(--bad)}
.badge.st-dropped{background:#eef1f6;color:#3d4656}
.legend{display:flex;flex-wrap:wrap;gap:6px 16px;margin:6px 0 12px;font-size:12px;color:#495366}
.legend .lg{display:inline-flex;align-items:center;gap:6px}
.legend .lg i{display:inline-block;width:12px;height:12px;border-radius:3px}
.legend .lg:not(:has(i))::before{content:'';display:inline-block;width:22px;height:12px;border-radius:6px;
border:1.5px solid}
.legend .lg.in::before{background:#e7f0ff;border-color:#2f6fd6}
.legend .lg.const::before{background:#f1f3f4;border-color:#9aa0a6}
.legend .lg.out::before{background:#e6f6ec;border-color:#1e8e4f}
.legend .lg.node-cube::before{border-radius:3px;background:#e8efff;border-color:#4a6fd4}
.legend .lg.node-vec::before{border-radius:3px;background:#fff6e6;border-color:#d08c1a}
.legend .lg.node-view::before{border-radius:3px;background:#f3f4f6;border-color:#9aa0a6}
.legend .lg.node-made::before{border-radius:3px;background:#f3ecff;border-color:#8e5bd6}
.legend .lg.frame::before{border-radius:4px;border-style:dashed;border-color:#5b3cc4;background:#f7f5ff}
.legend .lg.fused::before{border-radius:4px;background:#4b32b0;border-color:#4b32b0}
.tools{display:flex;gap:8px;margin:0 0 12px}
.tools input{flex:0 1 420px;padding:7px 10px;border:1px solid #cfd6e3;border-radius:7px;font:inherit}
.tools button{padding:6px 12px;border:1px solid #cfd6e3;background:#fff;border-radius:7px;font:inherit;cursor:pointer}
.tools button:hover{background:#f0f3f9}
html:not(.js) .tools{display:none}
article.group{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:14px 16px;margin:0 0 14px}
article.group>header{display:flex;flex-wrap:wrap;align-items:baseline;gap:6px 14px;margin-bottom:6px}
article.group .count{background:#ede9fe;color:#4b32b0;font-weight:650;border-radius:10px;padding:1px 9px;
font-size:12.5px}
article.group .chain{color:#495366;font-size:12.5px}
article.group .kern{font-family:var(--mono);font-size:12px;color:#1f5fa8;font-weight:600}
article.group .ggain{margin-left:auto;color:var(--good);font-weight:600;font-size:13px}
.caption{margin:0 0 4px;font-size:12px;color:var(--muted)}
.pair{display:flex;flex-wrap:wrap;gap:8px 28px;align-items:flex-start}
.pair>.drawing{flex:0 1 auto;max-width:100%}
.pair>.detail{flex:1 1 440px;min-width:360px}
.drawing{overflow-x:auto;padding:6px 0}
.region-svg{display:block;max-width:100%;height:auto}
.region-svg text{font-family:'DejaVu Sans',system-ui,sans-serif;text-anchor:middle}
.region-svg .op{font-size:12px;font-weight:700;fill:#1f2430}
.region-svg .nm{font-size:10px;fill:#5b6577}
.region-svg .val{font-size:10.5px;fill:#1f2430}
.region-svg .frame{fill:#f7f5ff;stroke:#5b3cc4;stroke-width:1.4;stroke-dasharray:6 4}
.region-svg .frame-off{fill:#fafafa;stroke:#9aa0a6}
.region-svg .edge{fill:none;stroke-width:1.3}
.region-svg .e-int{stroke:#7a818c}
.region-svg .e-in{stroke:#2f6fd6}
.region-svg .e-const{stroke:#9aa0a6;stroke-dasharray:3 3}
.region-svg .e-out{stroke:#1e8e4f}
.region-svg .e-fuse{stroke:#5b3cc4;stroke-width:2.2}
.region-svg .fuse-word{font-size:10.5px;fill:#5b3cc4;font-weight:600}
.region-svg .cube rect{fill:#e8efff;stroke:#4a6fd4}
.region-svg .vec rect{fill:#fff6e6;stroke:#d08c1a}
.region-svg .view rect{fill:#f3f4f6;stroke:#9aa0a6}
.region-svg .made rect{fill:#f3ecff;stroke:#8e5bd6}
.region-svg .in rect{fill:#e7f0ff;stroke:#2f6fd6}
.region-svg .const rect{fill:#f1f3f4;stroke:#9aa0a6}
.region-svg .const text{fill:#4d5563;font-style:italic}
.region-svg .out rect{fill:#e6f6ec;stroke:#1e8e4f}
.region-svg .it rect{stroke-width:1.2}
.region-svg .fused rect{fill:#4b32b0;stroke:#3a2590}
.region-svg .fused text{fill:#fff}
.region-svg .fused-off rect{fill:#8a8f98;stroke:#6b7079}
.region-svg .badge{fill:#eceef2;stroke:#b8bec7;stroke-width:.8}
.region-svg .bdg{font-size:8.5px;fill:#4d5563}
.region-svg .fop{font-size:13px;font-weight:700}
.region-svg .fattr{font-size:10.5px;fill:#e4defc}
details>summary{cursor:pointer}
details.members{margin-top:4px}
details.members>summary{font-size:13px;color:var(--accent);font-weight:600;padding:4px 0}
.rlist{border:1px solid var(--line);border-radius:8px;overflow:hidden}
details.region{border-bottom:1px solid #eef1f6;background:#fff}
details.region:last-child{border-bottom:0}
details.region>summary,.rline{display:grid;grid-template-columns:56px minmax(180px,1.1fr) minmax(200px,1.6fr) 96px 26px;
gap:10px;align-items:center;padding:6px 10px;font-size:12.5px}
details.region>summary::-webkit-details-marker{display:none}
details.region>summary::before{content:'';display:none}
details.region[open]>summary{background:#f4f6fb}
details.region>summary:hover{background:#f7f8fb}
details.region>.pair{padding:0 12px}
.rid{font-weight:700;color:var(--accent)}
.rname{font-family:var(--mono);font-size:11.5px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.rio{font-family:var(--mono);font-size:11px;color:#5b6577;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.rgain{text-align:right;font-weight:600;color:var(--good);white-space:nowrap}
.rchk{text-align:center;font-weight:700}
.rtime{text-align:right;white-space:nowrap;color:#3d4656}
.ok{color:var(--good)} .bad{color:var(--bad)} .good{color:var(--good)}
.region.single .rline{padding:4px 0}
#not-fused details.region{border:1px solid var(--line);border-radius:8px;margin-bottom:6px}
#not-fused details.region>summary{grid-template-columns:56px 130px minmax(120px,.8fr) minmax(140px,.8fr) 170px}
#not-fused .why{grid-column:2/-1;color:#5b4a1f;font-size:12.5px}
.detail{font-size:12.5px;padding:2px 0 10px}
.detail .facts{margin:4px 0;color:#3d4656}
.detail .kernel{margin:2px 0 6px;font-size:12px;color:#3d4656;line-height:1.5}
.detail .kernel .kname{font-family:var(--mono);font-weight:600;color:#1f5fa8}
.detail .kernel .kattrs{font-family:var(--mono);font-size:11.5px}
.detail .facts b{color:var(--muted);font-weight:600;margin-right:3px}
.detail .reason{margin:2px 0 6px;color:#3d4656}
.detail details.fold>summary h5{display:inline-block}
.detail .cols{display:grid;grid-template-columns:1fr;gap:0}
.detail table.nodes{border-collapse:collapse;width:100%}
.detail table.nodes td{padding:2px 8px 2px 0;border-bottom:1px solid #f0f2f6}
.detail ul.vals{list-style:none;margin:0;padding:0}
.detail ul.vals li{padding:2px 0 2px 10px;border-left:3px solid #cfd6e3;margin:2px 0}
.detail ul.vals li.in{border-left-color:#2f6fd6} .detail ul.vals li.out{border-left-color:#1e8e4f}
.detail ul.vals li.const{border-left-color:#b8bec7}
.detail .shape{color:var(--muted);font-size:11.5px;margin-left:6px}
.tag{display:inline-block;margin-left:6px;font-size:10.5px;padding:0 6px;border-radius:8px;background:#eef1f6;
color:#5b6577;font-family:system-ui,sans-serif;text-decoration:none}
a.tag{background:#f3ecff;color:#6a3fc0}
.chart{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:10px 16px}
.crow{display:grid;grid-template-columns:300px 1fr 250px;gap:14px;align-items:center;padding:5px 0;
border-bottom:1px solid #f1f3f7}
.crow.axis{border-bottom:1px solid var(--line);padding:2px 0 6px}
.plot{position:relative}
.plot .grid{position:absolute;top:0;bottom:0;left:368px;right:264px;pointer-events:none}
.plot .grid i{position:absolute;top:0;bottom:0;border-left:1px dashed #e6e9f0}
.ticks{position:relative;height:16px;font-size:11px;color:var(--muted)}
.ticks span{position:absolute;transform:translateX(-50%)}
.ticks span:first-child{transform:none}
.clabel{font-size:12.5px;overflow:hidden;white-space:nowrap;text-overflow:ellipsis}
.clabel a{color:var(--accent);font-weight:700;text-decoration:none;margin-right:4px}
.clabel .sub{display:block;font-family:var(--mono);font-size:11px;color:var(--muted);overflow:hidden;
text-overflow:ellipsis}
.cbars{position:relative;z-index:1;display:grid;grid-template-columns:48px 1fr;gap:3px 6px;align-items:center}
.cbars .bl{font-size:10px;color:var(--muted);text-align:right;white-space:nowrap}
.bar{display:flex;height:11px;border-radius:3px;overflow:hidden;background:transparent}
.cbars .bar:nth-child(2) .seg{opacity:.55}
.bar.infeasible{font-size:10.5px;color:var(--bad);height:auto}
.seg{display:block;height:100%;border-right:1px solid rgba(255,255,255,.7)}
.cnums{display:flex;flex-wrap:wrap;gap:2px 10px;font-size:12.5px;white-space:nowrap}
.cnums .sub,.crow .sub{color:var(--muted);font-size:11.5px}
.crow.st-skipped-by-cost .clabel b,.crow.st-rolled-back .clabel b{color:var(--warn)}
details.more>summary{padding:6px 0;color:var(--accent);font-weight:600;font-size:13px}
.kinds td.mini{width:28%}
.mb{height:6px;border-radius:3px;margin:2px 0}
.mb.b,.key.b{background:#aab4c5} .mb.a,.key.a{background:#3b5bdb}
.key{display:inline-block;width:10px;height:10px;border-radius:2px;vertical-align:-1px}
.strip{display:flex;flex-wrap:wrap;gap:3px;margin:0 0 12px}
.strip .cell{display:flex;flex-direction:column;align-items:center;justify-content:center;width:30px;height:34px;
border-radius:5px;text-decoration:none;color:#1f2430;font-size:12px;line-height:1.1;border:1px solid #cfd6e3}
.strip .cell.r0{background:#e8efff} .strip .cell.r1{background:#f3ecff}
.strip .cell i{font-style:normal;font-size:10px;color:var(--warn)}
table.layers td:first-child{white-space:nowrap}
details.layer-run{background:var(--card);border:1px solid var(--line);border-radius:12px;margin:0 0 10px;
padding:0 14px}
details.layer-run>summary{display:flex;flex-wrap:wrap;align-items:baseline;gap:4px 14px;padding:10px 0;font-size:14px}
details.layer-run>summary .lk{color:#495366;font-size:12.5px}
details.layer-run>summary .ggain{margin-left:auto;color:var(--good);font-weight:600;font-size:13px}
details.layer-run[open]>summary{border-bottom:1px solid var(--line);margin-bottom:10px}
details.layer-run article.group{border-color:#eceff5}
#target details>summary h2{display:inline}
#target p{color:var(--muted)}
footer{max-width:1360px;margin:0 auto;padding:0 24px 30px;color:var(--muted);font-size:12px}
@media (max-width:1100px){.kpis{grid-template-columns:repeat(3,1fr)}.two{grid-template-columns:1fr}
.crow{grid-template-columns:200px 1fr 190px}.plot .grid{left:268px;right:204px}}
""" + _SEG_CSS
