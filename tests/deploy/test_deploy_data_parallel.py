"""`ttsserve serve --data-parallel-size N` (ttsserve/entrypoints/data_parallel.py): the replica plan, and a real
launcher with two tiny CPU replicas on loopback (conftest.dp_cluster): requests spread over both replicas,
a killed replica is failed over and restarted by the supervisor."""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from deploy_helpers import ROOT, free_port

from ttsserve.entrypoints.data_parallel import (
    ReplicaSpec,
    add_data_parallel_args,
    child_argv,
    data_parallel_size,
    plan_replicas,
    serve_data_parallel,
)

SPEECH = {"model": "chattts", "voice": "alloy", "response_format": "pcm", "max_new_tokens": 40}


def test_child_argv_drops_what_each_replica_gets_its_own_value_for() -> None:
    argv = [
        "serve",
        "--port",
        "9000",
        "--host=0.0.0.0",
        "--model",
        "/m",
        "--device",
        "cuda",
        "--data-parallel-size",
        "2",
        "--data-parallel-base-port=9100",
        "--max-num-seqs",
        "64",
    ]
    assert child_argv(argv) == ["--model", "/m", "--max-num-seqs", "64"]


def test_plan_gpu_replicas_one_visible_gpu_each() -> None:
    specs = plan_replicas(2, 9001, "auto", ["3", "5"], ["--model", "/m"])
    assert [s.port for s in specs] == [9001, 9002]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["3", "5"]
    assert all(s.env["TTSSERVE_DATA_PARALLEL_SIZE"] == "1" for s in specs)  # no recursion in the replica
    assert specs[1].argv == ["--model", "/m", "--host", "127.0.0.1", "--port", "9002", "--device", "cuda"]


def test_plan_cpu_replicas_split_cores() -> None:
    specs = plan_replicas(2, 9001, "auto", [], [], cpu_count=8)  # auto without GPUs: CPU replicas
    assert [s.device for s in specs] == ["cpu", "cpu"]
    assert [s.env["OMP_NUM_THREADS"] for s in specs] == ["4", "4"]
    assert "CUDA_VISIBLE_DEVICES" not in specs[0].env


@pytest.mark.parametrize(
    "n, device, gpus, match",
    [
        (3, "cuda", ["0", "1"], "needs 3 GPUs, 2 visible"),
        (2, "cuda:1", ["0", "1"], "pins one GPU"),
        (2, "cuda", [], "needs 2 GPUs"),
        (2, "cpu", [], None),
    ],
)
def test_plan_errors(n: int, device: str, gpus: list[str], match: str | None) -> None:
    if match is None:
        assert len(plan_replicas(n, 9001, device, gpus, [])) == n
    else:
        with pytest.raises(ValueError, match=match):
            plan_replicas(n, 9001, device, gpus, [])
    with pytest.raises(ValueError, match="65535"):
        plan_replicas(2, 65535, "cpu", [], [])


def test_data_parallel_size_flag_env_default() -> None:
    p = argparse.ArgumentParser()
    add_data_parallel_args(p)
    assert data_parallel_size(p.parse_args([]), env={}) == 1
    env = {"TTSSERVE_DATA_PARALLEL_SIZE": "4"}
    assert data_parallel_size(p.parse_args([]), env=env) == 4
    assert data_parallel_size(p.parse_args(["--data-parallel-size", "2"]), env=env) == 2  # the flag wins
    with pytest.raises(ValueError, match="positive integer"):
        data_parallel_size(p.parse_args(["--data-parallel-size", "0"]), env={})


def test_a_replica_configuration_error_stops_the_launcher_with_code_2(monkeypatch) -> None:
    # The replica rejects --block-size 7 (exit code 2): restarting cannot help, so the launcher gives up.
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    port = free_port()
    spec = ReplicaSpec(0, port + 1, "cpu", ["--block-size", "7", "--port", str(port + 1)], {})
    start = time.monotonic()
    rc = asyncio.run(asyncio.wait_for(serve_data_parallel("127.0.0.1", port, [spec], grace_s=5), 60))
    assert rc == 2 and time.monotonic() - start < 60


def _speak(url: str, text: str) -> tuple[int, int]:
    r = httpx.post(url + "/v1/audio/speech", json={**SPEECH, "input": text}, timeout=60)
    return r.status_code, len(r.content)


def _served(url: str) -> float:
    """Speech requests this replica answered 200 (its Prometheus counter)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r'ttsserve_requests_total\{endpoint="/v1/audio/speech",status="200"\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def test_launcher_spreads_requests_and_survives_a_replica_crash(dp_cluster) -> None:
    c = dp_cluster
    c.wait_all_ready()
    before = [_served(c.replica_url(i)) for i in range(2)]
    # Concurrent requests: least connections sends them to both replicas.
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: _speak(c.url, f"Sentence number {i}."), range(6)))
    assert all(status == 200 and size > 0 for status, size in results), results
    after = [_served(c.replica_url(i)) for i in range(2)]
    assert all(a > b for a, b in zip(after, before)), (before, after)

    old_pid = c.kill_replica(0)
    for i in range(4):  # every request still succeeds: connects to the dead replica fail over to the other
        assert _speak(c.url, f"After the crash {i}.")[0] == 200
    # The supervisor starts a new process for the replica (its model loads while the next tests run; the
    # balancer keeps it out of rotation until /ready says so, as the nginx tests' first wait shows).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if c.replica_pid(0) != old_pid:
                break
        except AssertionError:  # between the old process's death and the new one's start
            pass
        time.sleep(0.2)
    assert c.replica_pid(0) != old_pid
    assert "replica 0 exited (code -9); restarting in 1 s" in c.log.read_text()
    assert httpx.get(c.url + "/ready", timeout=10).status_code == 200
