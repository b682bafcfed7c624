"""Headless Chromium (Debian's package) driven over the DevTools protocol, with no browser-automation package:
Chromium's --remote-debugging-port and a websocket (the `websockets` package that uvicorn already pulls in).

Browser.chromium() returns None where there is no Chromium; tests skip with the reason.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--mute-audio",
    "--autoplay-policy=no-user-gesture-required",
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    "--window-size=1280,900",
]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Page:
    """One tab: send() a DevTools command, evaluate() JavaScript, collect the URLs it requests."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.requested: list[str] = []
        self.events: list[dict] = []
        self.loaded = False

    def send(self, method: str, timeout_s: float = 30, **params) -> dict:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)

    def _event(self, msg: dict) -> None:
        if msg.get("method") == "Page.loadEventFired":
            self.loaded = True
        elif msg.get("method") == "Network.requestWillBeSent":
            self.requested.append(msg["params"]["request"]["url"])
        elif msg.get("method") in ("Runtime.exceptionThrown", "Runtime.consoleAPICalled"):
            self.events.append(msg)

    def navigate(self, url: str, timeout_s: float = 30) -> None:
        """Opens `url` and returns once its load event fired."""
        self.loaded = False
        self.send("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while not self.loaded:
            self._event(json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic()))))

    def evaluate(self, expression: str, await_promise: bool = False):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=await_promise)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30):
        """Polls `expression` until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{expression!r} still falsy after {timeout_s} s; console: {self.console()}")
            time.sleep(0.1)

    def console(self) -> list[str]:
        lines = []
        for e in self.events:
            p = e["params"]
            if e["method"] == "Runtime.exceptionThrown":
                lines.append(p["exceptionDetails"].get("exception", {}).get("description", str(p)))
            else:
                lines.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
        return lines

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))


class Browser:
    def __init__(self, binary: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="ttsserve-chromium-")
        self.proc = subprocess.Popen(
            [binary, *_FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.port = self._devtools_port()

    @classmethod
    def chromium(cls) -> Browser | None:
        binary = chromium_path()
        return cls(binary) if binary else None

    def _devtools_port(self, timeout_s: float = 30) -> int:
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            with contextlib.suppress(OSError, ValueError):
                return int(port_file.read_text().split()[0])
            time.sleep(0.05)
        self.close()
        raise RuntimeError(f"chromium did not open its DevTools port in {timeout_s} s")

    @contextlib.contextmanager
    def page(self):
        """A fresh tab with the Network, Page and Runtime domains on."""
        from websockets.sync.client import connect

        target = httpx.put(f"http://127.0.0.1:{self.port}/json/new?about:blank", timeout=10).json()
        with connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=10) as ws:
            page = Page(ws)
            for domain in ("Network", "Page", "Runtime"):
                page.send(f"{domain}.enable")
            try:
                yield page
            finally:
                with contextlib.suppress(Exception):
                    httpx.get(f"http://127.0.0.1:{self.port}/json/close/{target['id']}", timeout=5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.profile, ignore_errors=True)
