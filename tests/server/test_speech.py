"""POST /v1/audio/speech and /synthesize with the REAL engine (tiny random weights, CPU) behind uvicorn.

Seeded requests give the same tokens, so the raw PCM of one request is the reference every other form of the
same request (other formats, SSE, the simple API, a different sample rate or speed) is checked against, to
within helpers.SAME_AUDIO_LSB (batched float math may move a sample by one int16 step).
"""

from __future__ import annotations

import numpy as np
import openai
import pytest

from tests.server.helpers import decode, decode_int16, parse_sse, same_audio, sse_audio

# min_new_tokens = the server cap (REAL_MAX_NEW_TOKENS): every form runs the same 24 frames, in several chunks;
# the dummy's EOS (model/dummy_eos.py) could otherwise end one early, after a chunk or two.
SEEDED = {"seed": 5, "min_new_tokens": 24}
SPEECH = {"model": "tts-1", "input": "Hello there, this is a test.", "voice": "alloy", **SEEDED}


@pytest.fixture(scope="module")
def real(request):
    """One real server for the read-only tests of this module."""
    from tests.server.conftest import REAL_MAX_NEW_TOKENS, LiveServer, make_real_engine
    from ttsserve.server.app import ServerConfig, create_app

    srv = LiveServer(create_app(make_real_engine(), ServerConfig(max_new_tokens=REAL_MAX_NEW_TOKENS))).start()
    with srv.client() as c:
        pcm = c.post("/v1/audio/speech", json={**SPEECH, "response_format": "pcm"})
        assert pcm.status_code == 200, pcm.text
    srv.pcm = pcm.content  # the reference: s16le at 24 kHz
    yield srv
    srv.stop()


def test_openai_sdk_create_and_with_streaming_response(real):
    client = openai.OpenAI(base_url=real.url + "/v1", api_key="sk-x", max_retries=0)
    resp = client.audio.speech.create(
        model="tts-1", voice="alloy", input=SPEECH["input"], response_format="pcm", extra_body=SEEDED
    )
    assert same_audio(resp.content, real.pcm)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=SPEECH["input"], response_format="wav", extra_body=SEEDED
    ) as stream:
        assert stream.headers["content-type"] == "audio/wav"
        chunks = [c for c in stream.iter_bytes() if c]
    assert len(chunks) > 1  # audio arrived in pieces as it was produced
    assert same_audio(decode_int16(b"".join(chunks), "wav"), real.pcm)
    default = client.audio.speech.create(model="chattts", voice="alloy", input=SPEECH["input"])  # mp3 default
    x, rate = decode(default.content, "mp3")
    assert rate == 24000 and x.size > 0


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "aac"])
def test_every_format_decodes(real, fmt):
    ref = decode_int16(real.pcm, "pcm")
    with real.client() as c, c.stream("POST", "/v1/audio/speech", json={**SPEECH, "response_format": fmt}) as r:
        assert r.status_code == 200
        data = b"".join(r.iter_bytes())
    if fmt in ("wav", "flac"):
        assert same_audio(decode_int16(data, fmt), ref)  # lossless (bit-exactness: test_speech_fake)
        return
    x, rate = decode(data, fmt)
    assert abs(x.size / rate - ref.size / 24000) < 0.08  # codec delay / padding aside
    rms_ref, rms = np.sqrt(np.mean((ref / 32767.0) ** 2)), np.sqrt(np.mean(x**2))
    assert 0.5 < rms / rms_ref < 2.0


def test_sse_matches_the_audio_stream(real):
    with real.client() as c:
        r = c.post("/v1/audio/speech", json={**SPEECH, "response_format": "pcm", "stream_format": "sse"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.content)
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1]) and len(events) > 2
    done = events[-1]
    assert done["type"] == "speech.audio.done" and done["finish_reason"] in ("stop", "length")
    assert 0 < done["usage"]["output_tokens"] <= 24 and done["usage"]["input_tokens"] == len(SPEECH["input"])
    assert same_audio(sse_audio(events), real.pcm)


