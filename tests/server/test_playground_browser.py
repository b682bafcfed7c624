"""The web playground, /docs and /redoc in a real browser: headless Chromium (scripts/ci_deps.sh installs Debian's
package) against a real server on the tiny engine.

The page runs its own self-test with ?selftest=1 (static/playground.js): it synthesizes through the streamed PCM
path into Web Audio, waits until its played-samples counter moved, records a clip from Chromium's fake
microphone and saves it as a voice; the results land in #selftest-result.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.browser import Browser, chromium_path
from tests.server.conftest import REAL_MAX_NEW_TOKENS, LiveServer, make_real_engine
from tests.server.multiproc_helpers import REPO, SERVE_FLAGS, free_port
from ttsserve.server.app import ServerConfig, create_app

pytestmark = [
    pytest.mark.skipif(
        chromium_path() is None, reason="needs Chromium (scripts/ci_deps.sh installs Debian's chromium package)"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("websockets") is None, reason="needs the websockets package (uvicorn[standard])"
    ),
]


@pytest.fixture(scope="module")
def browser():
    b = Browser.chromium()
    yield b
    b.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("voices") / "voices.db"
    cfg = ServerConfig(max_new_tokens=REAL_MAX_NEW_TOKENS, voices_db=str(db))
    srv = LiveServer(create_app(make_real_engine(), cfg)).start()
    yield srv
    srv.stop()


def _local(urls: list[str], base: str) -> list[str]:
    """The URLs in `urls` that leave `base` (data: and blob: stay in the page)."""
    return [u for u in urls if not u.startswith((base + "/", "data:", "blob:", "about:"))]


def test_playground_plays_streamed_audio_and_saves_a_voice(browser, server, tmp_path):
    with browser.page() as page:
        page.navigate(f"{server.url}/?selftest=1&voice_name=browser-voice")
        page.wait_for("document.getElementById('selftest-result').dataset.done", timeout_s=60)
        result = json.loads(page.evaluate("document.getElementById('selftest-result').textContent"))
        assert result["ok"], (result, page.console())
        shown = int(page.evaluate("document.getElementById('played-samples').textContent"))
        page.screenshot(tmp_path / "playground.png")
        offsite = _local(page.requested, server.url)
    assert result["played_samples"] > 0 and shown == result["played_samples"]
    assert result["played_samples"] == result["received_samples"]  # every sample received was played out
    wav, mp3 = result["download"]["wav"], result["download"]["mp3"]
    assert wav["head"] == "RIFF" and wav["bytes"] == 44 + 2 * result["received_samples"]
    assert mp3["type"] == "audio/mpeg" and mp3["bytes"] > 100  # the same request again, in the chosen format
    assert result["voice"]["name"] == "browser-voice" and result["voice"]["type"] == "audio_sample"
    assert result["state"] == "live"  # /metrics was read and parsed
    voices = httpx.get(server.url + "/v1/audio/voices", timeout=10).json()["data"]
    assert "browser-voice" in {v["name"] for v in voices}
    assert not offsite, offsite


def test_docs_and_redoc_render_offline(browser, server):
    with browser.page() as page:
        page.navigate(server.url + "/docs")
        title = page.wait_for("document.querySelector('.swagger-ui .info .title')?.textContent")
        assert title.startswith("ttsserve")
        ops = page.wait_for("document.querySelectorAll('.swagger-ui .opblock').length")
        assert ops >= 5  # speech, synthesize, models, voices, ops
        swagger_requests = list(page.requested)
        page.navigate(server.url + "/redoc")
        heading = page.wait_for("document.querySelector('.api-info h1')?.textContent")
        assert heading.startswith("ttsserve")
        assert page.evaluate("document.querySelectorAll('[data-section-id]').length") >= 5
        redoc_requests = page.requested[len(swagger_requests) :]
    assert any(u.endswith("swagger-ui-bundle.js") for u in swagger_requests)
    assert any(u.endswith("redoc.standalone.js") for u in redoc_requests)
    assert not _local(page.requested, server.url), page.requested


# ---- CORS: a page on another loopback port calls the API -------------------------------------------
_CALL = """fetch(%r + '/v1/audio/speech', {method: 'POST', headers: {'Content-Type': 'application/json'},
  body: JSON.stringify({model: 'tts-1', input: 'Hi.', voice: 'alloy', response_format: 'wav'})})
  .then(r => r.arrayBuffer().then(b => 'status ' + r.status + ', ' + b.byteLength + ' bytes'),
        e => 'failed: ' + e)"""


@contextlib.contextmanager
def _origin_page():
    """A plain page on its own loopback port: the other origin."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<!doctype html><title>other origin</title><p>other origin</p>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _cross_origin_call(browser, origin: str, api: str) -> str:
    with browser.page() as page:
        page.navigate(origin + "/")
        page.wait_for("document.readyState === 'complete' && location.href.startsWith('http')")
        return page.evaluate(_CALL % api, await_promise=True)


def test_cross_origin_call_fails_without_cors(browser, server):
    with _origin_page() as origin:
        outcome = _cross_origin_call(browser, origin, server.url)
    assert outcome.startswith("failed: TypeError"), outcome


def _serve_help() -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "ttsserve.entrypoints.serve", "--help"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120).stdout


@contextlib.contextmanager
def _serve_process(tmp_path, *extra: str):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "ttsserve.entrypoints.serve", *SERVE_FLAGS, "--port", str(port), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "TTSSERVE_CPU_COMPILE": "0"}
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, f"not ready in 120 s:\n{log_path.read_text()}"
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(url + "/ready", timeout=2).status_code == 200:
                        break
                time.sleep(0.2)
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_cross_origin_call_succeeds_with_cors(browser, tmp_path):
    if "--allowed-origins" not in _serve_help():
        pytest.skip("needs the CORS flags")
    with _origin_page() as origin:
        flags = ("--allowed-origins", json.dumps([origin]), "--voices-db", str(tmp_path / "voices.db"))
        with _serve_process(tmp_path, *flags) as api:
            outcome = _cross_origin_call(browser, origin, api)
    assert outcome.startswith("status 200, ") and int(outcome.split(", ")[1].split()[0]) > 44, outcome
