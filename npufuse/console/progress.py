"""Progress of long work, per stage: a bar on a terminal, one line per stage in logs, nothing with -q.

Plain writes to a stream (stderr by default), no dependency: the bar is `\\r` plus a redrawn line, which every
terminal understands, and logs (stderr not a terminal) get exactly one line per stage when it ends, so a CI log
of a big model stays short and greppable.

    progress = Progress.for_cli(quiet)
    with progress.stage("verify original", unit="segments") as stage:
        for ...:
            stage.update(done, total)

Stages may nest (a match phase holds the rewrite checks of its rounds): on a terminal the inner bar takes the
line while it runs, and when it ends the outer bar is drawn again on the next line. Not thread-safe: one thread
drives one `Progress`.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from npufuse.console.units import format_bytes
from npufuse.console.textsafe import safe_line

_BAR_CELLS = 20
_PREFIX = "npufuse: "


class Progress:
    """Per-stage progress on a stream (default sys.stderr).

    `enabled=False` writes nothing at all; `tty` picks the bar (True) or the one-line-per-stage log (False), by
    default from `stream.isatty()`. `clock` and `min_interval_s` are there for tests and for throttling: a bar is
    redrawn at most every `min_interval_s`, since hot loops call `advance` far more often than a terminal can
    usefully show."""

    def __init__(self, stream: TextIO | None = None, enabled: bool = True, tty: bool | None = None,
                 min_interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic,
                 min_log_s: float = 0.0) -> None:
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self.enabled = enabled
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.tty = tty
        self.min_interval_s = min_interval_s
        self.min_log_s = min_log_s   # logs skip stages quicker than this (a small model's run stays quiet)
        self.clock = clock
        # Stages entered and not yet left, innermost last: the one to redraw when an inner stage ends.
        self._active: list[Stage] = []
        # The stage whose bar is on the current, unfinished terminal line (None: the cursor is at a line start),
        # and that line's length, so a shorter redraw can blank what the longer one left.
        self._line_owner: Stage | None = None
        self._line_len = 0

    @classmethod
    def for_cli(cls, quiet: bool) -> Progress:
        """Progress for a command: silent with `-q`; a bar when stderr is a terminal, log lines otherwise.

        A `TERM=dumb` terminal (an editor's shell buffer) counts as a log: it may not honour `\\r`."""
        stream = sys.stderr
        isatty = getattr(stream, "isatty", None)
        tty = bool(isatty()) if callable(isatty) else False
        return cls(stream, enabled=not quiet, tty=tty and os.environ.get("TERM") != "dumb", min_log_s=1.0)

    @staticmethod
    def silent() -> Progress:
        """A Progress that writes nothing: the default of library calls, which should not print."""
        return Progress(enabled=False)

    def stage(self, name: str, total: float | None = None, unit: str = "") -> Stage:
        """A stage to use as a context manager. `unit` names what is counted ("segments"); "B" counts bytes,
        shown with binary prefixes. `total` may be unknown (None) and set later with `Stage.update`."""
        return Stage(self, name, total, unit)

    def note(self, message: str) -> None:
        """One line `npufuse: message`, on a line of its own even while a bar is drawn (nothing when disabled)."""
        if not self.enabled:
            return
        self._clear_line()
        self.stream.write(f"{_PREFIX}{safe_line(message)}\n")
        self.stream.flush()

    # ---- terminal line bookkeeping (tty only) ----------------------------------------------------------------

    def _clear_line(self) -> None:
        """Blank a bar left on the current line, so what follows starts at column 0 of a clean line."""
        if self._line_owner is not None:
            self.stream.write("\r" + " " * self._line_len + "\r")
            self._line_owner, self._line_len = None, 0

    def _write_line(self, owner: Stage, line: str) -> None:
        # Pad to the previous line's length: `\r` moves the cursor but does not erase what a longer line left.
        pad = max(self._line_len - len(line), 0) if self._line_owner is not None else 0
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._line_owner, self._line_len = owner, len(line)

    def _end_line(self) -> None:
        """Finish the current line with a newline (a no-op at a line start)."""
        if self._line_owner is not None:
            self.stream.write("\n")
            self.stream.flush()
            self._line_owner, self._line_len = None, 0


def _terminal_width(stream: TextIO) -> int:
    """Columns of the terminal behind `stream`. shutil asks stdout, which may be redirected while stderr is a
    terminal, so the stream's own descriptor is asked first unless $COLUMNS says otherwise."""
    if "COLUMNS" not in os.environ:
        try:
            columns = os.get_terminal_size(stream.fileno()).columns
            if columns > 0:   # a pseudo-terminal nobody sized (script, some CI runners) says 0
                return columns
        except (AttributeError, OSError, ValueError):
            pass   # not a real file (io.StringIO raises UnsupportedOperation, an OSError) or not a terminal
    return shutil.get_terminal_size((80, 24)).columns or 80


def _amount(n: float, unit: str) -> str:
    """A count as shown: bytes with binary prefixes, whole numbers without a decimal point."""
    if unit == "B":
        return format_bytes(n)
    return str(int(n)) if float(n).is_integer() else f"{n:.1f}"


class Stage:
    """One stage of work, used as a context manager; made by `Progress.stage`.

    `advance` and `update` are called from hot loops: when the Progress is disabled, or writes logs, they only
    store the count; on a terminal they redraw at most every `min_interval_s`."""

    def __init__(self, progress: Progress, name: str, total: float | None, unit: str) -> None:
        self.progress = progress
        self.name = safe_line(name)  # a stage may be named after a node: no control character reaches the terminal
        self.total = total
        self.unit = unit
        self.done: float = 0
        # Decided once: the only check `advance` makes before returning.
        self._live = progress.enabled and progress.tty
        self._start = progress.clock() if progress.enabled else 0.0
        self._last_draw = float("-inf")

    def __enter__(self) -> Stage:
        p = self.progress
        if p.enabled:
            self._start = p.clock()
            p._active.append(self)
            if self._live:   # show the stage at once: its first advance may be a long way off
                self._draw(force=True)
        return self

    def advance(self, n: float = 1) -> None:
        """Count `n` more units done."""
        self.done += n
        if self._live:
            self._draw()

    def update(self, done: float, total: float | None = None) -> None:
        """Set the count done (and the total, when it becomes known or changes)."""
        self.done = done
        if total is not None:
            self.total = total
        if self._live:
            self._draw()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        p = self.progress
        if not p.enabled:
            return
        if self in p._active:
            p._active.remove(self)
        elapsed = p.clock() - self._start
        if p.tty:
            if exc_type is None:
                self._draw(force=True)
                p._end_line()
                # An inner stage took the outer one's line: show the outer bar again on the next line.
                if p._active:
                    p._active[-1]._draw(force=True)
            else:
                if p._line_owner is self:
                    self._draw(force=True)   # leave the bar where the work stopped
                p._end_line()   # the error message that follows starts on a fresh line
            return
        if exc_type is not None or elapsed < p.min_log_s:
            return   # the error says what happened; a summary of a failed stage would mislead
        counted = self._counts(with_total=False)
        summary = f"{self.name}: {counted} in {elapsed:.1f} s" if counted else f"{self.name} in {elapsed:.1f} s"
        p.stream.write(f"{_PREFIX}{summary}\n")
        p.stream.flush()

    # ---- rendering -------------------------------------------------------------------------------------------

    def _counts(self, with_total: bool = True) -> str:
        """`12/32 segments`, `1.2 GiB / 12.3 GiB`, `7 rounds`; empty when nothing was counted."""
        if self.total is None and not self.done:
            return ""
        unit = f" {self.unit}" if self.unit and self.unit != "B" else ""
        done = _amount(self.done, self.unit)
        if not with_total or self.total is None:
            return done + unit
        sep = " / " if self.unit == "B" else "/"   # "1.2 GiB/12.3 GiB" reads as one word
        return f"{done}{sep}{_amount(self.total, self.unit)}{unit}"

    def _render(self, elapsed: float) -> str:
        parts = [f"{_PREFIX}{self.name}"]
        if self.total is not None and self.total > 0:
            frac = min(max(self.done / self.total, 0.0), 1.0)
            full = int(frac * _BAR_CELLS)
            parts.append("[" + "#" * full + "-" * (_BAR_CELLS - full) + "]")
        counts = self._counts()
        if counts:
            parts.append(" " + counts)
        parts.append(f" {elapsed:.1f}s")
        return " ".join(parts)

    def _draw(self, force: bool = False) -> None:
        p = self.progress
        now = p.clock()
        # Throttled only while this bar is the one on the line: after a note or an inner stage, draw at once.
        if not force and p._line_owner is self and now - self._last_draw < p.min_interval_s:
            return
        self._last_draw = now
        # One column short of the width: a line filling the last column wraps on some terminals, and then
        # every `\r` redraw would stack a new line.
        width = max(_terminal_width(p.stream) - 1, 10)
        p._write_line(self, self._render(now - self._start)[:width])
