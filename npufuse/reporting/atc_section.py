"""The report's ATC-form block (`npufuse report --emit atc`, `optimize --emit atc --report`), as the renderers show
it: one summary line (kernels reached through plugins, regions left to ATC's passes) and one row per fused region
(the plugin node and CANN kernel it became, or the reason it stays standard ops)."""

from __future__ import annotations

from collections import Counter
from typing import Any

HEADERS = ["fused node", "npufuse op", "in the ATC form", "kernel or reason"]


def atc_summary(atc: dict[str, Any]) -> str:
    regions = atc.get("regions") or []
    plugins = Counter(r["kernel"] for r in regions if r.get("plugin"))
    standard = Counter(r["reason"] for r in regions if not r.get("plugin"))
    through = ", ".join(f"{n} {k}" for k, n in sorted(plugins.items())) or "none"
    left = ", ".join(f"{n} {k}" for k, n in sorted(standard.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"
    return (f"ATC form ({atc.get('form')}, opset {atc.get('opset')}, GE {atc.get('ge')}): kernels through plugins: "
            f"{through}; left to ATC's passes as standard ops: {left}")


def atc_rows(atc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in atc.get("regions") or []:
        if r.get("plugin"):
            rows.append([r["node"], r["op_type"], f"npu::{r['plugin']}", r["kernel"]])
        else:
            rows.append([r["node"], r["op_type"], "standard ops", f"{r['reason']}: {r.get('detail') or ''}"])
    return rows
