"""Helpers of the deployment tests (ports, readiness, the data-parallel cluster handle)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
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
class Cluster:
    """The launcher on `port`; replica i on `replica_ports[i]`; its log (launcher + prefixed replica lines)."""

    proc: subprocess.Popen
    port: int
    replica_ports: list[int]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def replica_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.replica_ports[i]}"

    def replica_pid(self, i: int) -> int:
        """The pid of the process serving replica i now (found by its --port in /proc)."""
        want = ["--port", str(self.replica_ports[i])]
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if "ttsserve.entrypoints.serve" in argv and any(argv[k : k + 2] == want for k in range(len(argv))):
                return int(d.name)
        raise AssertionError(f"no process for replica {i}\n{self.log.read_text()[-2000:]}")

    def kill_replica(self, i: int) -> int:
        pid = self.replica_pid(i)
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_all_ready(self, timeout_s: float = 90.0) -> None:
        """Every replica answers /ready, and the balancer has probed them since (it probes every 1 s,
        LoadBalancer.probe_interval_s): until then a replica that just came up is not in its rotation yet."""
        wait_ready([self.replica_url(i) for i in range(len(self.replica_ports))], timeout_s, self.proc, self.log)
        time.sleep(1.5)
