"""How a check result is shown: a compact table for people, JUnit XML for CI systems."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from npufuse.console.textsafe import safe_xml_text

if TYPE_CHECKING:
    from npufuse.guard.api import CheckResult


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return "0" if x == 0 else f"{x:.2e}"


def _where(idx: tuple[int, ...]) -> str:
    return "(" + ",".join(map(str, idx)) + ")" if idx else "-"


def text_report(result: CheckResult) -> str:
    """Per output: worst abs/rel error, where, the tolerance used, the smallest one that passes, verdict;
    then the culprits and notes."""
    stat = result.statistic + (f" q={result.quantile:g}" if result.quantile is not None else "")
    head = (f"npufuse check: {result.candidate} vs {result.reference} "
            f"(statistic {stat}{'' if result.seed is None else f', seed {result.seed}'})")
    cols = ["output", "worst abs", "worst rel", "where", "rtol/atol used", "min rtol", "min atol", "verdict"]
    rows = [[o.name, _num(o.max_abs_err), _num(o.max_rel_err), _where(o.worst_index),
             f"{o.rtol:.1e}/{o.atol:.1e}", _num(o.min_passing_rtol), _num(o.min_passing_atol),
             ("empty" if o.inconclusive else "ok") if o.ok else "INCONCLUSIVE" if o.inconclusive else "DRIFT"]
            for o in result.outputs]
    widths = [max(len(r[i]) for r in [cols, *rows]) for i in range(len(cols))]
    lines = [head, "  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for o in result.outputs:
        if not o.ok and o.detail:
            lines.append(f"  {o.name}: {o.detail}")
    if result.culprits:
        lines.append(f"culprits ({result.attribution}):")
        for c in result.culprits:
            tag = "confirmed" if c.confirmed else "unconfirmed"
            lines.append(f"  {c.node} [{c.pattern}, {tag}] replaced {', '.join(c.replaced)}: {c.evidence}")
    elif not result.ok and result.attribution:
        lines.append(f"culprits: none named ({result.attribution})")
    for n in result.notes:
        lines.append(f"note: {n}")
    bad = len(result.failed)
    if result.inconclusive:
        lines.append(f"INCONCLUSIVE: no output drifts, but {sum(o.inconclusive for o in result.outputs)} of "
                     f"{len(result.outputs)} output(s) could not be checked on these inputs")
    else:
        lines.append(f"PASS: {len(result.outputs)} output(s) within tolerance" if result.ok else
                     f"DRIFT: {bad} of {len(result.outputs)} output(s) outside tolerance")
    return "\n".join(lines)


def junit_xml(result: CheckResult) -> str:
    """One testsuite; one testcase per output and one per culprit, failures carrying the message."""
    suite = ET.Element("testsuite", name="npufuse.check")
    props = ET.SubElement(suite, "properties")
    for k, v in (("mode", result.mode), ("reference", result.reference), ("candidate", result.candidate),
                 ("statistic", result.statistic), ("quantile", result.quantile), ("seed", result.seed)):
        if v is not None:
            ET.SubElement(props, "property", name=k, value=str(v))
    failures = 0
    for o in result.outputs:
        case = ET.SubElement(suite, "testcase", classname="npufuse.check.output", name=o.name)
        if not o.ok:
            failures += 1
            msg = (f"{o.name} drifts: worst abs {_num(o.max_abs_err)}, worst rel {_num(o.max_rel_err)} at "
                   f"{_where(o.worst_index)}; passes at rtol >= {_num(o.min_passing_rtol)} or "
                   f"atol >= {_num(o.min_passing_atol)}")
            fail = ET.SubElement(case, "failure", message=msg, type="drift")
            fail.text = o.detail or msg
    for c in result.culprits:
        case = ET.SubElement(suite, "testcase", classname="npufuse.check.culprit", name=f"{c.node} [{c.pattern}]")
        failures += 1
        fail = ET.SubElement(case, "failure", type="culprit",
                             message=f"rewrite {c.pattern} at {c.node} (replaced {', '.join(c.replaced)}) "
                                     f"{'causes' if c.confirmed else 'may cause'} the drift")
        fail.text = c.evidence
    suite.set("tests", str(len(result.outputs) + len(result.culprits)))
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    suite.set("skipped", "0")
    out = ET.SubElement(suite, "system-out")
    out.text = text_report(result)
    root = ET.Element("testsuites", name="npufuse", tests=suite.get("tests"), failures=str(failures), errors="0")
    root.append(suite)
    ET.indent(root)
    # ElementTree writes control characters from a name raw, which XML 1.0 forbids: a CI system would reject
    # the whole file. The markup itself holds none, so escaping the finished text touches only names.
    return safe_xml_text('<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n")
