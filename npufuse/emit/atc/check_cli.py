"""`npufuse atc-check`: would ATC's ONNX parser accept this model? An offline `atc --mode=3`.

    npufuse atc-check MODEL [--ge released|head] [--format text|json] [-o FILE]

Exit codes: 0 nothing would be refused (warnings may be listed); 1 ATC would refuse the model; 2 bad input or
usage (one line on stderr); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import onnx

from npufuse.console.cli_common import OneLineCommand
from npufuse.console.textsafe import safe_text
from npufuse.emit.atc.precheck import GE_VERSIONS, atc_problems, format_text, refused, to_json
from npufuse.errors import EXIT_DRIFT, EXIT_OK, InputError, first_line

# 1, the drift code of `npufuse check`: "the model is not fit for what was asked", not bad input.
EXIT_REFUSED = EXIT_DRIFT


def load_structure(path: Path) -> onnx.ModelProto:
    """The model's graph without its external weights (the check never reads a tensor); InputError on bad input."""
    if not path.exists():
        raise InputError(f"{path}: no such file; pass the path of an .onnx model")
    if path.is_dir():
        raise InputError(f"{path}: is a directory; pass the path of an .onnx model file")
    if not path.is_file():  # a FIFO or a device would block the read forever
        raise InputError(f"{path}: not a regular file (a pipe, socket or device); save the model to a file first")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError, OSError, ...
        raise InputError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {first_line(exc)}); "
                         "check the file is complete and was saved by onnx.save") from None
    # Protobuf parses many non-ONNX files into an empty message rather than failing.
    if not model.graph.node and not model.graph.output:
        raise InputError(f"{path}: the file parsed but holds no graph (truncated or not ONNX?); re-export the model")
    return model


@click.command("atc-check", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_path", metavar="MODEL", type=click.Path(path_type=Path))
@click.option("--ge", type=click.Choice(GE_VERSIONS), default="released", show_default=True,
              help="Which CANN parser to check against: released GE (v8.5.0..v9.2.0-beta.1) needs every node's "
                   "domain set when the model imports two domains; head (not yet released) reads \"\" as ai.onnx.")
@click.option("--format", "fmt", type=click.Choice(("text", "json")), default="text", show_default=True,
              help="text: one line per problem and a total; json: counts and every problem as fields.")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Write the report here instead of standard output (the total line is still printed).")
@click.option("--kernels", "kernels", type=click.Path(path_type=Path), metavar="FILE",
              help="Your kernels file (docs/kernels.md): the keys its [kernel.atc] nodes declare count as "
                   "registered (your plugins register them).")
def atc_check(model_path: Path, ge: str, fmt: str, output: Path | None, kernels: Path | None) -> None:
    """Check offline what ATC's ONNX parser would refuse (as `atc --mode=3` does, If branches included).

    Every node is looked up by the key CANN's parser builds, <domain>::<opset>::<op_type>, in the table of keys
    CANN's ONNX plugins register; each miss is E13010, each fix is one line.

    Exit codes: 0 nothing refused, 1 ATC would refuse the model, 2 bad input or usage.
    """
    from npufuse.ir.modelio import atomic_write, check_output_path, input_data_files

    model = load_structure(model_path)
    if output is not None:
        check_output_path(output, model_path, False, "-o/--output", data_files=input_data_files(model, model_path))
    extra: frozenset[str] = frozenset()
    if kernels is not None:
        from npufuse.emit.atc.keys import make_key
        from npufuse.fusion.kernels_file import read_kernels_file

        extra = frozenset(make_key(k.atc.domain, k.atc.version, k.atc.op_type) for k in read_kernels_file(kernels)
                          if k.atc is not None)
    problems = atc_problems(model, ge=ge, extra_keys=extra)
    text = format_text(problems, str(model_path), ge=ge)
    report = json.dumps({"model": str(model_path), "ge": ge, **to_json(problems)}, indent=2) + "\n" \
        if fmt == "json" else text
    if output is None:
        click.echo(safe_text(report) if fmt == "text" else report, nl=False)
    else:
        atomic_write(output, lambda tmp: Path(tmp).write_text(report, encoding="utf-8"), "the report")
        click.echo(text.splitlines()[-1])  # the total line: already made printable by format_text
    click.get_current_context().exit(EXIT_REFUSED if refused(problems) else EXIT_OK)
