"""Inline SVG drawings of fusion regions for the HTML report.

A region is drawn as a small layered graph (Sugiyama style: longest-path layers, dummy points for long
edges, barycentre ordering, order-preserving least-squares placement): the boundary input values on top,
constants in a column on the left, the matched nodes inside a dashed frame (the region's boundary), the
boundary output values below it, and, to the right, the fused op the frame becomes. Every string from the
model is escaped; the drawing uses no external resource.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from typing import Any

from npufuse.reporting.dims import dims_text

CUBE_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "MatMulInteger", "QLinearMatMul", "QLinearConv",
            "Einsum"}
VIEW_OPS = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Shape", "Expand",
            "Concat", "Slice", "Gather", "Cast", "Split", "Dropout"}

NODE_H, PILL_H, LAYER_GAP, GAP_X, MARGIN = 40.0, 22.0, 30.0, 18.0, 10.0
FRAME_PAD, FUSED_GAP = 14.0, 64.0
MAX_CONST_PILLS = 8


def text_width(s: str, size: float, bold: bool = False) -> float:
    """A close-enough width of `s` in a DejaVu/Helvetica-like sans font (no font metrics at hand)."""
    w = 0.0
    for ch in s:
        if ch in "iljtfrI.,:;|!'()[]/ ":
            w += 0.33
        elif ch.isupper() or ch in "mwMW@%":
            w += 0.72
        elif ch.isdigit():
            w += 0.6
        else:
            w += 0.58
    return w * size * (1.07 if bold else 1.0)


def short_name(name: str, limit: int = 26) -> str:
    """The tail of a path-like ONNX name ('/m/encoder/layer.0/attention/self/Softmax' -> 'self/Softmax')."""
    if len(name) <= limit:
        return name
    parts = [p for p in name.split("/") if p]
    tail = "/".join(parts[-2:]) if len(parts) >= 2 else name
    if len(tail) > limit and len(parts) >= 1 and len(parts[-1]) <= limit:
        tail = parts[-1]
    if len(tail) > limit:
        tail = "…" + tail[-(limit - 1):]
    return tail


def node_class(op_type: str, made: bool) -> str:
    if made:
        return "made"
    base = op_type.split(".")[-1]
    if base in CUBE_OPS:
        return "cube"
    if base in VIEW_OPS:
        return "view"
    return "vec"


def shape_text(v: dict[str, Any]) -> str:
    """A region value's shape and dtype (`?×sequence×128 float32`), with the size the cost model priced a
    symbolic or unknown dim at: `(priced as 1×512×128)`."""
    text = f"{dims_text(v.get('shape'))} {v.get('dtype') or ''}".strip()
    if v.get("priced_shape") is not None:
        text += f" (priced as {dims_text(v['priced_shape'])})"
    return text


@dataclass
class _Item:
    key: str
    kind: str                 # in | const | node | out | dummy
    label: str = ""
    sub: str = ""
    title: str = ""
    css: str = ""
    w: float = 0.0
    h: float = 0.0
    layer: int = 0
    x: float = 0.0            # centre
    y: float = 0.0            # centre
    badge: int = 0            # constants read but not drawn
    preds: list[str] = field(default_factory=list)
    succs: list[str] = field(default_factory=list)


@dataclass
class _Edge:
    src: str
    dst: str
    css: str
    points: list[str] = field(default_factory=list)   # the keys it passes through, dummies included


def _isotonic(desired: list[float], widths: list[float], gap: float) -> list[float]:
    """Centres closest (least squares) to `desired` that keep the given order and do not overlap."""
    offsets = [0.0]
    for i in range(1, len(widths)):
        offsets.append(offsets[-1] + (widths[i - 1] + widths[i]) / 2 + gap)
    ys = [d - o for d, o in zip(desired, offsets)]
    blocks: list[list[float]] = []          # [mean, count]
    for y in ys:                            # pool adjacent violators: a non-decreasing fit
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    fit: list[float] = []
    for m, c in blocks:
        fit.extend([m] * int(c))
    return [f + o for f, o in zip(fit, offsets)]


def _crossings(layers: list[list[str]], items: dict[str, _Item]) -> int:
    total = 0
    for upper, lower in zip(layers, layers[1:]):
        pos = {k: i for i, k in enumerate(lower)}
        pairs = [(i, pos[s]) for i, k in enumerate(upper) for s in items[k].succs if s in pos]
        for a in range(len(pairs)):
            for b in range(a + 1, len(pairs)):
                if (pairs[a][0] - pairs[b][0]) * (pairs[a][1] - pairs[b][1]) < 0:
                    total += 1
    return total


def layout(region: dict[str, Any]) -> tuple[dict[str, _Item], list[_Edge], list[list[str]]]:
    """Items with positions, edges with their routes, and the layers (keys, left to right)."""
    nodes = region.get("nodes") or []
    in_info = {v["name"]: v for v in region.get("inputs") or []}
    out_info = {v["name"]: v for v in region.get("outputs") or []}
    items: dict[str, _Item] = {}
    producer: dict[str, str] = {}
    for i, n in enumerate(nodes):
        key = f"n{i}"
        made = n.get("from_region") is not None
        sub = f"from region #{n['from_region']}" if made else short_name(n["name"])
        op = n["op_type"]
        w = max(text_width(op, 12, True), text_width(sub, 10)) + 22
        items[key] = _Item(key, "node", op, sub, f"{op}  {n['name']}", node_class(op, made), max(w, 72.0), NODE_H)
        for v in n.get("outputs") or []:
            producer.setdefault(v, key)

    edges: list[_Edge] = []
    used_inputs: list[str] = []
    for i, n in enumerate(nodes):
        for v in dict.fromkeys(n.get("inputs") or []):
            if v in producer and producer[v] != f"n{i}":
                edges.append(_Edge(producer[v], f"n{i}", "e-int"))
            elif v in in_info:
                if v not in used_inputs:
                    used_inputs.append(v)
                kind = "const" if in_info[v].get("constant") else "in"
                edges.append(_Edge(f"{kind}:{v}", f"n{i}", f"e-{kind}"))
    # Many constants (shape arithmetic of an exported attention) would bury the drawing: past a handful, each
    # node shows how many it reads instead, and the table beside the drawing lists them.
    n_const = sum(1 for v in used_inputs if in_info[v].get("constant"))
    if n_const > MAX_CONST_PILLS:
        for e in [e for e in edges if e.src.startswith("const:")]:
            items[e.dst].badge += 1
        edges = [e for e in edges if not e.src.startswith("const:")]
        used_inputs = [v for v in used_inputs if not in_info[v].get("constant")]
    for v in used_inputs:
        info = in_info[v]
        kind = "const" if info.get("constant") else "in"
        label = short_name(v, 22 if kind == "const" else 28)
        items[f"{kind}:{v}"] = _Item(f"{kind}:{v}", kind, label, "", f"{v}  [{shape_text(info)}]",
                                     kind, text_width(label, 10.5) + 20, PILL_H)
    for v, info in out_info.items():
        if v in producer:
            label = short_name(v, 28)
            items[f"out:{v}"] = _Item(f"out:{v}", "out", label, "", f"{v}  [{shape_text(info)}]", "out",
                                      text_width(label, 10.5) + 20, PILL_H)
            edges.append(_Edge(producer[v], f"out:{v}", "e-out"))

    # Longest-path layers: inputs on 0, nodes from 1, outputs one below the deepest node.
    for key in items:
        if items[key].kind == "node":
            items[key].layer = 1
    for _ in range(len(nodes) + 1):
        changed = False
        for e in edges:
            a, b = items[e.src], items[e.dst]
            if a.kind == "node" and b.kind == "node" and b.layer < a.layer + 1:
                b.layer, changed = a.layer + 1, True
        if not changed:
            break
    depth = max((it.layer for it in items.values() if it.kind == "node"), default=0)
    for it in items.values():
        if it.kind == "out":
            it.layer = depth + 1

    # Constants sit in a side column; everything else is layered, long edges through dummy points.
    layered = [e for e in edges if items[e.src].kind != "const"]
    for e in layered:
        a, b = items[e.src], items[e.dst]
        prev = e.src
        e.points = [e.src]
        for layer in range(a.layer + 1, b.layer):
            d = f"d{len(items)}"
            items[d] = _Item(d, "dummy", layer=layer, w=2.0)
            items[prev].succs.append(d)
            items[d].preds.append(prev)
            e.points.append(d)
            prev = d
        items[prev].succs.append(e.dst)
        items[e.dst].preds.append(prev)
        e.points.append(e.dst)
    for e in edges:
        if items[e.src].kind == "const":
            e.points = [e.src, e.dst]

    n_layers = depth + 2
    layers: list[list[str]] = [[] for _ in range(n_layers)]
    for key, it in items.items():
        if it.kind != "const":
            layers[it.layer].append(key)
    _order(layers, items)
    _place(layers, items)
    return items, edges, layers


def _order(layers: list[list[str]], items: dict[str, _Item]) -> None:
    """Barycentre sweeps, down and up, keeping the ordering with the fewest crossings."""
    best = [list(layer) for layer in layers]
    best_x = _crossings(layers, items)
    for sweep in range(8):
        down = sweep % 2 == 0
        rng = range(1, len(layers)) if down else range(len(layers) - 2, -1, -1)
        for li in rng:
            ref = layers[li - 1] if down else layers[li + 1]
            pos = {k: i for i, k in enumerate(ref)}

            def bary(key: str, old: int) -> float:
                nb = items[key].preds if down else items[key].succs
                ps = [pos[k] for k in nb if k in pos]
                return sum(ps) / len(ps) if ps else float(old)

            layers[li] = [k for _, _, k in sorted((bary(k, i), i, k) for i, k in enumerate(layers[li]))]
        c = _crossings(layers, items)
        if c < best_x:
            best, best_x = [list(layer) for layer in layers], c
    layers[:] = best


def _place(layers: list[list[str]], items: dict[str, _Item]) -> None:
    for layer in layers:
        x = 0.0
        for k in layer:
            it = items[k]
            it.x = x + it.w / 2
            x += it.w + GAP_X
        shift = x / 2
        for k in layer:
            items[k].x -= shift
    for sweep in range(10):
        down = sweep % 2 == 0
        rng = range(1, len(layers)) if down else range(len(layers) - 2, -1, -1)
        for li in rng:
            layer = layers[li]
            desired = []
            for k in layer:
                nb = items[k].preds if down else items[k].succs
                xs = [items[n].x for n in nb]
                desired.append(sum(xs) / len(xs) if xs else items[k].x)
            gaps = [items[k].w for k in layer]
            for k, x in zip(layer, _isotonic(desired, gaps, GAP_X)):
                items[k].x = x
    y = 0.0
    for layer in layers:
        h = max((items[k].h for k in layer), default=0.0)
        for k in layer:
            items[k].y = y + h / 2
        y += h + LAYER_GAP


def _path(points: list[tuple[float, float]]) -> str:
    """A smooth path through the points, vertical tangents at each (edges run top to bottom)."""
    (x0, y0), rest = points[0], points[1:]
    d = [f"M{x0:.1f},{y0:.1f}"]
    for x1, y1 in rest:
        dy = (y1 - y0) * 0.5
        d.append(f"C{x0:.1f},{y0 + dy:.1f} {x1:.1f},{y1 - dy:.1f} {x1:.1f},{y1:.1f}")
        x0, y0 = x1, y1
    return " ".join(d)


def region_svg(region: dict[str, Any], uid: str, fused_label: str, fused_lines: list[str],
               status: str = "applied") -> str:
    """The drawing of one region as an inline <svg> element (unique marker ids from `uid`)."""
    items, edges, layers = layout(region)
    consts = [it for it in items.values() if it.kind == "const"]
    const_w = max((c.w for c in consts), default=0.0)
    left_col = const_w + 36 if consts else 0.0

    core = [it for it in items.values() if it.kind != "const"]
    min_x = min((it.x - it.w / 2 for it in core), default=0.0)
    dx = MARGIN + left_col + FRAME_PAD - min_x
    dy = MARGIN + 4.0
    for it in core:
        it.x += dx
        it.y += dy

    inner = [it for it in core if it.kind in ("node", "dummy") and 1 <= it.layer]
    inner = [it for it in inner if it.layer <= max((n.layer for n in core if n.kind == "node"), default=0)]
    fx0 = min((it.x - it.w / 2 for it in inner), default=MARGIN + left_col) - FRAME_PAD
    fx1 = max((it.x + it.w / 2 for it in inner), default=fx0 + 60) + FRAME_PAD
    fy0 = min((it.y - it.h / 2 for it in inner), default=dy) - FRAME_PAD
    fy1 = max((it.y + it.h / 2 for it in inner), default=fy0 + 40) + FRAME_PAD

    # Constants: a column left of the frame, each near the node that reads it, never overlapping.
    readers: dict[str, list[str]] = {}
    for e in edges:
        if items[e.src].kind == "const":
            readers.setdefault(e.src, []).append(e.dst)
    placed = sorted(consts, key=lambda c: (min(items[r].y for r in readers[c.key]),
                                           min(items[r].x for r in readers[c.key])))
    y_next = dy + PILL_H / 2
    for c in placed:
        want = min(items[r].y for r in readers[c.key])
        c.y = max(want, y_next)
        c.x = MARGIN + const_w / 2
        y_next = c.y + PILL_H + 6

    # The fused op, right of the frame.
    fw = max([text_width(fused_label, 13, True)] + [text_width(s, 10.5) for s in fused_lines]) + 28
    fh = 30 + 15 * len(fused_lines)
    fcy = (fy0 + fy1) / 2
    # Right of the frame and of anything drawn at the fused op's height (wide rows of inputs above it).
    beside = [it.x + it.w / 2 for it in core if it.kind != "dummy" and abs(it.y - fcy) < fh / 2 + it.h / 2 + 8]
    fcx = max([fx1] + beside) + FUSED_GAP + fw / 2
    width = max([fcx + fw / 2] + [it.x + it.w / 2 for it in core]) + MARGIN
    height = max([it.y + it.h / 2 for it in items.values()] + [fy1, fcy + fh / 2]) + MARGIN

    out = [f'<svg class="region-svg" viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
           f'height="{height:.0f}" role="img" aria-label="{escape(fused_label)} region drawing">',
           "<defs>"]
    for name, color in (("int", "#7a818c"), ("in", "#2f6fd6"), ("const", "#9aa0a6"), ("out", "#1e8e4f"),
                        ("fuse", "#5b3cc4")):
        out.append(f'<marker id="ah-{uid}-{name}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                   f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
                   f'fill="{color}"/></marker>')
    out.append("</defs>")
    frame_cls = "frame" if status == "applied" else "frame frame-off"
    out.append(f'<rect class="{frame_cls}" x="{fx0:.1f}" y="{fy0:.1f}" width="{fx1 - fx0:.1f}" '
               f'height="{fy1 - fy0:.1f}" rx="10"/>')

    for e in edges:
        kind = e.css.split("-")[1]
        if items[e.src].kind == "const":
            s, t = items[e.src], items[e.dst]
            x0, y0 = s.x + s.w / 2, s.y
            x1, y1 = t.x - t.w / 2, t.y
            mx = (x0 + x1) / 2
            d = f"M{x0:.1f},{y0:.1f} C{mx:.1f},{y0:.1f} {mx:.1f},{y1:.1f} {x1 - 2:.1f},{y1:.1f}"
        else:
            pts = []
            for i, k in enumerate(e.points):
                it = items[k]
                if i == 0:
                    pts.append((it.x, it.y + it.h / 2))
                elif i == len(e.points) - 1:
                    pts.append((it.x, it.y - it.h / 2 - 2))
                else:
                    pts.append((it.x, it.y))
            d = _path(pts)
        out.append(f'<path class="edge {e.css}" d="{d}" marker-end="url(#ah-{uid}-{kind})"/>')

    for it in items.values():
        if it.kind == "dummy":
            continue
        x, y, w, h = it.x - it.w / 2, it.y - it.h / 2, it.w, it.h
        out.append(f'<g class="it {it.css}"><title>{escape(it.title)}</title>')
        if it.kind == "node":
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="5"/>')
            out.append(f'<text class="op" x="{it.x:.1f}" y="{y + 16:.1f}">{escape(it.label)}</text>')
            out.append(f'<text class="nm" x="{it.x:.1f}" y="{y + 31:.1f}">{escape(it.sub)}</text>')
            if it.badge:
                label = f"+{it.badge} const"
                bw = text_width(label, 8.5) + 8
                out.append(f'<rect class="badge" x="{x + w - bw + 4:.1f}" y="{y - 6:.1f}" width="{bw:.1f}" '
                           f'height="12" rx="6"/><text class="bdg" x="{x + w - bw / 2 + 4:.1f}" y="{y + 3:.1f}">'
                           f'{label}</text>')
        else:
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{h / 2:.1f}"/>')
            out.append(f'<text class="val" x="{it.x:.1f}" y="{it.y + 3.8:.1f}">{escape(it.label)}</text>')
        out.append("</g>")

    # The arrow from the frame to the fused op, and the fused op itself.
    ax0, ax1 = fx1 + 6, fcx - fw / 2 - 6
    out.append(f'<path class="edge e-fuse" d="M{ax0:.1f},{fcy:.1f} L{ax1:.1f},{fcy:.1f}" '
               f'marker-end="url(#ah-{uid}-fuse)"/>')
    arrow_word = "fused" if status == "applied" else "not fused"
    out.append(f'<text class="fuse-word" x="{(ax0 + ax1) / 2:.1f}" y="{fcy - 6:.1f}">{arrow_word}</text>')
    fused_cls = "fused" if status == "applied" else "fused fused-off"
    out.append(f'<g class="{fused_cls}"><title>{escape(fused_label)}</title>'
               f'<rect x="{fcx - fw / 2:.1f}" y="{fcy - fh / 2:.1f}" width="{fw:.1f}" height="{fh:.1f}" rx="7"/>'
               f'<text class="fop" x="{fcx:.1f}" y="{fcy - fh / 2 + 20:.1f}">{escape(fused_label)}</text>')
    for i, line in enumerate(fused_lines):
        out.append(f'<text class="fattr" x="{fcx:.1f}" y="{fcy - fh / 2 + 37 + 15 * i:.1f}">{escape(line)}</text>')
    out.append("</g></svg>")
    return "".join(out)
