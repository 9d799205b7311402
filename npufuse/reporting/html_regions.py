"""The HTML page's fused regions: each drawn (region_svg), summarised and detailed; shared by the flat page and the
layer-by-layer one (html_layers)."""

from __future__ import annotations

from collections import OrderedDict
from html import escape
from typing import Any
from npufuse.npu_model.ascend_kernels import kernel_label
from npufuse.console.units import format_bytes
from npufuse.reporting.region_svg import region_svg, shape_text, short_name


def _e(s: Any) -> str:
    return escape(str(s), quote=True)


def _bytes(n: float | None) -> str:
    return "–" if n is None else format_bytes(n)


def _us(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{v:,.{digits}f} µs"


def _num(v: float | None) -> str:
    if v is None:
        return "–"
    if v == 0:
        return "0"
    return f"{v:.2e}" if abs(v) < 1e-3 or abs(v) >= 1e5 else f"{v:.4g}"


def _n(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _signed(v: float, fmt: str = ",.1f") -> str:
    """+1.5 / −1.5 with a real minus sign."""
    return format(v, "+" + fmt).replace("-", "−")


def _check_text(check: dict[str, Any] | None) -> tuple[str, str]:
    """(css class, short text) for a candidate's numeric check."""
    if check is None:
        return "muted", "not verified"
    if not check.get("ok"):
        return "bad", "check failed: " + (check.get("reason") or "")
    outs = check.get("outputs") or []
    worst = max((o.get("max_abs_err") or 0.0 for o in outs), default=0.0)
    return "ok", f"verified · max abs err {_num(worst)}"


def _region_signature(region: dict[str, Any]) -> tuple:
    nodes = region["nodes"]
    producer = {v: j for j, n in enumerate(nodes) for v in n.get("outputs") or []}
    consts = {v["name"] for v in region["inputs"] if v.get("constant")}
    dyn = [v["name"] for v in region["inputs"] if not v.get("constant")]
    shape = []
    for n in nodes:
        srcs = []
        for v in n.get("inputs") or []:
            if v in producer:
                srcs.append(("n", producer[v]))
            elif v in consts:
                srcs.append(("c",))
            elif v in dyn:
                srcs.append(("i", dyn.index(v)))
        shape.append((n["op_type"], tuple(srcs)))
    return (region["kind"], tuple(region.get("fused_ops") or ()), tuple(shape), len(region["outputs"]))


def _fused_label(region: dict[str, Any]) -> tuple[str, list[str]]:
    fused = region.get("fused_nodes") or []
    if fused:
        label = " + ".join(f["op_type"] for f in fused)
    elif region.get("fused_ops"):
        label = " + ".join(region["fused_ops"])
    else:
        label = region["kind"]
    lines = [region["kind"]] if region["kind"] not in label else []
    for f in fused[:1]:
        for k, v in list(f.get("attributes", {}).items())[:4]:
            text = ",".join(str(x) for x in v) if isinstance(v, list) else str(v)
            if len(text) > 28:
                text = text[:27] + "…"
            lines.append(f"{k}={text}")
    if region.get("absorbed_into") is not None:
        lines.append(f"then absorbed by region #{region['absorbed_into']}")
    return label, lines


def _ops_chain(region: dict[str, Any], limit: int = 7) -> str:
    ops = [n["op_type"] for n in region["nodes"]]
    if len(ops) > limit:
        return " → ".join(ops[: limit - 2]) + f" → … ({len(ops) - limit + 2} more) → " + ops[-1]
    return " → ".join(ops)


def _folded(title: str, body: str, n: int, limit: int = 12) -> str:
    """A titled block, folded into <details> when it has more than `limit` rows."""
    if n <= limit:
        return f"<h5>{_e(title)}</h5>{body}"
    return f"<details class='fold'><summary><h5>{_e(title)}</h5></summary>{body}</details>"


def _region_detail(region: dict[str, Any], cand: dict[str, Any], brief: bool = False) -> str:
    """The table under a drawing: nodes, values crossing the boundary, decision and check (`brief`: without the
    cost model's sentence and the Ascend kernel, for a region whose entry says they are another region's)."""
    rows = []
    for n in region["nodes"]:
        made = n.get("from_region")
        tag = (f' <a class="tag" href="#region-{made}">made by region #{made}</a>' if made is not None else "")
        rows.append(f"<tr><td class='op'>{_e(n['op_type'])}</td><td class='name'>{_e(n['name'])}{tag}</td></tr>")
    ins = "".join(f"<li class='{'const' if v.get('constant') else 'in'}'><span class='name'>{_e(v['name'])}</span>"
                  f" <span class='shape'>{_e(shape_text(v))}</span>"
                  f"{' <span class=tag>constant</span>' if v.get('constant') else ''}</li>"
                  for v in region["inputs"])
    outs = "".join(f"<li class='out'><span class='name'>{_e(v['name'])}</span>"
                   f" <span class='shape'>{_e(shape_text(v))}</span>"
                   f"{' <span class=tag>graph output</span>' if v.get('graph_output') else ''}</li>"
                   for v in region["outputs"])
    nodes_html = _folded(f"Replaced nodes ({len(region['nodes'])})", f"<table class='nodes'>{''.join(rows)}</table>",
                         len(rows))
    ins_html = _folded(f"Inputs crossing the boundary ({len(region['inputs'])})", f"<ul class='vals'>{ins}</ul>",
                       len(region["inputs"]))
    outs_html = _folded(f"Outputs crossing the boundary ({len(region['outputs'])})", f"<ul class='vals'>{outs}</ul>",
                        len(region["outputs"]))
    d = cand.get("decision") or {}
    cls, chk = _check_text(cand.get("check"))
    facts = [f"<b>pattern</b> {_e(region['pattern'])}", f"<b>status</b> {_e(cand['status'])}"]
    if d:
        facts += [f"<b>modeled</b> {_us(d.get('t_unfused_us'), 2)} → {_us(d.get('t_fused_us'), 2)}",
                  f"<b>GM saved</b> {_bytes(d.get('gm_bytes_saved'))}",
                  f"<b>launches saved</b> {_e(d.get('launches_saved'))}",
                  f"<b>tile</b> {_e(d.get('tile') or '–')}", f"<b>bound by</b> {_e(d.get('bound_by') or '–')}"]
    facts.append(f"<span class='{cls}'>{_e(chk)}</span>")
    reason = f"<p class='reason'>{_e(cand.get('reason') or '')}</p>" if cand.get("reason") and not brief else ""
    reason += "" if brief else _kernel_detail(cand.get("ascend_kernel"))
    return (f"<div class='detail'><p class='facts'>{' · '.join(facts)}</p>{reason}<div class='cols'>"
            f"<div>{nodes_html}</div><div>{ins_html}{outs_html}</div></div></div>")


def _kernel_detail(k: dict[str, Any] | None) -> str:
    """The Ascend kernel the region becomes: its name, attributes, input binding and notes."""
    if not k:
        return ""
    attrs = " · ".join(f"{_e(n)}={_e(v)}" for n, v in (k.get("attrs") or {}).items())
    ins = ", ".join(f"{_e(b['name'])} ← {_e(b['value'] if b.get('value') else b.get('const'))}"
                    for b in k.get("inputs") or [])
    where = "ATC built-in" if k.get("builtin") else k.get("source") or ""
    if k.get("chip"):
        where += f" · {'has a kernel for' if k.get('available') else 'no kernel for'} {k['chip']}"
    parts = [f"<b>Ascend kernel</b> <span class='kname'>{_e(kernel_label(k))}</span> "
             f"<span class='muted'>({_e(where)})</span>"]
    if k.get("fusion"):
        parts.append(_e(k["fusion"]))
    if attrs:
        parts.append(f"<span class='kattrs'>{attrs}</span>")
    if ins:
        parts.append(f"<span class='kattrs'>inputs: {ins}</span>")
    parts += [f"<span class='muted'>{_e(n)}</span>" for n in k.get("notes") or []]
    if k.get("problem"):
        parts.append(f"<span class='bad'>{_e(k['problem'])}</span>")
    return f"<p class='kernel'>{'<br>'.join(parts)}</p>"


def _drawing(region: dict[str, Any]) -> str:
    label, lines = _fused_label(region)
    return (f"<div class='drawing'>{region_svg(region, str(region['candidate']), label, lines, region['status'])}"
            f"</div>")


def _drawing_and_detail(region: dict[str, Any], cand: dict[str, Any]) -> str:
    """The drawing with its table beside it (below it when the drawing is wide)."""
    return f"<div class='pair'>{_drawing(region)}{_region_detail(region, cand)}</div>"


def _search_text(region: dict[str, Any]) -> str:
    parts = [region["kind"], region["pattern"], f"#{region['candidate']}"]
    parts += [n["name"] for n in region["nodes"]] + [n["op_type"] for n in region["nodes"]]
    parts += [v["name"] for v in region["inputs"] + region["outputs"]]
    return " ".join(parts).lower()


def _region_summary_line(region: dict[str, Any], cand: dict[str, Any]) -> str:
    d = cand.get("decision") or {}
    first = region["nodes"][0]["name"] if region["nodes"] else ""
    dyn_in = [v["name"] for v in region["inputs"] if not v.get("constant")]
    cls, chk = _check_text(cand.get("check"))
    gain = d.get("gain_us")
    return (f"<span class='rid'>#{region['candidate']}</span>"
            f"<span class='rname' title='{_e(first)}'>{_e(short_name(first, 48))}</span>"
            f"<span class='rio' title='{_e(', '.join(dyn_in))} → "
            f"{_e(', '.join(v['name'] for v in region['outputs']))}'>"
            f"{_e(', '.join(short_name(v, 30) for v in dyn_in[:2]))}{' …' if len(dyn_in) > 2 else ''} → "
            f"{_e(', '.join(short_name(v['name'], 30) for v in region['outputs'][:2]))}</span>"
            f"<span class='rgain'>{'–' if gain is None else _signed(-gain) + ' µs'}</span>"
            f"<span class='{cls} rchk'>{'✓' if cls == 'ok' else ('✗' if cls == 'bad' else '·')}</span>")


REGION_LEGEND = ("<div class='legend'><span class='lg in'>input value</span><span class='lg const'>constant / "
                 "weight</span><span class='lg out'>output value</span><span class='lg node-cube'>Cube op</span>"
                 "<span class='lg node-vec'>Vector op</span><span class='lg node-view'>layout / view op</span>"
                 "<span class='lg node-made'>made by an earlier fusion</span><span class='lg frame'>region boundary"
                 "</span><span class='lg fused'>fused op</span></div>")


def _region_tools(section: str) -> str:
    return ("<div class='tools'><input id='filter-regions' type='search' placeholder='Filter regions by node, "
            "value or kind…' aria-label='Filter regions'><button type='button' data-toggle='open' "
            f"data-target='#{section}'>Expand all</button><button type='button' data-toggle='close' "
            f"data-target='#{section}'>Collapse all</button></div>")


def region_gain(cands: list[dict[str, Any]], members: list[dict[str, Any]]) -> float:
    return sum((cands[r["candidate"]].get("decision") or {}).get("gain_us") or 0.0 for r in members)


def shape_cards(regions: list[dict[str, Any]], cands: list[dict[str, Any]], gid: str) -> list[str]:
    """One card per region shape (most gain first): the shape's drawing, and each region's own entry."""
    groups: OrderedDict[tuple, list[dict[str, Any]]] = OrderedDict()
    for r in regions:
        groups.setdefault(_region_signature(r), []).append(r)
    ordered = sorted(groups.values(), key=lambda ms: (-region_gain(cands, ms), ms[0]["candidate"]))
    cards = []
    for gi, members in enumerate(ordered):
        rep = members[0]
        gain = region_gain(cands, members)
        gm = sum((cands[r["candidate"]].get("decision") or {}).get("gm_bytes_saved") or 0 for r in members)
        kern = cands[rep["candidate"]].get("ascend_kernel")
        head = (f"<header><h3>{_e(rep['kind'])}</h3>"
                + (f"<span class='kern'>→ {_e(kernel_label(kern))}</span>" if kern else "") +
                f"<span class='count'>{'× ' + str(len(members)) if len(members) > 1 else '1 region'}</span>"
                f"<span class='chain'>{_e(_ops_chain(rep))}</span>"
                f"<span class='ggain'>gain {_us(gain)} · GM saved {_bytes(gm)}</span></header>")
        search = " ".join(_search_text(r) for r in members)
        if len(members) == 1:
            body = (f"<div class='region single' id='region-{rep['candidate']}' data-region='{rep['candidate']}'>"
                    f"<div class='rline'>{_region_summary_line(rep, cands[rep['candidate']])}</div>"
                    f"{_drawing_and_detail(rep, cands[rep['candidate']])}</div>")
        else:
            items = []
            for r in members:
                c = cands[r["candidate"]]
                items.append(f"<details class='region' id='region-{r['candidate']}' data-region='{r['candidate']}' "
                             f"data-search='{_e(_search_text(r))}'><summary>{_region_summary_line(r, c)}</summary>"
                             f"{_drawing_and_detail(r, c)}</details>")
            body = (f"<p class='caption'>Drawn: region #{rep['candidate']}; the {len(members)} regions listed below "
                    f"have this same shape (open one for its own drawing and names).</p>"
                    f"{_drawing_and_detail(rep, cands[rep['candidate']])}<details class='members'><summary>All "
                    f"{len(members)} regions of this shape</summary><div class='rlist'>{''.join(items)}</div>"
                    f"</details>")
        cards.append(f"<article class='group' id='{gid}-{gi}' data-search='{_e(search)}'>{head}{body}</article>")
    return cards
