"""Voice mixing: the mix syntax (pure), and mixed voices through a real server and the openai SDK."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from tests.server.helpers import same_audio, wav_bytes
from ttsserve.server.voice_mix import VoiceMixError, is_mix, mix_speakers, parse_voice_mix
from ttsserve.server.voices import BUILTIN_VOICES
from ttsserve.text.speaker import encode_speaker

SPEECH = {"model": "tts-1", "input": "Mix test.", "seed": 5, "response_format": "pcm"}


def test_parse_voice_mix():
    assert parse_voice_mix("alloy+nova") == [("alloy", 0.5), ("nova", 0.5)]
    assert parse_voice_mix(" alloy (0.7) + nova(0.3) ") == [("alloy", pytest.approx(0.7)), ("nova", pytest.approx(0.3))]
    assert parse_voice_mix("a(3)+b") == [("a", 0.75), ("b", 0.25)]
    assert parse_voice_mix("my voice(2e0)") == [("my voice", 1.0)]
    assert is_mix("a+b") and is_mix("a(1)") and not is_mix("plain name")
    for bad in ("alloy++nova", "+nova", "alloy+", "alloy(0.5", "alloy(x)", "alloy()", "(0.5)", "a(1)(2)", "a)b"):
        with pytest.raises(VoiceMixError):
            parse_voice_mix(bad)
    for bad in ("alloy(0)+nova", "alloy(-1)+nova", "alloy(nan)", "alloy(inf)+nova"):
        with pytest.raises(VoiceMixError, match="> 0"):
            parse_voice_mix(bad)


def test_mix_speakers_is_the_weighted_mean_of_unit_vectors():
    a, b = np.array([3, 0], np.float16), np.array([0, 10], np.float16)
    out = mix_speakers([a, b], [0.75, 0.25])
    assert out.dtype == np.float16 and np.allclose(out, [0.75, 0.25])


def _pcm(c, voice, status=200):
    r = c.post("/v1/audio/speech", json={**SPEECH, "voice": voice})
    assert r.status_code == status, r.text
    return r.content if status == 200 else r.json()["error"]


def test_mixed_voices_through_a_real_server(serve_real):
    srv, eng = serve_real()
    alloy, nova = eng.random_speaker(BUILTIN_VOICES["alloy"]), eng.random_speaker(BUILTIN_VOICES["nova"])
    with srv.client() as c:
        even = _pcm(c, "alloy+nova")
        assert same_audio(_pcm(c, "nova(2)+ALLOY(2)"), even)
        # the mix is exactly a speaker voice with the weighted mean of the unit vectors
        expected = encode_speaker(mix_speakers([alloy, nova], [0.5, 0.5]))
        assert same_audio(_pcm(c, {"speaker": expected}), even)
        for single in ("alloy", "nova"):
            assert not same_audio(_pcm(c, single), even, max_lsb=100)
        weighted = _pcm(c, "alloy(0.7)+nova(0.3)")
        assert same_audio(_pcm(c, {"speaker": encode_speaker(mix_speakers([alloy, nova], [0.7, 0.3]))}), weighted)
        assert not same_audio(weighted, even, max_lsb=100)

        # saved voices mix too, by name or id
        narrator = c.post("/v1/audio/voices", json={"name": "narrator", "seed": 77}).json()
        mixed = _pcm(c, f"{narrator['id']}(1)+echo(3)")
        vec = mix_speakers([eng.random_speaker(77), eng.random_speaker(BUILTIN_VOICES["echo"])], [0.25, 0.75])
        assert same_audio(_pcm(c, {"speaker": encode_speaker(vec)}), mixed)
        assert same_audio(_pcm(c, "narrator(1)+echo(3)"), mixed)

        # a recording-based voice cannot be mixed: a 400 naming it
        r = c.post(
            "/v1/audio/voices",
            files={"audio_sample": ("me.wav", wav_bytes(1.0), "audio/wav")},
            data={"name": "me", "transcript": "hello"},
        )
        assert r.status_code == 200, r.text
        err = _pcm(c, "alloy+me", 400)
        assert err["param"] == "voice" and "'me'" in err["message"] and "recording" in err["message"]

        err = _pcm(c, "alloy+bogus", 404)
        assert err["code"] == "voice_not_found" and "'bogus'" in err["message"]
        assert _pcm(c, "alloy(0)+nova", 400)["param"] == "voice"
        assert _pcm(c, "alloy++nova", 400)["param"] == "voice"

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)
    sdk = client.audio.speech.create(
        model="tts-1", voice="alloy+nova", input=SPEECH["input"], response_format="pcm", extra_body={"seed": 5}
    ).content
    assert same_audio(sdk, even)
