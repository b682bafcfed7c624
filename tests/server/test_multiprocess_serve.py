"""`ttsserve serve --api-server-count 2` as real processes on loopback: both API servers serve, metrics sum
over them, a seeded request sounds as in the single-process server, bad input is a 400 with the core's
message, a client that leaves frees its KV blocks in the core, voices and rate limits are shared, SIGTERM
drains. A dead core's faults are in tests/faults/test_core_faults.py."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.prom_util import metric
from tests.server.conftest import wait_until
from tests.server.helpers import parse_sse, same_audio
from tests.server.multiproc_helpers import ServeProcess
from ttsserve.server.preflight import REUSE_PORT_BALANCES

SPEECH = {
    "model": "tts-1",
    "input": "Hello there.",
    "voice": "alloy",
    "response_format": "pcm",
    "seed": 5,
    "max_new_tokens": 24,
}
LONG = {**SPEECH, "input": "long " * 40, "min_new_tokens": 3000, "max_new_tokens": 3000, "seed": 1}


def _total(text: str, name: str) -> float:
    """The sum of a metric's samples over all label values."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServeProcess(tmp_path_factory.mktemp("mp"), "--voices-db", ":memory:", "--max-new-tokens", "3000")
    clients: dict[str, httpx.Client] = {}
    try:
        srv.wait_ready()
        clients.update(srv.pinned_clients())
        yield srv, clients
    finally:
        for c in clients.values():
            c.close()
        assert srv.stop() == 0, srv.log()


def test_both_api_servers_serve_and_metrics_sum_over_them(server):
    srv, clients = server
    before = metric(
        clients["0"].get("/metrics").text,
        "ttsserve_requests_total",
        '{endpoint="/v1/audio/speech",status="200"}',
        missing=0.0,
    )
    vllm_before = _total(clients["0"].get("/metrics").text, "vllm:e2e_request_latency_seconds_count")
    statuses: dict[str, list[int]] = {}

    def run(index: str) -> None:
        statuses[index] = [
            clients[index].post("/v1/audio/speech", json={**SPEECH, "seed": i}).status_code for i in range(2)
        ]

    threads = [threading.Thread(target=run, args=(i,)) for i in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert statuses == {"0": [200, 200], "1": [200, 200]}
    for client in clients.values():  # either process reports the four requests, whichever process served them
        text = client.get("/metrics").text
        assert metric(text, "ttsserve_requests_total", '{endpoint="/v1/audio/speech",status="200"}') == before + 4
        assert metric(text, "ttsserve_step_time_ms") > 0
        # vLLM's names sum over the API servers too; the engine's gauges appear once
        assert wait_until(
            lambda: _total(client.get("/metrics").text, "vllm:e2e_request_latency_seconds_count") == vllm_before + 4
        )
        assert len(re.findall(r"^vllm:num_requests_running\{", text, re.MULTILINE)) == 1
        # engine gauges come from the core's stats, which reach each API server within ~0.1 s
        assert wait_until(lambda: metric(client.get("/metrics").text, "ttsserve_num_requests_running") == 0)
    assert clients["1"].get("/ready").json()["status"] == "ready"


def test_seeded_output_is_the_single_process_servers(server, serve_real):
    _, clients = server
    single, _ = serve_real()
    with single.client() as c:
        reference = c.post("/v1/audio/speech", json=SPEECH)
    assert reference.status_code == 200 and len(reference.content) > 1000
    for client in clients.values():
        r = client.post("/v1/audio/speech", json=SPEECH)
        assert r.status_code == 200 and same_audio(r.content, reference.content)


def test_bad_input_is_a_400_with_the_cores_message(server):
    _, clients = server
    for client in clients.values():
        r = client.post("/v1/audio/speech", json={**SPEECH, "input": "!!!"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "text: nothing speakable is left after normalization"
        assert r.json()["error"]["param"] == "input"
        r = client.post("/synthesize", json={"text": "?!", "max_new_tokens": 24})
        assert r.status_code == 400 and "nothing speakable" in r.json()["error"]["message"]


def test_client_disconnect_aborts_in_the_core_and_frees_its_blocks(server):
    srv, clients = server
    metrics = clients["0"]
    aborted = metric(metrics.get("/metrics").text, "ttsserve_requests_aborted_total", missing=0.0)
    with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/v1/audio/speech", json=LONG) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()  # keep a reference: a dropped iterator closes the response at once
        next(chunks)
        assert wait_until(lambda: metric(metrics.get("/metrics").text, "ttsserve_kv_cache_usage_ratio") > 0)
        assert metric(metrics.get("/metrics").text, "ttsserve_num_requests_running") == 1
    # leaving the block closed the connection mid-stream: the core aborts the request and frees its blocks
    assert wait_until(lambda: metric(metrics.get("/metrics").text, "ttsserve_kv_cache_usage_ratio") == 0, timeout=10)
    text = metrics.get("/metrics").text
    assert metric(text, "ttsserve_num_requests_running") == 0
    assert metric(text, "ttsserve_requests_aborted_total") == aborted + 1


def test_voices_are_visible_from_every_api_server(server):
    _, clients = server
    r = clients["0"].post("/v1/audio/voices", json={"name": "shared voice", "seed": 77})
    assert r.status_code == 200
    vid = r.json()["id"]
    assert clients["1"].get(f"/v1/audio/voices/{vid}").json()["name"] == "shared voice"
    assert clients["1"].post("/v1/audio/speech", json={**SPEECH, "voice": "shared voice"}).status_code == 200
    assert clients["1"].delete(f"/v1/audio/voices/{vid}").status_code == 200
    assert clients["0"].get(f"/v1/audio/voices/{vid}").status_code == 404


@pytest.mark.skipif(not REUSE_PORT_BALANCES, reason="SO_REUSEPORT balances connections on Linux only")
def test_a_burst_of_connections_spreads_over_the_api_servers(server):
    """64 connections opened at once (clients arriving together, or reconnecting after a restart): on one
    shared socket the first process to wake accepted all that were pending (128-0-0-0 seen on 4 servers),
    and keep-alive kept them there. Each API server has its own socket of a SO_REUSEPORT group instead, so
    the kernel's hash spreads them: fewer than 12 of 64 on one of 2 servers has a chance of about 1e-7."""
    srv, _ = server
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)

    async def burst(n: int) -> Counter:
        conns = await asyncio.gather(*[asyncio.open_connection(host, int(port)) for _ in range(n)])
        seen: Counter = Counter()
        try:
            for _, writer in conns:
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            for reader, _ in conns:
                head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)).decode().lower()
                seen[re.search(r"^x-api-server: (\d+)", head, re.MULTILINE).group(1)] += 1
        finally:
            for _, writer in conns:
                writer.close()
        return seen

    seen = asyncio.run(burst(64))
    assert sorted(seen) == ["0", "1"] and min(seen.values()) >= 12, seen


