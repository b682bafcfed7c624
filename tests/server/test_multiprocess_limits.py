"""Rate limits shared by several API servers: one RateLimiter behind a RateLimitService, asked by several
SharedRateLimiters, holds each key to its limit in total (not N times it)."""

from __future__ import annotations

import pytest

from ttsserve.server.errors import ApiError
from ttsserve.server.limits import RateLimiter
from ttsserve.server.shared_limits import RateLimitService, SharedRateLimiter


@pytest.fixture
def service(tmp_path):
    svc = RateLimitService(RateLimiter(requests_per_minute=3, chars_per_minute=100), f"ipc://{tmp_path}/limits.sock")
    yield svc.start()
    svc.stop()


def test_one_budget_per_key_across_api_servers(service):
    a, b = SharedRateLimiter(service.address), SharedRateLimiter(service.address)
    a.check("key-1", 10)
    b.check("key-1", 10)
    a.check("key-1", 10)
    for limiter in (a, b):  # three requests in total were allowed, whichever process saw them
        with pytest.raises(ApiError) as ei:
            limiter.check("key-1", 10)
        assert ei.value.status == 429 and "3 requests per minute" in ei.value.message
        assert 1 <= int(ei.value.headers["Retry-After"]) <= 60 and ei.value.code == "rate_limit_exceeded"
    b.check("key-2", 90)  # another key has its own budget
    with pytest.raises(ApiError) as ei:
        a.check("key-2", 20)
    assert ei.value.status == 429 and "characters" in ei.value.message
    with pytest.raises(ApiError, match="exceeds the limit of 100"):
        b.check("key-3", 101)
    a.close()
    b.close()


def test_an_unanswered_check_is_refused_not_allowed(service):
    limiter = SharedRateLimiter(service.address, timeout_s=0.2)
    limiter.check("k", 1)
    service.stop()
    with pytest.raises(ApiError) as ei:
        limiter.check("k", 1)
    assert ei.value.status == 503 and ei.value.headers["Retry-After"] == "1"
    limiter.close()
