"""The Python API: `optimize`, `report`, `check` and `profiles` do what the commands of the same name do.

    import npufuse

    result = npufuse.optimize("model.onnx", output="model.npufuse.onnx")
    print(result.summary())          # the text `npufuse optimize` prints
    result.fused                     # Counter: fused kind -> count

The commands are thin wrappers over these functions, so the two cannot disagree. Every error the command line
reports with exit code 2 (bad input or usage) is raised here as `npufuse.NpufuseError` (its subclass
`InputError`), whose `str()` is the one line the command prints after `npufuse: error: `; drift (exit code 1) is
`npufuse.DriftError`. Nothing here prints; pass `progress=True` for the commands' progress on stderr.
Documented with examples in docs/api.md.
"""

from __future__ import annotations

import functools
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Union

import onnx

from npufuse.errors import DriftError, InconclusiveError, InputError, NpufuseError, parse_dims, parse_size
from npufuse.console.textsafe import safe_line
from npufuse.ir.collector import fewer_collections

if TYPE_CHECKING:
    from npufuse.fusion.engine import OptimizeResult as EngineResult
    from npufuse.guard.api import CheckResult
    from npufuse.npu_model.spec import NpuSpec
    from npufuse.console.progress import Progress

ModelLike = Union[str, os.PathLike, onnx.ModelProto]
"""A model: the path of an .onnx file, or an `onnx.ModelProto` in memory."""
PathLike = Union[str, os.PathLike]
Dims = Union[Mapping[str, int], Iterable[str], None]
"""Sizes of symbolic dims: `{"batch": 1, "sequence": 128}`, or the command line's `["batch=1", "sequence=128"]`."""

DEFAULT_TARGET = "Ascend910B2"

_F = TypeVar("_F", bound=Callable[..., Any])


def _one_line_errors(fn: _F) -> _F:
    """An NpufuseError leaves with the message the command line prints: control characters a model's names may
    hold are escaped, so `str(exc)` is exactly the line after `npufuse: error: `."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NpufuseError as exc:
            exc.args = (safe_line(str(exc)),)
            raise
    return wrapper  # type: ignore[return-value]


# ---- results -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OptimizeResult:
    """What one `optimize` run produced.

    Attributes:
        model: the optimized model, self-contained: every weight is inside it (read in from the input's files on
            first access), so `onnx.save(result.model, path)` works for a model under protobuf's 2 GiB limit.
            For larger models write with `output=` instead, which streams the weights file to file.
        report: the JSON report `npufuse optimize --report` writes (schema `npufuse.optimize/1`,
            docs/optimize-report.md); its `model` is null for a model given in memory.
        fused: fusions applied, per kind (`FusedConv[Relu]`, `Conv(BN folded)`, ...).
        near_misses: chains that looked fusible but were refused, as in the report's `near_misses`.
        verified: whether the numeric checks ran (`verify=True`).
        ok: True unless the whole-model check failed (`optimize` raises then, so a returned result is ok).
        output: where the optimized model was written, or None when nothing was written (`output=None`).
        details: the engine's full record (`npufuse.fusion.engine.OptimizeResult`): every candidate with its cost
            decision and numeric check, the whole-model comparison, timings. Its `model` may still refer to the
            input's files for its weights (relative to `base_dir`).
        base_dir: the folder the weights `details.model` refers to lie in (None for a model given in memory
            without external data).
    """

    fused: Counter
    verified: bool
    ok: bool
    output: Path | None
    details: EngineResult = field(repr=False)
    base_dir: str | None = field(repr=False)
    # builds the report on first use: on a 100k-node graph it costs as much as the optimization itself
    make_report: Callable[[], dict[str, Any]] = field(repr=False, compare=False)
    # things the user should know that are not the run's results (a stale OUT.data beside an embedded output)
    notes: tuple[str, ...] = ()
    # with emit="atc": the ATC form (npufuse.emit.atc.emitter.AtcForm: model, form, each region's plugin or reason)
    atc: Any = field(default=None, repr=False, compare=False)
    atc_check: Any = field(default=None, repr=False, compare=False)   # its comparison with the original

    @functools.cached_property
    def report(self) -> dict[str, Any]:
        """The JSON report `npufuse optimize --report` writes (built on first access)."""
        return self.make_report()

    @functools.cached_property
    def near_misses(self) -> list[dict[str, Any]]:
        """The report's `near_misses`."""
        return list(self.report["near_misses"])

    @functools.cached_property
    def model(self) -> onnx.ModelProto:
        """The optimized model with every weight inside it (copied from the input's files once, on first use)."""
        return _self_contained(self.details.model, self.base_dir)

    def summary(self) -> str:
        """The text summary `npufuse optimize` prints: node counts, fusions per kind, refusals per reason, errors."""
        from npufuse.reporting.summary import optimize_text

        text = optimize_text(self.details, str(self.output) if self.output is not None else None, self.verified)
        if self.atc is not None:
            text = text.rstrip("\n") + "\n" + self.atc.summary_line() + "\n"
            if self.atc_check is not None:
                for c in self.atc_check.comparisons:
                    text += (f"ATC form vs original, output {c.name}: max abs {c.max_abs_err:.3g}, max rel "
                             f"{c.max_rel_err:.3g} -> {'ok' if c.ok else 'DRIFT'}\n")
        return "\n".join([text.rstrip("\n"), *(f"note: {n}" for n in self.notes)]) + "\n" if self.notes else text

    def __str__(self) -> str:
        return self.summary()


