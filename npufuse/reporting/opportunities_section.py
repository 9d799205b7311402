"""The report's kernel opportunities (fusion.opportunities) as the renderers show them: one row per kernel
signature, ranked by modeled gain over the model, and one per region left out because it would not fit or pay."""

from __future__ import annotations

from typing import Any

HEADERS = ["#", "kernel that would fuse", "regions", "gain µs", "% of model", "shapes seen", "tile", "why no kernel"]
LEFT_OUT_HEADERS = ["candidate", "first node", "why it is no opportunity"]


def _shape(t: dict[str, Any] | None) -> str:
    if not t or t.get("shape") is None:
        return "?"
    return "x".join("?" if d is None else str(d) for d in t["shape"])


def shapes_seen(opp: dict[str, Any]) -> str:
    """The distinct shapes of the regions' first input (the activation the kernel streams)."""
    seen: list[str] = []
    for r in opp["regions"]:
        values = r.get("values") or {}
        first = next(iter(values.values()), None)
        s = _shape(first)
        if s not in seen:
            seen.append(s)
    return ", ".join(seen)


def opportunity_rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for i, o in enumerate((doc.get("opportunities") or {}).get("kernels") or [], 1):
        pct = o.get("gain_pct_of_model")
        rows.append([str(i), o["signature"], str(o["count"]), f"{o['gain_us']:.2f}",
                     "–" if pct is None else f"{pct:.1f}%", shapes_seen(o), o["regions"][0]["tile"],
                     o["unsupported"]])
    return rows


def left_out_rows(doc: dict[str, Any]) -> list[list[str]]:
    return [[str(r["candidate"]), r["nodes"][0] if r["nodes"] else "", r.get("why_not", "")]
            for r in (doc.get("opportunities") or {}).get("left_out") or []]


def opportunities_summary(doc: dict[str, Any]) -> str:
    opp = doc.get("opportunities") or {}
    kernels, left = opp.get("kernels") or [], opp.get("left_out") or []
    if not kernels and not left:
        return "kernel opportunities: none (no candidate was refused for want of a kernel)"
    gain = sum(o["gain_us"] for o in kernels)
    return (f"kernel opportunities: {len(kernels)} kernel{'s' if len(kernels) != 1 else ''} no shipped kernel "
            f"covers would save {gain:.1f} µs modeled ({sum(o['count'] for o in kernels)} regions); "
            f"{len(left)} region{'s' if len(left) != 1 else ''} refused for want of a kernel would not fit or pay")
