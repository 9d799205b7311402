"""Command line: `npufuse optimize | report | check | profiles`.

Exit codes: 0 ok; 1 numeric drift or a failed verification; 2 bad input or usage (one line, no traceback);
130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from npufuse import __version__
from npufuse.console.cli_common import OneLineCommand, OneLineError
from npufuse.errors import EXIT_DRIFT, DriftError, InconclusiveError
from npufuse.console.textsafe import safe_line, safe_text


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


def _progress(quiet: bool):
    from npufuse.console.progress import Progress

    return Progress.for_cli(quiet)


_precision_option = click.option(
    "--precision-mode", "precision_mode", metavar="MODE", default=None,
    help="ATC's --precision_mode (or --precision_mode_v2) value you will compile with: the dtypes every kernel is "
         "priced in (default: the profile's, ATC's default force_fp16; e.g. allow_fp32_to_fp16, "
         "must_keep_origin_dtype, allow_mix_precision; docs/cost-model.md).")

def _implmode_options(f):
    """ATC's --op_select_implmode, --optypelist_for_implmode and --enable_small_channel, as `optimize` and `report`
    take them."""
    f = click.option(
        "--optypelist-for-implmode", "optypelist_for_implmode", metavar="OPS", default="",
        help="ATC's --optypelist_for_implmode: the op types (comma-separated, e.g. Sigmoid) --op-select-implmode "
             "applies to.")(f)
    f = click.option(
        "--enable-small-channel", "enable_small_channel", is_flag=True, default=False,
        help="ATC's --enable_small_channel=1 is set in your compile: a Conv reading at most 4 channels (an RGB stem) "
             "is priced in ATC's C04 format (docs/cost-model.md).")(f)
    return click.option(
        "--op-select-implmode", "op_select_implmode", metavar="MODE", default=None,
        help="ATC's --op_select_implmode you will compile with (default: ATC's, high_performance; also "
             "high_precision, high_performance_for_all, high_precision_for_all): which kernels are priced in their "
             "high-precision implementation (docs/cost-model.md).")(f)


_margin_option = click.option(
    "--margin", type=click.FloatRange(min=0.0, max=1.0, max_open=True), default=None, metavar="FRACTION",
    help="Fuse only where the modeled gain exceeds this fraction of the time at stake: the unfused time less "
         "the Cube work both sides share (default 0.05).")


@main.command()
@click.argument("model", type=click.Path(dir_okay=True, path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Where to write the optimized model "
              "(default: MODEL with suffix .npufuse.onnx beside it).")
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="Also write a JSON report here.")
@click.option("--target", default="Ascend910B2", show_default=True,
              help="Hardware profile (name or TOML file) the cost model prices fusions on.")
@click.option("--force-fuse", is_flag=True, help="Fuse every legal candidate, even where the cost model says no.")
@_precision_option
@_implmode_options
@_margin_option
@click.option("--only", multiple=True, metavar="PATTERN", help="Run only these patterns (repeatable).")
@click.option("--disable", multiple=True, metavar="PATTERN", help="Do not run these patterns (repeatable).")
@click.option("--kernels", "kernels", type=click.Path(path_type=Path), metavar="FILE",
              help="Your own fused kernels (TOML): the regions they run are fused for the target "
                   "(docs/kernels.md).")
@click.option("--fusion-switch", "fusion_switch", type=click.Path(path_type=Path), metavar="FILE",
              help="ATC's fusion switch file (JSON or PassName:off lines): run only the patterns it leaves on; "
                   "--only/--disable then apply on top (docs/fusion-switch.md).")
@click.option("--write-fusion-switch", "switch_out", type=click.Path(path_type=Path), metavar="FILE",
              help="Also write ATC's fusion switch file: its passes npufuse did are off, those it left to ATC on.")
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
@click.option("--emit", type=click.Choice(["onnx", "atc"]), default="onnx", show_default=True,
              help="onnx: fused ops with function bodies (any onnxruntime runs it); atc: what CANN's ATC converts "
                   "(plugin nodes for the fused kernels that have one, standard ops elsewhere; docs/atc.md).")
@click.option("--ge", type=click.Choice(["released", "head"]), default="released", show_default=True,
              help="With --emit atc: the GE (ATC) versions to parse on: released v8.5.0..v9.2.0-beta.1, or head.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
def optimize(model: Path, output: Path | None, report_path: Path | None, target: str, force_fuse: bool,
             margin: float | None, only: tuple[str, ...], disable: tuple[str, ...], fusion_switch: Path | None,
             switch_out: Path | None, no_verify: bool, dims: tuple[str, ...], seed: int,
             verify_memory: str, external: bool | None, overwrite: bool, emit: str, ge: str, kernels: Path | None,
             precision_mode: str | None, op_select_implmode: str | None, optypelist_for_implmode: str,
             enable_small_channel: bool, quiet: bool) -> None:
    """Fuse MODEL and write the optimized model."""
    from npufuse import api

    suffix = ".atc.onnx" if emit == "atc" else ".npufuse.onnx"
    out = output or model.with_name(model.name.removesuffix(".onnx") + suffix)
    try:
        result = api.optimize(model, target=target, output=out, report=report_path, verify=not no_verify,
                              force_fuse=force_fuse, margin=margin, only=only, disable=disable,
                              fusion_switch=fusion_switch, write_fusion_switch=switch_out, dims=dims, seed=seed,
                              kernels=kernels, precision_mode=precision_mode,
                              op_select_implmode=op_select_implmode, optypelist_for_implmode=optypelist_for_implmode,
                              enable_small_channel=enable_small_channel, verify_memory=verify_memory,
                              external_data=external, overwrite=overwrite,
                              progress=_progress(quiet), emit=emit, ge=ge)
    except (DriftError, InconclusiveError) as exc:   # the summary first, then the one line
        if not quiet:
            click.echo(safe_text(exc.result.summary()))
        if isinstance(exc, InconclusiveError):
            raise   # exit 2, one line (OneLineCommand)
        click.echo(safe_line(f"npufuse: error: {exc}"), err=True)
        sys.exit(EXIT_DRIFT)
    if not quiet:
        click.echo(safe_text(result.summary()))


REPORT_FORMATS = ("text", "json", "markdown", "html")


@main.command()
@click.argument("model", type=click.Path(dir_okay=True, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(REPORT_FORMATS), default="text", show_default=True)
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Write the report here (default: stdout).")
@click.option("--target", default="Ascend910B2", show_default=True, help="Hardware profile (name or TOML file).")
@click.option("--force-fuse", is_flag=True, help="Report as if every legal candidate were fused.")
@_precision_option
@_implmode_options
@_margin_option
@click.option("--only", multiple=True, metavar="PATTERN", help="Run only these patterns (repeatable).")
@click.option("--disable", multiple=True, metavar="PATTERN", help="Do not run these patterns (repeatable).")
@click.option("--kernels", "kernels", type=click.Path(path_type=Path), metavar="FILE",
              help="Your own fused kernels (TOML): the regions they run are fused for the target "
                   "(docs/kernels.md).")
@click.option("--fusion-switch", "fusion_switch", type=click.Path(path_type=Path), metavar="FILE",
              help="ATC's fusion switch file (JSON or PassName:off lines): run only the patterns it leaves on; "
                   "--only/--disable then apply on top (docs/fusion-switch.md).")
@click.option("--no-verify", is_flag=True, help="Skip the numeric checks (faster; no rollbacks are seen).")
@click.option("--dim", "dims", multiple=True, metavar="NAME=INT", help="Value for a symbolic dim (repeatable).")
@click.option("--verify-memory", default="1GiB", show_default=True, metavar="SIZE",
              help="Weights one onnxruntime session may hold while verifying.")
@click.option("--emit", type=click.Choice(["onnx", "atc"]), default="onnx", show_default=True,
              help="atc: also show what each fused region becomes in the ATC form (plugin node and CANN kernel, "
                   "or why it stays standard ops; docs/atc.md).")
@click.option("--ge", type=click.Choice(["released", "head"]), default="released", show_default=True,
              help="With --emit atc: the GE (ATC) versions to parse on.")
@click.option("--kernel-briefs", "kernel_briefs", type=click.Path(path_type=Path), metavar="DIR",
              help="Write a brief per kernel opportunity into this new folder: the fused op, shapes, tile, modeled "
                   "times, reference kernel and test vectors from the model's activations (docs/kernels.md).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the inputs the test vectors use.")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
def report(model: Path, fmt: str, output: Path | None, target: str, force_fuse: bool, margin: float | None,
           only: tuple[str, ...], disable: tuple[str, ...], fusion_switch: Path | None, no_verify: bool,
           dims: tuple[str, ...], verify_memory: str, emit: str, ge: str, kernel_briefs: Path | None, seed: int,
           kernels: Path | None, precision_mode: str | None, op_select_implmode: str | None,
           optypelist_for_implmode: str, enable_small_channel: bool, quiet: bool) -> None:
    """Every fusion candidate in MODEL, fused or not, with its cost estimate and the reason."""
    from npufuse import api

    doc = api.report(model, target=target, format=fmt, output=output, verify=not no_verify, force_fuse=force_fuse,
                     margin=margin, only=only, disable=disable, fusion_switch=fusion_switch, dims=dims,
                     verify_memory=verify_memory, emit=emit, ge=ge, kernel_briefs=kernel_briefs, seed=seed,
                     kernels=kernels, precision_mode=precision_mode, op_select_implmode=op_select_implmode,
                     optypelist_for_implmode=optypelist_for_implmode, enable_small_channel=enable_small_channel,
                     progress=_progress(quiet))
    if output is None:
        click.echo(doc.render(fmt))


@main.command()
@click.option("--target", "targets", multiple=True, metavar="PROFILE",
              help="Show only these profiles (names or TOML files); default: every shipped profile.")
def profiles(targets: tuple[str, ...]) -> None:
    """List the hardware profiles and their numbers."""
    from npufuse import api

    specs = api.profiles(*targets)
    fields = list(dict.fromkeys(name for sp in specs for name, _ in sp.describe()))   # calibrated terms vary
    rows = [[f] + [dict(sp.describe()).get(f, "-") for sp in specs] for f in fields]
    headers = [""] + [sp.name for sp in specs]
    widths = [max(len(str(r[i])) for r in rows + [headers]) for i in range(len(headers))]
    for r in [headers] + [r for r in rows if r[0] != "Profile"]:
        click.echo(safe_line("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()))


from npufuse.guard.cli import check  # noqa: E402  (the CI guard lives with its package)

main.add_command(check)

from npufuse.calibrate.cli import calibrate  # noqa: E402  (the calibration lives with its package)
from npufuse.emit.atc.check_cli import atc_check  # noqa: E402  (ATC's pre-check lives with the ATC form)

main.add_command(calibrate)
main.add_command(atc_check)


if __name__ == "__main__":  # pragma: no cover
    main()
