"""`npufuse calibrate DATA... --target PROFILE -o PROFILE.toml`: fit, validate leave-one-model-out, write."""

from __future__ import annotations

import json
from pathlib import Path

import click

from npufuse.console.cli_common import OneLineCommand
from npufuse.errors import InputError


@click.command(cls=OneLineCommand)
@click.argument("data", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--target", required=True, help="The profile to calibrate (name or TOML file); its rows are those "
              "whose `profile` is this profile's name.")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="Where to write the calibrated profile TOML.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Also write the table and fit as JSON.")
@click.option("--fit", "fit_keys", metavar="KEY,KEY", help="Terms to fit (default: by the kind of rows; see "
              "docs/calibration.md), e.g. cube.efficiency_max,launch.graph_kernel_us.")
@click.option("--disable", multiple=True, metavar="PATTERN",
              help="Patterns the engine must not apply when it builds the recipes (repeatable).")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
def calibrate(data: tuple[Path, ...], target: str, output: Path, json_path: Path | None, fit_keys: str | None,
              disable: tuple[str, ...], quiet: bool) -> None:
    """Fit a profile's calibrated terms to published timings (DATA: calibration TOML files)."""
    from npufuse.calibrate import data as data_mod
    from npufuse.calibrate.fit import PARAMS
    from npufuse.calibrate.profile_out import data_name, profile_text, strip_calibration
    from npufuse.calibrate.run import calibrate as run_calibrate
    from npufuse.calibrate.run import format_summary, format_table
    from npufuse.calibrate.workloads import Builder
    from npufuse.fusion.engine import require_patterns
    from npufuse.npu_model.spec import ProfileError, _parse, load_profile

    try:
        given = load_profile(target)
    except ProfileError as exc:
        raise InputError(str(exc)) from None
    source = Path(given.source_path)
    if source.is_file():
        text_in = source.read_text("utf-8")
    else:
        from importlib import resources

        text_in = resources.files("npufuse.npu_model").joinpath("profiles", f"{given.name}.toml").read_text("utf-8")
    # an earlier calibration's terms are dropped: the fit starts from the physics, whatever the input's history
    text_in, _previous = strip_calibration(text_in)
    spec = _parse(text_in.encode("utf-8"), given.source_path, given.name)
    keys = None
    if fit_keys:
        keys = [k.strip() for k in fit_keys.split(",") if k.strip()]
        bad = [k for k in keys if k not in PARAMS]
        if bad:
            raise InputError(f"--fit {bad[0]!r} is not a calibrated term; use some of {', '.join(PARAMS)}")
    require_patterns(None, disable)
    inputs = {p.resolve() for p in data}
    if Path(target).is_file():
        inputs.add(Path(target).resolve())
    for out in (output, json_path):
        if out is not None and out.resolve() in inputs:
            raise InputError(f"{out}: is one of the inputs; write the result to another file (inputs are never "
                             "modified)")
    files = data_mod.load([str(p) for p in data])
    seen: set[str] = set()

    def progress(i: int, n: int, row) -> None:
        if not quiet and row.workload not in seen:
            seen.add(row.workload)
            click.echo(f"[{i + 1}/{n}] {row.workload}", err=True)

    cal = run_calibrate(files, spec, keys, Builder(spec, disable=tuple(disable)), progress)
    click.echo(format_table(cal))
    click.echo(format_summary(cal))
    text = profile_text(text_in, cal, [data_name(str(p)) for p in data], tuple(disable))
    _check_loads(text, output)
    _write(output, text)
    if json_path is not None:
        doc = cal.to_dict() | {"command": _command(data, target, output, json_path, fit_keys, disable)}
        _write(json_path, json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


def _check_loads(text: str, output: Path) -> None:
    from npufuse.npu_model.spec import ProfileError, _parse

    try:
        _parse(text.encode("utf-8"), str(output), output.stem)
    except ProfileError as exc:  # pragma: no cover - a bug in profile_out, not bad input
        raise AssertionError(f"the calibrated profile does not load: {exc}") from exc


def _write(path: Path, text: str) -> None:
    from npufuse.ir.modelio import atomic_write

    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), what="the calibrated profile")


def _command(data, target, output, json_path, fit_keys, disable) -> str:
    parts = ["npufuse calibrate", *(str(d) for d in data), "--target", str(target), "-o", str(output)]
    if fit_keys:
        parts += ["--fit", fit_keys]
    for d in disable:
        parts += ["--disable", d]
    if json_path is not None:
        parts += ["--json", str(json_path)]
    return " ".join(parts)
