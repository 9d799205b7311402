"""Differential fuzzer: random graphs of every fusion family, optimized in-process, run against the original.

    python tools/fuzz.py --seed 0 --count 2000 --out fuzz-out [--family attention] [--summary fuzz-out/summary.json]

Each case (seed, index) is drawn reproducibly: a family (round robin), an opset in 11..23 where the family's ops
exist, a dtype (fp32, fp16, bf16 where the family's ops allow), random shapes and exporter forms, and sometimes a
near-miss perturbation. npufuse optimizes it twice with force_fuse (so the cost model hides no rewrite): with
verification and without. Each result must pass onnx.checker (full_check), leave the input untouched, and run on
onnxruntime like the original at two sizes of the symbolic dims; a perturbed graph must not get its family's
fusion. One outcome per case, the worst it showed (see OUTCOMES); failures are saved under --out as
`<family>/<index>.onnx` + `<family>/<index>.json` (seed, family, opset, dtype, perturbation, outcome, message,
traceback). `--replay DIR/<family>/<index>.json` runs one saved case again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's npufuse, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_graphs import FAMILIES, Builder, Unbuildable  # noqa: E402

from npufuse.errors import InputError  # noqa: E402
from npufuse.fusion.engine import OptimizeOptions, optimize  # noqa: E402
from npufuse.ir.runtime import session  # noqa: E402
from npufuse.verify.compare import Tolerance, compare  # noqa: E402

# Worst first: a case's outcome is the first of these it showed.
OUTCOMES = ("crash", "invalid-model", "wrong-output", "near-miss-violated", "input-modified", "refused",
            "false-drift", "inconclusive", "original-unrunnable", "ok")
FAILURES = OUTCOMES[:7]
OPSETS = range(11, 24)
DTYPE_WEIGHTS = {"fp32": 0.6, "fp16": 0.3, "bf16": 0.1}
PERTURB_RATE = 0.35
BUILD_ATTEMPTS = 8
# The family's own pattern(s): how often an unperturbed case got it (coverage of the generators).
TARGETS = {"conv_bn_act": ("conv_bn_act",), "conv_residual": ("conv_bn_act",), "gemm_bn": ("gemm_bn",),
           "matmul_epilogue": ("matmul_epilogue",), "layernorm": ("layernorm",), "rmsnorm": ("rmsnorm",),
           "gelu": ("gelu",), "add_norm": ("add_layernorm", "add_rmsnorm"), "attention": ("attention",),
           "rotary": ("rotary",), "rotary_pair": ("rotary_pair",), "gated_mlp": ("gated_mlp",),
           "mla_prolog": ("mla_prolog",)}
NUMPY_OF = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
            onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.INT64: np.int64, onnx.TensorProto.BOOL: np.bool_}


@dataclass
class Case:
    seed: int
    index: int
    family: str
    opset: int
    dtype: str
    perturbation: str | None
    attempt: int = 0


@dataclass
class Outcome:
    case: Case
    outcome: str
    message: str = ""
    traceback: str = ""
    fused: list[str] = field(default_factory=list)      # kinds applied without verification
    target_fused: bool = False
    model: onnx.ModelProto | None = None

    def to_dict(self) -> dict:
        return asdict(self.case) | {"outcome": self.outcome, "message": self.message, "traceback": self.traceback,
                                    "fused": self.fused, "target_fused": self.target_fused}


# ---- drawing a case ----------------------------------------------------------------------------------------

def draw(seed: int, index: int, families: list[str], opsets: list[int] | None = None,
         dtypes: list[str] | None = None) -> tuple[Case, onnx.ModelProto, dict[str, str]]:
    """The case `index` of `seed`: the same graph on every run and machine (numpy's PCG64 is portable).
    `opsets` / `dtypes` narrow the draw (a sub-slice: one opset, one dtype)."""
    name = families[index % len(families)]
    fam = FAMILIES[name]
    last = None
    for attempt in range(BUILD_ATTEMPTS):
        rng = np.random.default_rng([seed, index, attempt, 0])
        allowed = [o for o in (opsets or OPSETS) if o >= fam.min_opset]
        opset = int(allowed[int(rng.integers(len(allowed)))])
        kinds = [d for d in DTYPE_WEIGHTS if d in fam.dtypes and (dtypes is None or d in dtypes)]
        if not allowed or not kinds:
            raise ValueError(f"family {name} has no opset in {opsets} or dtype in {dtypes}")
        w = np.array([DTYPE_WEIGHTS[d] for d in kinds])
        dtype = kinds[int(rng.choice(len(kinds), p=w / w.sum()))]
        perturbs = sorted(fam.perturbations)
        perturb = perturbs[int(rng.integers(len(perturbs)))] if perturbs and rng.random() < PERTURB_RATE else None
        case = Case(seed, index, name, opset, dtype, perturb, attempt)
        try:
            return case, *build(case)
        except Unbuildable as exc:
            last = exc
    raise Unbuildable(f"case {index} of family {name}: no buildable draw in {BUILD_ATTEMPTS} attempts ({last})")


def build(case: Case) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The graph of a drawn case; its own random stream, so that a saved case rebuilds from its json alone."""
    b = Builder(case.opset, case.dtype, np.random.default_rng([case.seed, case.index, case.attempt, 1]))
    FAMILIES[case.family].build(b, case.perturbation)
    return b.model(), b.feed_kind


def replay_case(doc: dict) -> tuple[Case, onnx.ModelProto, dict[str, str]]:
    case = Case(doc["seed"], doc["index"], doc["family"], doc["opset"], doc["dtype"], doc["perturbation"],
                doc.get("attempt", 0))
    return case, *build(case)


# ---- inputs -------------------------------------------------------------------------------------------------

def dim_assignments(model: onnx.ModelProto, rng: np.random.Generator, n: int = 2) -> list[dict[str, int]]:
    """`n` different values for the symbolic dims (the first is what npufuse verifies with)."""
    declared = {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param}
    names = sorted(declared - {"total"})
    out = []
    for k in range(n):
        dims = {nm: int(rng.integers(1, 6)) if k else int(rng.integers(2, 5)) for nm in names}
        if "total" in declared:    # the attention mask covers the cache and the new keys
            dims["total"] = dims["past"] + dims["seq"]
        out.append(dims)
    return out


def feeds_for(model: onnx.ModelProto, kinds: dict[str, str], dims: dict[str, int],
              rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {}
    for i in model.graph.input:
        tt = i.type.tensor_type
        shape = [d.dim_value if not d.dim_param else dims[d.dim_param] for d in tt.shape.dim]
        kind = kinds.get(i.name, "normal")
        if kind == "positions":
            feeds[i.name] = np.arange(3, 3 + shape[0], dtype=np.int64)
        elif kind in ("mask01", "bool"):
            keep = rng.random(shape) < 0.7
            keep[..., 0] = True            # one key always visible: a fully masked row is NaN by definition
            feeds[i.name] = keep if kind == "bool" else keep.astype(np.int64)
        elif kind == "mask_add":
            feeds[i.name] = np.where(rng.random(shape) < 0.7, 0.0, -1e4).astype(NUMPY_OF[tt.elem_type])
        elif tt.elem_type == onnx.TensorProto.BFLOAT16:   # numpy's bfloat16 is ml_dtypes' (an onnx dependency)
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32).astype(
                onnx.helper.tensor_dtype_to_np_dtype(onnx.TensorProto.BFLOAT16))
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(NUMPY_OF[tt.elem_type])
    return feeds


class Runner:
    """onnxruntime sessions, one per distinct model, reused across sizes."""

    def __init__(self) -> None:
        self.cache: dict[bytes, object] = {}

    def run(self, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        key = model.SerializeToString(deterministic=True)
        sess = self.cache.get(key)
        if sess is None:
            sess = self.cache[key] = session(model)
        names = [o.name for o in sess.get_outputs()]
        return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items()
                                                 if k in {i.name for i in sess.get_inputs()}})))


