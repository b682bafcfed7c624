"""Admission control at the HTTP edge: API keys (401), per-key rate limits (429), the in-flight bound (503),
and request body size (413).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import time
from collections.abc import Callable, Iterable

from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import SlidingWindowCounterRateLimiter
from starlette.exceptions import HTTPException as StarletteHTTPException

from ttsserve.server.errors import ApiError


def key_id(key: str | bytes) -> str:
    """A short, non-secret identity of an API key (rate limits, logs, voice owners): a hash, never the key."""
    return "key-" + hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()[:12]


class ApiKeyAuth:
    """Bearer-token check. With no keys configured every request passes (as "anonymous").

    `check(authorization_header) -> key_id` returns a short, non-secret identity of the key (for rate
    limits and logs) or raises ApiError(401). admin_keys are accepted too; `is_admin(key_id)` tells them.
    """

    def __init__(self, keys: Iterable[str], admin_keys: Iterable[str] = ()) -> None:
        admin = [k.encode() for k in admin_keys if k]
        self._keys = [k.encode() for k in keys if k] + admin
        self._admin_ids = frozenset(key_id(k) for k in admin)

    def is_admin(self, ident: str | None) -> bool:
        return ident in self._admin_ids

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> str | None:
        if not self._keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(
                401,
                "missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        tok = token.encode()
        # Compare with every key (no early exit) so timing does not tell which prefix matched.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(tok, key)
        if not ok:
            raise ApiError(401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return key_id(tok)


class RateLimiter:
    """Per-identity limits on requests per minute and input characters per minute (0 disables a limit).

    Sliding-window counters (O(1) memory per identity, unlike a moving window that stores one entry per
    character). `check(identity, num_chars)` consumes quota or raises ApiError(429) with Retry-After, and
    returns a refund: calling it gives the quota back (for a request the server then refuses with 503,
    which did no work for the client). A request whose text alone exceeds chars_per_minute can never pass
    and gets 429 with a message saying so.
    """

    def __init__(self, requests_per_minute: int = 0, chars_per_minute: int = 0) -> None:
        self._storage = MemoryStorage()
        self._limiter = SlidingWindowCounterRateLimiter(self._storage)
        self._req = RateLimitItemPerMinute(requests_per_minute) if requests_per_minute > 0 else None
        self._chars = RateLimitItemPerMinute(chars_per_minute) if chars_per_minute > 0 else None

    def check(self, identity: str, num_chars: int) -> Callable[[], None]:
        if self._chars is not None and num_chars > self._chars.amount:
            raise ApiError(
                429,
                f"input of {num_chars} characters exceeds the limit of {self._chars.amount} characters per minute",
                code="rate_limit_exceeded",
                headers={"Retry-After": "60"},
            )
        checks = [
            (item, cost) for item, cost in ((self._req, 1), (self._chars, num_chars)) if item is not None and cost > 0
        ]
        # Test all before hitting any, so a request refused on characters does not use up a request slot.
        for item, cost in checks:
            if not self._limiter.test(item, identity, cost=cost):
                stats = self._limiter.get_window_stats(item, identity)
                retry = max(1, math.ceil(stats.reset_time - time.time()))
                what = "requests" if item is self._req else "characters"
                raise ApiError(
                    429,
                    f"rate limit exceeded: {item.amount} {what} per minute",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry)},
                )
        hits = []
        for item, cost in checks:
            # The counter of the window this hit lands in: a refund must take it back from there even if
            # the window has rolled over since (it then counts, weighted, as the previous window).
            window = self._storage.sliding_window_keys(item.key_for(identity), item.get_expiry(), time.time())[1]
            if self._limiter.hit(item, identity, cost=cost):
                hits.append((window, cost))
        return functools.partial(self._refund, hits)

    def _refund(self, hits: list[tuple[str, int]]) -> None:
        while hits:  # emptied, so a second call refunds nothing
            window, cost = hits.pop()
            if self._storage.get(window) > 0:  # an expired window is gone: nothing left to give back
                self._storage.decr(window, cost)


class AdmissionGate:
    """Bounds the requests in flight at the server (queued in the engine or streaming).

    `acquire()` returns a release callable (idempotent) or raises ApiError(503) with Retry-After when full.
    """

    def __init__(self, limit: int, retry_after_s: int = 1) -> None:
        if limit < 1:
            raise ValueError(f"in-flight limit must be >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self.retry_after_s = retry_after_s
        self.closed = False

    def acquire(self):
        if self.closed:
            raise ApiError(
                503, "server is shutting down", code="shutting_down", headers={"Retry-After": str(self.retry_after_s)}
            )
        if self.in_flight >= self.limit:
            raise ApiError(
                503,
                f"server is at capacity ({self.limit} requests in flight); retry later",
                code="server_overloaded",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1

        return release


class KeyRequiredMiddleware:
    """Pure ASGI: the API key check (401, OpenAI shape) on `paths` that have no handler of ours to check it,
    i.e. FastAPI's documentation routes, and /metrics (open by default, as vLLM's, for scrapers)."""

    def __init__(self, app, auth: ApiKeyAuth, paths: Iterable[str]) -> None:
        self.app = app
        self.auth = auth
        self.paths = frozenset(paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in self.paths:
            header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            try:
                self.auth.check(header or None)
            except ApiError as err:
                return await _send_error(send, err, scope=scope)
        return await self.app(scope, receive, send)


def _log_reason(scope, err: ApiError) -> None:
    """err's code and message on the request's access-log line (RequestContextMiddleware's `log`)."""
    log = (scope or {}).get("state", {}).get("log")
    if isinstance(log, dict):
        log.setdefault("error", err.code)
        log.setdefault("reason", err.message)


async def _send_error(
    send, err: ApiError, extra_headers: tuple[tuple[bytes, bytes], ...] = (), scope: dict | None = None
) -> None:
    _log_reason(scope, err)
    body = _error_bytes(err)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": [*headers, *extra_headers]})
    await send({"type": "http.response.body", "body": body})


def _error_bytes(err: ApiError) -> bytes:
    import json

    return json.dumps(err.body()).encode()


class BodyLimitMiddleware:
    """Pure ASGI middleware: 413 (OpenAI shape) for bodies over the limit, by Content-Length up front or
    by counting a chunked body as it is read. `upload_paths` get `max_upload_bytes` instead (voice audio).
    """

    def __init__(self, app, max_body_bytes: int, max_upload_bytes: int, upload_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes
        self.upload_paths = upload_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_upload_bytes if scope["path"] in self.upload_paths else self.max_body_bytes
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._reject(send, limit, scope)
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise _TooLarge(limit)
            return msg

        async def tracking_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._reject(send, limit, scope)

    @staticmethod
    async def _reject(send, limit: int, scope) -> None:
        err = ApiError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        _log_reason(scope, err)
        body = _error_bytes(err)
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(StarletteHTTPException):
    """Raised from `receive` mid-body: an HTTPException so FastAPI passes it through body parsing to the
    app's error handlers (which render the OpenAI shape); the middleware answers itself if it escapes."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds {limit} bytes")
