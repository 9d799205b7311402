"""Headless chromium for the HTML report's tests and benchmark (tests/test_reports.py,
benchmarks/bench_report_html.py): Debian's `chromium`, driven over the DevTools protocol on a pipe, no port and no
network. tools/install_test_browser.sh installs it where it can."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from typing import Any


def chromium() -> str | None:
    for exe in (shutil.which("chromium"), "/usr/bin/chromium", shutil.which("chromium-browser")):
        if exe and os.path.exists(exe):
            return exe
    return None


class Browser:
    """Headless chromium driven over the DevTools protocol on a pipe (fd 3 in, fd 4 out): no port, no network."""

    def __init__(self, exe: str, user_dir: str) -> None:
        to_child_r, self._w = os.pipe()
        self._r, from_child_w = os.pipe()

        def wire() -> None:  # in the child: the protocol pipes on fds 3 and 4
            a, b = os.dup(to_child_r), os.dup(from_child_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-extensions", "--mute-audio", f"--user-data-dir={user_dir}", "--remote-debugging-pipe",
                "about:blank"]
        # stderr to a file, not a pipe: chromium logs freely and a full pipe would stall it.
        self._stderr = open(os.path.join(user_dir, "chromium-stderr.log"), "w+b")  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self._stderr, preexec_fn=wire, close_fds=False)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 60) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            m = self._read(timeout)
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m["result"]
            self.events.append(m)

    def wait_for(self, method: str, timeout: float = 60) -> dict[str, Any]:
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            m = self._read(max(0.01, deadline - time.monotonic()))
            if m.get("method") == method:
                return m
            self.events.append(m)

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from chromium")
            ready, _, _ = select.select([self._r], [], [], left)
            if ready:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    self._stderr.seek(0)
                    err = self._stderr.read().decode(errors="replace")[-2000:]
                    raise EOFError(f"chromium closed the protocol pipe: {err}")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait(10)
        finally:
            os.close(self._w)
            os.close(self._r)
            self._stderr.close()


def page_problems(events: list[dict[str, Any]]) -> list[str]:
    """Console errors and warnings, uncaught exceptions, browser log errors (CSP violations included), dialogs."""
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
            out.append(f"console.{p['type']}: {[a.get('value', a.get('description')) for a in p.get('args', [])]}")
        elif m == "Runtime.exceptionThrown":
            out.append(f"uncaught: {p.get('exceptionDetails', {}).get('exception', {}).get('description')}")
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") in ("error", "warning"):
            out.append(f"log {p['entry']['level']}: {p['entry'].get('text')}")
        elif m == "Page.javascriptDialogOpening":
            out.append(f"dialog: {p.get('message')}")
    return out


def load_page(browser: Browser, uri: str, width: int = 1400, height: int = 2000, timeout: float = 60
              ) -> tuple[str, float]:
    """Open `uri` in a new tab of `browser` (console, log and page events on); its session id and the page's own
    load time in ms (navigation start to the end of the load event, from the Navigation Timing entry)."""
    target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    s = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Page.enable", "Runtime.enable", "Log.enable"):
        browser.call(domain, session=s)
    browser.call("Emulation.setDeviceMetricsOverride",
                 {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=s)
    browser.call("Page.navigate", {"url": uri}, session=s)
    browser.wait_for("Page.loadEventFired", timeout)
    load_ms = browser.call("Runtime.evaluate", {
        "expression": "performance.getEntriesByType('navigation')[0].loadEventEnd", "returnByValue": True},
        session=s)["result"]["value"]
    return s, float(load_ms)
