"""Per-request bounds through `serve --api-server-count 2`: --request-timeout against a stopped engine core
(SIGSTOP), before any audio (504) and mid-stream (a cut body, an SSE error event), on each API server; the core
aborts the requests and frees their KV blocks once it runs again; --max-audio-seconds ends a request at the
ceiling with finish reason length."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.prom_util import metric
from tests.server.conftest import wait_until
from tests.server.multiproc_helpers import ServeProcess

TIMEOUT_S = 2.0
SPEECH = {"model": "tts-1", "voice": "alloy", "response_format": "pcm", "seed": 1}
LONG = {**SPEECH, "input": "A long one.", "min_new_tokens": 1500}  # ~7 s of CPU without the ceiling


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServeProcess(
        tmp_path_factory.mktemp("mp"),
        "--voices-db",
        ":memory:",
        "--max-new-tokens",
        "2048",
        "--request-timeout",
        str(TIMEOUT_S),
        "--max-audio-seconds",
        "3",
    )
    clients: dict[str, httpx.Client] = {}
    try:
        srv.wait_ready()
        clients.update(srv.pinned_clients())
        yield srv, clients
    finally:
        for c in clients.values():
            c.close()
        assert srv.stop() == 0, srv.log()


def _kv_freed(client: httpx.Client) -> bool:
    text = client.get("/metrics").text
    return metric(text, "ttsserve_kv_cache_usage_ratio") == 0 and metric(text, "ttsserve_num_requests_running") == 0


def test_a_stopped_core_gives_504_before_audio_on_every_api_server(server):
    srv, clients = server
    core = srv.pid_of("engine core")
    os.kill(core, signal.SIGSTOP)
    try:
        for client in clients.values():
            t = time.monotonic()
            r = client.post("/v1/audio/speech", json=LONG)
            assert r.status_code == 504, r.text
            assert r.json()["error"]["code"] == "request_timeout"
            assert TIMEOUT_S <= time.monotonic() - t < TIMEOUT_S + 3
    finally:
        os.kill(core, signal.SIGCONT)
    assert wait_until(lambda: _kv_freed(clients["0"]), timeout=15)
    log = srv.log()
    assert log.count('"status": 504') == 2 and log.count('"finish_reason": "timeout"') >= 2


def test_a_core_stopped_mid_stream_cuts_the_stream(server):
    srv, clients = server
    core = srv.pid_of("engine core")
    for client, body in zip(clients.values(), (LONG, {**LONG, "stream_format": "sse"}), strict=True):
        got = bytearray()
        with pytest.raises(httpx.RemoteProtocolError), client.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200
            for chunk in r.iter_bytes():
                if not got:
                    os.kill(core, signal.SIGSTOP)  # no more audio: the request's time runs out mid-stream
                got += chunk
        os.kill(core, signal.SIGCONT)
        if body.get("stream_format") == "sse":
            events = [json.loads(x[6:]) for x in got.decode().splitlines() if x.startswith("data: ")]
            assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "request_timeout"
    assert wait_until(lambda: _kv_freed(clients["0"]), timeout=15)
    done = [json.loads(x.split("ttsserve.access: ", 1)[1]) for x in srv.log().splitlines() if "synthesis_done" in x]
    cut = [x for x in done if x["finish_reason"] == "timeout"]
    assert len(cut) == 2 and all(x["request_id"] and "request_timeout" in x["reason"] for x in cut)


def test_max_audio_seconds_ends_the_request_with_length(server):
    _, clients = server
    for client in clients.values():
        r = client.post("/synthesize", json={"text": "A long one.", "min_new_tokens": 1500, "format": "pcm"})
        assert r.status_code == 200 and r.headers["x-finish-reason"] == "length", r.text
        assert len(r.content) == 3 * 24000 * 2
    big = {**SPEECH, "input": "word " * 200}  # >= 67 s of speech
    r = clients["0"].post("/v1/audio/speech", json=big)
    assert r.status_code == 400 and r.json()["error"]["code"] == "audio_too_long"
