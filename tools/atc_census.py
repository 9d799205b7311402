"""Every shipped model through `npufuse optimize --emit atc` (verification on): does the ATC form pass the
pre-check, which kernels does it reach through plugins, does it verify against the original.

    python tools/atc_census.py [--target Ascend910B2] [MODEL ...]     # default: examples/ and tests/fixtures/
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import npufuse
from npufuse.errors import NpufuseError

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    target = "Ascend910B2"
    if argv[:1] == ["--target"]:
        target, argv = argv[1], argv[2:]
    models = [Path(a) for a in argv] or sorted((ROOT / "examples").glob("*.onnx")) + sorted(
        p for p in (ROOT / "tests" / "fixtures").rglob("*.onnx") if "fuzz_regressions" not in p.parts)
    kernels: Counter = Counter()
    reasons: Counter = Counter()
    ok = failed = 0
    for p in models:
        try:
            r = npufuse.optimize(str(p), target=target, emit="atc")
        except NpufuseError as exc:
            failed += 1
            print(f"{p.name}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        ok += 1
        for reg in r.atc.regions:
            if reg.plugin:
                kernels[reg.kernel] += 1
            else:
                reasons[reg.reason] += 1
        worst = max((c.max_abs_err for c in r.atc_check.comparisons), default=0.0)
        print(f"{p.name}: {r.atc.summary_line()}; verified, worst abs {worst:.3g}")
    print(f"\n{ok} of {ok + failed} models written in the ATC form and verified on {target}")
    print("kernels through plugins:", dict(kernels.most_common()))
    print("regions left to ATC's passes, by reason:", dict(reasons.most_common()))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
