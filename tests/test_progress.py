"""Progress output: bars on a terminal, one line per stage in logs, nothing when quiet.

A fake clock and an io.StringIO stream make every test deterministic; $COLUMNS fixes the terminal width."""

import io
import sys

import pytest

from npufuse.console.progress import Progress


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def tick(self, s: float) -> None:
        self.t += s


@pytest.fixture(autouse=True)
def _columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")


def make(tty: bool, enabled: bool = True, interval: float = 0.1):
    out, clock = io.StringIO(), FakeClock()
    return Progress(out, enabled=enabled, tty=tty, min_interval_s=interval, clock=clock), out, clock


def test_tty_bar_shows_name_bar_count_and_ends_with_newline():
    p, out, clock = make(tty=True)
    with p.stage("verify original", 32, "segments") as st:
        for _ in range(12):
            clock.tick(0.2)
            st.advance()
        clock.tick(0.2)
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    assert "\r" in text
    assert "npufuse: verify original [" in text
    assert "12/32 segments" in text
    last = text.rsplit("\r", 1)[1]
    assert last.startswith("npufuse: verify original [######") and "12/32 segments" in last
    assert last.rstrip().endswith("2.6s")


def test_tty_full_bar_on_completion():
    p, out, clock = make(tty=True)
    with p.stage("verify optimized", unit="segments") as st:
        st.update(0, 4)
        st.update(4, 4)   # within min_interval: throttled, but the end always draws
    last = out.getvalue().rsplit("\r", 1)[1]
    assert "[" + "#" * 20 + "]" in last and "4/4 segments" in last


def test_tty_throttles_redraws():
    p, out, clock = make(tty=True, interval=0.1)
    with p.stage("check rewrites", 10_000, "rewrites") as st:
        for _ in range(10_000):
            clock.tick(0.00005)   # 10,000 calls over 0.5 s
            st.advance()
    redraws = out.getvalue().count("\r")
    assert 3 <= redraws <= 10   # enter + ~5 throttled + final, not 10,000
    assert "10000/10000 rewrites" in out.getvalue().rsplit("\r", 1)[1]


def test_tty_unknown_total_shows_a_count_without_bar():
    p, out, clock = make(tty=True)
    with p.stage("match phase 1", unit="rounds") as st:
        for _ in range(3):
            clock.tick(1)
            st.advance()
    last = out.getvalue().rsplit("\r", 1)[1]
    assert "[" not in last and "3 rounds" in last


def test_tty_line_is_clipped_to_terminal_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    p, out, clock = make(tty=True)
    with p.stage("a very long stage name that will not fit on a narrow terminal", 10, "segments") as st:
        st.advance(5)
    for line in out.getvalue().replace("\n", "").split("\r")[1:]:
        assert len(line) <= 39


def test_tty_shorter_redraw_blanks_the_longer_line():
    p, out, clock = make(tty=True)
    with p.stage("write model", 100, "items") as st:
        st.advance(99)
        with p.stage("x"):
            pass
    text = out.getvalue()
    # The inner stage's first draw overwrote the outer's line: padded to its length, so nothing is left over.
    frames = text.split("\r")
    outer, inner = frames[2], frames[3]
    assert inner.startswith("npufuse: x") and len(inner) >= len(outer.rstrip())


def test_tty_nested_stage_redraws_outer_bar_after_it():
    p, out, clock = make(tty=True)
    with p.stage("match phase 0", unit="rounds") as outer:
        outer.advance()
        with p.stage("check rewrites (round 1)", 2, "rewrites") as inner:
            inner.advance(2)
        clock.tick(1)
    lines = out.getvalue().split("\n")
    assert lines[-1] == ""
    assert "check rewrites (round 1)" in lines[0].rsplit("\r", 1)[1]
    assert lines[1].rsplit("\r", 1)[1].startswith("npufuse: match phase 0  1 rounds")


def test_tty_bytes_unit():
    p, out, clock = make(tty=True)
    with p.stage("write weights", 12.3 * (1 << 30), "B") as st:
        st.advance(1.2 * (1 << 30))
        clock.tick(1)
        st.advance(0)
    assert "1.2 GiB / 12.3 GiB" in out.getvalue()


def test_non_tty_one_line_per_stage_at_the_end():
    p, out, clock = make(tty=False)
    with p.stage("verify original", unit="segments") as st:
        for i in range(12):
            st.update(i + 1, 12)
            clock.tick(0.25)
            assert out.getvalue() == ""   # nothing while running
        clock.tick(0.4)
    with p.stage("normalize"):
        clock.tick(0.06)
    assert out.getvalue() == ("npufuse: verify original: 12 segments in 3.4 s\n"
                              "npufuse: normalize in 0.1 s\n")
    assert "\r" not in out.getvalue()


