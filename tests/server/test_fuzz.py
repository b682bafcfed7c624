"""Schemathesis fuzz of the app's own OpenAPI document against a live server (real engine): no input gives
a 5xx or a 422, every error is OpenAI-shaped, and responses match what the document says."""

from __future__ import annotations

import os
import zlib

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance

from tests.server.conftest import LiveServer, make_real_engine
from ttsserve.server.app import ServerConfig, create_app

# ~10 operations x 12 -> ~100 cases in a few seconds. TTSSERVE_FUZZ_EXAMPLES=500 for a deep run (which
# also turns on schemathesis' coverage phase: every boundary value the schema implies).
KEY = "fuzz-key"
EXAMPLES_PER_OPERATION = int(os.environ.get("TTSSERVE_FUZZ_EXAMPLES", "12"))
DEEP = EXAMPLES_PER_OPERATION > 12


@pytest.fixture(scope="module")
def live():
    # The real engine; a tight frame cap keeps fuzzed 4096-character inputs (many segments) cheap.
    # With an API key, so schemathesis' auth checks (wrong/missing key must give 401) apply too.
    srv = LiveServer(create_app(make_real_engine(), ServerConfig(max_new_tokens=8, api_keys=(KEY,)))).start()
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


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case, live):
    if isinstance(case.body, dict) and zlib.crc32(repr(case.body).encode()) % 2:
        # Half the bodies get a served model and a known voice (where the generated one was a valid string),
        # so real syntheses run instead of 404s.
        for key, value, max_len in (("model", "tts-1", 256), ("voice", "alloy", 128)):
            if isinstance(case.body.get(key), str) and 1 <= len(case.body[key]) <= max_len:
                case.body[key] = value
    # All schemathesis checks (status codes, content types and bodies as documented, auth) except "a
    # schema-valid request is accepted": text with nothing speakable or a PNG as audio_sample is
    # schema-valid yet rightly a 400.
    response = case.call_and_validate(
        base_url=live.url,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
        excluded_checks=[positive_data_acceptance],
    )
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    assert response.status_code != 422  # validation errors are OpenAI-shaped 400s
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
