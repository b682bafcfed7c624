"""Connection faults against a real `serve` process (tiny model, CPU), one process and two API servers:
a flood of idle sockets under a low open-file limit, headers and bodies trickled in, keep-alive idleness.

The server runs with 1-s header/body/keep-alive timeouts and RLIMIT_NOFILE 384 soft / 512 hard (set in the
child): it must raise the soft limit to the hard one, cap its connections below it, answer 503 over the cap
(never let the kernel reset a client), close every idle socket after the header timeout, and log each kind
of close.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.multiproc_helpers import SERVE_FLAGS, free_port

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1.0
FD_SOFT, FD_HARD = 384, 512
SPEECH = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "response_format": "pcm", "seed": 1}


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_SOFT, FD_HARD))


class Server:
    def __init__(self, tmp: Path, api_servers: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"serve-{self.port}.log"
        timeouts = ["--header-timeout", "1", "--body-timeout", "1", "--timeout-keep-alive", "1"]
        cmd = [sys.executable, "-m", "ttsserve.entrypoints.serve", *SERVE_FLAGS, *timeouts]
        cmd += ["--port", str(self.port), "--api-server-count", str(api_servers), "--drain-timeout", "5"]
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "TTSSERVE_CPU_COMPILE": "0"}
        self._log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_low_fd_limit
        )
        self.api_servers = api_servers

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout_s: float = 150) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, self.log()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    if self.log().count("connections: at most") >= max(1, self.api_servers):
                        return
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        if self.proc.poll() is None:
            self.proc.kill()  # the children die with the launcher (die_with_parent)
            self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module", params=[0, 2], ids=["single", "api-servers-2"])
def server(request, tmp_path_factory):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048 <= hard:  # this process holds the 1,000 idle sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    srv = Server(tmp_path_factory.mktemp("conn"), request.param)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _readable(s: socket.socket, timeout_s: float) -> bool:
    """select.poll, not select.select: the flood's sockets get descriptors past select's FD_SETSIZE (1024)."""
    p = select.poll()
    p.register(s, select.POLLIN)
    return bool(p.poll(max(timeout_s, 0) * 1000))


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setblocking(False)
    return s


def _read_until_closed(s: socket.socket, timeout_s: float) -> tuple[bytes, float | None]:
    """Everything the server sends until it closes (-> the bytes, seconds until the close; None: still open).
    A reset raises ConnectionResetError: the tests want a status or a clean close, never that."""
    got, start = b"", time.monotonic()
    while (left := start + timeout_s - time.monotonic()) > 0:
        if not _readable(s, left):
            break
        chunk = s.recv(65536)
        if not chunk:
            return got, time.monotonic() - start
        got += chunk
    return got, None


def _request_ok(url: str) -> int:
    """A status, or the name of the transport error (a reset is what must never happen)."""
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            return c.post("/v1/audio/speech", json=SPEECH).status_code
    except httpx.TransportError as e:
        return type(e).__name__


def test_fd_limit_raised_and_cap_below_it(server):
    log = server.log()
    assert f"open-file limit raised from {FD_SOFT} to {FD_HARD}" in log, log
    caps = [int(line.split("at most ")[1].split()[0]) for line in log.splitlines() if "connections: at most" in line]
    assert caps and all(0 < cap < FD_HARD - 64 for cap in caps), caps


def test_idle_flood_is_shed_with_503_and_timed_out(server):
    """1,000 silent sockets (more than the fd limit): others still get answers (200, or 503 over the cap,
    never a reset), the shed sockets read a 503, and every idle one is closed by the header timeout."""
    idle = [_connect(server.port) for _ in range(1000)]
    try:
        with ThreadPoolExecutor(8) as pool:
            during = list(pool.map(lambda _: _request_ok(server.url), range(8)))
        assert set(during) <= {200, 503}, during
        t0 = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda s: _read_until_closed(s, TIMEOUT_S + 5 - (time.monotonic() - t0)), idle))
        still_open = sum(closed_after is None for _, closed_after in results)
        assert still_open == 0, f"{still_open} idle sockets still open after the header timeout"
        shed = [got for got, _ in results if got]
        assert shed and all(got.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in got for got in shed)
        assert len(shed) < 1000  # the others were held until the header timeout, then closed without a word
    finally:
        for s in idle:
            s.close()
    after = [_request_ok(server.url) for _ in range(3)]
    assert after == [200] * 3, after


def test_trickled_headers_get_408(server):
    s = _connect(server.port)
    head = b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    start, got = time.monotonic(), b""
    with s:
        for byte in head:  # 1 byte every 0.25 s until the server answers
            if _readable(s, 0.25):
                got, closed_after = _read_until_closed(s, 3)
                break
            s.send(bytes([byte]))
        took = time.monotonic() - start
    assert got.startswith(b"HTTP/1.1 408 "), got
    assert closed_after is not None and TIMEOUT_S * 0.8 < took < TIMEOUT_S + 2, took


def test_slow_body_gets_408(server):
    s = _connect(server.port)
    body = b'{"model": "tts-1", "input": "Hello there.", "voice": "alloy"}'
    head = b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    s.send(head + b"content-length: %d\r\n\r\n" % len(body))
    start, got = time.monotonic(), b""
    with s:
        for byte in body:
            if _readable(s, 0.25):
                got, closed_after = _read_until_closed(s, 3)
                break
            s.send(bytes([byte]))
        took = time.monotonic() - start
    assert got.startswith(b"HTTP/1.1 408 "), got
    assert closed_after is not None and TIMEOUT_S * 0.8 < took < TIMEOUT_S + 2, took


@pytest.mark.parametrize("phase", ["headers", "body"])
def test_timeout_408_survives_bytes_sent_after_it(server, phase):
    """The client goes on sending after the server timed it out, before it reads: the 408 must still arrive
    (a plain close with those bytes unread, or arriving after it, makes the kernel reset the connection, and a
    reset throws away the 408 the client had not yet read)."""
    head = b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    if phase == "body":
        head += b"content-length: 64\r\n\r\n{"
    s = _connect(server.port)
    with s:
        s.send(head)
        time.sleep(TIMEOUT_S + 0.5)  # timed out by now: the 408 is in this socket, unread
        for _ in range(3):
            s.send(b"x" * 100)
            time.sleep(0.05)
        got, closed_after = _read_until_closed(s, 3)
    assert got.startswith(b"HTTP/1.1 408 "), got
    assert closed_after is not None


def test_idle_keep_alive_connection_is_closed(server):
    s = _connect(server.port)
    with s:
        s.send(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first or not first.endswith(b"}"):  # /health's whole JSON answer
            assert _readable(s, 10), first
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        start = time.monotonic()
        rest, closed_after = _read_until_closed(s, TIMEOUT_S + 3)
    assert rest == b"" and closed_after is not None and TIMEOUT_S * 0.8 < closed_after < TIMEOUT_S + 2
    assert time.monotonic() - start < TIMEOUT_S + 3


def test_every_server_close_is_logged(server):
    """One rate-limited line with counts per reason (a burst waits up to the 10-s log interval)."""
    wanted = ("shed", "header_timeout", "body_timeout", "keep_alive")
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline:
        lines = [line for line in server.log().splitlines() if "closed connections:" in line]
        if all(any(f"{w} " in line for line in lines) for w in wanted):
            break
        time.sleep(0.5)
    assert all(any(f"{w} " in line for line in lines) for w in wanted), lines
    assert any("WARNING" in line and "shed " in line for line in lines), lines


def test_keep_alive_outlives_the_clients_idle_expiry():
    """A server that closes an idle connection at the moment a client reuses it resets that request (httpx
    ReadError, nothing in the server's log): the server's keep-alive must outlast common clients' expiry,
    and the load generator's must be the shorter one."""
    from ttsserve.bench.serving import CLIENT_KEEPALIVE_S
    from ttsserve.server.args import ServerConfig

    default = ServerConfig().timeout_keep_alive_s
    assert default > httpx.Limits().keepalive_expiry and default > 60  # httpx 5 s, nginx/ALB upstream 60 s
    assert CLIENT_KEEPALIVE_S < 5  # below uvicorn's default too, for servers run with it