def test_a_killed_api_server_is_restarted(server):
    srv, clients = server
    os.kill(srv.pid_of("API server 1"), signal.SIGKILL)
    assert wait_until(lambda: "API server 1 exited" in srv.log(), timeout=30), srv.log()
    # Until it is back, new connections all reach API server 0: none waits on the dead one's socket.
    for _ in range(8):
        r = httpx.get(srv.url + "/health", timeout=5)
        assert r.status_code == 200 and r.headers["x-api-server"] == "0"
    assert wait_until(lambda: len(re.findall(r"API server 1: pid", srv.log())) == 2, timeout=30), srv.log()
    clients["1"].close()
    srv.wait_ready(60)
    clients.update(srv.pinned_clients())  # a connection on the new process
    assert clients["1"].post("/v1/audio/speech", json=SPEECH).status_code == 200
    assert "API server 1 exited" in srv.log()


def test_rate_limits_hold_across_api_servers_and_sigterm_drains(tmp_path):
    srv = ServeProcess(
        tmp_path,
        "--api-key",
        "k1,k2",
        "--requests-per-minute",
        "4",
        "--max-new-tokens",
        "3000",
        "--voices-db",
        str(tmp_path / "voices.db"),
    )
    try:
        srv.wait_ready()
        clients = srv.pinned_clients(headers={"Authorization": "Bearer k1"})
        got = [
            (i, clients[i].post("/v1/audio/voices", json={"name": f"v{n}-{i}", "seed": n}).status_code)
            for n in range(3)
            for i in ("0", "1")
        ]
        # one budget of 4 for the key, not 4 per API server
        assert got == [("0", 200), ("1", 200), ("0", 200), ("1", 200), ("0", 429), ("1", 429)]
        for c in clients.values():
            c.close()
        result: dict = {}
        started = threading.Event()
        body = {**SPEECH, "stream_format": "sse", "min_new_tokens": 150, "max_new_tokens": 150}

        def stream() -> None:
            with (
                httpx.Client(base_url=srv.url, timeout=60, headers={"Authorization": "Bearer k2"}) as c,
                c.stream("POST", "/v1/audio/speech", json=body) as r,
            ):
                data = b""
                for chunk in r.iter_bytes():
                    data += chunk
                    started.set()
                result["events"] = parse_sse(data)

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert srv.proc.wait(60) == 0, srv.log()
        done = result["events"][-1]
        assert done["type"] == "speech.audio.done" and done["usage"]["output_tokens"] == 150  # ran to its end
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=2)
    finally:
        srv.stop()
    assert "stopped" in srv.log() and "not cleanly" not in srv.log()


def test_children_die_with_the_launcher(tmp_path):
    srv = ServeProcess(tmp_path, "--voices-db", str(tmp_path / "voices.db"))
    try:
        srv.wait_ready()
        children = [srv.pid_of(role) for role in ("engine core", "API server 0", "API server 1")]
        srv.proc.kill()  # no chance to clean up: the children must notice on their own
        srv.proc.wait(10)
        assert wait_until(lambda: not any(_alive(pid) for pid in children), timeout=40)
    finally:
        srv.stop()


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (exited, not yet reaped by the process that inherited it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_every_process_freezes_its_start_up_heap(server):
    """The core and each API server move their start-up objects out of the GC's generations (engine/core/
    heap.py): a full collection would otherwise walk them all and pause the process's loop."""
    srv, _ = server
    frozen = dict(re.findall(r"(engine core|API server \d): (\d+) start-up objects frozen", srv.log()))
    assert set(frozen) == {"engine core", "API server 0", "API server 1"}, srv.log()[-2000:]
    assert all(int(n) > 10_000 for n in frozen.values()), frozen
