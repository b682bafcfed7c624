"""SIGTERM under load, in one process and under the launcher: the server keeps listening while it drains,
every accepted request runs to its end, new requests (new connections and kept-alive ones) get 503
`shutting_down` with Retry-After and `Connection: close`, /ready says 503, the exit status is 0 and the
launcher's run directory is gone."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import wait_until
from tests.server.multiproc_helpers import ServeProcess

SPEECH = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "response_format": "pcm", "seed": 5}
STREAM = {**SPEECH, "input": "long " * 20, "min_new_tokens": 1000, "max_new_tokens": 1000}


def _wait_ready(url: str, proc, log, timeout_s: float = 150) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log()
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not ready in {timeout_s} s:\n{log()}")


@pytest.mark.parametrize("count", [0, 2], ids=["one process", "launcher"])
def test_sigterm_under_load_drains_and_refuses_new_requests_with_503(tmp_path, count):
    srv = ServeProcess(tmp_path, "--max-new-tokens", "3000", "--voices-db", str(tmp_path / "v.db"), count=count)
    try:
        _wait_ready(srv.url, srv.proc, srv.log)
        keep_alive = httpx.Client(base_url=srv.url, timeout=30)
        assert keep_alive.get("/health").status_code == 200  # an idle kept-alive connection before the drain
        results: list = []
        started = threading.Semaphore(0)

        def stream() -> None:
            try:
                with (
                    httpx.Client(base_url=srv.url, timeout=60) as c,
                    c.stream("POST", "/v1/audio/speech", json=STREAM) as r,
                ):
                    n = 0
                    for chunk in r.iter_bytes():
                        n += len(chunk)
                        started.release()
                    results.append((r.status_code, n))
            except httpx.HTTPError as e:
                results.append(e)

        threads = [threading.Thread(target=stream) for _ in range(3)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=60)
        srv.proc.send_signal(signal.SIGTERM)

        def draining() -> bool:  # on every API server (each fresh connection may reach another)
            return all(httpx.get(srv.url + "/ready", timeout=10).status_code == 503 for _ in range(4))

        assert wait_until(draining, timeout=10, interval=0.05), srv.log()[-2000:]
        for client in (keep_alive, httpx.Client(base_url=srv.url, timeout=10)):
            r = client.post("/v1/audio/speech", json=SPEECH)
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
            assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
            client.close()
        r = httpx.get(srv.url + "/ready", timeout=10)
        assert r.status_code == 503 and r.headers["connection"] == "close"
        for t in threads:
            t.join(60)
        # every accepted request ran to its end: 1000 frames of 24 kHz 16-bit audio each
        assert [res[0] if isinstance(res, tuple) else res for res in results] == [200] * 3, results
        assert all(res[1] >= 1000 * 512 * 2 * 0.9 for res in results), results
        assert srv.proc.wait(60) == 0, srv.log()[-3000:]
    finally:
        srv.stop()
    m = re.search(r"run directory: (\S+)", srv.log())
    if count:
        assert m and not os.path.exists(m.group(1)), srv.log()[-2000:]
    assert "not cleanly" not in srv.log()
    assert f"writes voices (--voices-db, TTSSERVE_VOICES_DB): {tmp_path / 'v.db'}" in srv.log()  # files outside the run


def test_api_servers_drain_together_so_an_idle_one_keeps_answering_503(tmp_path):
    """Under the launcher an API server whose own requests are done keeps listening and answering 503 until
    every server's are: on Linux each holds its own socket of one SO_REUSEPORT group, and one that closed
    early reset the new connections the kernel had just hashed to it (a client saw a disconnect, not a 503)."""
    srv = ServeProcess(tmp_path, "--max-new-tokens", "3000", count=3).wait_ready()
    try:
        done: list = []
        started = threading.Event()

        def stream() -> None:
            long = {**STREAM, "min_new_tokens": 2500, "max_new_tokens": 2500}
            with httpx.Client(base_url=srv.url, timeout=90) as c, c.stream("POST", "/v1/audio/speech", json=long) as r:
                n = 0
                for chunk in r.iter_bytes():
                    n += len(chunk)
                    started.set()
                done.append((r.status_code, n))

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the idle servers' drains are done by now: they used to stop here
        answered = set()
        for _ in range(30):  # fresh connections, hashed over every socket still open
            r = httpx.get(srv.url + "/ready", timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
            answered.add(r.headers["x-api-server"])
        assert t.is_alive(), "the stream ended before the probes: make it longer"
        assert answered == {"0", "1", "2"}, answered
        t.join(90)
        assert len(done) == 1 and done[0][0] == 200 and done[0][1] >= 2499 * 512 * 2, done  # all of its audio
        assert srv.proc.wait(60) == 0, srv.log()[-3000:]
    finally:
        srv.stop()