def test_non_tty_bytes_formatted():
    p, out, clock = make(tty=False)
    with p.stage("write weights", 3 << 30, "B") as st:
        st.advance(1 << 30)
        st.advance(1 << 29)
        clock.tick(2)
    with p.stage("write model", unit="B") as st:
        st.advance(5 << 20)
    assert out.getvalue() == ("npufuse: write weights: 1.5 GiB in 2.0 s\n"
                              "npufuse: write model: 5 MiB in 0.0 s\n")


def test_non_tty_nested_stages_each_get_one_line():
    p, out, clock = make(tty=False)
    with p.stage("match phase 0", unit="rounds") as outer:
        for rnd in range(2):
            outer.advance()
            with p.stage(f"check rewrites (round {rnd + 1})", 3, "rewrites") as inner:
                inner.advance(3)
    assert out.getvalue().splitlines() == [
        "npufuse: check rewrites (round 1): 3 rewrites in 0.0 s",
        "npufuse: check rewrites (round 2): 3 rewrites in 0.0 s",
        "npufuse: match phase 0: 2 rounds in 0.0 s",
    ]


@pytest.mark.parametrize("tty", [True, False])
def test_disabled_prints_nothing(tty):
    p, out, clock = make(tty=tty, enabled=False)
    with p.stage("verify original", 10, "segments") as st:
        for _ in range(10):
            clock.tick(1)
            st.advance()
        st.update(10, 10)
    p.note("hello")
    assert out.getvalue() == ""


def test_silent_prints_nothing(capsys):
    p = Progress.silent()
    with p.stage("x", 3, "B") as st:
        st.advance(3)
    p.note("hello")
    assert capsys.readouterr() == ("", "")


def test_for_cli_quiet_is_silent(capsys):
    p = Progress.for_cli(quiet=True)
    assert not p.enabled
    with p.stage("verify original", 2, "segments") as st:
        st.advance(2)
    p.note("hello")
    assert capsys.readouterr() == ("", "")


def test_for_cli_not_quiet_logs_when_stderr_is_not_a_terminal(monkeypatch):
    err = io.StringIO()   # isatty() is False
    monkeypatch.setattr(sys, "stderr", err)
    p = Progress.for_cli(quiet=False)
    assert p.enabled and not p.tty
    with p.stage("normalize"):
        pass
    # A quick stage is not worth a log line: a small model's run (and a one-line error) stays quiet.
    assert err.getvalue() == ""
    now = [0.0]
    p.clock = lambda: now[0]
    with p.stage("verify original", unit="segments") as stage:
        stage.update(3, 3)
        now[0] = 2.5
    assert err.getvalue() == "npufuse: verify original: 3 segments in 2.5 s\n"


def test_for_cli_dumb_terminal_logs(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    monkeypatch.setenv("TERM", "xterm")
    assert Progress.for_cli(quiet=False).tty
    monkeypatch.setenv("TERM", "dumb")
    assert not Progress.for_cli(quiet=False).tty


def test_exception_non_tty_prints_nothing_for_the_stage():
    p, out, clock = make(tty=False)
    with pytest.raises(RuntimeError):
        with p.stage("verify original", 12, "segments") as st:
            st.advance(3)
            raise RuntimeError("boom")
    assert out.getvalue() == ""


def test_exception_tty_ends_the_line():
    p, out, clock = make(tty=True)
    with pytest.raises(RuntimeError):
        with p.stage("verify original", 12, "segments") as st:
            st.advance(3)
            raise RuntimeError("boom")
    text = out.getvalue()
    assert text.endswith("\n") and "3/12 segments" in text


def test_note_on_its_own_line_while_a_bar_is_drawn():
    p, out, clock = make(tty=True)
    with p.stage("verify original", 4, "segments") as st:
        st.advance()
        p.note("falling back to synthetic inputs")
        st.advance()
    lines = out.getvalue().split("\n")
    assert lines[0].rsplit("\r", 1)[1] == "npufuse: falling back to synthetic inputs"
    assert "2/4 segments" in lines[1]


def test_non_tty_note():
    p, out, clock = make(tty=False)
    p.note("hello")
    assert out.getvalue() == "npufuse: hello\n"


def test_stage_exception_propagates():
    p, out, clock = make(tty=True)
    with pytest.raises(KeyError):
        with p.stage("x"):
            raise KeyError("k")
