"""The HTML report of a deep model, layer by layer: a whole-model overview and the fused regions grouped by layer.

On a 12-80-layer model the flat page repeats every drawing once per layer. Here the regions are grouped by the
layer each lies in (`regions[i].layer`, from node names and scopes, see reporting.layers), consecutive layers with
the same fusions (same region shapes and fates, same near-misses) are one collapsible group ("layers 0-11: same
fusions in each"), the first layer of a group is drawn and every other region keeps its own entry (names, shapes,
cost, check) with a link to the drawing of its shape. The overview above tells per layer group what fused, what
was skipped by cost and what was a near-miss, with a strip of one cell per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from npufuse.reporting.html_regions import (REGION_LEGEND, _drawing_and_detail, _e, _n, _region_detail,
                                    _region_signature, _region_summary_line, _region_tools, _search_text, _signed,
                                    _us, region_gain, shape_cards)
from npufuse.reporting.layers import split_label

LAYERED_MIN_LAYERS = 4        # fewer layers read well on the flat page
BLOCKS_MIN_CANDIDATES = 64    # topological blocks (no layer names) only help a page with many candidates:
# below, the flat page (regions grouped by shape) reads better (ResNet-50, 53 candidates)
OUTSIDE = "outside the layers"


def wants_layers(doc: dict[str, Any]) -> bool:
    layers = doc.get("layers") or []
    if len(layers) < LAYERED_MIN_LAYERS:
        return False
    return doc.get("layer_source") != "topological-blocks" or len(doc["candidates"]) >= BLOCKS_MIN_CANDIDATES


@dataclass
class LayerRun:
    """Consecutive layers with the same fusions."""
    labels: list[str]
    regions: dict[str, list[dict[str, Any]]] = field(default_factory=dict)      # label -> its regions
    near_misses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # label -> its near-misses

    @property
    def title(self) -> str:
        if len(self.labels) == 1:
            return self.labels[0]
        first, last = split_label(self.labels[0]), split_label(self.labels[-1])
        if first[1] is not None and first[0] == last[0]:
            return f"{first[0]}.{first[1]}–{last[1]}"
        return f"{self.labels[0]} … {self.labels[-1]}"

    def all_regions(self) -> list[dict[str, Any]]:
        return [r for lab in self.labels for r in self.regions.get(lab, [])]

    def all_near_misses(self) -> list[dict[str, Any]]:
        return [f for lab in self.labels for f in self.near_misses.get(lab, [])]


def _fingerprint(regions: list[dict[str, Any]], near: list[dict[str, Any]]) -> tuple:
    """What makes two layers the same: their regions' shapes and fates (absorbed or in the output included: the
    first layer's input norm has no residual Add before it to be absorbed into), and their near-misses."""
    return (tuple(sorted((r["status"], r.get("absorbed_into") is None, repr(_region_signature(r)))
                         for r in regions)),
            tuple(sorted((f["pattern"], f["reason"]) for f in near)))


def layer_runs(doc: dict[str, Any]) -> tuple[list[LayerRun], LayerRun | None]:
    """The layers grouped into runs of identical ones (model order), and what lies outside every layer."""
    by_layer: dict[str | None, list[dict[str, Any]]] = {}
    near: dict[str | None, list[dict[str, Any]]] = {}
    for r in doc.get("regions") or []:
        by_layer.setdefault(r.get("layer"), []).append(r)
    for f in doc.get("near_misses") or []:
        near.setdefault(f.get("layer"), []).append(f)
    runs: list[LayerRun] = []
    prev_fp = None
    for lab in doc.get("layers") or []:
        fp = _fingerprint(by_layer.get(lab, []), near.get(lab, []))
        stack, idx = split_label(lab)
        last = runs[-1].labels[-1] if runs else None
        contiguous = last is not None and idx is not None and split_label(last) == (stack, idx - 1)
        if runs and fp == prev_fp and contiguous:
            runs[-1].labels.append(lab)
        else:
            runs.append(LayerRun([lab]))
        runs[-1].regions[lab] = by_layer.get(lab, [])
        runs[-1].near_misses[lab] = near.get(lab, [])
        prev_fp = fp
    outside = None
    if by_layer.get(None) or near.get(None):
        outside = LayerRun([OUTSIDE], {OUTSIDE: by_layer.get(None, [])}, {OUTSIDE: near.get(None, [])})
    return runs, outside


