"""Voices: built-in names, CRUD over HTTP and the OpenAI SDK, SQLite persistence across a restart."""

from __future__ import annotations

import tracemalloc

import numpy as np
import openai
import pytest

from tests.server.helpers import same_audio, silent_flac, wav_bytes
from ttsserve.constants import MAX_REFERENCE_SECONDS
from ttsserve.server.voices import BUILTIN_VOICES
from ttsserve.text.speaker import encode_speaker

SPEECH = {"model": "tts-1", "input": "Voice test.", "seed": 11, "response_format": "pcm"}


def _pcm(c, voice) -> bytes:
    r = c.post("/v1/audio/speech", json={**SPEECH, "voice": voice})
    assert r.status_code == 200, r.text
    return r.content


def test_builtin_voices_are_fixed_speakers(serve_real):
    srv, eng = serve_real()
    with srv.client() as c:
        listed = c.get("/v1/audio/voices").json()["data"]
        assert {v["name"] for v in listed if v["type"] == "builtin"} == set(BUILTIN_VOICES)
        a1, e1 = _pcm(c, "alloy"), _pcm(c, "echo")
        assert not same_audio(a1, e1, max_lsb=100)  # different speakers
        for same in ("ALLOY", {"id": "alloy"}, {"seed": BUILTIN_VOICES["alloy"]}):
            assert same_audio(_pcm(c, same), a1), same
        # a ChatTTS speaker string of echo's vector is echo
        echo_str = encode_speaker(eng.random_speaker(BUILTIN_VOICES["echo"]))
        assert same_audio(_pcm(c, {"speaker": echo_str}), e1)
        r = c.delete("/v1/audio/voices/alloy")
        assert r.status_code == 400 and r.json()["error"]["param"] == "voice_id"


