"""`npufuse check` as a Python API: original vs optimized, or a model vs a golden file.

    from npufuse.guard import assert_no_drift, check_models, save_golden, check_golden

    def test_optimized_model_matches():
        assert_no_drift("model.onnx", "model.npufuse.onnx", atol=1e-4)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx

from npufuse.errors import InputError
from npufuse.ir.graph import Graph
from npufuse.guard.attribution import Attribution, Culprit, attribute
from npufuse.guard.golden import (
    Golden,
    graph_sha256,
    read_golden,
    runtime_versions,
    write_golden,
)
from npufuse.guard.stats import (
    OutputCheck,
    OutputTolerance,
    check_statistic,
    measure,
    resolve_tolerances,
)
from npufuse.ir.modelio import load_model, model_dir
from npufuse.prepare.normalize import normalize
from npufuse.ir import widen
from npufuse.verify.segments import DEFAULT_VERIFY_MEMORY_BYTES
from npufuse.verify.whole import run_model
from npufuse.verify.inputs import model_inputs

ModelLike = Union[onnx.ModelProto, str, os.PathLike]
PerOutput = Mapping[str, Union[Mapping[str, float], OutputTolerance]]


@dataclass
class CheckResult:
    """The verdict of a check: per output, and the rewrites blamed for drift."""

    ok: bool
    mode: str                                   # "models" (ORIGINAL vs OPTIMIZED) or "golden"
    reference: str                              # what was compared against: ORIGINAL's label or the golden file
    candidate: str                              # the model judged
    outputs: list[OutputCheck] = field(default_factory=list)
    culprits: list[Culprit] = field(default_factory=list)
    attribution: str = ""                       # how the culprits were found (or why none were)
    statistic: str = "elementwise"
    quantile: float | None = None
    seed: int | None = None
    dims: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.ok

    @property
    def inconclusive(self) -> bool:
        """Not ok, yet no output drifts where the reference is defined: some output's reference is NaN/inf on the
        inputs, or every output is empty (nothing was compared)."""
        return (not self.ok and bool(self.outputs) and all(o.ok or o.inconclusive for o in self.outputs)
                and any(o.inconclusive for o in self.outputs))

    @property
    def failed(self) -> list[OutputCheck]:
        return [o for o in self.outputs if not o.ok]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "npufuse.check/1", "ok": self.ok, "mode": self.mode, "reference": self.reference,
            "candidate": self.candidate, "statistic": self.statistic, "quantile": self.quantile,
            "seed": self.seed, "dims": dict(self.dims), "outputs": [o.to_dict() for o in self.outputs],
            "culprits": [c.to_dict() for c in self.culprits], "attribution": self.attribution,
            "notes": list(self.notes), "versions": runtime_versions(),
        }

    def to_text(self) -> str:
        from npufuse.guard.report import text_report

        return text_report(self)

    def to_junit_xml(self) -> str:
        from npufuse.guard.report import junit_xml

        return junit_xml(self)


def check_models(original: ModelLike, optimized: ModelLike, *, seed: int = 0, dims: Mapping[str, int] | None = None,
                 rtol: float | None = None, atol: float | None = None, per_output: PerOutput | None = None,
                 statistic: str = "elementwise", quantile: float = 0.99, base_dir: str | None = None,
                 attribute_drift: bool = True, memory_bytes: int = DEFAULT_VERIFY_MEMORY_BYTES) -> CheckResult:
    """Run ORIGINAL and OPTIMIZED on the same seeded, role-aware inputs and compare every output.

    Tolerances: `rtol`/`atol` for every output, `per_output={"out0": {"atol": 1e-3}}` over them, dtype
    defaults (npufuse.verify.compare.DEFAULT_TOLERANCES) for what is left. On drift, the rewrites of
    OPTIMIZED responsible are named in `culprits` (set `attribute_drift=False` to skip that).
    """
    check_statistic(statistic, quantile)
    orig, orig_dir, orig_label = _load(original, base_dir, "ORIGINAL")
    opt, opt_dir, opt_label = _load(optimized, base_dir, "OPTIMIZED")
    norm, types = normalize(orig, orig_dir)
    g = Graph(norm, orig_dir, types)
    feeds = model_inputs(g, seed, dims, skip_hint=_CHECK_MEMORY_HINT)
    opt_inputs = _required_inputs(opt)
    extra = [n for n in opt_inputs if n not in feeds]
    if extra:
        raise InputError(f"{opt_label}: needs input {extra[0]!r}, which {orig_label} does not have; "
                         "pass the optimized version of the same model")
    opt_outputs = [o.name for o in opt.graph.output]
    orig_outputs = [o.name for o in orig.graph.output]
    lacking = [n for n in orig_outputs if n not in opt_outputs]
    if lacking:  # not drift: these are two different models (or outputs renamed), nothing to compare
        raise InputError(f"{opt_label}: has no output {lacking[0]!r} (its outputs: {', '.join(map(repr, opt_outputs))};"
                         f" {orig_label}'s: {', '.join(map(repr, orig_outputs))}); pass the optimized version of "
                         "the same model, whose outputs keep their names")
    _same_input_types(orig, opt, orig_label, opt_label)
    want = _run(orig, feeds, None, orig_dir, orig_label, memory_bytes)
    tols = resolve_tolerances(list(want), rtol, atol, per_output)
    got = _run(opt, feeds, [n for n in want if n in opt_outputs], opt_dir, opt_label, memory_bytes)
    checks = _judge(want, got, tols, statistic, quantile, opt_label)
    result = CheckResult(_passed(checks), "models", orig_label, opt_label, checks, statistic=statistic,
                         quantile=quantile if statistic == "quantile" else None, seed=seed, dims=dict(dims or {}))
    if widen.mentions_bf16(orig) or widen.mentions_bf16(opt):
        result.notes.append(widen.NOTE)
    extra_out = [n for n in opt_outputs if n not in want]
    if extra_out:
        result.notes.append(f"{opt_label} has output(s) {orig_label} lacks, not compared: {', '.join(extra_out)}")
    if not result.ok and not result.inconclusive and attribute_drift and all(n in got for n in want):
        def judge(outs: Mapping[str, np.ndarray]) -> bool:
            return all(c.ok for c in _judge(want, outs, tols, statistic, quantile, opt_label))

        found: Attribution = attribute(g, opt, feeds, judge, opt_dir)
        result.culprits, result.attribution = found.culprits, found.method
    return result


# check has no --no-verify: checking is all it does
_CHECK_MEMORY_HINT = "run the check on a machine with more memory"


def _same_input_types(orig: onnx.ModelProto, opt: onnx.ModelProto, orig_label: str, opt_label: str) -> None:
    """InputError when an input both models declare differs in element type, rank or a fixed dim: two different
    models, not drift (npufuse keeps every input's declaration). A symbolic dim against a fixed one is allowed."""
    mine, theirs = Graph(orig), Graph(opt)
    both = set(_required_inputs(opt))
    for name in (n for n in _required_inputs(orig) if n in both):   # the model's order: the first difference
        a_type, b_type, a, b = mine.dtype(name), theirs.dtype(name), mine.shape(name), theirs.shape(name)
        why = ""
        if a_type is not None and b_type is not None and a_type != b_type:
            why = f"element type {b_type} where {orig_label} has {a_type}"
        elif a is not None and b is not None and len(a) != len(b):
            why = f"rank {len(b)} where {orig_label} has rank {len(a)}"
        elif a is not None and b is not None:
            diff = [k for k, (x, y) in enumerate(zip(a, b)) if isinstance(x, int) and isinstance(y, int) and x != y]
            if diff:
                why = f"dim {diff[0]} = {b[diff[0]]} where {orig_label} has {a[diff[0]]}"
        if why:
            raise InputError(f"{opt_label}: input {name!r} has {why}; these are different models, not drift: "
                             "pass the optimized version of the same model")


def save_golden(model: ModelLike, path: str | os.PathLike, *, seed: int = 0, dims: Mapping[str, int] | None = None,
                base_dir: str | None = None, memory_bytes: int = DEFAULT_VERIFY_MEMORY_BYTES) -> Path:
    """Run MODEL on seeded, role-aware inputs and store inputs and outputs in a golden .npz at `path`."""
    proto, mdir, label = _load(model, base_dir, "MODEL")
    norm, types = normalize(proto, mdir)
    feeds = model_inputs(Graph(norm, mdir, types), seed, dims, skip_hint=_CHECK_MEMORY_HINT)
    outs = _run(proto, feeds, None, mdir, label, memory_bytes)
    for name, value in outs.items():
        arr = np.asarray(value)
        if arr.size and arr.dtype.kind in "fc" and not np.isfinite(arr).any():
            # a golden of NaN/inf checks nothing later: every comparison against it is inconclusive
            raise InputError(f"{label}: output {name!r} is NaN/inf everywhere on the generated inputs (seed {seed}), so "
                             "a golden of it would check nothing; fix the model, or pass --seed/--dim values for "
                             "which it computes finite outputs")
    meta = {"seed": seed, "dims": dict(dims or {}), "model": Path(label).name, "graph_sha256": graph_sha256(proto),
            **runtime_versions()}
    return write_golden(path, Golden(feeds, outs, meta))


def check_golden(model: ModelLike, path: str | os.PathLike, *, rtol: float | None = None, atol: float | None = None,
                 per_output: PerOutput | None = None, statistic: str = "elementwise", quantile: float = 0.99,
                 base_dir: str | None = None, memory_bytes: int = DEFAULT_VERIFY_MEMORY_BYTES) -> CheckResult:
    """Run MODEL on the golden file's inputs and compare with the outputs stored there."""
    check_statistic(statistic, quantile)
    golden = read_golden(path)
    proto, mdir, label = _load(model, base_dir, "MODEL")
    _check_golden_inputs(proto, golden, str(path), label)
    model_outputs = [o.name for o in proto.graph.output]
    missing = [n for n in golden.outputs if n not in model_outputs]
    if missing:
        raise InputError(f"{path}: golden output {missing[0]!r} is not an output of {label} (outputs: "
                         f"{', '.join(model_outputs)}); re-create the golden with --save-golden")
    tols = resolve_tolerances(list(golden.outputs), rtol, atol, per_output)
    got = _run(proto, golden.inputs, list(golden.outputs), mdir, label, memory_bytes)
    checks = _judge(golden.outputs, got, tols, statistic, quantile, label)
    meta = golden.meta
    result = CheckResult(_passed(checks), "golden", str(path), label, checks, statistic=statistic,
                         quantile=quantile if statistic == "quantile" else None, seed=meta.get("seed"),
                         dims=dict(meta.get("dims") or {}))
    if meta.get("graph_sha256") and meta["graph_sha256"] != graph_sha256(proto):
        result.notes.append(f"the graph of {label} differs from the one the golden was saved from "
                            f"({meta.get('model', '?')})")
    now = runtime_versions()
    for key in ("onnxruntime", "npufuse"):
        if meta.get(key) and meta[key] != now[key]:
            result.notes.append(f"{key} {now[key]} now, {meta[key]} when the golden was saved")
    if widen.mentions_bf16(proto):
        result.notes.append(widen.NOTE)
    extra = [n for n in model_outputs if n not in golden.outputs]
    if extra:
        result.notes.append(f"output(s) not in the golden, not compared: {', '.join(extra)}")
    return result


def assert_no_drift(original: ModelLike, optimized: ModelLike, **kw: Any) -> CheckResult:
    """pytest-friendly: raise AssertionError with the report when OPTIMIZED drifts from ORIGINAL."""
    result = check_models(original, optimized, **kw)
    if not result.ok:
        raise AssertionError("optimized model drifts from the original\n" + result.to_text())
    return result


def assert_matches_golden(model: ModelLike, path: str | os.PathLike, **kw: Any) -> CheckResult:
    """pytest-friendly: raise AssertionError with the report when MODEL drifts from the golden file."""
    result = check_golden(model, path, **kw)
    if not result.ok:
        raise AssertionError(f"model drifts from the golden file {path}\n" + result.to_text())
    return result


# ---- helpers -------------------------------------------------------------------------------------

def _load(model: ModelLike, base_dir: str | None, role: str) -> tuple[onnx.ModelProto, str | None, str]:
    """(proto, folder its external data is relative to, label for messages)."""
    if isinstance(model, onnx.ModelProto):
        return model, base_dir, role
    if isinstance(model, (str, os.PathLike)):
        return load_model(model), base_dir or model_dir(model), str(model)
    raise InputError(f"{role}: expected an onnx.ModelProto or a path, got {type(model).__name__}")


def _required_inputs(model: onnx.ModelProto) -> list[str]:
    inits = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def _run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], outputs: list[str] | None, base_dir: str | None,
         label: str, memory_bytes: int = DEFAULT_VERIFY_MEMORY_BYTES) -> dict[str, np.ndarray]:
    try:  # segment by segment: a model of any size checks in bounded memory
        outs = run_model(model, feeds, base_dir, memory_bytes)
        return {n: outs[n] for n in (outputs if outputs is not None else list(outs))}
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidArgument/... types
        text = str(exc).strip().splitlines()
        line = (text[0] if text else type(exc).__name__)[:300]
        raise InputError(f"{label}: onnxruntime cannot run it ({line}); check the model loads in onnxruntime") from None


