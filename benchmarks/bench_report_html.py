#!/usr/bin/env python3
"""Size and load time of the HTML report on deep models: BERT-base (12 layers) and a 32-layer decoder (Llama-7B
shape), the layer-by-layer page beside the flat one (every region drawn), in headless chromium.

Reproduce (from the repository root, in the venv; needs Debian's chromium, tools/install_test_browser.sh; writes
benchmarks/results/report_html.json)::

    python benchmarks/bench_report_html.py                 # both models, 3 page loads each
    python benchmarks/bench_report_html.py --case bert-base --loads 5

Models (benchmarks/bench_scale.py builds and caches them in benchmarks/.cache/): ``bert_base_ts17.onnx``
(``transformers.BertModel(BertConfig())``, TorchScript export, needs torch + transformers once) and
``llama7b.onnx`` (``tools/make_llm_graphs.py --preset 7b``: 32 layers, hidden 4096, sparse zero weights).

Method. ``npufuse report MODEL --format json --no-verify`` runs once as a subprocess (``report_s``: what a user
waits for, interpreter start-up included); the JSON document is then rendered here twice, as the page npufuse
writes (layer by layer) and as the flat page (the same document with its ``layers`` emptied, which is what a
model with fewer than 4 layers gets). Each page is loaded ``--loads`` times in a fresh chromium tab (one browser per
case); ``load_ms`` is the page's own Navigation Timing (navigation start to the end of the load event), median of
the loads. ``problems`` lists console errors and warnings, uncaught exceptions and CSP violations (must be empty).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from bench_scale import CACHE, _git, _machine, _versions, ensure_bert, ensure_llama  # noqa: E402
from headless_browser import Browser, chromium, load_page, page_problems  # noqa: E402

from npufuse.reporting.html import render_html  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "report_html.json"
CASES = {"bert-base": lambda cache: ensure_bert(cache), "decoder-32": lambda cache: ensure_llama("7b", cache)}

_FACTS = """JSON.stringify({
  layerGroups: document.querySelectorAll('#regions details.layer-run').length,
  stripCells: document.querySelectorAll('#overview .strip .cell').length,
  svgs: document.querySelectorAll('svg.region-svg').length,
  regions: document.querySelectorAll('[id^=region-]').length,
  height: document.documentElement.scrollHeight
})"""


def _load(exe: str, page: Path, loads: int) -> dict:
    browser = Browser(exe, tempfile.mkdtemp(prefix="npufuse-bench-chromium-"))
    times, facts = [], {}
    try:
        for _ in range(loads):
            s, ms = load_page(browser, page.as_uri())
            times.append(ms)
            facts = json.loads(browser.call("Runtime.evaluate", {"expression": _FACTS, "returnByValue": True},
                                            session=s)["result"]["value"])
        problems = page_problems(browser.events)
    finally:
        browser.close()
    return {"load_ms_median": round(statistics.median(times), 1), "load_ms": [round(t, 1) for t in times],
            "problems": problems, **facts}


def run_case(name: str, cache: Path, loads: int, exe: str, work: Path) -> dict:
    model = CASES[name](cache)
    doc_path = work / f"{name}.json"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "npufuse.cli", "report", str(model), "--format", "json", "--no-verify",
                    "-q", "-o", str(doc_path)], check=True, cwd=ROOT)
    report_s = time.perf_counter() - t0
    doc = json.loads(doc_path.read_text())
    out = {"model": model.name, "report_s": round(report_s, 2), "candidates": len(doc["candidates"]),
           "layers": len(doc.get("layers") or []), "layer_source": doc.get("layer_source"), "pages": {}}
    for page_name, d in (("layered", doc), ("flat", dict(doc, layers=[]))):
        t0 = time.perf_counter()
        html = render_html(d)
        render_s = time.perf_counter() - t0
        page = work / f"{name}-{page_name}.html"
        page.write_text(html, encoding="utf-8")
        out["pages"][page_name] = {"bytes": len(html.encode()), "render_s": round(render_s, 3),
                                   **_load(exe, page, loads)}
    lay, flat = out["pages"]["layered"], out["pages"]["flat"]
    out["layered_over_flat_bytes"] = round(lay["bytes"] / flat["bytes"], 3)
    print(f"{name}: {out['candidates']} candidates, {out['layers']} layers; report {out['report_s']} s; layered "
          f"{lay['bytes'] / 1e6:.2f} MB, load {lay['load_ms_median']} ms, {lay['layerGroups']} groups; flat "
          f"{flat['bytes'] / 1e6:.2f} MB, load {flat['load_ms_median']} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="default: all")
    ap.add_argument("--loads", type=int, default=3, help="page loads per page (median)")
    ap.add_argument("--cache", type=Path, default=CACHE, help="where the generated models live")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    exe = chromium()
    if exe is None:
        raise SystemExit("bench_report_html: no chromium here (tools/install_test_browser.sh)")
    args.cache.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="npufuse-bench-report-") as work:
        for name in args.case or sorted(CASES):
            results[name] = run_case(name, args.cache, args.loads, exe, Path(work))
    chromium_version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
    record = {"benchmark": "bench_report_html", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "git": _git(), "versions": _versions() | {"chromium": chromium_version}, "machine": _machine(),
              "loads": args.loads, "cases": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
