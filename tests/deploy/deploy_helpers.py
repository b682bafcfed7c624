"""Helpers of the deployment tests (ports, readiness, whole servers standing in for machines)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.tiny_args import TINY_CLI_ARGS

ROOT = Path(__file__).resolve().parents[2]
TINY_SERVE_ARGS = [
    *TINY_CLI_ARGS,
    "--voices-db",
    ":memory:",
    "--kv-cache-memory",
    "64M",
    "--swap-space",
    "0",
    "--log-level",
    "warning",
]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """A port p such that p .. p + n - 1 are all free now."""
    for _ in range(50):
        p = free_port()
        if p + n < 65535 and all(_is_free(p + i) for i in range(n)):
            return p
    raise RuntimeError("no run of free ports")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def wait_ready(urls: list[str], timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(http_status(u + "/ready") == 200 for u in urls):
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.2)
    tail = log.read_text()[-4000:] if log and log.exists() else ""
    raise RuntimeError(f"not ready within {timeout_s} s: {urls}\n{tail}")


@dataclass
class Machines:
    """Whole servers (one per port), as an orchestrator would run them: start, kill, restart, wait."""

    cmds: list[list[str]]
    replica_ports: list[int]
    logs: list[Path]
    env: dict[str, str]
    procs: list = field(default_factory=list)

    def start(self, i: int) -> None:
        while len(self.procs) <= i:
            self.procs.append(None)
        with open(self.logs[i], "a") as f:
            self.procs[i] = subprocess.Popen(self.cmds[i], stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)

    def replica_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.replica_ports[i]}"

    def kill_replica(self, i: int) -> int:
        pid = self.procs[i].pid
        os.kill(pid, signal.SIGKILL)
        self.procs[i].wait(10)
        return pid

    def restart(self, i: int, timeout_s: float = 120.0) -> None:
        if self.procs[i].poll() is not None:
            self.start(i)
        wait_ready([self.replica_url(i)], timeout_s, self.procs[i], self.logs[i])

    def wait_all_ready(self, timeout_s: float = 90.0) -> None:
        for i in range(len(self.replica_ports)):
            wait_ready([self.replica_url(i)], timeout_s, self.procs[i], self.logs[i])