def _passed(checks: list[OutputCheck]) -> bool:
    """Every output within tolerance, and something was compared (all outputs empty verifies nothing)."""
    return all(c.ok for c in checks) and not (checks and all(c.inconclusive for c in checks))


def _judge(want: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], tols: Mapping[str, OutputTolerance],
           statistic: str, quantile: float, label: str) -> list[OutputCheck]:
    checks = []
    for name, ref in want.items():
        if name not in got:
            inf = float("inf")
            tol = tols[name]
            checks.append(OutputCheck(name, False, statistic, tol.rtol or 0.0, tol.atol or 0.0, inf, inf, (), None,
                                      None, inf, inf, inf, quantile if statistic == "quantile" else None,
                                      tuple(np.shape(ref)), np.asarray(ref).dtype.name, f"missing from {label}"))
            continue
        checks.append(measure(name, got[name], ref, tols[name], statistic, quantile))
    return checks


def _check_golden_inputs(model: onnx.ModelProto, golden: Golden, path: str, label: str) -> None:
    """Refuse a golden file whose inputs are not the model's (names, dtypes, fixed dims)."""
    g = Graph(model)
    required = _required_inputs(model)
    missing = [n for n in required if n not in golden.inputs]
    extra = [n for n in golden.inputs if n not in required]
    fix = "the golden was saved from a model with different inputs; re-create it with --save-golden"
    if missing:
        raise InputError(f"{path}: has no input {missing[0]!r} that {label} needs; {fix}")
    if extra:
        raise InputError(f"{path}: input {extra[0]!r} is not an input of {label}; {fix}")
    for name in required:
        arr = golden.inputs[name]
        dtype, shape = g.dtype(name), g.shape(name)
        if dtype is not None and arr.dtype != dtype:
            raise InputError(f"{path}: input {name!r} is {arr.dtype}, {label} wants {dtype}; {fix}")
        if shape is not None and (len(shape) != arr.ndim or any(isinstance(d, int) and d != s
                                                                 for d, s in zip(shape, arr.shape))):
            raise InputError(f"{path}: input {name!r} has shape {tuple(arr.shape)}, {label} wants "
                             f"{tuple(d if d is not None else '?' for d in shape)}; {fix}")
