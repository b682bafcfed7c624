"""A synthesis that ends without one sample (EOS at the first step) is a 500 in the OpenAI shape on every
response mode, never a 200 carrying an empty file: every mode waits for the first audio before it sends
headers, so a stream can still answer with a real status."""

from __future__ import annotations

import pytest

SPEECH = {"model": "tts-1", "input": "nothing to say [[eos]]", "voice": "alloy"}
CASES = [
    ("/v1/audio/speech", {**SPEECH, "response_format": "mp3"}),  # the README's curl (chunked audio stream)
    ("/v1/audio/speech", {**SPEECH, "response_format": "wav", "stream_format": "sse"}),
    ("/synthesize", {"text": SPEECH["input"], "format": "wav"}),  # the whole file
    ("/synthesize", {"text": SPEECH["input"], "format": "pcm", "stream": True}),
]


@pytest.mark.parametrize(
    "path, body", CASES, ids=["speech-audio", "speech-sse", "synthesize-file", "synthesize-stream"]
)
def test_no_audio_is_a_500_not_an_empty_200(serve, path, body):
    srv, eng = serve()
    with srv.client() as c:
        r = c.post(path, json=body, headers={"X-Request-ID": "empty-1"})
        metrics = c.get("/metrics").text
    assert r.status_code == 500, (r.status_code, r.content[:200])
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "no_audio" and err["param"] is None
    assert err["message"].startswith("the model produced no audio (EOS at the first step)")
    assert r.headers["x-request-id"] == "empty-1" and r.headers["content-type"] == "application/json"
    assert eng.finished and not eng.running  # the engine request ran to its end and was released
    endpoint = path if path == "/synthesize" else "/v1/audio/speech"
    assert f'ttsserve_requests_total{{endpoint="{endpoint}",status="500"}} 1.0' in metrics


def test_audio_that_exists_still_streams(serve):
    """The check is on the whole synthesis: a normal stream is unchanged (the first chunk opens it)."""
    srv, _ = serve()
    with srv.client() as c:
        r = c.post("/v1/audio/speech", json={**SPEECH, "input": "some words", "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) == 4 * len("some words") * 512 * 2


def test_a_real_engine_that_says_eos_at_once(serve, tmp_path):
    """The real engine emits a final output without samples when EOS comes at the first step; the README's
    curl (mp3, default streaming) then gets the 500, and the engine serves the next request."""
    from tests.eos_testutil import eos_at_once_checkpoint
    from tests.server.conftest import make_real_engine, wait_until

    engine = make_real_engine(model=str(eos_at_once_checkpoint(tmp_path)), load_format="safetensors")
    srv, _ = serve(engine)
    with srv.client() as c:
        for _ in range(2):
            r = c.post("/v1/audio/speech", json={"model": "chattts", "input": "Hello!", "voice": "alloy"})
            assert r.status_code == 500 and r.json()["error"]["code"] == "no_audio", r.content[:200]
    s = engine.stats
    assert wait_until(lambda: s()["num_running"] == 0 and s()["num_free_blocks"] == s()["num_blocks"])
