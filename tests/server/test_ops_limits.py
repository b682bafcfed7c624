"""Operations and admission control over a real server: health/ready/metrics/models, request ids and access
logs, API keys, rate limits, the in-flight bound, body limits, client disconnects and graceful shutdown."""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import httpx
import openai
import pytest

from tests.prom_util import metric
from tests.server.conftest import wait_until
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import parse_sse, same_audio, sse_audio
from ttsserve.server.errors import ApiError
from ttsserve.server.limits import RateLimiter

SPEECH = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "response_format": "pcm"}


def test_health_ready_models_metrics(serve_real):
    srv, eng = serve_real()
    with srv.client() as c:
        assert c.get("/health").json() == {"status": "ok"}
        ready = c.get("/ready").json()
        assert ready == {
            "status": "ready",
            "model": "chattts",
            "cores": [{"core": 0, "ready": True, "reason": None, "pid": ready["cores"][0]["pid"]}],
        }
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert ids == ["chattts", "tts-1", "tts-1-hd", "gpt-4o-mini-tts"]
        assert c.get("/v1/models/tts-1").json()["object"] == "model"
        assert c.get("/v1/models/whisper-1").status_code == 404
        r = c.post("/synthesize", json={"text": "Metrics please.", "seed": 2})
        assert r.status_code == 200
        audio_s = float(r.headers["x-audio-duration"])
        assert c.post("/v1/audio/speech", json={**SPEECH, "voice": "nobody"}).status_code == 404
        text = c.get("/metrics").text
    assert metric(text, "ttsserve_requests_total", '{endpoint="/synthesize",status="200"}') == 1
    assert metric(text, "ttsserve_requests_total", '{endpoint="/v1/audio/speech",status="404"}') == 1
    assert metric(text, "ttsserve_time_to_first_audio_seconds_count", '{endpoint="synthesize"}') == 1
    assert metric(text, "ttsserve_request_latency_seconds_count", '{endpoint="synthesize"}') == 1
    assert metric(text, "ttsserve_audio_seconds_total") == pytest.approx(audio_s, abs=1e-3)
    assert metric(text, "ttsserve_real_time_factor_count") == 1
    assert metric(text, "ttsserve_num_requests_running") == 0 and metric(text, "ttsserve_num_requests_waiting") == 0
    assert metric(text, "ttsserve_kv_cache_usage_ratio") == 0 and metric(text, "ttsserve_step_time_ms") > 0
    assert metric(text, "ttsserve_num_preemptions_total") == 0 and metric(text, "ttsserve_num_swaps_total") == 0
    assert metric(text, "ttsserve_engine_warm") == float(eng.stats()["warm"])
    stats = eng.stats()  # idle since the request: the scrape saw these same totals
    steps = metric(text, "ttsserve_engine_steps_total")
    assert steps == stats["steps_total"] > 0
    phase = metric(text, "ttsserve_engine_phase_seconds_total", '{phase="runner_prepare"}')
    assert phase == pytest.approx(stats["runner_breakdown_ms"]["prepare_ms"] * steps / 1000)
    hist = stats["step_time_histogram"]  # every step in one bucket
    assert metric(text, "ttsserve_engine_step_seconds_count") == sum(hist["counts"]) == steps
    assert metric(text, "ttsserve_engine_step_seconds_bucket", '{le="+Inf"}') == steps
    assert metric(text, "ttsserve_engine_step_seconds_sum") == pytest.approx(hist["sum_s"])
    below = sum(hist["counts"][: hist["le_s"].index(0.05) + 1])
    assert metric(text, "ttsserve_engine_step_seconds_bucket", '{le="0.05"}') == below
    # the one synthesis heard its first audio once, within its API-side time to first audio
    first = stats["first_audio_histogram"]
    assert metric(text, "ttsserve_engine_time_to_first_audio_seconds_count") == sum(first["counts"]) == 1
    assert 0 < first["sum_s"] <= metric(text, "ttsserve_time_to_first_audio_seconds_sum", '{endpoint="synthesize"}')
    assert metric(text, "ttsserve_engine_slow_steps_total") == stats["slow_steps_total"]
    assert metric(text, "ttsserve_engine_kernel_compiles_while_serving_total") == 0  # nothing compiles on a CPU
    for g in range(3):  # process-wide totals, read at the scrape: never above the stats read after it
        assert (
            0
            <= metric(text, "ttsserve_engine_gc_pause_seconds_total", f'{{generation="{g}"}}')
            <= stats["gc_pause_seconds_total"][g]
        )
    longest = metric(text, "ttsserve_engine_step_max_seconds")
    assert 0 < longest == hist["max_s"] and longest * steps >= hist["sum_s"]
    srv.stop()
    assert not eng.ready


def test_ready_is_503_when_the_engine_is_not(serve):
    srv, eng = serve()
    with srv.client() as c:
        eng._accepting = False
        r = c.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready" and r.headers["retry-after"]


