"""Lenient bodies, as vLLM: unknown fields are ignored, logged once per name and named in X-Ignored-Fields
(--strict-request-fields: a 400); Kokoro's volume_multiplier, stream and lang_code."""

from __future__ import annotations

import json
import logging

import numpy as np
import openai

from tests.server.helpers import decode_int16, expected_sine, to_int16

SPEECH = {"model": "tts-1", "input": "Hello there, world.", "voice": "alloy", "seed": 7, "response_format": "pcm"}


def _access_lines(caplog) -> list[dict]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "ttsserve.access"]
    return [x for x in lines if x["event"] == "access"]


def test_unknown_fields_are_ignored_reported_and_logged_once(serve, caplog):
    srv, _ = serve()
    caplog.set_level(logging.INFO)
    with srv.client() as c:
        for _ in range(2):
            r = c.post("/v1/audio/speech", json={**SPEECH, "user": "u1", "return_download_link": True})
            assert r.status_code == 200, r.text
            assert r.headers["x-ignored-fields"] == "return_download_link,user"
        r = c.post("/synthesize", json={"text": "Hi there.", "user": "u1", "weird\r\nname,x": 1})
        assert r.status_code == 200 and r.headers["x-ignored-fields"] == "user,weird%0D%0Aname%2Cx"
        assert "x-ignored-fields" not in c.post("/v1/audio/speech", json=SPEECH).headers
    warned = [r.getMessage() for r in caplog.records if "ignoring request field" in r.getMessage()]
    assert len(warned) == 3 and sum("'user'" in m for m in warned) == 1
    logged = [line.get("ignored_fields") for line in _access_lines(caplog) if line["path"] == "/v1/audio/speech"]
    assert logged[:2] == [["return_download_link", "user"]] * 2


def test_strict_request_fields_restores_the_400(serve, caplog):
    srv, _ = serve(strict_request_fields=True)
    caplog.set_level(logging.INFO)
    with srv.client() as c:
        r = c.post("/v1/audio/speech", json={**SPEECH, "user": "u1"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "unknown_parameter" and err["param"] == "user" and "user" in err["message"]
        assert c.post("/synthesize", json={"text": "Hi.", "bogus": 1}).json()["error"]["param"] == "bogus"
        # Kokoro's lang_code is a known field: accepted and reported even when strict
        r = c.post("/v1/audio/speech", json={**SPEECH, "lang_code": "a"})
        assert r.status_code == 200 and r.headers["x-ignored-fields"] == "lang_code"
    line = next(x for x in _access_lines(caplog) if x["status"] == 400)
    assert line["error"] == "unknown_parameter" and "user" in line["reason"]


def test_the_openai_sdk_extra_body_passes(serve):
    srv, _ = serve()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    r = client.audio.speech.with_raw_response.create(
        model="tts-1", voice="alloy", input="Hello.", extra_body={"user_tag": 1}
    )
    assert r.headers["x-ignored-fields"] == "user_tag" and len(r.content) > 1000


def test_volume_multiplier_scales_and_clips(serve):
    srv, eng = serve()
    with srv.client() as c:
        for gain in (0.5, 2.0, 5.0):
            for extra in ({}, {"stream": False}):
                r = c.post("/v1/audio/speech", json={**SPEECH, "volume_multiplier": gain, **extra})
                assert r.status_code == 200, r.text
                want = to_int16(np.clip(expected_sine(eng) * gain, -1, 1))
                got = decode_int16(r.content, "pcm")
                assert np.abs(got.astype(np.int32) - want).max() <= 1, (gain, extra)
        r = c.post("/synthesize", json={"text": "Hi there.", "format": "pcm", "volume_multiplier": 0})
        assert r.status_code == 200 and not decode_int16(r.content, "pcm").any()
        for bad in (-1, 11, "2", None):
            r = c.post("/v1/audio/speech", json={**SPEECH, "volume_multiplier": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "volume_multiplier", bad


def test_stream_false_is_one_whole_file(serve):
    srv, _ = serve()
    with srv.client() as c:
        whole = c.post("/v1/audio/speech", json={**SPEECH, "response_format": "wav", "stream": False})
        assert whole.status_code == 200 and "x-audio-duration" in whole.headers  # the file mode's real sizes
        assert whole.headers["content-length"] == str(len(whole.content))
        streamed = c.post("/v1/audio/speech", json={**SPEECH, "response_format": "wav", "stream": True})
        assert streamed.status_code == 200 and "content-length" not in streamed.headers
        assert np.array_equal(decode_int16(whole.content, "wav"), decode_int16(streamed.content, "wav"))
        r = c.post("/v1/audio/speech", json={**SPEECH, "stream": False, "stream_format": "sse"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