def _self_contained(model: onnx.ModelProto, base_dir: str | None) -> onnx.ModelProto:
    """`model` with the bytes of every weight it refers to (in the input's files) copied into it, as stored."""
    from npufuse.ir.weights import external_ref, is_external, iter_tensors

    if not any(is_external(t) for t in iter_tensors(model)):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in iter_tensors(out):
        if is_external(t):
            ref = external_ref(t)
            with open(ref.path(base_dir), "rb") as f:
                f.seek(ref.offset)
                data = f.read(ref.length) if ref.length is not None else f.read()
            del t.external_data[:]
            t.ClearField("data_location")   # as onnx.load leaves an embedded tensor: field unset, not DEFAULT
            t.raw_data = data
    return out


class ReportDocument(dict):
    """The report document (schema `npufuse.report/1`, docs/report.md): a plain dict, plus `render`."""

    def render(self, format: str = "text") -> str:
        """The document as `npufuse report --format FORMAT` prints it: one of text, json, markdown, html."""
        from npufuse.reporting import render

        return render(self, _report_format(format))


# ---- the commands --------------------------------------------------------------------------------

@_one_line_errors
@fewer_collections()   # load, optimize and write: the collector's passes over a big model's objects add up
def optimize(model: ModelLike, *, target: str | os.PathLike = DEFAULT_TARGET, output: PathLike | None = None,
             report: PathLike | None = None, verify: bool = True, force_fuse: bool = False,
             margin: float | None = None, only: Iterable[str] = (), disable: Iterable[str] = (),
             fusion_switch: PathLike | None = None, write_fusion_switch: PathLike | None = None, dims: Dims = None,
             seed: int = 0, verify_memory: str | int = "1GiB", external_data: bool | None = None,
             overwrite: bool = False, progress: bool | Progress = False,
             base_dir: PathLike | None = None, emit: str = "onnx", ge: str = "released",
             kernels: PathLike | None = None, precision_mode: str | None = None,
             op_select_implmode: str | None = None, optypelist_for_implmode: Iterable[str] | str = (),
             enable_small_channel: bool = False) -> OptimizeResult:
    """Fuse `model` for `target`, as `npufuse optimize` does; the input is never modified.

    Args:
        model: the path of an .onnx file, or an `onnx.ModelProto`. A ModelProto whose weights live in external
            data files (loaded with `load_external_data=False`) needs `base_dir`.
        target: hardware profile the cost model prices fusions on: a shipped name (see `profiles()`) or a TOML file.
        output: where to write the optimized model, atomically, exactly as the command does. None (the default)
            writes nothing: the optimized model is `result.model`. Unlike the command there is no default path.
        report: also write the JSON report here (written on drift too, as the command does).
        verify: run the numeric checks (per rewrite and whole model); False is `--no-verify`.
        force_fuse: fuse every legal candidate, even where the cost model says no.
        margin: fuse only where the modeled gain exceeds this fraction of the unfused time, in [0, 1)
            (None: 0.05).
        only: run only these patterns.
        disable: do not run these patterns.
        fusion_switch: ATC's fusion switch file (CANN JSON or `PassName:off` lines; CANN pass or npufuse pattern
            names): run only the patterns it leaves on; `only`/`disable` then apply on top (docs/fusion-switch.md).
        kernels: the user's own kernels (TOML, docs/kernels.md): regions they run are fused for the target, and
            with emit="atc" written as the node their ATC plugin registers.
        write_fusion_switch: also write ATC's switch file here (with the model, when `output` is given): the
            passes npufuse did are off, those it left to ATC on.
        dims: sizes of symbolic dims, `{"batch": 1}` or `["batch=1"]`.
        seed: seed of the generated verification inputs (>= 0).
        verify_memory: weights one onnxruntime session may hold while verifying, `"1GiB"` or bytes.
        external_data: True writes the weights to `OUTPUT.data`, False inside the model, None as the input had
            them (and external past 2 GiB).
        overwrite: allow `output` to be the input file itself.
        progress: True shows per-stage progress on stderr (as the command does); or a `npufuse.console.progress.Progress`.
        base_dir: for a ModelProto, the folder its external data locations are relative to.
        emit: "onnx" (fused ops with function bodies, any onnxruntime runs it) or "atc" (what CANN's ATC parser
            reads: plugin nodes for the kernels that have one, standard ops elsewhere, one opset <= 18;
            docs/atc.md). The ATC form is pre-checked against ATC's parser rules and verified against the original
            with reference kernels of the CANN plugin ops.
        ge: for emit="atc", the GE versions to parse on: "released" (v8.5.0 .. v9.2.0-beta.1) or "head".
        precision_mode: ATC's --precision_mode (or --precision_mode_v2) value the model will be compiled under,
            which sets the dtypes every kernel is priced in (None: the profile's, ATC's default force_fp16).
        op_select_implmode: ATC's --op_select_implmode (None: ATC's default, high_performance), with
            `optypelist_for_implmode` (op types, or ATC's comma-separated list): which kernels are priced in their
            high-precision implementation (docs/cost-model.md).
        enable_small_channel: ATC's --enable_small_channel=1 is set in the compile: a Conv of at most 4 input
            channels is priced in ATC's C04 format.

    Returns:
        The run: optimized model, report, fusions per kind, near misses, where it was written.

    Raises:
        DriftError: the optimized model drifts from the original; nothing is written (the report is, if asked).
            `exc.result` is the OptimizeResult. The command exits 1 here.
        InconclusiveError: the whole-model check could verify nothing (the original gives NaN/inf or empty
            outputs on the generated inputs); nothing written. An InputError, so an NpufuseError.
        NpufuseError: bad input or usage (a missing or unreadable model, an unknown target or pattern, bad dims,
            an output path that is the input or one of its data files, ...): the command's exit code 2.
    """
    from npufuse.fusion.engine import OptimizeOptions
    from npufuse.fusion.engine import optimize as run_optimize
    from npufuse.emit.fusion_switch import select_patterns
    from npufuse.emit.fusion_switch import write_fusion_switch as write_switch
    from npufuse.ir.modelio import check_output_path, write_model
    from npufuse.reporting.summary import optimize_report

    _check_margin(margin)
    _check_seed(seed)
    _check_emit(emit, ge)
    spec = _with_kernels(_load_target(target, precision_mode, op_select_implmode, optypelist_for_implmode,
                                      enable_small_channel),
                         kernels)
    patterns = select_patterns(fusion_switch, _names(only), _names(disable))
    opts = OptimizeOptions(patterns=patterns, spec=spec,
                           force_fuse=force_fuse, margin=margin, verify=verify, dims=_dims(dims), seed=seed,
                           progress=_progress(progress), verify_memory_bytes=_size(verify_memory),
                           keep_normalized=report is not None and spec is not None)   # price_model reads it
    src = _Source.of(model, base_dir)
    profile = _profile_file(target) + ((Path(fusion_switch),) if fusion_switch is not None else ()) + \
        ((Path(kernels),) if kernels is not None else ())
    out = None
    if output is not None:
        out = check_output_path(output, src.path, overwrite, data_files=src.data_files, others=profile)
    written = (out, out.with_name(out.name + ".data")) if out is not None else ()
    if report is not None:
        check_output_path(report, src.path, False, "--report", others=written + profile, data_files=src.data_files)
    switch_out = None
    if write_fusion_switch is not None:
        switch_out = check_output_path(write_fusion_switch, src.path, False, "--write-fusion-switch",
                                       data_files=src.data_files, others=written + profile
                                       + ((Path(report),) if report is not None else ()))
    result = run_optimize(src.proto, src.base_dir, opts)
    atc = atc_check = None
    if result.ok and emit == "atc":
        atc, atc_check = _atc_form(src, result.model, spec, ge, verify, seed, _dims(dims))
    wrote = None
    notes: list[str] = []
    drifted = atc_check is not None and not atc_check.ok
    if result.ok and out is not None and not drifted:
        started = time.time()
        write_model(atc.model if atc is not None else result.model, out, src.base_dir,
                    external=bool(src.data_files) if external_data is None else external_data,
                    progress=opts.progress, onnx_checker=atc is None,
                    structure_checked=atc is None)   # the engine checked its result (fusion.engine._optimize)
        wrote = out
        stale = out.with_name(out.name + ".data")
        if stale.is_file() and stale.stat().st_mtime < started - 1.0:
            # an external write renames a fresh OUT.data into place; an older one is from an earlier run
            notes.append(f"{stale} is left from an earlier write: this output does not read it (its weights are "
                         "embedded); delete it if nothing else uses it")
        if switch_out is not None:   # with the model it describes, never alone
            write_switch(switch_out, result, [p.name for p in patterns], atc)
    def make_report() -> dict[str, Any]:
        doc = optimize_report(result, src.label, str(wrote) if wrote is not None else None,
                              spec.name if spec else None, verify, spec)
        if spec is not None:   # the model's time as `npufuse report` and `calibrate` price it
            from npufuse.reporting.document import price_model

            doc["modeled_time_us"] = price_model(src.proto, result, spec, src.base_dir, opts.dims).modeled_time_us()
        if atc is not None:
            doc["atc"] = atc.to_json()
            if atc_check is not None:
                doc["atc"]["check"] = {
                    "ok": atc_check.ok, "reason": atc_check.reason,
                    "outputs": [{"name": c.name, "ok": c.ok, "max_abs_err": c.max_abs_err,
                                 "max_rel_err": c.max_rel_err} for c in atc_check.comparisons]}
        return doc

    api_result = OptimizeResult(result.applied_by_kind(), verify, result.ok and not drifted, wrote, result,
                                src.base_dir, make_report, tuple(notes), atc, atc_check)
    if report is not None:
        _write_text(Path(report), _json(api_result.report))
    if result.inconclusive:   # not drift: the generated inputs could not exercise the model
        why = result.model_check.reason.removeprefix("inconclusive: ")
        raise InconclusiveError(
            f"the whole-model check was inconclusive ({why}); nothing written. The original model itself gives "
            "NaN/inf (or empty outputs) on npufuse's generated inputs: set symbolic sizes with --dim (each at "
            "least 1), or pass --no-verify to write it unchecked", api_result)
    if not result.ok:
        raise DriftError(f"the optimized model drifts from the original ({result.model_check.reason}); nothing "
                         "written. Run with --report to see each rewrite's check, or --disable the pattern "
                         "responsible.", api_result)
    if drifted:
        raise DriftError(f"the ATC form drifts from the original ({atc_check.reason}); nothing written. Run with "
                         "--report to see which regions became plugin nodes (docs/atc.md)", api_result)
    return api_result


