"""Schemathesis fuzz of the app's own OpenAPI document against a live server (real engine): no input gives
a 5xx or a 422, every error is OpenAI-shaped, and responses match what the document says."""

from __future__ import annotations

import os
import zlib

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.server.conftest import LiveServer, make_real_engine
from tests.server.helpers import wav_bytes
from ttsserve.server.app import ServerConfig, create_app
from ttsserve.text.speaker import encode_speaker

# ~10 operations x 12 -> ~100 cases in a few seconds. TTSSERVE_FUZZ_EXAMPLES=500 for a deep run (which
# also turns on schemathesis' coverage phase: every boundary value the schema implies).
KEY = "fuzz-key"
SPEAKER: list[str] = []  # a valid speaker string of the fuzzed engine, set by `live`
REFERENCE_WAV = wav_bytes(1.0)
EXAMPLES_PER_OPERATION = int(os.environ.get("TTSSERVE_FUZZ_EXAMPLES", "12"))
DEEP = EXAMPLES_PER_OPERATION > 12


@pytest.fixture(scope="module")
def live():
    # The real engine; a tight frame cap keeps fuzzed 4096-character inputs (many segments) cheap.
    # With an API key, so schemathesis' auth checks (wrong/missing key must give 401) apply too.
    # max_input_chars: 1000 CJK characters (>= 167 s of speech) stay under --max-audio-seconds (600).
    cfg = ServerConfig(max_new_tokens=8, api_keys=(KEY,), max_input_chars=1000)
    engine = make_real_engine()
    SPEAKER.append(encode_speaker(engine.random_speaker(1)))
    srv = LiveServer(create_app(engine, cfg)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(live):
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    # Fuzzing phase only: the coverage phase alone adds ~500 boundary cases (all explored in development,
    # none failed); the suite's budget is ~100 examples.
    schema.config.phases.update(phases=["examples", "coverage", "fuzzing"] if DEEP else ["examples", "fuzzing"])
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


def _make_acceptable(body) -> None:
    """What no schema can say: a ChatTTS speaker string must decode to a speaker vector, and a reference
    recording must be audio of 0.5-30 s. Generated ones are replaced by valid ones (their format is checked by
    tests/server/test_voices.py); everything else the generator draws is sent as drawn."""
    if not isinstance(body, dict):
        return
    for holder in (body, body.get("voice")):
        if isinstance(holder, dict) and isinstance(holder.get("speaker"), str):
            holder["speaker"] = SPEAKER[0]
    if "audio_sample" in body and not isinstance(body["audio_sample"], str):  # bytes, or schemathesis' Binary
        body["audio_sample"] = REFERENCE_WAV
        body.pop("file", None)


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case, live):
    # Edited as a whole and assigned back: for multipart bodies case.body hands out a copy each time.
    body = case.body
    if isinstance(body, dict) and zlib.crc32(repr(body).encode()) % 2:
        # Half the bodies get a served model and a known voice (where the generated one was a valid string),
        # so real syntheses run instead of 404s.
        for key, value, max_len in (("model", "tts-1", 256), ("voice", "alloy", 128)):
            if isinstance(body.get(key), str) and 1 <= len(body[key]) <= max_len:
                body[key] = value
    _make_acceptable(body)
    case.body = body
    # All schemathesis checks: status codes, content types and bodies as documented, auth, and "a
    # schema-valid request is accepted" (positive_data_acceptance).
    response = case.call_and_validate(
        base_url=live.url,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    assert response.status_code != 422  # validation errors are OpenAI-shaped 400s
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