def test_synthesize_file_equals_stream(real):
    with real.client() as c:
        r = c.post("/synthesize", json={"text": SPEECH["input"], "voice": "alloy", **SEEDED, "format": "wav"})
        assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
        assert r.headers["x-finish-reason"] in ("stop", "length")
        assert same_audio(decode_int16(r.content, "wav"), real.pcm)
        assert float(r.headers["x-audio-duration"]) == pytest.approx(len(real.pcm) / 2 / 24000, abs=1e-3)
        r = c.post("/synthesize", json={"text": SPEECH["input"], **SEEDED, "format": "pcm", "stream": True})
        assert r.status_code == 200 and r.headers.get("transfer-encoding") == "chunked"
        assert same_audio(r.content, real.pcm)  # /synthesize defaults to alloy


def test_sample_rate_and_speed(real):
    n = len(real.pcm) // 2
    with real.client() as c:
        r = c.post("/v1/audio/speech", json={**SPEECH, "response_format": "wav", "sample_rate": 16000})
        x, rate = decode(r.content, "wav")
        assert rate == 16000 and abs(x.size - n * 2 / 3) <= 2
        # speed 1.4 is exactly [speed_9]; speed 2.0 is [speed_9] plus a 2.0/1.4 time stretch of the same audio
        base = c.post("/v1/audio/speech", json={**SPEECH, "response_format": "pcm", "speed": 1.4}).content
        fast = c.post("/v1/audio/speech", json={**SPEECH, "response_format": "pcm", "speed": 2.0}).content
    assert not same_audio(base, real.pcm, max_lsb=100)  # a different prompt token, a different utterance
    assert abs(len(fast) // 2 - round(len(base) // 2 / (2.0 / 1.4))) <= 2


def test_input_errors_from_the_real_engine(real):
    with real.client() as c:
        r = c.post("/v1/audio/speech", json={**SPEECH, "input": "\U0001f600"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        r = c.post("/synthesize", json={"text": "\U0001f600 \U0001f600"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text"
        r = c.post("/v1/audio/speech", json={**SPEECH, "refine_text": True, "prompt": "[oral_2][break_4]"})
        assert r.status_code == 200 and len(r.content) > 0  # the refine stage ran first


def test_error_statuses_and_shape(real):
    cases = [
        ({"input": "x"}, 400, "model"),  # missing fields -> 400, never FastAPI's 422
        ({**SPEECH, "speed": 5}, 400, "speed"),
        ({**SPEECH, "response_format": "ogg"}, 400, "response_format"),
        ({**SPEECH, "voice": "nobody"}, 404, "voice"),
        ({**SPEECH, "voice": {"id": "voice_missing"}}, 404, "voice"),
        ({**SPEECH, "voice": {"seed": 1, "id": "alloy"}}, 400, "voice"),
        ({**SPEECH, "voice": {"speaker": "not a speaker string"}}, 400, "voice"),
        ({**SPEECH, "model": "gpt-5"}, 404, "model"),
        ({**SPEECH, "input": "   "}, 400, "input"),
        ({**SPEECH, "input": "y" * 4097}, 413, "input"),
        ({**SPEECH, "sample_rate": 12345}, 400, "sample_rate"),
        ({**SPEECH, "temperature": -1}, 400, "temperature"),
        ({**SPEECH, "top_p": 1.5}, 400, "top_p"),
        ({**SPEECH, "prompt": "[speed_2]"}, 400, "prompt"),
    ]
    with real.client() as c:
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
        assert c.get("/v1/audio/speech").status_code == 405


def test_sdk_maps_error_statuses(real):
    client = openai.OpenAI(base_url=real.url + "/v1", api_key="sk", max_retries=0)
    with pytest.raises(openai.NotFoundError) as ei:
        client.audio.speech.create(model="tts-1", voice="nobody", input="hi")
    assert ei.value.body["param"] == "voice"
    with pytest.raises(openai.BadRequestError):
        client.audio.speech.create(model="tts-1", voice="alloy", input="hi", speed=9.0)
    with pytest.raises(openai.NotFoundError):
        client.audio.speech.create(model="whisper-1", voice="alloy", input="hi")
