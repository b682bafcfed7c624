"""A request refused with 503 gets its rate-limit quota back, with the limiter of one process (RateLimiter) and
with the one the API servers share (SharedRateLimiter asking a RateLimitService): the same 503s, the same budget."""

from __future__ import annotations

import threading

import pytest

from tests.server.conftest import LiveServer, wait_until
from tests.server.fake_engine import FakeEngine
from tests.server.test_ops_limits import SPEECH, _clear_of_a_minute_boundary
from ttsserve.server.app import ServerConfig, create_app
from ttsserve.server.errors import ApiError
from ttsserve.server.limits import RateLimiter
from ttsserve.server.shared_limits import RateLimitService, SharedRateLimiter


@pytest.fixture(params=["one process", "shared"])
def serve_limited(request, tmp_path):
    """serve_limited(engine, **ServerConfig fields) -> LiveServer whose rate limits are checked the mode's way."""
    servers, services = [], []

    def _serve(engine, **cfg):
        config = ServerConfig(**cfg)
        limiter = None
        if request.param == "shared":
            svc = RateLimitService(
                RateLimiter(config.requests_per_minute, config.chars_per_minute), f"ipc://{tmp_path}/limits.sock"
            ).start()
            services.append(svc)
            limiter = SharedRateLimiter(svc.address)
        srv = LiveServer(create_app(engine, config, rate_limiter=limiter)).start()
        servers.append(srv)
        return srv

    yield _serve
    for srv in servers:
        srv.stop()
    for svc in services:
        svc.stop()


def test_a_full_engine_queue_is_503_and_not_charged(serve_limited):
    _clear_of_a_minute_boundary(5)
    eng = FakeEngine(max_queue_len=0)
    srv = serve_limited(eng, requests_per_minute=2, chars_per_minute=50)
    speech, synth = {**SPEECH, "input": "x" * 20}, {"text": "y" * 20, "format": "pcm"}
    with srv.client() as c:
        for path, body in [("/v1/audio/speech", speech), ("/synthesize", synth)] * 3:
            r = c.post(path, json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded", r.text
        eng.max_queue_len = 1024
        assert c.post("/v1/audio/speech", json=speech).status_code == 200  # the whole budget is still there
        assert c.post("/synthesize", json=synth).status_code == 200
        assert c.post("/v1/audio/speech", json=speech).status_code == 429


def test_at_capacity_is_503_and_not_charged(serve_limited):
    _clear_of_a_minute_boundary(5)
    eng = FakeEngine(chunk_delay_s=0.02)
    srv = serve_limited(eng, max_in_flight=1, requests_per_minute=2)
    got: dict = {}

    def slow():  # holds the one in-flight slot for ~0.4 s; uses one request of the budget
        with srv.client() as c:
            got["status"] = c.post("/v1/audio/speech", json={**SPEECH, "input": "x" * 40}).status_code

    t = threading.Thread(target=slow)
    t.start()
    assert wait_until(lambda: len(eng.running) == 1)
    with srv.client() as c:
        for _ in range(4):
            r = c.post("/v1/audio/speech", json=SPEECH)
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded", r.text
        t.join(10)
        assert got["status"] == 200
        assert wait_until(lambda: srv.app.state.server.gate.in_flight == 0)  # released after its last byte
        assert c.post("/v1/audio/speech", json=SPEECH).status_code == 200
        assert c.post("/v1/audio/speech", json=SPEECH).status_code == 429


def test_a_shared_refund_is_given_back_once(tmp_path):
    svc = RateLimitService(RateLimiter(requests_per_minute=2), f"ipc://{tmp_path}/limits.sock").start()
    a, b = SharedRateLimiter(svc.address), SharedRateLimiter(svc.address)
    try:
        _clear_of_a_minute_boundary(3)
        refund = a.check("k", 1)
        b.check("k", 1)
        refund()
        refund()  # idempotent: the second call gives back nothing
        a.check("k", 1)  # after its refund on the same connection: one slot was free again, no more
        with pytest.raises(ApiError, match="2 requests per minute"):
            b.check("k", 1)
    finally:
        a.close()
        b.close()
        svc.stop()
