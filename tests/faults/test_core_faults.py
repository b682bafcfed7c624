"""Faults of the engine core under `serve --api-server-count 2`, on the tiny model: a core killed (-9) or
stopped (SIGSTOP) under load is restarted in place. The requests it held fail (503 `engine_dead` before their
headers, an error-ended stream after), none waits for ever, /ready says 503 until the new core is up, the API
servers stay up and serve again; past --core-restart-limit deaths the launcher exits 1."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from tests.server.conftest import wait_until
from tests.server.multiproc_helpers import ServeProcess

SPEECH = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "response_format": "pcm", "seed": 5}
LONG = {**SPEECH, "input": "long " * 40, "min_new_tokens": 3000, "max_new_tokens": 3000, "seed": 1}


class Streams:
    """n long streams under way; each ends in `results` as "done", an HTTP status, or the transport error."""

    def __init__(self, url: str, n: int) -> None:
        self.results: list = []
        self.started = threading.Semaphore(0)
        self.threads = [threading.Thread(target=self._run, args=(url,)) for _ in range(n)]
        for t in self.threads:
            t.start()
        for _ in range(n):
            assert self.started.acquire(timeout=60), "a stream did not start"

    def _run(self, url: str) -> None:
        try:
            with httpx.Client(base_url=url, timeout=30) as c, c.stream("POST", "/v1/audio/speech", json=LONG) as r:
                if r.status_code != 200:
                    self.started.release()
                    self.results.append((r.status_code, r.read()))
                    return
                for i, _ in enumerate(r.iter_bytes()):
                    if i == 0:
                        self.started.release()
            self.results.append("done")
        except httpx.HTTPError as e:
            self.results.append(e)

    def join(self, timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a stream still waits on a dead core"
        return self.results


def _assert_failed_on_a_dead_core(results: list) -> None:
    for res in results:  # under way: its headers went out, so it ends early with an error (no last chunk)
        assert isinstance(res, httpx.RemoteProtocolError), res


def _ready_again(srv: ServeProcess, timeout_s: float = 90) -> list[int]:
    """/ready's statuses until it is 200 on every API server (connections spread over them)."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = {httpx.get(srv.url + "/ready", timeout=5).status_code for _ in range(4)}
        seen.extend(codes)
        if codes == {200}:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"not ready again in {timeout_s} s; saw {seen[-5:]}:\n{srv.log()[-3000:]}")


def test_a_killed_core_is_restarted_and_the_server_recovers(tmp_path):
    # with a rate limit: the shared limiter's refund of a refused request must not turn the 503 into a 500
    srv = ServeProcess(
        tmp_path, "--max-new-tokens", "3000", "--voices-db", str(tmp_path / "v.db"), "--requests-per-minute", "1000"
    )
    try:
        srv.wait_ready()
        streams = Streams(srv.url, 3)
        os.kill(srv.pid_of("engine core"), signal.SIGKILL)
        _assert_failed_on_a_dead_core(streams.join(20))
        r = httpx.post(srv.url + "/v1/audio/speech", json=SPEECH, timeout=10)  # while the core is down
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        r = httpx.get(srv.url + "/health", timeout=5)
        assert r.status_code in (200, 503)  # 503 engine_dead until the new core said hello
        seen = _ready_again(srv)
        assert seen[0] == 503, seen
        for _ in range(4):
            assert httpx.post(srv.url + "/v1/audio/speech", json=SPEECH, timeout=30).status_code == 200
        assert srv.proc.poll() is None and "restarting it in" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_a_stopped_core_is_seen_as_stalled_killed_and_restarted(tmp_path):
    srv = ServeProcess(
        tmp_path, "--max-new-tokens", "3000", "--voices-db", str(tmp_path / "v.db"), "--engine-stall-timeout", "3"
    )
    core = None
    try:
        srv.wait_ready()
        streams = Streams(srv.url, 2)
        core = srv.pid_of("engine core")
        os.kill(core, signal.SIGSTOP)
        stopped_at = time.monotonic()

        def health_503() -> bool:
            r = httpx.get(srv.url + "/health", timeout=5)
            return r.status_code == 503 and r.json()["error"]["code"] in ("engine_stalled", "engine_dead")

        assert wait_until(health_503, timeout=10, interval=0.1), srv.log()[-3000:]
        assert time.monotonic() - stopped_at < 8
        _assert_failed_on_a_dead_core(streams.join(20))  # the launcher killed the stalled core
        assert "stalled" in srv.log()
        _ready_again(srv)
        assert httpx.post(srv.url + "/v1/audio/speech", json=SPEECH, timeout=30).status_code == 200
    finally:
        if core is not None:
            try:
                os.kill(core, signal.SIGKILL)  # should be gone already; never leave a stopped process
            except ProcessLookupError:
                pass
        assert srv.stop() == 0, srv.log()[-3000:]


def test_too_many_core_deaths_stop_the_launcher_with_status_1(tmp_path):
    srv = ServeProcess(tmp_path, "--voices-db", str(tmp_path / "v.db"), "--core-restart-limit", "0")
    try:
        srv.wait_ready()
        os.kill(srv.pid_of("engine core"), signal.SIGKILL)
        assert srv.proc.wait(60) == 1, srv.log()[-3000:]
        assert "over --core-restart-limit 0" in srv.log()
    finally:
        srv.stop()