# ---- one case -----------------------------------------------------------------------------------------------

def evaluate(case: Case, model: onnx.ModelProto, kinds: dict[str, str]) -> Outcome:
    found: list[tuple[str, str, str]] = []     # (outcome, message, traceback)
    rng = np.random.default_rng([case.seed, case.index, 1 << 20])
    dims_list = dim_assignments(model, rng)
    runner = Runner()
    refs: list[tuple[dict, dict]] = []
    try:
        onnx.checker.check_model(model, full_check=True)
        for dims in dims_list:
            feeds = feeds_for(model, kinds, dims, rng)
            if not feeds and model.graph.input:
                raise RuntimeError("bf16 inputs: no numpy reference")
            refs.append((feeds, runner.run(model, feeds)))
    except Exception as exc:
        found.append(("original-unrunnable", _first_line(exc), ""))
        refs = []
    original_bytes = model.SerializeToString(deterministic=True)
    fused: list[str] = []
    target_fused = False
    forbidden = FAMILIES[case.family].perturbations.get(case.perturbation) if case.perturbation else None
    drift_reported, drift_reason = False, ""
    no_verify_matches = None      # True: the fused model ran like the original (or nothing fused)
    inconclusive = False
    for verify in (True, False):
        mode = "verify" if verify else "no-verify"
        opts = OptimizeOptions(force_fuse=True, verify=verify, dims=dims_list[0] if dims_list else None, seed=case.index)
        try:
            res = optimize(model, None, opts)
        except InputError as exc:
            found.append(("refused", f"{mode}: {_first_line(exc)}", ""))
            continue
        except AssertionError as exc:
            kind = "invalid-model" if "produced an invalid model" in str(exc) else "crash"
            found.append((kind, f"{mode}: {_first_line(exc)}", traceback.format_exc()))
            continue
        except Exception as exc:  # a crash is what this looks for
            found.append(("crash", f"{mode}: {type(exc).__name__}: {_first_line(exc)}", traceback.format_exc()))
            continue
        if model.SerializeToString(deterministic=True) != original_bytes:
            found.append(("input-modified", f"{mode}: optimize changed its input model", ""))
        applied = [(r.match.pattern, r.match.kind) for r in res.applied]
        if not verify:
            fused = [k for _, k in applied]
            target_fused = any(p in TARGETS[case.family] for p, _ in applied)
        if forbidden is not None:
            bad = [k for p, k in applied if forbidden.forbidden(p, k)]
            if bad:
                found.append(("near-miss-violated", f"{mode}: {case.perturbation} fused as {', '.join(bad)}", ""))
        if verify and res.inconclusive:   # npufuse said it could not verify (the reference is NaN/inf): honest
            found.append(("inconclusive", f"{mode}: npufuse: {res.model_check.reason[:150]}", ""))
        elif verify and not res.ok:
            drift_reported = True
            drift_reason = res.model_check.reason if res.model_check is not None else ""
        if not applied:
            if not verify:
                no_verify_matches = True
            continue
        try:
            onnx.checker.check_model(res.model, full_check=True)
        except Exception as exc:
            found.append(("invalid-model", f"{mode}: checker: {_first_line(exc)}", ""))
            continue
        if not refs:
            continue
        wrong = None
        for feeds, want in refs:
            try:
                got = runner.run(res.model, feeds)
            except Exception as exc:
                found.append(("invalid-model", f"{mode}: onnxruntime cannot run it: {_first_line(exc)}", ""))
                wrong = "unrunnable"
                break
            wrong = _compare(got, want, feeds)
            if wrong is not None:
                break
        if wrong is None:
            if not verify:
                no_verify_matches = True
        elif wrong.startswith("inconclusive"):
            inconclusive = True
            found.append(("inconclusive", f"{mode}: {wrong}", ""))
        elif wrong != "unrunnable":
            found.append(("wrong-output", f"{mode}: {wrong}", ""))
    if drift_reported and (no_verify_matches or inconclusive or "NaN" in drift_reason):
        why = "the reference is NaN/inf" if inconclusive or "NaN" in drift_reason else "the fused model matches"
        found.append(("false-drift", f"verify: npufuse reported drift ({drift_reason[:150]}) but {why}", ""))
    worst = min(found, key=lambda f: OUTCOMES.index(f[0]), default=("ok", "", ""))
    return Outcome(case, worst[0], worst[1], worst[2], fused, target_fused,
                   model if worst[0] in FAILURES else None)


