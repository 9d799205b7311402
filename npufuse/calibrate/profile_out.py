"""The calibrated profile: the input profile's text with the fitted terms set, a [calibration] table (what was
fitted, against what, how well it predicts models it never saw) and a "calibrated: ..." source for each term.

The input's text is edited line by line (its comments and order stay); the result is parsed back with the profile
loader before it is written, so a profile `npufuse calibrate` writes always loads.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from pathlib import Path

from npufuse import __version__
from npufuse.calibrate.run import Calibration

_HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")


def _num(v: float) -> str:
    text = repr(float(f"{v:.6g}"))
    return text


def _section_span(lines: list[str], section: str) -> tuple[int, int] | None:
    """(header index, end index exclusive) of a [section] table, None where there is none."""
    start = None
    for i, line in enumerate(lines):
        m = _HEADER.match(line)
        if m and start is None and m.group(1) == section:
            start = i
        elif m and start is not None:
            return start, i
    return (start, len(lines)) if start is not None else None


def _set(lines: list[str], section: str, key: str, value: str, comment: str = "") -> None:
    """Set `key = value` in [section] (replacing the key's line, or right after the header; a new table at the end)."""
    line = f"{key} = {value}" + (f"  # {comment}" if comment else "")
    span = _section_span(lines, section)
    if span is None:
        lines += ["", f"[{section}]", line]
        return
    start, end = span
    pat = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for i in range(start + 1, end):
        if pat.match(lines[i]):
            lines[i] = line
            return
    lines.insert(start + 1, line)


def _drop(lines: list[str], section: str) -> None:
    span = _section_span(lines, section)
    if span is not None:
        del lines[span[0]:span[1]]


def strip_calibration(text: str) -> tuple[str, list[str]]:
    """The profile text without what an earlier calibration wrote (its [calibration] table, the terms it lists and
    their "calibrated: ..." sources), and those terms: a calibration always starts from the physics."""
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    doc = tomllib.loads(text)
    keys = [str(k) for k in (doc.get("calibration") or {}).get("parameters", [])]
    lines = text.rstrip("\n").split("\n")
    _drop(lines, "calibration")
    for key in keys:
        section, _, leaf = key.rpartition(".")
        for sec, name in ((section, leaf), ("sources", json.dumps(key))):
            span = _section_span(lines, sec)
            if span is None:
                continue
            pat = re.compile(rf"^\s*{re.escape(name)}\s*=")
            for i in range(span[1] - 1, span[0], -1):
                if pat.match(lines[i]):
                    del lines[i]
    return "\n".join(lines) + "\n", keys


def profile_text(profile_text_in: str, cal: Calibration, data_names: list[str], disabled: tuple[str, ...] = (),
                 today: str | None = None) -> str:
    """The calibrated profile's TOML text."""
    date = today or _dt.date.today().isoformat()
    lines = profile_text_in.rstrip("\n").split("\n")
    _drop(lines, "calibration")
    lomo_n = sum(1 for t in cal.table if t.status == "lomo")
    against = (f"{', '.join(data_names)} ({cal.rows_used} rows, {cal.models} models); leave-one-model-out median "
               f"|error| {cal.lomo_median_abs_error_pct:.1f}% over {lomo_n} figures; {date}")
    for key, value in cal.fit.values.items():
        section, _, leaf = key.rpartition(".")
        _set(lines, section, leaf, _num(value), "calibrated (see [calibration])")
        _set(lines, "sources", json.dumps(key), json.dumps(f"calibrated: npufuse calibrate on {against}"))
    values = ", ".join(f"{json.dumps(k)} = {_num(v)}" for k, v in cal.fit.values.items())
    table = [
        "",
        "[calibration]   # written by `npufuse calibrate`; docs/calibration.md",
        f"parameters = {json.dumps(list(cal.fit.values))}",
        f"values = {{ {values} }}",
        f"not_identified = {json.dumps(list(cal.fit.not_identified))}",
        f"data = {json.dumps(data_names)}",
        f"data_sha256 = {json.dumps([f.sha256 for f in cal.files])}",
        f"rows_used = {cal.rows_used}",
        f"models = {cal.models}",
        f"rows = {json.dumps(cal.rows_kind)}",
        f"lomo_figures = {lomo_n}",
        f"lomo_median_abs_error_pct = {round(cal.lomo_median_abs_error_pct, 2)}",
        f"uncalibrated_median_abs_error_pct = {round(cal.before_median_abs_error_pct, 2)}",
        *([f"lofo_median_abs_error_pct = {round(cal.lofo_median_abs_error_pct, 2)}",
           "lofo_by_class = { " + ", ".join(f"{k} = {round(v, 2)}" for k, v in cal.lofo_by_class.items()) + " }"]
          if cal.lofo_by_class else []),
        f"disabled_patterns = {json.dumps(list(disabled))}",
        f"date = {json.dumps(date)}",
        f"npufuse_version = {json.dumps(__version__)}",
    ]
    return "\n".join(lines + table) + "\n"


def data_name(path: str) -> str:
    """How a data file is named in the profile: relative to the package root for the shipped data, else as given."""
    p = Path(path).resolve()
    root = Path(__file__).resolve().parent.parent.parent
    try:
        return p.relative_to(root).as_posix()
    except ValueError:
        return str(path)
