"""What only a fake engine can show: bit-exact known signals through every lossless path, every option
reaching the engine's request, and engine failures before and after the first audio."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.server.helpers import (
    decode,
    decode_int16,
    dominant_hz,
    expected_sine,
    to_int16,
)

SPEECH = {"model": "tts-1", "input": "Hello there, world.", "voice": "alloy", "seed": 7}


def test_known_signal_through_every_format(serve):
    srv, eng = serve()
    for fmt in ("pcm", "wav", "flac", "mp3", "opus", "aac"):
        with srv.client() as c, c.stream("POST", "/v1/audio/speech", json={**SPEECH, "response_format": fmt}) as r:
            data = b"".join(r.iter_bytes())
        want = expected_sine(eng)
        if fmt in ("pcm", "wav", "flac"):
            np.testing.assert_array_equal(decode_int16(data, fmt), to_int16(want))
            continue
        x, rate = decode(data, fmt)
        assert abs(dominant_hz(x, rate) - dominant_hz(want, 24000)) < 3.0, fmt  # the same tone came out


def test_chattts_extras_reach_the_engine(serve):
    srv, eng = serve()
    body = {
        **SPEECH,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "repetition_penalty": 1.2,
        "max_new_tokens": 40,
        "normalize": False,
        "instructions": "cheerful [oral_2] please [laugh_1] and [break_4]",
    }
    with srv.client() as c:
        assert c.post("/v1/audio/speech", json=body).status_code == 200
        req = eng.requests[-1]
        p = req.code_params
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_new_tokens, p.seed) == (
            0.5,
            0.9,
            5,
            1.2,
            40,
            7,
        )
        assert req.refine_text and req.refine_prompt == "[oral_2][laugh_1][break_4]" and not req.normalize
        assert req.refine_params.seed == 7 and req.code_prompt == "[speed_5]"
        assert req.voice.name == "alloy" and req.voice.spk_emb is not None
        c.post("/v1/audio/speech", json={**SPEECH, "prompt": "[oral_9]", "refine_text": False})
        assert eng.requests[-1].refine_prompt == "[oral_9]" and not eng.requests[-1].refine_text
        c.post("/v1/audio/speech", json={**SPEECH, "speed": 0.5})
        assert eng.requests[-1].code_prompt == "[speed_0]"
    srv2, eng2 = serve(max_new_tokens=16)  # the server-wide cap wins over a larger request
    with srv2.client() as c:
        c.post("/v1/audio/speech", json={**SPEECH, "max_new_tokens": 100})
        assert eng2.requests[-1].code_params.max_new_tokens == 16
    srv3, eng3 = serve()  # a cap by default: one request cannot hold a stream for the model's whole context
    with srv3.client() as c:
        c.post("/v1/audio/speech", json={**SPEECH, "max_new_tokens": 100000})
        assert eng3.requests[-1].code_params.max_new_tokens == 2048


def test_engine_failures_give_real_statuses(serve):
    srv, eng = serve()
    with srv.client() as c:
        r = c.post("/v1/audio/speech", json={**SPEECH, "input": "boom [[failfirst]]"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        r = c.post("/v1/audio/speech", json={**SPEECH, "input": "?!?"})  # the engine's ValueError
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        # /synthesize (whole file) gives a real status even when the engine fails after audio started
        r = c.post("/synthesize", json={"text": "hello [[fail]] there"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    assert not eng.running


def test_midstream_failure_breaks_the_stream(serve):
    srv, eng = serve()
    body = {**SPEECH, "input": "long text [[fail]] " * 5, "response_format": "pcm"}
    with (
        srv.client() as c,
        pytest.raises(httpx.RemoteProtocolError),
        c.stream("POST", "/v1/audio/speech", json=body) as r,
    ):
        assert r.status_code == 200
        b"".join(r.iter_bytes())  # a 200 never ends cleanly when the synthesis failed
    assert not eng.running