def _small_dims(dims: Mapping[str, int]) -> dict[str, int]:
    """`dims` capped at the size verification would pick for each name by itself (verify.dim_sizes)."""
    from npufuse.verify.dim_sizes import dim_size

    return {name: min(int(value), dim_size(name)) for name, value in dims.items()}


def _check_emit(emit: str, ge: str) -> None:
    if emit not in ("onnx", "atc"):
        raise InputError(f"emit {emit!r}: choose onnx (the default) or atc")
    if ge not in ("released", "head"):
        raise InputError(f"ge {ge!r}: choose released (the default) or head")


def _atc_form(src: "_Source", model: onnx.ModelProto, spec: NpuSpec | None, ge: str, verify: bool, seed: int,
              dims: dict[str, int]) -> tuple[Any, Any]:
    """The ATC form of the optimized `model`, and (when verifying) its comparison with the original."""
    from npufuse.emit.atc.emitter import to_atc
    from npufuse.emit.atc.verify import verify_atc
    from npufuse.prepare.infer import infer_value_types

    atc = to_atc(model, infer_value_types(model), getattr(spec, "chip", None), ge=ge,
                 user_kernels=getattr(spec, "user_kernels", ()), precision_mode=getattr(spec, "precision_mode", None))
    check = verify_atc(src.proto, atc.model, src.base_dir, seed=seed, dims=dims,
                       user_nodes=atc.user_nodes) if verify else None
    return atc, check


