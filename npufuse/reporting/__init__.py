"""Fusion-opportunity reports: one document (schema `npufuse.report/1`), rendered as text, JSON, Markdown or
HTML (docs/report.md)."""

from __future__ import annotations

from typing import Any

from npufuse.console.jsontext import dumps_indented
from npufuse.reporting.document import REPORT_SCHEMA, build_report

REPORT_FORMATS = ("text", "json", "markdown", "html")


def render(doc: dict[str, Any], fmt: str) -> str:
    """The report document in one of REPORT_FORMATS. Names in it come from the model: control characters in
    them are escaped (JSON escapes its own; the other formats go through textsafe)."""
    if fmt == "json":
        return dumps_indented(doc)   # json.dumps(doc, indent=2)
    from npufuse.console.textsafe import safe_text

    return safe_text(_render_markup(doc, fmt))


def _render_markup(doc: dict[str, Any], fmt: str) -> str:
    if fmt == "text":
        from npufuse.reporting.text import render_text
        return render_text(doc)
    if fmt == "markdown":
        from npufuse.reporting.markdown import render_markdown
        return render_markdown(doc)
    if fmt == "html":
        from npufuse.reporting.html import render_html
        return render_html(doc)
    raise ValueError(f"unknown report format {fmt!r}; known: {', '.join(REPORT_FORMATS)}")


__all__ = ["REPORT_FORMATS", "REPORT_SCHEMA", "build_report", "render"]
