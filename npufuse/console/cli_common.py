"""What every npufuse command shares: bad input or usage is one line on stderr and exit code 2."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import click

from npufuse.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, InputError
from npufuse.console.textsafe import safe_line


class OneLineError(click.ClickException):
    """Bad input or usage: `npufuse: error: ...` on stderr, exit code 2, no usage dump or traceback."""

    exit_code = EXIT_BAD_INPUT

    def show(self, file: Any = None) -> None:
        # One line whatever the message quotes (a path, a node name): control characters are escaped.
        click.echo(f"npufuse: error: {safe_line(self.format_message())}", err=True)


class OneLineCommand(click.Command):
    """Turns click usage errors and npufuse's InputError into one line and exit code 2, whether the
    command runs on its own or under the `npufuse` group."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            raise OneLineError(f"{exc.format_message().rstrip('.')}; see `npufuse {self.name} --help`") from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except InputError as exc:
            raise OneLineError(str(exc)) from None
        except OSError as exc:
            if not _stdout_failed(exc):
                raise
            _silence_stdout()
            if isinstance(exc, BrokenPipeError):  # `npufuse report ... | head`: the reader left; say nothing
                ctx.exit(0)
            raise OneLineError(f"cannot write to standard output ({exc.strerror or exc}); any output file the "
                               "command wrote is complete, its printed summary is not: redirect stdout elsewhere, "
                               "or pass -q") from None
        except KeyboardInterrupt:
            # click would print "Aborted!" and exit 1, the drift code. The temp files of a write in progress
            # are already gone: every write removes its own on the way out (modelio.atomic_write).
            raise Interrupted() from None


class Interrupted(click.ClickException):
    """Ctrl-C: one line on stderr and exit code 130 (128 + SIGINT), as a shell reports it."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self) -> None:
        super().__init__("interrupted (Ctrl-C); the write in progress, if any, was abandoned and left no partial file")

    def show(self, file: Any = None) -> None:
        click.echo(f"npufuse: error: {self.format_message()}", err=True)


def _stdout_failed(exc: OSError) -> bool:
    """True if `exc` came from printing to standard output (a full disk, a closed pipe), not from a file."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or not frames[-1].filename.replace(os.sep, "/").endswith("click/utils.py"):
        return False
    try:  # the stream itself refuses: a full device or a closed pipe
        sys.stdout.flush()
    except OSError:
        return True
    return isinstance(exc, BrokenPipeError) or exc.errno is not None


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