@_one_line_errors
def report(model: ModelLike, *, target: str | os.PathLike = DEFAULT_TARGET, format: str = "json",
           output: PathLike | None = None, verify: bool = True, force_fuse: bool = False,
           margin: float | None = None, only: Iterable[str] = (), disable: Iterable[str] = (),
           fusion_switch: PathLike | None = None, dims: Dims = None,
           verify_memory: str | int = "1GiB", progress: bool | Progress = False,
           base_dir: PathLike | None = None, emit: str = "onnx", ge: str = "released",
           kernel_briefs: PathLike | None = None, seed: int = 0, kernels: PathLike | None = None,
           precision_mode: str | None = None, op_select_implmode: str | None = None,
           optypelist_for_implmode: Iterable[str] | str = (), enable_small_channel: bool = False) -> ReportDocument:
    """Every fusion candidate in `model`, fused or not, with its cost estimate and the reason, as
    `npufuse report` finds them; the input is never modified.

    Args:
        model: the path of an .onnx file, or an `onnx.ModelProto` (with `base_dir` if its weights are external).
        target: hardware profile (a shipped name or a TOML file).
        format: what `output` gets: "json" (the default), "markdown", "html" or "text".
        output: write the rendered report here, atomically; None writes nothing.
        verify: run the numeric checks (False: faster, no rollbacks are seen).
        force_fuse: report as if every legal candidate were fused.
        margin: the gain a fusion must exceed, as a fraction of the unfused time, in [0, 1) (None: 0.05).
        only: run only these patterns.
        disable: do not run these patterns.
        fusion_switch: ATC's fusion switch file: run only the patterns it leaves on (see `optimize`).
        dims: sizes of symbolic dims, `{"batch": 1}` or `["batch=1"]`.
        verify_memory: weights one onnxruntime session may hold while verifying, `"1GiB"` or bytes.
        progress: True shows per-stage progress on stderr; or a `npufuse.console.progress.Progress`.
        base_dir: for a ModelProto, the folder its external data locations are relative to.
        emit: "atc" adds the `atc` block: what each fused region becomes in the ATC form (docs/atc.md), without
            writing or verifying that form.
        ge: with emit="atc", the GE version whose parser rules the form follows: "released" or "head".
        kernel_briefs: write a brief per kernel opportunity into this new (or empty) folder: the fused op, its
            shapes, tile and modeled times, the reference kernel and test vectors from the model's activations on
            seeded inputs (`seed`, `dims`) (docs/kernels.md).
        seed: seed of those inputs.
        kernels: the user's own kernels (TOML, docs/kernels.md), which the target then runs (see `optimize`).
        precision_mode: ATC's precision mode the model is priced under (see `optimize`).
        op_select_implmode, optypelist_for_implmode: ATC's operator implementation mode (see `optimize`).
        enable_small_channel: ATC's --enable_small_channel=1 is set in the compile (see `optimize`).

    Returns:
        The report document (schema `npufuse.report/1`, docs/report.md), a dict; `.render(format)` gives the
        text the command prints.

    Raises:
        NpufuseError: bad input or usage (the command's exit code 2).
    """
    from npufuse.fusion.engine import OptimizeOptions
    from npufuse.fusion.engine import optimize as run_optimize
    from npufuse.emit.fusion_switch import select_patterns
    from npufuse.ir.modelio import check_output_path
    from npufuse.reporting import build_report, render

    fmt = _report_format(format)
    _check_margin(margin)
    spec = _with_kernels(_load_target(target, precision_mode, op_select_implmode, optypelist_for_implmode,
                                      enable_small_channel),
                         kernels)
    dim_values = _dims(dims)
    # Pricing takes the user's sizes; the numeric checks run at small ones (a size the dim's name suggests, or the
    # user's where smaller): a batch-64 report prices batch 64 in seconds instead of verifying it for minutes.
    check_at = _small_dims(dim_values)
    opts = OptimizeOptions(patterns=select_patterns(fusion_switch, _names(only), _names(disable)), spec=spec,
                           force_fuse=force_fuse, margin=margin, verify=verify, dims=dim_values,
                           verify_dims=check_at, progress=_progress(progress),
                           verify_memory_bytes=_size(verify_memory), keep_normalized=True)   # build_report prices it
    src = _Source.of(model, base_dir)
    if output is not None:
        check_output_path(output, src.path, False, "-o", data_files=src.data_files,
                          others=_profile_file(target) + ((Path(fusion_switch),) if fusion_switch is not None else ()))
    if kernel_briefs is not None:
        from npufuse.reporting.kernel_briefs import check_output_dir
        check_output_dir(kernel_briefs)
    _check_emit(emit, ge)
    result = run_optimize(src.proto, src.base_dir, opts)
    smaller = {k: v for k, v in check_at.items() if v != dim_values.get(k)}
    if verify and smaller:
        result.notes.append("checked at " + ", ".join(f"{k}={v}" for k, v in sorted(smaller.items())) + ", priced at "
                            + ", ".join(f"{k}={dim_values[k]}" for k in sorted(smaller)) + ": the numeric checks "
                            "run at small sizes whatever --dim says for pricing")
    doc = ReportDocument(build_report(src.proto, result, spec, src.label, src.base_dir, dim_values, verify))
    if emit == "atc" and result.ok:
        doc["atc"] = _atc_form(src, result.model, spec, ge, False, 0, dim_values)[0].to_json()
    if kernel_briefs is not None:
        from npufuse.reporting.kernel_briefs import write_kernel_briefs
        _check_seed(seed)
        write_kernel_briefs(kernel_briefs, doc, result, src.proto, src.base_dir, seed, dim_values)
    if output is not None:
        _write_text(Path(output), render(doc, fmt))
    return doc


