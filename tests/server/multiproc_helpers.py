"""Helpers for the multi-process tests: a real engine-core process, real `serve --api-server-count` processes,
and a client connection pinned to each API server."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.server.conftest import REAL_ENGINE, REAL_MAX_NEW_TOKENS
from tests.tiny_args import TINY_CLI_ARGS
from ttsserve.config import EngineConfig

REPO = Path(__file__).resolve().parents[2]
SERVE_FLAGS = [
    *TINY_CLI_ARGS,
    "--kv-cache-memory",
    "64MiB",
    "--swap-space",
    "0",
    "--max-new-tokens",
    str(REAL_MAX_NEW_TOKENS),
]


def start_core(address: str, **overrides) -> multiprocessing.Process:
    """An engine-core process on the tiny engine (REAL_ENGINE + overrides), ready to serve `address`."""
    from ttsserve.engine.core.proc import run_engine_core

    ctx = multiprocessing.get_context("spawn")
    ready_r, ready_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=run_engine_core, args=(EngineConfig(**{**REAL_ENGINE, **overrides}), address, ready_w, 5.0)
    )
    proc.start()
    ready_w.close()
    try:
        assert ready_r.poll(120), "the engine core did not start in 120 s"
        assert ready_r.recv()[0] == "ready"
    except BaseException:
        stop_process(proc)
        raise
    return proc


def stop_process(proc: multiprocessing.Process, timeout_s: float = 30) -> int | None:
    """SIGTERM (the core drains and exits 0), SIGKILL after timeout_s. Returns the exit code."""
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    return proc.exitcode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m ttsserve.entrypoints.serve --api-server-count N ...` on a free loopback port; its log in
    `log_path`."""

    def __init__(self, tmp_path: Path, *extra: str, count: int = 2) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"serve-{self.port}.log"
        cmd = [
            sys.executable,
            "-m",
            "ttsserve.entrypoints.serve",
            *SERVE_FLAGS,
            "--port",
            str(self.port),
            "--api-server-count",
            str(count),
            "--drain-timeout",
            "20",
            *extra,
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "TTSSERVE_CPU_COMPILE": "0"}
        self._log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.count = count

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout_s: float = 150) -> ServeProcess:
        """Until every API server (the one process with count 0) has answered /ready with 200."""
        deadline = time.monotonic() + timeout_s
        seen: set[str] = set()
        while len(seen) < max(self.count, 1):
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, f"not ready in {timeout_s} s:\n{self.log()}"
            try:
                r = httpx.get(self.url + "/ready", timeout=2)
                if r.status_code == 200:
                    seen.add(r.headers.get("x-api-server", "0"))
                    continue
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        return self

    def pinned_clients(self, tries: int = 400, **kw) -> dict[str, httpx.Client]:
        """One keep-alive client per API server index: a connection stays with the process that accepted it."""
        clients: dict[str, httpx.Client] = {}
        for _ in range(tries):
            c = httpx.Client(base_url=self.url, timeout=60, limits=httpx.Limits(max_connections=1), **kw)
            index = c.get("/health").headers["x-api-server"]
            if index in clients:
                c.close()
            else:
                clients[index] = c
            if len(clients) == self.count:
                return clients
        raise AssertionError(f"only reached API servers {sorted(clients)} in {tries} connections")

    def pid_of(self, role: str) -> int:
        """The pid the launcher logged first for 'engine core' (core 0) or 'API server <i>'."""
        m = re.search(rf"{role}(?: 0)?: pid (\d+)", self.log())
        assert m, self.log()
        return int(m.group(1))

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        if self.proc.poll() is None:  # the launcher hangs: kill it and, so nothing outlives the test, its children
            self.proc.kill()
            self.proc.wait(10)
            for pid in map(int, re.findall(r"(?:engine core(?: \d+)?|API server \d+): pid (\d+)", self.log())):
                _kill_spawned(pid)
        self._log.close()
        return self.proc.returncode


def _kill_spawned(pid: int) -> None:
    """SIGKILL `pid` if it still is a multiprocessing child (not a recycled pid)."""
    try:
        if b"multiprocessing" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass
