"""POST /v1/audio/speech and /synthesize over a real uvicorn server, with the fake engine (exact signals)."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from tests.server.helpers import (
    decode, decode_int16, dominant_hz, expected_sine, parse_sse, sse_audio, to_int16,
)

SPEECH = {"model": "tts-1", "input": "Hello there, world.", "voice": "alloy", "seed": 7}


def sdk(srv, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-test", max_retries=0, **kw)


def test_openai_sdk_create_and_streaming(serve):
    srv, eng = serve()
    client = sdk(srv)
    resp = client.audio.speech.create(model="tts-1", voice="alloy", input="Hello there, world.",
                                      response_format="wav")
    x = decode_int16(resp.content, "wav")
    np.testing.assert_array_equal(x, to_int16(expected_sine(eng)))

    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="Hello there, world.", response_format="pcm", extra_body={"seed": 3}
    ) as stream:
        assert stream.headers["content-type"] == "audio/pcm"
        chunks = [c for c in stream.iter_bytes(1024) if c]
    assert len(chunks) > 1  # it really streamed
    np.testing.assert_array_equal(decode_int16(b"".join(chunks), "pcm"), to_int16(expected_sine(eng)))
    assert eng.requests[-1].code_params.seed == 3


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_format_decodes_streamed(serve, fmt):
    srv, eng = serve()
    with srv.client() as c, c.stream("POST", "/v1/audio/speech", json={**SPEECH, "response_format": fmt}) as r:
        assert r.status_code == 200, r.read()
        data = b"".join(r.iter_bytes())
    want = expected_sine(eng)
    x, rate = decode(data, fmt)
    if fmt in ("wav", "pcm", "flac"):
        np.testing.assert_array_equal(decode_int16(data, fmt), to_int16(want))
        return
    # Lossy: right length (codec delay/padding aside) and the same tone.
    assert abs(x.size / rate - want.size / 24000) < 0.08, (x.size, rate)
    assert abs(dominant_hz(x, rate) - dominant_hz(want, 24000)) < 3.0


def test_sample_rate_and_speed(serve):
    srv, eng = serve()
    with srv.client() as c:
        r = c.post("/v1/audio/speech", json={**SPEECH, "response_format": "wav", "sample_rate": 16000})
        x, rate = decode(r.content, "wav")
        assert rate == 16000 and abs(x.size - expected_sine(eng).size * 2 / 3) <= 2
        r = c.post("/v1/audio/speech", json={**SPEECH, "response_format": "wav", "speed": 2.0})
        x, rate = decode(r.content, "wav")
    # speed 2.0 -> [speed_9] (assumed 1.4x) in the prompt, the rest (2.0 / 1.4) by time stretch.
    assert eng.requests[-1].code_prompt == "[speed_9]"
    assert abs(x.size - round(expected_sine(eng).size / (2.0 / 1.4))) <= 2
    assert abs(dominant_hz(x, rate) - dominant_hz(expected_sine(eng), 24000)) < 3.0  # pitch kept


def test_sse_events(serve):
    srv, eng = serve()
    with srv.client() as c:
        r = c.post("/v1/audio/speech", json={**SPEECH, "response_format": "pcm", "stream_format": "sse"})
        raw = c.post("/v1/audio/speech", json={**SPEECH, "response_format": "pcm"}).content
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.content)
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) > 2
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    frames = 4 * len(SPEECH["input"])
    assert done["usage"] == {"input_tokens": len(SPEECH["input"]), "output_tokens": frames,
                             "total_tokens": len(SPEECH["input"]) + frames}
    assert sse_audio(events) == raw  # same seed, same bytes as the plain audio stream


def test_chattts_extras_reach_the_engine(serve):
    srv, eng = serve()
    body = {**SPEECH, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.2,
            "max_new_tokens": 40, "instructions": "cheerful [oral_2] please [laugh_1] and [break_4]"}
    with srv.client() as c:
        r = c.post("/v1/audio/speech", json=body)
        assert r.status_code == 200
        req = eng.requests[-1]
        p = req.code_params
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_new_tokens, p.seed) == (
            0.5, 0.9, 5, 1.2, 40, 7)
        assert req.refine_text and req.refine_prompt == "[oral_2][laugh_1][break_4]"
        r = c.post("/v1/audio/speech", json={**SPEECH, "prompt": "[oral_9]", "refine_text": False})
        assert eng.requests[-1].refine_prompt == "[oral_9]" and not eng.requests[-1].refine_text
        r = c.post("/v1/audio/speech", json={**SPEECH, "prompt": "[speed_2]"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_synthesize_whole_file_and_stream(serve):
    srv, eng = serve()
    with srv.client() as c:
        r = c.post("/synthesize", json={"text": "Simple API.", "seed": 1, "max_new_tokens": 30})
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        assert r.headers["x-finish-reason"] == "length" and r.headers["x-truncated-segments"] == "0"
        assert int(r.headers["content-length"]) == len(r.content)
        assert r.content[4:8] != b"\xff\xff\xff\xff"  # non-streamed WAV carries real sizes
        np.testing.assert_array_equal(decode_int16(r.content, "wav"), to_int16(expected_sine(eng)))
        assert eng.requests[-1].voice.name == "alloy"  # the default voice
        r = c.post("/synthesize", json={"text": "Simple API.", "seed": 1, "stream": True, "format": "flac"})
        assert r.status_code == 200 and r.headers.get("transfer-encoding") == "chunked"
        np.testing.assert_array_equal(decode_int16(r.content, "flac"), to_int16(expected_sine(eng)))


def test_errors_have_openai_shape_and_status(serve):
    srv, eng = serve(max_input_chars=100)
    cases = [
        ({"input": "x"}, 400, "model"),  # missing fields -> 400 (never 422)
        ({**SPEECH, "speed": 5}, 400, "speed"),
        ({**SPEECH, "response_format": "ogg"}, 400, "response_format"),
        ({**SPEECH, "voice": "nobody"}, 404, "voice"),
        ({**SPEECH, "voice": {"id": "voice_missing"}}, 404, "voice"),
        ({**SPEECH, "voice": {"seed": 1, "id": "alloy"}}, 400, "voice"),
        ({**SPEECH, "model": "gpt-5"}, 404, "model"),
        ({**SPEECH, "colour": "red"}, 400, "colour"),
        ({**SPEECH, "input": "   "}, 400, "input"),  # SynthesisRequest rejects blank text
        ({**SPEECH, "input": "?!?"}, 400, "input"),  # the engine's ValueError (normalizes to nothing)
        ({**SPEECH, "input": "y" * 101}, 413, "input"),
        ({**SPEECH, "sample_rate": 12345}, 400, "sample_rate"),
        ({**SPEECH, "temperature": -1}, 400, "temperature"),
        ({**SPEECH, "input": "boom [[failfirst]]"}, 500, None),
    ]
    with srv.client() as c:
        for body, status, param in cases:
            r = c.post("/v1/audio/speech", json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            assert err["param"] == param, (body, err)
        r = c.post("/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = c.get("/v1/nothing-here")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        # /synthesize gives a real status even when the engine fails after audio started
        r = c.post("/synthesize", json={"text": "hello [[fail]] there"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    assert not eng.running


def test_midstream_failure_breaks_the_stream(serve):
    srv, eng = serve()
    import httpx

    with srv.client() as c, pytest.raises(httpx.RemoteProtocolError):
        with c.stream("POST", "/v1/audio/speech", json={**SPEECH, "input": "long text [[fail]] " * 5,
                                                        "response_format": "pcm"}) as r:
            assert r.status_code == 200
            b"".join(r.iter_bytes())  # a 200 never ends cleanly when the synthesis failed


def test_sdk_maps_error_statuses(serve):
    srv, _ = serve(api_keys=("sk-good",))
    with pytest.raises(openai.AuthenticationError):
        sdk(srv).audio.speech.create(model="tts-1", voice="alloy", input="hi")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-good", max_retries=0)
    with pytest.raises(openai.NotFoundError) as ei:
        client.audio.speech.create(model="tts-1", voice="nobody", input="hi")
    assert ei.value.body["param"] == "voice"
    with pytest.raises(openai.BadRequestError):
        client.audio.speech.create(model="tts-1", voice="alloy", input="hi", speed=9.0)
