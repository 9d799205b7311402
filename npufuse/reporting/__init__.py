"""Fusion-opportunity reports: one document (schema `npufuse.report/1`), rendered as text, JSON, ..."""

from npufuse.reporting.document import REPORT_SCHEMA, build_report

__all__ = ["REPORT_SCHEMA", "build_report"]