@_one_line_errors
def check(original: ModelLike, optimized: ModelLike | None = None, *, golden: PathLike | None = None,
          rtol: float | None = None, atol: float | None = None,
          per_output: Mapping[str, Mapping[str, float]] | None = None, statistic: str = "elementwise",
          quantile: float = 0.99, seed: int = 0, dims: Dims = None, attribute_drift: bool = True,
          verify_memory: str | int = "1GiB", base_dir: PathLike | None = None) -> CheckResult:
    """Check that a model still computes what it should, as `npufuse check` does: `original` against `optimized`
    on the same seeded inputs, or a model against a `golden` file (see `save_golden`).

    Args:
        original: the reference model (a path or an `onnx.ModelProto`); with `golden`, the model to judge.
        optimized: the model to judge against `original`. Pass exactly one of `optimized` and `golden`.
        golden: a golden .npz written by `save_golden` (or `npufuse check --save-golden`).
        rtol: relative tolerance for every output (None: the dtype's default).
        atol: absolute tolerance for every output (None: a floor of atol_scale * max|want| per dtype).
        per_output: tolerances of single outputs over those, `{"logits": {"atol": 1e-3}}`.
        statistic: which error must be within atol + rtol*|want|: "elementwise", "max", "mean" or "quantile".
        quantile: fraction of elements that must pass with statistic="quantile", in (0, 1].
        seed: seed of the generated inputs (not with `golden`, whose inputs are stored).
        dims: sizes of symbolic dims, `{"batch": 1}` or `["batch=1"]` (not with `golden`).
        attribute_drift: on drift, search for the rewrites of `optimized` responsible (`result.culprits`).
        verify_memory: weights one onnxruntime session may hold, `"1GiB"` or bytes.
        base_dir: for ModelProto inputs, the folder their external data locations are relative to.

    Returns:
        The verdict (`npufuse.guard.api.CheckResult`): `.ok`, `.outputs` (one comparison per output), `.culprits`,
        `.to_text()`, `.to_dict()`, `.to_junit_xml()`. Drift is `ok == False`, not an exception (the command
        exits 1).

    Raises:
        InconclusiveError: nothing could be verified (the reference is NaN/inf or every output empty);
            `exc.result` is the CheckResult. The command exits 2 here.
        NpufuseError: bad input or usage (the command's exit code 2).
    """
    from npufuse.guard import api as guard

    if (optimized is None) == (golden is None):
        raise InputError("pass exactly one of OPTIMIZED, --golden FILE or --save-golden FILE "
                         "(e.g. npufuse check model.onnx model.npufuse.onnx)")
    memory_bytes = _size(verify_memory)
    kw: dict[str, Any] = dict(rtol=rtol, atol=atol, per_output=per_output, statistic=statistic, quantile=quantile,
                              memory_bytes=memory_bytes)
    orig = _guard_model(original, base_dir, "ORIGINAL" if golden is None else "MODEL")
    if golden is not None:
        if dims:
            raise InputError("--dim has no effect with --golden (the inputs are stored in the golden); drop it")
        result = guard.check_golden(orig, golden, base_dir=_dir(base_dir), **kw)
    else:
        _check_seed(seed)
        opt = _guard_model(optimized, base_dir, "OPTIMIZED")
        result = guard.check_models(orig, opt, seed=seed, dims=_dims(dims), base_dir=_dir(base_dir),
                                    attribute_drift=attribute_drift, **kw)
    if result.inconclusive:   # not drift: the inputs left the reference undefined
        bad = next((o for o in result.outputs if o.inconclusive and not o.ok),
                   next(o for o in result.outputs if o.inconclusive))   # all empty: the first
        raise InconclusiveError(
            f"the check was inconclusive: output {bad.name!r}: {bad.detail}; nothing was verified there. Set "
            "symbolic sizes with --dim (each at least 1), or compare on a --golden file saved from inputs that "
            "exercise the model", result)
    return result


