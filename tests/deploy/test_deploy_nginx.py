"""nginx in front of two real `ttsserve serve` replicas (tiny model, CPU, loopback), with the shipped template
rendered for loopback: requests are spread, a replica killed mid-test costs no request (POSTs are retried on
the other replica before any byte went out), streams come through unbuffered, and limit_req answers 429.
Skips when nginx is not installed (scripts/ci_deps.sh installs Debian's)."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from deploy_helpers import free_port, wait_ready

from ttsserve.deploy.nginx import NginxParams, render_nginx_conf

pytestmark = pytest.mark.skipif(
    shutil.which("nginx") is None, reason="nginx not installed (scripts/ci_deps.sh installs Debian's nginx-light)"
)
TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day and everyone was happy."


@dataclass
class Nginx:
    url: str
    access_log: Path
    error_log: Path

    def access_lines(self) -> list[str]:
        return self.access_log.read_text().splitlines()


@pytest.fixture(scope="module")
def nginx(machines, tmp_path_factory):
    d = tmp_path_factory.mktemp("nginx")
    port = free_port()
    conf = render_nginx_conf(
        NginxParams(
            upstreams=[f"127.0.0.1:{p}" for p in machines.replica_ports],
            listen=f"127.0.0.1:{port}",
            rate="2r/s",
            burst=20,
            runtime_dir=str(d),
            error_log=str(d / "error.log"),
            access_log=f"{d / 'access.log'} ttsserve",
            worker_processes="1",
        )
    )
    (d / "nginx.conf").write_text(conf)
    proc = subprocess.Popen(
        ["nginx", "-p", str(d), "-c", str(d / "nginx.conf"), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_ready([f"http://127.0.0.1:{port}"], 20, proc, d / "error.log")
        yield Nginx(f"http://127.0.0.1:{port}", d / "access.log", d / "error.log")
    finally:
        proc.send_signal(signal.SIGQUIT)  # graceful stop
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _synthesize(url: str, i: int) -> int:
    r = httpx.post(
        url + "/synthesize", json={"text": f"Request number {i}.", "max_new_tokens": 30, "seed": i}, timeout=60
    )
    assert r.status_code != 200 or r.content[:4] == b"RIFF"
    return r.status_code


def _upstreams(line: str) -> list[str]:
    m = re.search(r"upstream=(.*?) ustatus=", line)
    return [u.strip() for u in m.group(1).split(",")] if m else []


def test_streams_pass_through_unbuffered(machines, nginx) -> None:
    machines.wait_all_ready()
    # min_new_tokens: the dummy's EOS (model/dummy_eos.py) must not end the stream after a chunk or two
    body = {
        "model": "chattts",
        "input": TEXT,
        "voice": "alloy",
        "response_format": "mp3",
        "seed": 2,
        "min_new_tokens": 300,
        "max_new_tokens": 300,
    }
    httpx.post(nginx.url + "/v1/audio/speech", json=body, timeout=60)  # warm both code paths once
    events: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    with httpx.stream("POST", nginx.url + "/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers.get("transfer-encoding") == "chunked"
        for chunk in r.iter_raw():
            events.append((time.perf_counter() - t0, len(chunk)))
    first, last = events[0][0], events[-1][0]
    arrival_times = {round(t, 2) for t, _ in events}
    assert len(arrival_times) >= 3, events  # the body came in pieces, as the replica produced it
    assert first < 0.5 * last, f"first audio bytes at {first:.2f} s of {last:.2f} s: the response was held back"


def test_rate_limit_answers_429(nginx) -> None:
    # A client of its own (127.0.0.2: another limit_req key) sends 40 requests at about the same time; rate
    # 2r/s with burst 20 lets about 20 through and refuses the rest with 429 before they reach a replica.
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(transport=transport, timeout=30) as client, ThreadPoolExecutor(10) as pool:
        codes = list(
            pool.map(
                lambda _: (
                    client.post(
                        nginx.url + "/synthesize", content=b"{not json", headers={"content-type": "application/json"}
                    ).status_code
                ),
                range(40),
            )
        )
    assert codes.count(429) >= 10, codes
    assert set(codes) <= {400, 422, 429}, codes  # the others reached a replica, which rejected the bad body
    assert httpx.get(nginx.url + "/health", timeout=10).status_code == 200  # only synthesis is limited


def test_balances_and_survives_a_killed_replica(machines, nginx) -> None:
    machines.wait_all_ready()
    replicas = [f"127.0.0.1:{p}" for p in machines.replica_ports]
    n0 = len(nginx.access_lines())
    assert [_synthesize(nginx.url, i) for i in range(6)] == [200] * 6
    used = {u for line in nginx.access_lines()[n0:] for u in _upstreams(line)}
    assert used == set(replicas), "least_conn spreads sequential requests over both replicas"

    machines.kill_replica(1)  # SIGKILL: connections to it are refused from now on
    n1 = len(nginx.access_lines())
    assert [_synthesize(nginx.url, 10 + i) for i in range(6)] == [200] * 6
    lines = nginx.access_lines()[n1:]
    retried = [ln for ln in lines if _upstreams(ln) == [replicas[1], replicas[0]]]
    # The dead replica was tried, failed before any byte was sent, and the POST went to the live one.
    assert retried, "\n".join(lines)
    assert all(" 200 " in ln for ln in lines)
    assert "connect() failed" in nginx.error_log.read_text()
    machines.restart(1)  # as an orchestrator would
