"""What every npufuse command shares: bad input or usage is one line on stderr and exit code 2."""

from __future__ import annotations

from typing import Any

import click

from npufuse.errors import EXIT_BAD_INPUT, InputError


class OneLineError(click.ClickException):
    """Bad input or usage: `npufuse: error: ...` on stderr, exit code 2, no usage dump or traceback."""

    exit_code = EXIT_BAD_INPUT

    def show(self, file: Any = None) -> None:
        click.echo(f"npufuse: error: {self.format_message()}", err=True)


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