def test_request_id_in_and_out_and_access_log(serve_real, caplog):
    srv, _ = serve_real()
    caplog.set_level(logging.INFO, logger="ttsserve.access")
    with srv.client() as c:
        r = c.post("/v1/audio/speech", json=SPEECH, headers={"X-Request-ID": "client-abc.1"})
        assert r.headers["x-request-id"] == "client-abc.1"
        r = c.post("/v1/audio/speech", json={**SPEECH, "voice": "nobody"}, headers={"X-Request-ID": "bad id!"})
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])  # unsafe ids are replaced
        generated = r.headers["x-request-id"]
    assert wait_until(lambda: sum('"synthesis_done"' in m for m in caplog.messages) >= 1)
    lines = [json.loads(m) for m in caplog.messages if m.startswith("{")]
    ok = next(x for x in lines if x["event"] == "access" and x["request_id"] == "client-abc.1")
    assert ok["status"] == 200 and ok["path"] == "/v1/audio/speech" and ok["voice"] == "alloy"
    assert any(x["event"] == "access" and x["request_id"] == generated and x["status"] == 404 for x in lines)
    done = next(x for x in lines if x["event"] == "synthesis_done" and x["request_id"] == "client-abc.1")
    assert done["finish_reason"] in ("stop", "length") and 0 < done["frames"] <= 24