@_one_line_errors
def save_golden(model: ModelLike, path: PathLike, *, seed: int = 0, dims: Dims = None,
                verify_memory: str | int = "1GiB", base_dir: PathLike | None = None) -> Path:
    """Run `model` on seeded, role-aware inputs and store inputs and outputs in a golden .npz at `path`, as
    `npufuse check MODEL --save-golden PATH` does; later `check(model, golden=path)` compares with it.

    Returns:
        The path written. Raises NpufuseError on bad input (the command's exit code 2).
    """
    from npufuse.guard import api as guard
    from npufuse.ir.modelio import check_output_path

    _check_seed(seed)
    src = _Source.of(model, base_dir, "MODEL")
    check_output_path(path, src.path, False, "--save-golden", data_files=src.data_files)
    return guard.save_golden(src.path if src.path is not None else src.proto, path, seed=seed, dims=_dims(dims), base_dir=_dir(base_dir),
                             memory_bytes=_size(verify_memory))


@_one_line_errors
def profiles(*targets: str | os.PathLike) -> list[NpuSpec]:
    """The hardware profiles `target=` accepts, as `npufuse profiles` lists them: every shipped one, or those named
    (shipped names or TOML files). Each has `.name` and `.describe()` (its numbers as (field, text) pairs).

    Raises:
        NpufuseError: an unknown name or a malformed TOML file.
    """
    from npufuse.npu_model.spec import list_profiles

    return [_load_target(t) for t in (targets or list_profiles())]