def _compare(got: dict, want: dict, feeds: dict) -> str | None:
    sizes = {k: list(v.shape) for k, v in feeds.items()}
    for name, w in want.items():
        if name not in got:
            return f"output {name} missing"
        c = compare(name, got[name], w, Tolerance.for_dtype(w.dtype) if w.dtype.kind == "f" else None)
        if not c.ok:
            if "NaN or inf" in c.detail:
                return f"inconclusive: output {name}: {c.detail}"
            return f"output {name} at inputs {sizes}: {c.detail or 'differs'} (max rel err {c.max_rel_err:.3g})"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


# ---- a run ----------------------------------------------------------------------------------------------------

def run_cases(seed: int, count: int, families: list[str] | None = None, out: Path | None = None,
              start: int = 0, progress_every: int = 0, opsets: list[int] | None = None,
              dtypes: list[str] | None = None, on_case=None) -> dict:
    """Fuzz `count` cases; returns the summary (and saves failing cases under `out`)."""
    names = [n for n in families or list(FAMILIES)
             if any(o >= FAMILIES[n].min_opset for o in (opsets or OPSETS))
             and any(d in FAMILIES[n].dtypes for d in (dtypes or DTYPE_WEIGHTS))]   # narrowed runs skip the rest
    if not names:
        raise ValueError(f"no family can be drawn at opsets {opsets} with dtypes {dtypes}")
    table: dict[str, Counter] = defaultdict(Counter)
    perturbed: dict[str, Counter] = defaultdict(Counter)
    coverage: dict[str, Counter] = defaultdict(Counter)
    failures: Counter = Counter()
    t0 = time.perf_counter()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    for index in range(start, start + count):
        try:
            case, model, kinds = draw(seed, index, names, opsets, dtypes)
        except Unbuildable:   # every attempt was invalid ONNX (e.g. bf16 Conv before opset 22): not npufuse's
            table[names[index % len(names)]]["unbuildable"] += 1
            continue
        res = evaluate(case, model, kinds)
        if on_case is not None:
            on_case(res)
        table[case.family][res.outcome] += 1
        if case.perturbation:
            perturbed[case.family][res.outcome] += 1
        else:
            coverage[case.family]["unperturbed"] += 1
            coverage[case.family]["target_fused"] += res.target_fused
        if res.outcome in FAILURES:
            failures[(case.family, res.outcome, _generic(res.message))] += 1
            if out is not None:
                _save(out, res)
        done = index - start + 1
        if progress_every and done % progress_every == 0:
            el = time.perf_counter() - t0
            print(f"[fuzz] {done}/{count} in {el:.0f} s ({done / el:.2f} graphs/s)", file=sys.stderr, flush=True)
            if out is not None:   # a long run shows its counts so far, and keeps them if it is stopped
                partial = _summary(seed, start, done, names, el, table, perturbed, coverage, failures)
                (out / "summary.partial.json").write_text(json.dumps(partial, indent=2) + "\n", encoding="utf-8")
    return _summary(seed, start, count, names, time.perf_counter() - t0, table, perturbed, coverage, failures)


