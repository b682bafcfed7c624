"""Shared fixtures of the deployment tests: two whole tiny CPU servers on loopback (`ttsserve serve`, one engine
each), standing in for two machines behind nginx, started once per session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from deploy_helpers import ROOT, TINY_SERVE_ARGS, Machines, free_port_run


@pytest.fixture(scope="session")
def machines(tmp_path_factory) -> Machines:
    """Two tiny CPU servers (session-wide; a test that kills one restarts it with Machines.restart)."""
    base = free_port_run(2)
    d = tmp_path_factory.mktemp("machines")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    cmds = [
        [sys.executable, "-m", "ttsserve.entrypoints.serve", *TINY_SERVE_ARGS, "--host", "127.0.0.1", "--port", str(p)]
        for p in (base, base + 1)
    ]
    m = Machines(cmds, [base, base + 1], [d / "server-0.log", d / "server-1.log"], env)
    try:
        for i in range(2):
            m.start(i)
        m.wait_all_ready(120)
        yield m
    finally:
        for p in m.procs:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in m.procs:
            if p is not None:
                try:
                    p.wait(40)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