# ---- shared with the commands --------------------------------------------------------------------

def _load_target(target: str | os.PathLike | None, precision_mode: str | None = None,
                 op_select_implmode: str | None = None, optypelist_for_implmode: Iterable[str] | str = (),
                 enable_small_channel: bool = False) -> NpuSpec | None:
    """The profile `target` names, priced under `precision_mode` where given (else the profile's own) and ATC's
    operator implementation mode (`op_select_implmode`, None: ATC's default; `optypelist_for_implmode`: op types,
    a list or ATC's comma-separated string) and --enable_small_channel (`enable_small_channel`)."""
    if target is None:
        return None
    from npufuse.npu_model.impl_mode import ImplModeError
    from npufuse.npu_model.precision import PrecisionModeError
    from npufuse.npu_model.spec import ProfileError, load_profile

    try:
        spec = load_profile(os.fspath(target)).with_precision(precision_mode)
    except (ProfileError, PrecisionModeError) as exc:
        raise InputError(f"--precision-mode: {exc}" if isinstance(exc, PrecisionModeError) else str(exc)) from None
    try:
        return spec.with_impl_mode(op_select_implmode, optypelist_for_implmode).with_small_channel(enable_small_channel)
    except ImplModeError as exc:
        raise InputError(f"--op-select-implmode / --optypelist-for-implmode: {exc}") from None


def _with_kernels(spec: NpuSpec | None, kernels: PathLike | None) -> NpuSpec | None:
    """The target with the user's kernels file read in (npu_model.user_kernels); a bad file is one line."""
    if kernels is None or spec is None:
        return spec
    import dataclasses

    from npufuse.fusion.kernels_file import read_kernels_file

    return dataclasses.replace(spec, user_kernels=read_kernels_file(kernels))


def _profile_file(target: str | os.PathLike | None) -> tuple[Path, ...]:
    """The target TOML the run reads, if it names a file: no output may overwrite it."""
    return (Path(target),) if target and Path(target).is_file() else ()


