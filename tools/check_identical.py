"""Record, or compare against a record, what npufuse makes of every shipped model: the optimized model's bytes,
the JSON report and the verification record, each as a sha256.

A restructuring that must not change behaviour (moving modules between packages, splitting files) is checked
with it: record before the move, compare after.

    python tools/check_identical.py record before.json        # on the tree before the change
    python tools/check_identical.py compare before.json       # after it: exit 1 on any difference

The report's `timings_s` (wall-clock seconds) is the one part that differs between two identical runs; it is left
out. Models: examples/*.onnx and tests/fixtures/**/*.onnx (optimized with verification on, seed 0, the default
target); a fixture npufuse refuses (exit 2) is recorded with its error line, so a changed refusal shows too.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def models() -> list[Path]:
    found = sorted((ROOT / "examples").glob("*.onnx")) + sorted((ROOT / "tests" / "fixtures").rglob("*.onnx"))
    return [p for p in found if "fuzz_regressions" not in p.parts]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(path: Path) -> dict[str, str]:
    """The sha256 of the optimized model, its report (less timings) and its verification record."""
    import npufuse
    from npufuse.errors import NpufuseError

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.onnx"
        rep = Path(tmp) / "report.json"
        try:
            npufuse.optimize(str(path), output=str(out), report=str(rep))
        except NpufuseError as exc:   # drift and refusals are outcomes too
            outcome = f"{type(exc).__name__}: {exc}"
        else:
            outcome = "ok"
        report = json.loads(rep.read_text()) if rep.is_file() else {}
        report.pop("timings_s", None)
        report["output"] = "OUT" if report.get("output") else report.get("output")   # a fresh temp folder each run
        verification = {"model_check": report.get("summary", {}).get("model_check"),
                        "checks": [f.get("check") for f in report.get("fusions", [])]}
        files = sorted(Path(tmp).iterdir())
        return {"outcome": outcome,
                "model": {f.name: _sha(f.read_bytes()) for f in files if f.name.startswith("out.onnx")},
                "report": _sha(json.dumps(report, sort_keys=True).encode()),
                "verification": _sha(json.dumps(verification, sort_keys=True, default=str).encode())}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("record", "compare"):
        print(__doc__.strip().splitlines()[0])
        print("usage: check_identical.py record|compare FILE.json")
        return 2
    mode, record = argv[0], Path(argv[1])
    got = {}
    os.chdir(ROOT)   # the report names the model as given: relative, so two checkouts compare alike
    for p in models():
        got[str(p.relative_to(ROOT))] = fingerprint(p.relative_to(ROOT))
        print(f"{p.relative_to(ROOT)}: {got[str(p.relative_to(ROOT))]['outcome']}", file=sys.stderr, flush=True)
    if mode == "record":
        record.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(got)} models in {record}")
        return 0
    want = json.loads(record.read_text())
    differ = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    for k in differ:
        print(f"DIFFERS {k}: {want.get(k)} -> {got.get(k)}")
    print(f"{len(got) - len(differ)} of {len(set(want) | set(got))} models identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
