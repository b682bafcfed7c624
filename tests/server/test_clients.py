"""Other clients than the OpenAI SDK: the voice and model lists Open WebUI and Kokoro clients read, voices
deleted by name, and the exact request bodies Open WebUI, SillyTavern and Home Assistant send (README, "Use it
from your tools")."""

from __future__ import annotations

import numpy as np

from tests.server.helpers import decode

# The bodies each client posts to {base}/audio/speech, field for field (from their sources):
# Open WebUI (backend/open_webui/routers/audio.py): the page's {input, voice} with `model` set to its TTS model;
# no response_format, so mp3.
OPEN_WEBUI = {"input": "Hello from Open WebUI.", "voice": "nova", "model": "tts-1"}
# SillyTavern, "OpenAI Compatible" provider (src/endpoints/openai.js, /custom/generate-voice): every field set,
# with Authorization "Bearer " + its stored key, which is empty when none was entered.
SILLYTAVERN = {
    "input": "Hello from SillyTavern.",
    "response_format": "mp3",
    "voice": "alloy",
    "speed": 1,
    "model": "tts-1",
}
# Home Assistant, the openai_tts integration (openaitts_engine.py); its streaming path asks for opus, and it
# merges the user's "extra payload" JSON into the body.
HOME_ASSISTANT = {
    "model": "tts-1",
    "input": "Hello from Home Assistant.",
    "voice": "shimmer",
    "response_format": "mp3",
    "speed": 1.0,
}


def test_voice_list_has_the_openai_and_the_open_webui_shapes(serve):
    srv, _ = serve()
    with srv.client() as c:
        made = c.post("/v1/audio/voices", json={"name": "narrator", "seed": 5}).json()
        body = c.get("/v1/audio/voices").json()
        assert body["object"] == "list" and {v["name"] for v in body["data"]} >= {"alloy", "narrator"}
        # Open WebUI: {voice["id"]: voice["name"] for voice in data["voices"]}
        voices = {v["id"]: v["name"] for v in body["voices"]}
        assert voices["alloy"] == "alloy" and voices[made["id"]] == "narrator"
        assert [v["id"] for v in body["voices"]] == [v["id"] for v in body["data"]]
        # the id Open WebUI then sends as `voice` is a voice
        assert c.post("/v1/audio/speech", json={**OPEN_WEBUI, "voice": made["id"]}).status_code == 200


def test_audio_models_lists_the_served_names(serve):
    srv, _ = serve(served_model_names=("chattts", "tts-1"))
    with srv.client() as c:
        r = c.get("/v1/audio/models")
        assert r.status_code == 200 and r.json() == {"models": [{"id": "chattts"}, {"id": "tts-1"}]}
    srv, _ = serve(api_keys=("k1",))
    with srv.client() as c:
        assert c.get("/v1/audio/models").status_code == 401
        assert c.get("/v1/audio/models", headers={"Authorization": "Bearer k1"}).status_code == 200


def test_every_voice_route_takes_a_name_or_an_id(serve):
    srv, _ = serve()
    with srv.client() as c:
        a = c.post("/v1/audio/voices", json={"name": "Guest One", "seed": 1}).json()
        b = c.post("/v1/audio/voices", json={"name": "host", "seed": 2}).json()
        assert c.get("/v1/audio/voices/Guest One").json()["id"] == a["id"]
        assert c.get(f"/v1/audio/voices/{a['id']}").json()["name"] == "Guest One"
        r = c.delete("/v1/audio/voices/Guest One")  # by name
        assert r.status_code == 200 and r.json() == {"id": a["id"], "object": "audio.voice.deleted", "deleted": True}
        assert c.get(f"/v1/audio/voices/{a['id']}").status_code == 404
        assert c.delete("/v1/audio/voices/Guest One").status_code == 404
        assert c.delete(f"/v1/audio/voices/{b['id']}").status_code == 200  # by id
        assert c.delete("/v1/audio/voices/host").status_code == 404
        assert c.delete("/v1/audio/voices/Nova").status_code == 400  # built-in, any case


def test_a_plain_key_cannot_delete_a_shared_voice_by_name(serve):
    srv, _ = serve(api_keys=("user",), admin_api_keys=("admin",))
    with srv.client() as c:
        admin, user = {"Authorization": "Bearer admin"}, {"Authorization": "Bearer user"}
        assert c.post("/v1/audio/voices", json={"name": "shared", "seed": 3}, headers=admin).status_code == 200
        assert c.post("/v1/audio/voices", json={"name": "mine", "seed": 4}, headers=user).status_code == 200
        assert c.delete("/v1/audio/voices/shared", headers=user).status_code == 403
        assert c.delete("/v1/audio/voices/mine", headers=user).status_code == 200
        assert c.delete("/v1/audio/voices/shared", headers=admin).status_code == 200


def _mp3_seconds(data: bytes) -> float:
    x, rate = decode(data, "mp3")
    return x.size / rate


def test_the_bodies_open_webui_sillytavern_and_home_assistant_send(serve):
    srv, _ = serve()
    with srv.client() as c:
        for body, headers in (
            (OPEN_WEBUI, {"Authorization": "Bearer sk-none"}),
            (SILLYTAVERN, {"Authorization": "Bearer"}),  # "Bearer " + no key, trimmed by fetch
            (HOME_ASSISTANT, {"User-Agent": "HomeAssistant-OpenAI-TTS"}),
            ({**HOME_ASSISTANT, "response_format": "opus"}, {}),
        ):
            r = c.post("/v1/audio/speech", json=body, headers=headers)
            assert r.status_code == 200, (body, r.text)
            fmt = body.get("response_format", "mp3")
            assert r.headers["content-type"] == {"mp3": "audio/mpeg", "opus": "audio/ogg"}[fmt]
            x, rate = decode(r.content, fmt)
            assert x.size / rate > 0.1 and np.abs(x).max() > 0.05, body
            assert "x-ignored-fields" not in r.headers
        # Home Assistant's "extra payload" and Open WebUI's extra parameters: unknown fields still get audio
        r = c.post("/v1/audio/speech", json={**HOME_ASSISTANT, "stability": 0.5, "user": "ha"})
        assert r.status_code == 200 and r.headers["x-ignored-fields"] == "stability,user"