def _counts(regions: list[dict[str, Any]], near: list[dict[str, Any]]) -> dict[str, int]:
    """Regions per fate; `fused` counts those in the output (a fusion absorbed into a bigger one counts there)."""
    out = {"fused": 0, "absorbed": 0, "applied": 0, "skipped-by-cost": 0, "rolled-back": 0, "dropped": 0}
    for r in regions:
        out[r["status"]] = out.get(r["status"], 0) + 1
        if r["status"] == "applied":
            out["fused" if r.get("absorbed_into") is None else "absorbed"] += 1
    out["near-misses"] = len(near)
    return out


def _fused_kinds(regions: list[dict[str, Any]]) -> str:
    kinds: dict[str, int] = {}
    for r in regions:
        if r["status"] == "applied" and r.get("absorbed_into") is None:
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))) or "nothing"


def _run_id(i: int) -> str:
    return f"layers-{i}"


def overview_section(doc: dict[str, Any]) -> str:
    """The whole model at a glance: per layer group what fused, was skipped by cost or near-missed, and the
    modeled gain; one strip cell per layer; the model's modeled time before and after."""
    runs, outside = layer_runs(doc)
    cands = doc["candidates"]
    t = doc["summary"]["modeled_time_us"]
    source = ("layer names in the node names and scopes" if doc.get("layer_source") == "names"
              else "topological blocks of equal node count (the node names carry no layer)")
    rows, cells = [], []
    for i, run in enumerate(runs + ([outside] if outside else [])):
        rid = _run_id(i) if run is not outside else "layers-outside"
        regions, near = run.all_regions(), run.all_near_misses()
        c = _counts(regions, near)
        gain = region_gain(cands, [r for r in regions if r["status"] == "applied"])
        per = len(run.labels)
        same = f"{per} layers, same fusions in each" if per > 1 else ""
        rows.append(f"<tr><td><a href='#{rid}'>{_e(run.title)}</a> <span class='muted'>{_e(same)}</span></td>"
                    f"<td>{_e(_fused_kinds(run.regions[run.labels[0]]))}{' <span class=muted>(each)</span>' if per > 1 else ''}"
                    f"</td><td class='r'>{c['fused']}</td><td class='r'>{c['skipped-by-cost']}</td>"
                    f"<td class='r'>{c['rolled-back'] + c['dropped']}</td><td class='r'>{c['near-misses']}</td>"
                    f"<td class='r'>{_us(gain)}</td></tr>")
        if run is outside:
            continue
        for lab in run.labels:
            lc = _counts(run.regions[lab], run.near_misses[lab])
            cells.append(f"<a class='cell r{i % 2}' href='#{rid}' title='{_e(lab)}: {lc['fused']} fused, "
                         f"{lc['skipped-by-cost']} skipped by cost, {lc['near-misses']} near-misses'>"
                         f"<b>{lc['fused']}</b><i>{lc['skipped-by-cost'] + lc['near-misses'] or ''}</i></a>")
    table = ("<table class='tbl layers'><thead><tr><th>layers</th><th>fused (in the output)</th><th class='r'>"
             "fused</th><th class='r'>skipped by cost</th><th class='r'>rolled back / dropped</th><th class='r'>"
             f"near-misses</th><th class='r'>modeled gain</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")
    strip = (f"<div class='strip' aria-label='one cell per layer: fused regions (bold) and not fused'>"
             f"{''.join(cells)}</div>")
    return (f"<section id='overview'><h2>Whole model <span class='h2n'>{_n(len(doc['layers']), 'layer')} in "
            f"{_n(len(runs), 'group')}</span></h2><p class='lead'>Modeled time {t['before']:,.1f} → {t['after']:,.1f} µs "
            f"({_signed(-t['gain'])} µs). Layers from {_e(source)}; consecutive layers with the same fusions are one "
            f"group. Each cell of the strip is a layer: regions fused (bold) and regions skipped by cost or "
            f"near-missed (small).</p>{strip}{table}</section>")


def _entry_without_drawing(r: dict[str, Any], c: dict[str, Any], drawn: int, drawn_c: dict[str, Any]) -> str:
    """A region of a repeated layer: its own names, shapes, cost figures and check; the drawing, and the cost
    model's sentence and Ascend kernel where they are the same, are those of region #`drawn`."""
    same = c.get("reason") == drawn_c.get("reason") and c.get("ascend_kernel") == _rebound(drawn_c, c)
    what = "shape, decision and Ascend kernel" if same else "shape"
    return (f"<details class='region' id='region-{r['candidate']}' data-region='{r['candidate']}' "
            f"data-search='{_e(_search_text(r))}'><summary>{_region_summary_line(r, c)}</summary>"
            f"<p class='caption'>Same {what} as region <a href='#region-{drawn}'>#{drawn}</a>, drawn there."
            f"</p>{_region_detail(r, c, brief=same)}</details>")


