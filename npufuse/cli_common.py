"""What every npufuse command shares: bad input or usage is one line on stderr and exit code 2."""

from __future__ import annotations

from typing import Any

import click

from npufuse.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, InputError
from npufuse.textsafe import safe_line


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
