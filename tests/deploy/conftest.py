"""Shared fixtures of the deployment tests: one data-parallel launcher with two tiny CPU replicas on loopback
(`python -m ttsserve.entrypoints.data_parallel`), used by the data-parallel and the nginx tests, so the model is
loaded twice per session, not four times."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from deploy_helpers import ROOT, TINY_SERVE_ARGS, Cluster, free_port_run, wait_ready


@pytest.fixture(scope="session")
def dp_cluster(tmp_path_factory) -> Cluster:
    """Two tiny CPU replicas behind the built-in balancer (session-wide; tests leave both replicas ready)."""
    base = free_port_run(3)
    log = tmp_path_factory.mktemp("dp") / "launcher.log"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "ttsserve.entrypoints.data_parallel",
        *TINY_SERVE_ARGS,
        "--host",
        "127.0.0.1",
        "--port",
        str(base),
        "--data-parallel-size",
        "2",
        "--data-parallel-base-port",
        str(base + 1),
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    cluster = Cluster(proc, base, [base + 1, base + 2], log)
    try:
        cluster.wait_all_ready(120)
        wait_ready([cluster.url], 10, proc, log)
        yield cluster
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