def _summary(seed: int, start: int, count: int, names: list[str], elapsed: float, table: dict, perturbed: dict,
             coverage: dict, failures: Counter) -> dict:
    return {
        "seed": seed, "start": start, "count": count, "families": names, "elapsed_s": round(elapsed, 2),
        "graphs_per_s": round(count / elapsed, 2) if elapsed else None,
        "outcomes": {f: dict(sorted(table[f].items())) for f in names},
        "perturbed_outcomes": {f: dict(sorted(perturbed[f].items())) for f in names if perturbed[f]},
        "coverage": {f: dict(coverage[f]) for f in names},
        "totals": dict(sum(table.values(), Counter())),
        "failures": [{"family": f, "outcome": o, "message": m, "count": n}
                     for (f, o, m), n in failures.most_common()],
    }


def _generic(message: str) -> str:
    """The message without its numbers, so that one bug's cases group together."""
    import re

    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", message)[:200]


def _save(out: Path, res: Outcome) -> None:
    folder = out / res.case.family
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"{res.case.index:06d}"
    if res.model is not None:
        onnx.save(res.model, str(stem) + ".onnx")
    Path(str(stem) + ".json").write_text(json.dumps(res.to_dict(), indent=2) + "\n", encoding="utf-8")


def format_table(summary: dict) -> str:
    cols = [o for o in OUTCOMES if summary["totals"].get(o)]
    rows = [["family"] + cols + ["total", "target fused"]]
    for f in summary["families"]:
        counts = summary["outcomes"].get(f, {})
        cov = summary["coverage"].get(f, {})
        rows.append([f] + [str(counts.get(o, 0)) for o in cols] + [str(sum(counts.values())),
                    f"{cov.get('target_fused', 0)}/{cov.get('unperturbed', 0)}"])
    rows.append(["total"] + [str(summary["totals"].get(o, 0)) for o in cols] + [str(summary["count"]), ""])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.append(f"{summary['count']} graphs in {summary['elapsed_s']} s ({summary['graphs_per_s']} graphs/s)")
    for f in summary["failures"]:
        lines.append(f"  {f['count']:5d}  {f['family']}  {f['outcome']}: {f['message']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--start", type=int, default=0, help="first case index (to split a run)")
    ap.add_argument("--out", type=Path, help="save failing cases and summary.json here")
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES), help="only these families (repeatable)")
    ap.add_argument("--opset", type=int, action="append", choices=list(OPSETS), help="only these opsets (repeatable)")
    ap.add_argument("--dtype", action="append", choices=list(DTYPE_WEIGHTS), help="only these dtypes (repeatable)")
    ap.add_argument("--summary", type=Path, help="write the summary JSON here (default: OUT/summary.json)")
    ap.add_argument("--replay", type=Path, help="run one saved case (its .json) again and print the outcome")
    ap.add_argument("--progress", type=int, default=0, metavar="N", help="report progress every N graphs")
    args = ap.parse_args(argv)
    if args.replay:
        doc = json.loads(args.replay.read_text(encoding="utf-8"))
        case, model, kinds = replay_case(doc)
        res = evaluate(case, model, kinds)
        print(json.dumps(res.to_dict(), indent=2))
        return 0 if res.outcome not in FAILURES else 1
    try:
        summary = run_cases(args.seed, args.count, args.family, args.out, args.start, args.progress, args.opset,
                            args.dtype)
    except ValueError as exc:
        print(f"fuzz: error: {exc}; widen --family, --opset or --dtype", file=sys.stderr)
        return 2
    summary["command"] = "python tools/fuzz.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(format_table(summary))
    target = args.summary or (args.out / "summary.json" if args.out else None)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 1 if any(summary["totals"].get(o) for o in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
