"""Per-request bounds in one process: --request-timeout (504 before any audio, a cut stream after; the engine
request aborted and its KV blocks freed either way, and a log line that says why) and --max-audio-seconds
(audio stops at the ceiling with finish reason length; text that alone would outlast it is a 400)."""

from __future__ import annotations

import base64
import json
import logging

import httpx
import pytest

from tests.server.conftest import wait_until
from tests.server.fake_engine import FakeEngine

SPEECH = {"model": "tts-1", "voice": "alloy", "response_format": "pcm", "seed": 1}
# min_new_tokens bans EOS on the random weights: ~7 s of CPU for one 1500-frame segment
LONG = {**SPEECH, "input": "A long one.", "min_new_tokens": 1500}


def _freed(eng) -> bool:
    s = eng.stats()
    return s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0


def _log_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "ttsserve.access"]


def test_timeout_before_any_audio_is_a_504_and_aborts(serve_real, caplog):
    srv, eng = serve_real(max_new_tokens=2048, request_timeout_s=0.02)
    caplog.set_level(logging.INFO, logger="ttsserve.access")
    with srv.client() as c:
        for body in (LONG, {**LONG, "stream_format": "sse"}):
            r = c.post("/v1/audio/speech", json=body)
            assert r.status_code == 504, r.text
            err = r.json()["error"]
            assert err["code"] == "request_timeout" and "0.02 s" in err["message"] and err["type"] == "server_error"
        r = c.post("/synthesize", json={"text": "A long one.", "min_new_tokens": 1500})
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    assert wait_until(lambda: _freed(eng), timeout=5)
    lines = [x for x in _log_lines(caplog) if x["event"] == "access" and x["status"] == 504]
    assert len(lines) == 3
    assert all(x["error"] == "request_timeout" and "request_timeout" in x["reason"] for x in lines)
    assert all(x["request_id"] and x["finish_reason"] == "timeout" for x in lines)


def test_timeout_mid_stream_cuts_the_stream_and_aborts(serve_real, caplog):
    srv, eng = serve_real(max_new_tokens=2048, request_timeout_s=1.0)
    caplog.set_level(logging.INFO, logger="ttsserve.access")
    with srv.client() as c:
        # raw audio: the body breaks off (no last chunk), which the client sees as an error
        got = bytearray()
        with pytest.raises(httpx.RemoteProtocolError), c.stream("POST", "/v1/audio/speech", json=LONG) as r:
            assert r.status_code == 200
            for chunk in r.iter_bytes():
                got += chunk
        assert 0 < len(got) < 1500 * 512 * 2  # some audio, far from the whole utterance
        # SSE: an error event naming the timeout, and no done event
        with c.stream("POST", "/v1/audio/speech", json={**LONG, "stream_format": "sse"}) as r:
            events = []
            with pytest.raises(httpx.RemoteProtocolError):
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
        assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "error"
        assert events[-1]["error"]["code"] == "request_timeout"
        assert not any(e["type"] == "speech.audio.done" for e in events)
    assert wait_until(lambda: _freed(eng), timeout=5)
    assert eng.stats()["frames_total"] < 2 * 1500  # both stopped long before their 1500 frames
    done = [x for x in _log_lines(caplog) if x["event"] == "synthesis_done"]
    assert len(done) == 2 and all(x["finish_reason"] == "timeout" and "1 s" in x["reason"] for x in done)


def test_audio_stops_at_max_audio_seconds_with_finish_reason_length(serve):
    srv, eng = serve(FakeEngine(), max_audio_seconds=1.5, max_new_tokens=10_000)
    text = "x" * 20  # estimated >= 1.3 s, so admitted; 80 frames of fake audio = 1.7 s
    want = int(1.5 * 24000) * 2  # 16-bit PCM
    with srv.client() as c:
        r = c.post("/synthesize", json={"text": text, "format": "pcm"})
        assert r.status_code == 200 and len(r.content) == want
        assert r.headers["x-finish-reason"] == "length" and r.headers["x-audio-duration"] == "1.500"
        r = c.post("/v1/audio/speech", json={**SPEECH, "input": text})
        assert r.status_code == 200 and len(r.content) == want
        r = c.post("/v1/audio/speech", json={**SPEECH, "input": text, "stream_format": "sse"})
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
        audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
        assert len(audio) == want and events[-1]["finish_reason"] == "length"
        # a short text is untouched
        r = c.post("/synthesize", json={"text": "hi", "format": "pcm"})
        assert r.headers["x-finish-reason"] == "stop"
    assert wait_until(lambda: not eng.running)
    assert len(eng.aborted) == 3  # each capped request was aborted in the engine at the ceiling


def test_text_that_alone_outlasts_max_audio_seconds_is_a_400(serve):
    srv, eng = serve(FakeEngine(), max_audio_seconds=10)
    with srv.client() as c:
        r = c.post("/v1/audio/speech", json={**SPEECH, "input": "word " * 40})  # 200 chars: >= 13 s
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "input" and err["code"] == "audio_too_long"
        assert "at least 13 s" in err["message"] and "10 s" in err["message"] and "per second" in err["message"]
        r = c.post("/synthesize", json={"text": "字" * 70})  # 70 CJK characters: >= 11.7 s
        assert r.status_code == 400 and r.json()["error"]["param"] == "text"
        # the same text at speed 2 fits
        r = c.post("/v1/audio/speech", json={**SPEECH, "input": "word " * 40, "speed": 2.0})
        assert r.status_code == 200
    assert len(eng.requests) == 1  # the refused ones never reached the engine