def _rebound(drawn_c: dict[str, Any], c: dict[str, Any]) -> Any:
    """The drawn region's kernel record as it would read for `c`: the same but for the node and value names
    (which differ per layer, and which `c`'s entry lists itself)."""
    k, mine = drawn_c.get("ascend_kernel"), c.get("ascend_kernel")
    if not k or not mine:
        return k
    return k | {"node": mine.get("node"), "inputs": mine.get("inputs"), "outputs": mine.get("outputs")}


def layered_regions_section(doc: dict[str, Any]) -> str:
    """Fused regions, one collapsible group per run of identical layers: the run's first layer drawn (one card
    per region shape), every other region's entry without a drawing, linking to its shape's."""
    cands = doc["candidates"]
    runs, outside = layer_runs(doc)
    applied = [r for r in doc.get("regions") or [] if r["status"] == "applied"]
    groups = []
    drawn_by_sig: dict[str, int] = {}   # each region shape is drawn once on the page
    for i, run in enumerate(runs + ([outside] if outside else [])):
        rid = _run_id(i) if run is not outside else "layers-outside"
        first = [r for r in run.regions[run.labels[0]] if r["status"] == "applied"]
        rest = [r for lab in run.labels[1:] for r in run.regions[lab] if r["status"] == "applied"]
        if not first and not rest:
            continue
        new = [r for r in first if repr(_region_signature(r)) not in drawn_by_sig]
        cards = "".join(shape_cards(new, cands, f"{rid}-shape"))
        for r in new:
            drawn_by_sig.setdefault(repr(_region_signature(r)), r["candidate"])
        drawn_before = [_entry_without_drawing(r, cands[r["candidate"]], d, cands[d]) for r in first if r not in new
                        for d in [drawn_by_sig[repr(_region_signature(r))]]]
        if drawn_before:
            cards += (f"<p class='caption'>Regions of {_e(run.labels[0])} whose shape is drawn in an earlier group:"
                      f"</p><div class='rlist'>{''.join(drawn_before)}</div>")
        entries = []
        for r in rest:
            sig = repr(_region_signature(r))
            if sig in drawn_by_sig:
                d = drawn_by_sig[sig]
                entries.append(_entry_without_drawing(r, cands[r["candidate"]], d, cands[d]))
            else:   # not in the run's first layer (cannot happen for a run of identical layers; kept honest)
                drawn_by_sig[sig] = r["candidate"]
                entries.append(f"<details class='region' id='region-{r['candidate']}' data-region='{r['candidate']}'"
                               f" data-search='{_e(_search_text(r))}'><summary>"
                               f"{_region_summary_line(r, cands[r['candidate']])}</summary>"
                               f"{_drawing_and_detail(r, cands[r['candidate']])}</details>")
        per = len(run.labels)
        gain = region_gain(cands, first + rest)
        caption = (f"<p class='caption'>Drawn: {_e(run.labels[0])}. The other {per - 1} layer"
                   f"{'s' if per > 2 else ''} of this group fused the same regions; each has its entry below."
                   f"</p>" if per > 1 else "")
        more = (f"<details class='members'><summary>The {len(rest)} regions of {_e(run.labels[1])} … "
                f"{_e(run.labels[-1])}</summary><div class='rlist'>{''.join(entries)}</div></details>"
                if entries else "")
        label = " ".join(run.labels).lower()   # the filter matches a run by its layers or by a region inside
        same = f" · {per} layers, same fusions in each" if per > 1 else ""
        groups.append(
            f"<details class='layer-run' id='{rid}' data-label='{_e(label)}'><summary><b>{_e(run.title)}</b>"
            f"<span class='muted'>{_e(same)}</span><span class='lk'>{_e(_fused_kinds(run.regions[run.labels[0]]))}"
            f"{' each' if per > 1 else ''}</span><span class='ggain'>gain {_us(gain)}</span></summary>"
            f"{caption}{cards}{more}</details>")
    return (f"<section id='regions'><h2>Fused regions, layer by layer <span class='h2n'>{_n(len(applied), 'region')}"
            f" in {_n(len(doc['layers']), 'layer')}</span></h2><p class='lead'>Each group is a run of consecutive "
            f"layers that fused the same regions (see the overview); open one for the drawings of its first layer "
            f"and an entry per region (names, shapes, modeled cost, check).</p>{REGION_LEGEND}"
            f"{_region_tools('regions')}{''.join(groups)}</section>")
