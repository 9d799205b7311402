"""Which fuse/skip decisions rest on a profile parameter that is only an assumption?

For each profile, every parameter whose [sources] entry says "assumption" is scaled down and up (x0.5, x2; the
Vector repeat costs as one group, since they share one guess), the fixtures are optimized again without
verification, and every candidate whose decision (fused, skipped by cost, infeasible) changes is listed with the
parameter that moved it. A decision that no assumption can flip within 2x rests on sourced or calibrated numbers.

    python tools/decision_sensitivity.py [--profile Ascend910B2 ...] [--set fixtures|all] [--margin F] [--sweep M1,M2]
                                         [--json OUT]

Run from the repository root; needs no torch. The recorded run is benchmarks/results/decision_sensitivity.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from npufuse.fusion.engine import OptimizeOptions, optimize  # noqa: E402
from npufuse.ir.modelio import load_model, model_dir  # noqa: E402
from npufuse.npu_model.spec import NpuSpec, load_profile  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures"
SCALES = (0.5, 2.0)


def fixture_paths(which: str) -> list[Path]:
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    keys = ["fixtures"] + (["llm_fixtures", "census_fixtures"] if which == "all" else [])
    names = [n if isinstance(n, str) else n["file"] for k in keys for n in manifest[k]]
    return [FIXTURES / n for n in names] + sorted((REPO / "examples").glob("*.onnx"))


def assumed_parameters(spec: NpuSpec) -> list[str]:
    """Source keys marked as assumptions, the Vector repeat costs folded into one 'vector.repeat_cost'."""
    keys = []
    for key, text in spec.sources:
        if not text.startswith("assumption"):
            continue
        key = "vector.repeat_cost" if key.startswith("vector.repeat_cost.") else key
        if key not in keys and _field_of(spec, key) is not None:
            keys.append(key)
    return keys


def _field_of(spec: NpuSpec, key: str) -> str | None:
    if key == "vector.repeat_cost":
        return "vector_repeat_cost"
    section, _, name = key.partition(".")
    names = {f.name for f in dataclasses.fields(spec)}
    for cand in (f"{section}_{name}", name):
        if cand in names:
            return cand
    return None


def scaled(spec: NpuSpec, key: str, factor: float) -> NpuSpec:
    field = _field_of(spec, key)
    value = getattr(spec, field)
    if field == "vector_repeat_cost":   # 'add' defines the unit (1 repeat); the guessed classes scale
        new = tuple((cls, cost if cls == "add" else cost * factor) for cls, cost in value)
    elif isinstance(value, bool) or value is None:
        return spec
    elif isinstance(value, int):
        new = max(1, int(round(value * factor)))
    else:
        new = value * factor
    return dataclasses.replace(spec, **{field: new})


def decisions(model, base: str, spec: NpuSpec, margin: float | None = None) -> dict[tuple, str]:
    res = optimize(model, base, OptimizeOptions(spec=spec, verify=False, margin=margin))
    return {(r.match.pattern, r.match.kind, r.match.nodes[0]): r.status for r in res.records}


def load_models(paths: list[Path]) -> list[tuple[str, object, str]]:
    """(file name, model, its folder) for each path, loaded once for every run over them."""
    return [(p.name, load_model(p), model_dir(p)) for p in paths]


def margin_sweep(profiles: list[str], margins: list[float], models: list[tuple[str, object, str]]) -> dict:
    """Per profile and margin, how many decisions differ from those taken at margin 0 (any gain fuses)."""
    out: dict = {}
    for name in profiles:
        spec = load_profile(name)
        at_zero = [decisions(m, d, spec, 0.0) for _, m, d in models]
        out[name] = {}
        for margin in margins:
            now = [decisions(m, d, spec, margin) for _, m, d in models]
            out[name][str(margin)] = sum(moved.get(cand) != status for moved, zero in zip(now, at_zero)
                                         for cand, status in zero.items())
    return out


def run(profiles: list[str], which: str = "fixtures", paths: list[Path] | None = None,
        margin: float | None = None, models: list[tuple[str, object, str]] | None = None) -> dict:
    """margin: the decisions' margin (None: npufuse's default); models: already loaded (load_models)."""
    models = models or load_models(paths or fixture_paths(which))
    out: dict = {"fixtures": [fx for fx, _, _ in models], "scales": list(SCALES), "margin": margin, "profiles": {}}
    for name in profiles:
        t0 = time.perf_counter()
        spec = load_profile(name)
        baseline = {fx: decisions(m, d, spec, margin) for fx, m, d in models}
        params = assumed_parameters(spec)
        flips: list[dict] = []
        for key in params:
            for factor in SCALES:
                variant = scaled(spec, key, factor)
                for fx, m, d in models:
                    now = decisions(m, d, variant, margin)
                    for cand, status in baseline[fx].items():
                        if now.get(cand, "absent") != status:
                            flips.append({"parameter": key, "factor": factor, "fixture": fx, "pattern": cand[0],
                                          "kind": cand[1], "node": cand[2], "baseline": status,
                                          "now": now.get(cand, "absent")})
        n_decisions = sum(len(b) for b in baseline.values())
        flipped = {(f["fixture"], f["pattern"], f["kind"], f["node"]) for f in flips}
        out["profiles"][name] = {
            "assumed_parameters": params,
            "calibrated": list(spec.calibration_info().get("parameters", [])),
            "decisions": n_decisions,
            "decisions_flipped_by_some_assumption": len(flipped),
            "flips_by_parameter": dict(Counter(f["parameter"] for f in flips)),
            "flips": flips,
            "elapsed_s": round(time.perf_counter() - t0, 1),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="append", help="profile(s) to test (default: Ascend910B2, Ascend310P3)")
    ap.add_argument("--set", choices=["fixtures", "all"], default="fixtures")
    ap.add_argument("--margin", type=float, help="the decisions' margin (default: npufuse's)")
    ap.add_argument("--sweep", type=lambda t: [float(x) for x in t.split(",")], metavar="M1,M2,...",
                    help="also count, per margin, the decisions that differ from margin 0's")
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args()
    models = load_models(fixture_paths(args.set))
    result = run(args.profile or ["Ascend910B2", "Ascend310P3"], margin=args.margin, models=models)
    result["command"] = "python tools/decision_sensitivity.py " + " ".join(sys.argv[1:])
    if args.sweep:
        result["margin_sweep"] = margin_sweep(list(result["profiles"]), args.sweep, models)
        for name, counts in result["margin_sweep"].items():
            print(f"{name}: decisions that differ from margin 0's: "
                  + ", ".join(f"margin {m}: {n}" for m, n in counts.items()))
    for name, r in result["profiles"].items():
        print(f"{name}: {r['decisions']} decisions on {len(result['fixtures'])} models; "
              f"{r['decisions_flipped_by_some_assumption']} flip when an assumption moves x0.5 or x2 "
              f"({', '.join(f'{k}: {v}' for k, v in r['flips_by_parameter'].items()) or 'none'}); "
              f"{r['elapsed_s']} s")
        for f in r["flips"][:40]:
            print(f"  {f['parameter']} x{f['factor']}: {f['fixture']} {f['kind']} at {f['node']}: "
                  f"{f['baseline']} -> {f['now']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