def test_api_keys(serve_real):
    srv, _ = serve_real(api_keys=("k1", "k2"))
    with srv.client() as c:
        r = c.post("/v1/audio/speech", json=SPEECH)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.post("/v1/audio/speech", json=SPEECH, headers={"Authorization": "Bearer k3"}).status_code == 401
        assert c.post("/v1/audio/speech", json={"bad": 1}).status_code == 401  # the key is checked first
        assert c.get("/v1/audio/voices", headers={"Authorization": "Basic k1"}).status_code == 401
        assert c.post("/v1/audio/speech", json=SPEECH, headers={"Authorization": "Bearer k2"}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200  # ops stay open


def _clear_of_a_minute_boundary(margin_s: float) -> None:
    """Wait out the end of the current minute if fewer than margin_s seconds are left: the sliding-window
    counter weighs the previous minute by the share of it still in the window, so just after a boundary a
    budget used up just before it counts as slightly less than full and one more request passes."""
    left = 60 - time.time() % 60
    if left < margin_s:
        time.sleep(left + 0.05)


def test_rate_limits_per_key(serve_real, serve):
    _clear_of_a_minute_boundary(10)
    srv, _ = serve_real(api_keys=("a", "b"), requests_per_minute=2, chars_per_minute=1000)
    a = openai.OpenAI(base_url=srv.url + "/v1", api_key="a", max_retries=0)
    for _ in range(2):
        a.audio.speech.create(model="tts-1", voice="alloy", input="hi")
    with pytest.raises(openai.RateLimitError) as ei:
        a.audio.speech.create(model="tts-1", voice="alloy", input="hi")
    assert 1 <= int(ei.value.response.headers["retry-after"]) <= 60
    b = openai.OpenAI(base_url=srv.url + "/v1", api_key="b", max_retries=0)
    b.audio.speech.create(model="tts-1", voice="alloy", input="hi")  # another key has its own budget

    srv2, _ = serve(chars_per_minute=30)
    with srv2.client() as c:
        assert c.post("/v1/audio/speech", json={**SPEECH, "input": "x" * 20}).status_code == 200
        r = c.post("/v1/audio/speech", json={**SPEECH, "input": "x" * 20})
        assert r.status_code == 429 and "characters" in r.json()["error"]["message"]
        assert c.post("/v1/audio/speech", json={**SPEECH, "input": "x" * 10}).status_code == 200
        r = c.post("/v1/audio/speech", json={**SPEECH, "input": "x" * 31})
        assert r.status_code == 429 and r.headers["retry-after"] == "60"


def test_queue_full_gives_503_with_retry_after(serve):
    srv, eng = serve(FakeEngine(chunk_delay_s=0.02), max_in_flight=1)
    got: dict = {}

    def slow():
        with srv.client() as c:
            got["status"] = c.post("/v1/audio/speech", json={**SPEECH, "input": "x" * 40}).status_code

    t = threading.Thread(target=slow)
    t.start()
    assert wait_until(lambda: len(eng.running) == 1)
    with srv.client() as c:
        r = c.post("/v1/audio/speech", json=SPEECH)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "server_overloaded"
    t.join(10)
    assert got["status"] == 200
    with srv.client() as c:  # the slot is free again
        assert c.post("/v1/audio/speech", json=SPEECH).status_code == 200


def test_refund_gives_back_exactly_what_one_request_used():
    rate = RateLimiter(requests_per_minute=2, chars_per_minute=100)
    _clear_of_a_minute_boundary(2)
    first = rate.check("a", 30)
    rate.check("a", 30)
    with pytest.raises(ApiError) as ei:
        rate.check("a", 1)
    assert ei.value.status == 429
    first()
    first()  # idempotent: the second call gives back nothing
    refund = rate.check("a", 70)  # one request and 30 + 40 characters were free again, no more
    with pytest.raises(ApiError):
        rate.check("a", 1)
    refund()
    rate.check("b", 100)  # other identities are untouched throughout
    rate.check("a", 70)


def test_requests_refused_with_503_do_not_count_against_the_rate_limit(serve):
    _clear_of_a_minute_boundary(5)
    srv, eng = serve(FakeEngine(max_queue_len=0), requests_per_minute=2, chars_per_minute=50)
    speech, synth = {**SPEECH, "input": "x" * 20}, {"text": "y" * 20, "format": "pcm"}
    with srv.client() as c:
        for path, body in [("/v1/audio/speech", speech), ("/synthesize", synth)] * 3:  # engine queue full
            r = c.post(path, json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded", r.text
        eng._accepting = False  # starting / draining
        assert c.post("/v1/audio/speech", json=speech).status_code == 503
        eng._accepting, eng.max_queue_len = True, 1024
        assert c.post("/v1/audio/speech", json=speech).status_code == 200  # the whole budget is still there
        assert c.post("/synthesize", json=synth).status_code == 200
        r = c.post("/v1/audio/speech", json=speech)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"


def test_requests_refused_at_capacity_do_not_count_against_the_rate_limit(serve):
    _clear_of_a_minute_boundary(5)
    srv, eng = serve(FakeEngine(chunk_delay_s=0.02), max_in_flight=1, requests_per_minute=2)
    got: dict = {}

    def slow():  # holds the one in-flight slot for ~0.4 s; uses one request of the budget
        with srv.client() as c:
            got["status"] = c.post("/v1/audio/speech", json={**SPEECH, "input": "x" * 40}).status_code

    t = threading.Thread(target=slow)
    t.start()
    assert wait_until(lambda: len(eng.running) == 1)
    with srv.client() as c:
        for _ in range(3):
            r = c.post("/v1/audio/speech", json=SPEECH)
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded", r.text
        t.join(10)
        assert got["status"] == 200
        assert c.post("/v1/audio/speech", json=SPEECH).status_code == 200
        assert c.post("/v1/audio/speech", json=SPEECH).status_code == 429


def test_body_limits(serve_real):
    srv, _ = serve_real(max_body_bytes=2048)
    with srv.client() as c:
        r = c.post("/v1/audio/speech", json={**SPEECH, "instructions": "z" * 3000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted while read
            yield b'{"model": "tts-1", "voice": "alloy", "input": "'
            for _ in range(10):
                yield b"a" * 500
            yield b'"}'

        r = c.post("/v1/audio/speech", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_disconnect_mid_stream_aborts_and_frees_blocks(serve_real):
    srv, eng = serve_real(max_new_tokens=3000)
    # min_new_tokens bans EOS: random weights would otherwise end the utterance at a random frame
    body = {**SPEECH, "input": "long " * 40, "min_new_tokens": 3000, "seed": 1}
    with srv.client() as c, c.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()  # keep a reference: a dropped iterator closes the response at once
        next(chunks)
        stats = eng.stats()
        assert stats["num_running"] == 1 and stats["num_free_blocks"] < stats["num_blocks"]
    # leaving the block closed the connection mid-stream: the request is aborted and its blocks freed
    assert wait_until(lambda: eng.stats()["num_running"] == 0, timeout=5)
    stats = eng.stats()
    assert stats["kv_cache_usage"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["frames_total"] < 1000  # stopped long before the 3000-frame cap
    with srv.client() as c:
        assert wait_until(lambda: metric(c.get("/metrics").text, "ttsserve_requests_aborted_total") == 1)


def test_disconnect_before_first_audio_aborts(serve):
    srv, eng = serve(FakeEngine(chunk_delay_s=3.0))
    with srv.client() as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/audio/speech", json=SPEECH, timeout=0.3)
    # the client gave up while the request waited for its first audio: aborted long before the 3 s chunk
    assert wait_until(lambda: len(eng.aborted) == 1, timeout=1.5)
    assert eng.stats()["num_running"] == 0


def test_graceful_shutdown_drains_in_flight_streams(serve_real):
    srv, eng = serve_real(max_new_tokens=120)
    body = {**SPEECH, "input": "drain " * 10, "stream_format": "sse", "seed": 9}
    with srv.client() as c:
        solo = parse_sse(c.post("/v1/audio/speech", json=body).content)
    got: dict = {}
    first = threading.Event()

    def stream():
        with srv.client() as c, c.stream("POST", "/v1/audio/speech", json=body) as r:
            data = b""
            for chunk in r.iter_bytes():
                data += chunk
                first.set()
            got["events"] = parse_sse(data)

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(10)
    srv.stop(wait=False)  # what SIGTERM does
    t.join(30)
    srv.thread.join(30)
    assert got["events"][-1]["type"] == "speech.audio.done"
    assert same_audio(sse_audio(got["events"]), sse_audio(solo))  # ran to its end: every sample arrived
    assert not eng.ready
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=2)