def test_voice_crud_survives_restart(serve_real, tmp_path):
    db = str(tmp_path / "voices.db")
    srv, eng = serve_real(voices_db=db)
    spk = encode_speaker(eng.random_speaker(4242))
    with srv.client() as c:
        r = c.post("/v1/audio/voices", json={"name": "narrator", "seed": 77})
        assert r.status_code == 200, r.text
        narrator = r.json()
        assert narrator["id"].startswith("voice_") and narrator["type"] == "seed" and narrator["seed"] == 77
        guest = c.post("/v1/audio/voices", json={"name": "guest", "speaker": spk}).json()
        assert guest["type"] == "speaker"
        assert c.post("/v1/audio/voices", json={"name": "narrator", "seed": 1}).status_code == 409
        assert c.post("/v1/audio/voices", json={"name": "nova", "seed": 1}).status_code == 400
        r = c.post("/v1/audio/voices", json={"name": "x", "speaker": "not a speaker"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speaker"
        assert c.post("/v1/audio/voices", json={"name": "x", "seed": 1, "speaker": spk}).status_code == 400
        by_id = _pcm(c, {"id": narrator["id"]})
        assert same_audio(_pcm(c, "narrator"), by_id) and same_audio(_pcm(c, {"seed": 77}), by_id)
        guest_audio = _pcm(c, {"id": guest["id"]})
        assert same_audio(_pcm(c, {"seed": 4242}), guest_audio)
        assert c.get(f"/v1/audio/voices/{guest['id']}").json()["name"] == "guest"
    srv.stop()

    srv2, _ = serve_real(voices_db=db)  # a restarted server reads the same file
    with srv2.client() as c:
        names = [v["name"] for v in c.get("/v1/audio/voices").json()["data"] if v["type"] != "builtin"]
        assert names == ["narrator", "guest"]
        assert same_audio(_pcm(c, {"id": narrator["id"]}), by_id) and same_audio(_pcm(c, "guest"), guest_audio)
        r = c.delete(f"/v1/audio/voices/{narrator['id']}")
        assert r.json() == {"id": narrator["id"], "object": "audio.voice.deleted", "deleted": True}
        assert c.delete(f"/v1/audio/voices/{narrator['id']}").status_code == 404
        r = c.post("/v1/audio/speech", json={**SPEECH, "voice": {"id": narrator["id"]}})
        assert r.status_code == 404 and r.json()["error"]["code"] == "voice_not_found"


def test_reference_recording_voice_via_openai_sdk(serve_real):
    srv, _ = serve_real()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)
    if not hasattr(client.audio, "voices"):
        pytest.skip(f"openai {openai.__version__} has no client.audio.voices")
    voice = client.audio.voices.create(
        name="me",
        audio_sample=("me.wav", wav_bytes(2.0), "audio/wav"),
        consent="granted",
        extra_body={"transcript": "This is my voice."},
    )
    assert voice.id.startswith("voice_") and voice.name == "me" and voice.type == "audio_sample"
    rec = srv.app.state.server.store.get(voice.id)  # the DVAE-encoded prompt: ~46.875 frames per second
    assert rec.spk_smp.dtype == np.int32 and rec.spk_smp.shape[0] == 4 and abs(rec.spk_smp.shape[1] - 94) <= 2
    assert rec.txt_smp == "This is my voice." and rec.spk_emb is None
    mine = client.audio.speech.create(
        model="tts-1", voice={"id": voice.id}, input="Say it.", response_format="pcm", extra_body={"seed": 3}
    ).content
    plain = client.audio.speech.create(
        model="tts-1", voice="alloy", input="Say it.", response_format="pcm", extra_body={"seed": 3}
    ).content
    assert len(mine) > 0 and not same_audio(mine, plain, max_lsb=100)
    deleted = client.audio.voices.delete(voice.id)
    assert deleted.deleted and deleted.id == voice.id


def test_reference_upload_errors(serve_real):
    srv, _ = serve_real(max_upload_bytes=200_000)
    with srv.client() as c:

        def post(files, data):
            return c.post("/v1/audio/voices", files=files, data=data)

        r = post({"audio_sample": ("a.wav", b"RIFF garbage", "audio/wav")}, {"name": "a", "transcript": "t"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "audio_sample"
        r = post({"audio_sample": ("a.wav", wav_bytes(0.1), "audio/wav")}, {"name": "a", "transcript": "t"})
        assert r.status_code == 400 and "0.5" in r.json()["error"]["message"]
        r = post({"audio_sample": ("a.wav", wav_bytes(1.0), "audio/wav")}, {"name": "a"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "transcript"
        r = post({"audio_sample": ("a.wav", wav_bytes(1.0), "audio/wav")}, {"name": "bad/name", "transcript": "t"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "name"
        r = post({"audio_sample": ("a.wav", wav_bytes(10.0), "audio/wav")}, {"name": "a", "transcript": "t"})
        assert r.status_code == 413
        r = c.post("/v1/audio/voices", content=b"name=a", headers={"content-type": "text/plain"})
        assert r.status_code == 415
        assert [v for v in c.get("/v1/audio/voices").json()["data"] if v["type"] != "builtin"] == []


def _upload(c, data: bytes, filename: str, name: str = "ref"):
    return c.post(
        "/v1/audio/voices",
        files={"audio_sample": (filename, data, "application/octet-stream")},
        data={"name": name, "transcript": "what the recording says"},
    )


@pytest.mark.parametrize("length_in_header", [True, False], ids=["header", "no-length"])
def test_a_long_silent_flac_is_refused_without_decoding_it(serve, length_in_header):
    srv, eng = serve()
    data = silent_flac(20 * 60, length_in_header=length_in_header)  # ~60 KB; 77 MB as float32 samples
    with srv.client() as c:
        tracemalloc.start()  # the server runs in this process: its numpy allocations are traced too
        try:
            r = _upload(c, data, "long.flac")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "audio_too_long" and err["param"] == "audio_sample"
        assert f"{MAX_REFERENCE_SECONDS:g} s limit" in err["message"]
        assert peak < 16 << 20  # the cap's worth of samples (1.9 MB) at most, never the 20 minutes
        assert eng.references == []  # the encoder never saw it
        assert _upload(c, wav_bytes(1.0), "ok.wav").status_code == 200  # the server is fine afterwards


def test_the_reference_length_limit_is_the_engines_everywhere(serve):
    srv, eng = serve()  # the fake engine has no limit of its own: the server's check is what refuses
    with srv.client() as c:
        doc = c.get("/openapi.json").json()["paths"]["/v1/audio/voices"]["post"]["requestBody"]
        field = doc["content"]["multipart/form-data"]["schema"]["properties"]["audio_sample"]
        assert field["description"].endswith(f"0.5-{MAX_REFERENCE_SECONDS:g} s")
        assert _upload(c, wav_bytes(MAX_REFERENCE_SECONDS - 0.5), "a.wav", "under").status_code == 200
        r = _upload(c, wav_bytes(MAX_REFERENCE_SECONDS + 0.5), "b.wav", "over")
        assert r.status_code == 400 and r.json()["error"]["code"] == "audio_too_long"
        assert f"{MAX_REFERENCE_SECONDS:g} s limit" in r.json()["error"]["message"]
    assert [n for n, _ in eng.references] == [round((MAX_REFERENCE_SECONDS - 0.5) * 16000)]