def _progress(progress: bool | Progress) -> Progress:
    from npufuse.console.progress import Progress

    if isinstance(progress, Progress):
        return progress
    return Progress.for_cli(quiet=not progress)


def _dims(dims: Dims) -> dict[str, int]:
    """Dims as the engine wants them, checked as `--dim` is (the same message for the same value)."""
    if dims is None:
        return {}
    if isinstance(dims, str):
        dims = [dims]
    elif isinstance(dims, Mapping):
        dims = [f"{name}={value}" for name, value in dims.items()]
    return parse_dims(list(dims))


def _size(value: str | int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InputError(f"verify_memory {value!r}: expected a size such as '1GiB' or a number of bytes")
    return parse_size(str(value), "--verify-memory")


def _names(names: Iterable[str] | str) -> list[str]:
    return [names] if isinstance(names, str) else list(names)


def _check_margin(margin: float | None) -> None:
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not 0.0 <= margin < 1.0):
        raise InputError(f"margin {margin!r}: expected a fraction in [0, 1), e.g. 0.05")


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InputError(f"seed {seed!r}: expected an integer >= 0")


def _report_format(fmt: str) -> str:
    from npufuse.reporting import REPORT_FORMATS

    if fmt not in REPORT_FORMATS:
        raise InputError(f"report format {fmt!r}: expected one of {', '.join(REPORT_FORMATS)}")
    return fmt


def _dir(base_dir: PathLike | None) -> str | None:
    return os.fspath(base_dir) if base_dir is not None else None


@dataclass(frozen=True)
class _Source:
    """A model to read, from a file or memory, checked as `load_model` checks a file."""

    proto: onnx.ModelProto
    path: Path | None           # the file it came from; None for a ModelProto
    base_dir: str | None        # the folder its external data locations are relative to
    label: str | None           # how reports name it: the path as given, None for a ModelProto
    data_files: frozenset[Path]

    @classmethod
    def of(cls, model: ModelLike, base_dir: PathLike | None, role: str = "model") -> _Source:
        from npufuse.ir.modelio import check_model, input_data_files, load_model, model_dir
        from npufuse.ir.weights import data_files, is_external, iter_tensors

        if isinstance(model, onnx.ModelProto):
            where = f"{role} (an onnx.ModelProto)"
            if not model.graph.node and not model.graph.output:
                raise InputError(f"{where}: holds no graph (no nodes, no outputs); pass a loaded ONNX model")
            folder = _dir(base_dir)
            external = next((t for t in iter_tensors(model) if is_external(t)), None)
            if external is not None and folder is None:
                raise InputError(f"{where}: tensor {external.name!r} is stored in an external data file; pass "
                                 "base_dir= the folder the model was loaded from, or load it with "
                                 "onnx.load(path) (which reads the weights in)")
            try:
                check_model(model, folder)
            except InputError as exc:
                raise InputError(f"{where}: {exc}") from None
            files = frozenset(data_files(model, folder)) if folder is not None else frozenset()
            return cls(model, None, folder, None, files)
        if isinstance(model, (str, os.PathLike)):
            if base_dir is not None:
                raise InputError(f"base_dir= is for an onnx.ModelProto; the external data of {os.fspath(model)} "
                                 "is read from the model's own folder")
            proto = load_model(model)
            return cls(proto, Path(model), model_dir(model), str(model),
                       frozenset(input_data_files(proto, model)))
        raise InputError(f"{role}: expected a path or an onnx.ModelProto, got {type(model).__name__}")


def _guard_model(model: ModelLike, base_dir: PathLike | None, role: str) -> ModelLike:
    """What npufuse.guard.api reads: a path as given (it loads, checks and labels it as the command does), or a
    ModelProto checked as a loaded file is."""
    if isinstance(model, onnx.ModelProto):
        return _Source.of(model, base_dir, role).proto
    if base_dir is not None and isinstance(model, (str, os.PathLike)):
        raise InputError(f"base_dir= is for an onnx.ModelProto; the external data of {os.fspath(model)} is read "
                         "from the model's own folder")
    return model


def _json(doc: Mapping[str, Any]) -> str:
    from npufuse.console.jsontext import dumps_indented

    return dumps_indented(doc)   # json.dumps(doc, indent=2), faster on a big report


def _write_text(path: Path, text: str) -> None:
    from npufuse.ir.modelio import atomic_write

    atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"), "the report")
