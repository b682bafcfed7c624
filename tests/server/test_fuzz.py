"""Schemathesis fuzz of the app's own OpenAPI document against a live server: no input gives a 5xx."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.server.conftest import LiveServer, make_real_engine
from ttsserve.server.app import ServerConfig, create_app

# ~10 operations x 12 -> ~100 cases in a few seconds. TTSSERVE_FUZZ_EXAMPLES=500 for a deep run (which
# also turns on schemathesis' coverage phase: every boundary value the schema implies).
EXAMPLES_PER_OPERATION = int(os.environ.get("TTSSERVE_FUZZ_EXAMPLES", "12"))
DEEP = EXAMPLES_PER_OPERATION > 12


@pytest.fixture(scope="module")
def live():
    # The real engine; a tight frame cap keeps fuzzed 4096-character inputs (many segments) cheap.
    srv = LiveServer(create_app(make_real_engine(), ServerConfig(max_new_tokens=8))).start()
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
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None,
          suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case, live):
    response = case.call(base_url=live.url, timeout=30)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    assert response.status_code != 422  # validation errors are OpenAI-shaped 400s
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
