"""`npufuse check`: the CI guard on the command line.

    npufuse check ORIGINAL OPTIMIZED [--rtol R] [--atol A | --atol OUT:A ...] [--statistic S] [--junit F]
    npufuse check MODEL --save-golden GOLDEN.npz
    npufuse check MODEL --golden GOLDEN.npz

Exit codes: 0 pass; 1 drift; 2 bad input or usage (one line on stderr); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from npufuse.console.cli_common import OneLineCommand
from npufuse.errors import EXIT_DRIFT, EXIT_OK, InputError, parse_dims, parse_size
from npufuse.guard.stats import STATISTICS
from npufuse.ir.modelio import atomic_write, check_output_path, input_files, load_model
from npufuse.console.textsafe import safe_text


def parse_tolerances(values: tuple[str, ...], flag: str) -> tuple[float | None, dict[str, float]]:
    """`1e-3` for every output, `NAME:1e-3` for one (the value follows the last colon)."""
    default: float | None = None
    per: dict[str, float] = {}
    for raw in values:
        name, sep, num = raw.rpartition(":")
        try:
            value = float(num)
        except ValueError:
            raise InputError(f"{flag} {raw!r}: expected a number or NAME:NUMBER, e.g. {flag} 1e-3 or "
                             f"{flag} logits:1e-3") from None
        if not math.isfinite(value) or value < 0:
            raise InputError(f"{flag} {raw!r}: the tolerance must be a finite number >= 0")
        if sep and not name:
            raise InputError(f"{flag} {raw!r}: empty output name before ':'; write NAME:NUMBER")
        if sep:
            per[name] = value
        else:
            default = value
    return default, per


@click.command("check", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("original", type=click.Path(path_type=Path))
@click.argument("optimized", type=click.Path(path_type=Path), required=False)
@click.option("--golden", type=click.Path(path_type=Path), help="Compare MODEL with the inputs and outputs stored "
              "in this golden file.")
@click.option("--save-golden", type=click.Path(path_type=Path), help="Run MODEL on seeded inputs and store inputs "
              "and outputs in this .npz (the golden for later --golden checks).")
@click.option("--rtol", "rtols", multiple=True, metavar="[NAME:]FLOAT",
              help="Relative tolerance, for every output or NAME:FLOAT for one (repeatable).")
@click.option("--atol", "atols", multiple=True, metavar="[NAME:]FLOAT",
              help="Absolute tolerance, for every output or NAME:FLOAT for one (repeatable). "
                   "Default: a floor of atol_scale * max|want| per dtype.")
@click.option("--statistic", type=click.Choice(STATISTICS), default="elementwise", show_default=True,
              help="Which error must be within atol + rtol*|want|: every element, the max, the mean, or a quantile.")
@click.option("--quantile", type=float, default=0.99, show_default=True,
              help="Fraction of elements that must pass with --statistic quantile.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the generated inputs.")
@click.option("--dim", "dims", multiple=True, metavar="NAME=INT", help="Value for a symbolic dim (repeatable).")
@click.option("--junit", type=click.Path(path_type=Path), help="Write JUnit XML here (one test case per output "
              "and per culprit).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the full result as JSON here.")
@click.option("--no-attribution", is_flag=True, help="On drift, do not search for the rewrite responsible.")
@click.option("--verify-memory", default="1GiB", show_default=True, metavar="SIZE",
              help="Weights one onnxruntime session may hold; bigger models are run segment by segment.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the verdict line and errors.")
def check(original: Path, optimized: Path | None, golden: Path | None, save_golden: Path | None,
          rtols: tuple[str, ...], atols: tuple[str, ...], statistic: str, quantile: float, seed: int,
          dims: tuple[str, ...], junit: Path | None, json_path: Path | None, no_attribution: bool,
          verify_memory: str, quiet: bool) -> None:
    """Check that a model still computes what it should.

    \b
    npufuse check ORIGINAL OPTIMIZED        same seeded inputs to both, compare every output
    npufuse check MODEL --save-golden G     store inputs and outputs once
    npufuse check MODEL --golden G          compare MODEL with the stored outputs

    Exit codes: 0 pass, 1 drift, 2 bad input or usage.
    """
    from npufuse.guard import api

    modes = sum(x is not None for x in (optimized, golden, save_golden))
    if modes != 1:
        raise InputError("pass exactly one of OPTIMIZED, --golden FILE or --save-golden FILE "
                         "(e.g. npufuse check model.onnx model.npufuse.onnx)")
    rtol, rtol_per = parse_tolerances(rtols, "--rtol")
    atol, atol_per = parse_tolerances(atols, "--atol")
    per_output: dict[str, dict[str, float]] = {}
    for key, per in (("rtol", rtol_per), ("atol", atol_per)):
        for name, v in per.items():
            per_output.setdefault(name, {})[key] = v
    dim_values = parse_dims(dims)
    memory_bytes = parse_size(verify_memory, "--verify-memory")
    # Nothing this command writes may land on a file it reads (a model or its external data, the golden) or on
    # another output. Loading the models here also reports a bad model before anything runs.
    original_files = input_files(load_model(original), original)
    reads: set[Path] = input_files(load_model(optimized), optimized) if optimized is not None else set()
    if golden is not None:
        reads.add(golden)
    written: list[Path] = []
    for flag, path in (("--save-golden", save_golden), ("--junit", junit), ("--json", json_path)):
        if path is not None:
            check_output_path(path, original, False, flag, others=tuple(reads) + tuple(written),
                              data_files=original_files)
            written.append(path)

    if save_golden is not None:
        if rtols or atols or junit or json_path:
            raise InputError("--save-golden stores outputs and compares nothing; drop --rtol/--atol/--junit/--json")
        out = api.save_golden(original, save_golden, seed=seed, dims=dim_values, memory_bytes=memory_bytes)
        if not quiet:
            click.echo(safe_text(f"npufuse check: wrote golden inputs and outputs of {original} to {out} "
                                 f"(seed {seed})"))
        return

    from npufuse import api as public
    from npufuse.errors import InconclusiveError

    inconclusive = None
    try:   # the Python API's check: the command cannot judge differently from it
        result = public.check(original, optimized, golden=golden, rtol=rtol, atol=atol, per_output=per_output,
                              statistic=statistic, quantile=quantile, seed=seed, dims=dim_values,
                              attribute_drift=not no_attribution, verify_memory=memory_bytes)
    except InconclusiveError as exc:   # not drift: the reports first, then one line and exit code 2
        result, inconclusive = exc.result, exc
    if junit is not None:
        atomic_write(junit, lambda tmp: Path(tmp).write_text(result.to_junit_xml(), encoding="utf-8"), "--junit")
    if json_path is not None:
        doc = json.dumps(result.to_dict(), indent=2) + "\n"
        atomic_write(json_path, lambda tmp: Path(tmp).write_text(doc, encoding="utf-8"), "--json")
    text = result.to_text()
    click.echo(safe_text(text.splitlines()[-1] if quiet else text))
    if inconclusive is not None:
        raise inconclusive
    click.get_current_context().exit(EXIT_OK if result.ok else EXIT_DRIFT)
