"""Command line: `npufuse optimize | report | check | profiles`.

Exit codes: 0 ok; 1 numeric drift or a failed verification; 2 bad input or usage (one line, no traceback);
130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from npufuse import __version__
from npufuse.cli_common import OneLineCommand, OneLineError
from npufuse.errors import EXIT_DRIFT, InputError, parse_dims, parse_size
from npufuse.textsafe import safe_line, safe_text


class _Group(click.Group):
    """Every subcommand reports bad input or usage in one line with exit code 2 (see cli_common)."""

    command_class = OneLineCommand

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args:
            return super().parse_args(ctx, args)  # plain `npufuse` shows the help
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            raise OneLineError(f"{exc.format_message().rstrip('.')}; see `npufuse --help`") from None

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            raise OneLineError(f"{exc.format_message().rstrip('.')}; see `npufuse --help`") from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="npufuse")
def main() -> None:
    """Fuse ONNX graphs for Ascend-style NPUs, priced by a cost model and proven numerically."""


def _load_target(target: str | None):
    if target is None:
        return None
    from npufuse.npu_model.spec import ProfileError, load_profile

    try:
        return load_profile(target)
    except ProfileError as exc:
        raise InputError(str(exc)) from None


def _profile_file(target: str | None) -> tuple[Path, ...]:
    """The --target TOML the run reads, if it names a file: no output may overwrite it."""
    return (Path(target),) if target and Path(target).is_file() else ()


def _progress(quiet: bool):
    from npufuse.progress import Progress

    return Progress.for_cli(quiet)


_margin_option = click.option(
    "--margin", type=click.FloatRange(min=0.0, max=1.0, max_open=True), default=None, metavar="FRACTION",
    help="Fuse only where the modeled gain exceeds this fraction of the unfused time (default 0.05).")


@main.command()
@click.argument("model", type=click.Path(dir_okay=True, path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Where to write the optimized model "
              "(default: MODEL with suffix .npufuse.onnx beside it).")
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="Also write a JSON report here.")
@click.option("--target", default="Ascend910B2", show_default=True,
              help="Hardware profile (name or TOML file) the cost model prices fusions on.")
@click.option("--force-fuse", is_flag=True, help="Fuse every legal candidate, even where the cost model says no.")
@_margin_option
@click.option("--only", multiple=True, metavar="PATTERN", help="Run only these patterns (repeatable).")
@click.option("--disable", multiple=True, metavar="PATTERN", help="Do not run these patterns (repeatable).")
@click.option("--no-verify", is_flag=True, help="Skip the numeric checks (per rewrite and whole model).")
@click.option("--dim", "dims", multiple=True, metavar="NAME=INT", help="Value for a symbolic dim (repeatable).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Seed of the generated verification inputs.")
@click.option("--verify-memory", default="1GiB", show_default=True, metavar="SIZE",
              help="Weights one onnxruntime session may hold while verifying; bigger models are run segment by "
                   "segment.")
@click.option("--external-data/--embedded-data", "external", default=None,
              help="Write the weights to OUT.data beside the model, or inside it (default: as the input had them, "
                   "and external past 2 GiB).")
@click.option("--overwrite", is_flag=True, help="Allow -o to be the input file itself.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
def optimize(model: Path, output: Path | None, report_path: Path | None, target: str, force_fuse: bool,
             margin: float | None, only: tuple[str, ...], disable: tuple[str, ...], no_verify: bool, dims: tuple[str, ...], seed: int,
             verify_memory: str, external: bool | None, overwrite: bool, quiet: bool) -> None:
    """Fuse MODEL and write the optimized model."""
    from npufuse.fusion.engine import OptimizeOptions, require_patterns
    from npufuse.fusion.engine import optimize as run_optimize
    from npufuse.modelio import (
        check_output_path,
        input_data_files,
        load_model,
        model_dir,
        write_model,
    )
    from npufuse.summary import optimize_report, optimize_text

    out = output or model.with_name(model.name.removesuffix(".onnx") + ".npufuse.onnx")
    spec = _load_target(target)
    progress = _progress(quiet)
    opts = OptimizeOptions(patterns=require_patterns(only, disable), spec=spec, force_fuse=force_fuse, margin=margin,
                           verify=not no_verify, dims=parse_dims(dims), seed=seed, progress=progress,
                           verify_memory_bytes=parse_size(verify_memory, "--verify-memory"))
    proto = load_model(model)
    data_files = input_data_files(proto, model)
    profile = _profile_file(target)
    out = check_output_path(out, model, overwrite, data_files=data_files, others=profile)
    if report_path is not None:
        check_output_path(report_path, model, False, "--report",
                          others=(out, out.with_name(out.name + ".data")) + profile, data_files=data_files)
    result = run_optimize(proto, model_dir(model), opts)
    wrote = None
    if result.ok:
        write_model(result.model, out, model_dir(model), external=bool(data_files) if external is None else external,
                    progress=progress)
        wrote = str(out)
    if report_path is not None:
        doc = optimize_report(result, str(model), wrote, spec.name if spec else None, not no_verify, spec)
        _write_text_atomic(report_path, json.dumps(doc, indent=2))
    if not quiet:
        click.echo(safe_text(optimize_text(result, wrote, not no_verify)))
    if result.inconclusive:   # not drift: the generated inputs could not exercise the model (exit 2, one line)
        why = result.model_check.reason.removeprefix("inconclusive: ")
        raise InputError(f"the whole-model check was inconclusive ({why}); nothing written. "
                         "The original model itself gives NaN/inf (or empty outputs) on npufuse's generated inputs: "
                         "set symbolic sizes with --dim (each at least 1), or pass --no-verify to write it unchecked")
    if not result.ok:
        click.echo(safe_line(f"npufuse: error: the optimized model drifts from the original "
                             f"({result.model_check.reason}); nothing written. Run with --report to see each "
                             "rewrite's check, or --disable the pattern responsible."), err=True)
        sys.exit(EXIT_DRIFT)


REPORT_FORMATS = ("text", "json", "markdown", "html")


@main.command()
@click.argument("model", type=click.Path(dir_okay=True, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(REPORT_FORMATS), default="text", show_default=True)
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Write the report here (default: stdout).")
@click.option("--target", default="Ascend910B2", show_default=True, help="Hardware profile (name or TOML file).")
@click.option("--force-fuse", is_flag=True, help="Report as if every legal candidate were fused.")
@_margin_option
@click.option("--only", multiple=True, metavar="PATTERN", help="Run only these patterns (repeatable).")
@click.option("--disable", multiple=True, metavar="PATTERN", help="Do not run these patterns (repeatable).")
@click.option("--no-verify", is_flag=True, help="Skip the numeric checks (faster; no rollbacks are seen).")
@click.option("--dim", "dims", multiple=True, metavar="NAME=INT", help="Value for a symbolic dim (repeatable).")
@click.option("--verify-memory", default="1GiB", show_default=True, metavar="SIZE",
              help="Weights one onnxruntime session may hold while verifying.")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
def report(model: Path, fmt: str, output: Path | None, target: str, force_fuse: bool, margin: float | None,
           only: tuple[str, ...], disable: tuple[str, ...], no_verify: bool, dims: tuple[str, ...],
           verify_memory: str, quiet: bool) -> None:
    """Every fusion candidate in MODEL, fused or not, with its cost estimate and the reason."""
    from npufuse.fusion.engine import OptimizeOptions, require_patterns
    from npufuse.fusion.engine import optimize as run_optimize
    from npufuse.modelio import check_output_path, input_data_files, load_model, model_dir
    from npufuse.reporting import build_report, render

    spec = _load_target(target)
    dim_values = parse_dims(dims)
    opts = OptimizeOptions(patterns=require_patterns(only, disable), spec=spec, force_fuse=force_fuse, margin=margin,
                           verify=not no_verify, dims=dim_values, progress=_progress(quiet),
                           verify_memory_bytes=parse_size(verify_memory, "--verify-memory"))
    proto = load_model(model)
    if output is not None:
        check_output_path(output, model, False, "-o", data_files=input_data_files(proto, model),
                          others=_profile_file(target))
    result = run_optimize(proto, model_dir(model), opts)
    doc = build_report(proto, result, spec, str(model), model_dir(model), dim_values, not no_verify)
    text = render(doc, fmt)
    if output is None:
        click.echo(text)
    else:
        _write_text_atomic(output, text)


@main.command()
@click.option("--target", "targets", multiple=True, metavar="PROFILE",
              help="Show only these profiles (names or TOML files); default: every shipped profile.")
def profiles(targets: tuple[str, ...]) -> None:
    """List the hardware profiles and their numbers."""
    from npufuse.npu_model.spec import list_profiles

    specs = [_load_target(t) for t in (targets or list_profiles())]
    fields = list(dict.fromkeys(name for sp in specs for name, _ in sp.describe()))   # calibrated terms vary
    rows = [[f] + [dict(sp.describe()).get(f, "-") for sp in specs] for f in fields]
    headers = [""] + [sp.name for sp in specs]
    widths = [max(len(str(r[i])) for r in rows + [headers]) for i in range(len(headers))]
    for r in [headers] + [r for r in rows if r[0] != "Profile"]:
        click.echo(safe_line("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()))


from npufuse.guard.cli import check  # noqa: E402  (the CI guard lives with its package)

main.add_command(check)

from npufuse.calibrate.cli import calibrate  # noqa: E402  (the calibration lives with its package)

main.add_command(calibrate)


def _write_text_atomic(path: Path, text: str) -> None:
    from npufuse.modelio import atomic_write

    atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"), "the report")


if __name__ == "__main__":  # pragma: no cover
    main()
