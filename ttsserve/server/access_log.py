"""Request context at the HTTP edge: request ids, one JSON access-log line per request, requests-by-status."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from http import HTTPStatus

from ttsserve.server.metrics import ServerMetrics

access_logger = logging.getLogger("ttsserve.access")
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def _endpoint_label(path: str) -> str:
    if path in ("/v1/audio/speech", "/synthesize", "/v1/audio/voices", "/v1/models", "/health", "/ready", "/metrics"):
        return path
    for prefix in ("/v1/audio/voices/", "/v1/models/"):
        if path.startswith(prefix):
            return prefix + "{id}"
    return "other"


def _status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"HTTP {status}"


class RequestContextMiddleware:
    """Pure ASGI (keeps streaming and disconnects intact): X-Request-ID in/out, one JSON access-log line per
    request, and the requests-by-status metric.

    The access line is written when the response starts (`ms`: time to the status line; for a stream the synthesis
    is still running). Syntheses add a `synthesis_done` line when they end (finish_reason, audio_s, frames, ttfa_ms,
    total_ms); a synthesis's access line has `admit_ms`, its time in the app before admission (the event loop's
    queue, the body's validation, the voice), from which its ttfa_ms counts. A client that leaves before any
    response is logged as status 499, an unhandled error as 500. Every request that ends without its audio says why:
    an error status has `error` (the code) and `reason`, and a stream cut short has `reason` on its synthesis_done
    line.
    """

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _REQUEST_ID_RE.match(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        started = time.perf_counter()
        state.update(request_id=rid, log={}, logged=False, arrived=started)
        status = 500

        async def send_with_id(msg) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                hdrs = [(k, v) for k, v in msg.get("headers", []) if k.lower() != b"x-request-id"]
                msg = {**msg, "headers": [*hdrs, (b"x-request-id", rid.encode())]}
                self._log(scope, rid, status, started, state)
            await send(msg)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:
            # An unhandled error: Starlette's outermost middleware answers it with a 500 (our handler's
            # body) after it has passed through here, so log that status, not a client that left.
            if not state["logged"]:
                gone = type(e).__name__ == "ClientDisconnect"
                state["log"].setdefault("reason", "client disconnected" if gone else f"{type(e).__name__}: {e}")
                self._log(scope, rid, 499 if gone else 500, started, state)
            raise
        finally:
            if not state["logged"]:  # no response was sent (client gone before the first byte)
                state["log"].setdefault("reason", "client disconnected before the response")
                self._log(scope, rid, 499, started, state)

    def _log(self, scope, rid: str, status: int, started: float, state: dict) -> None:
        state["logged"] = True
        if status >= 400 and "reason" not in state["log"]:  # every path above names its own; a last resort
            state["log"]["reason"] = _status_phrase(status)
        self.metrics.observe_request(_endpoint_label(scope["path"]), status)
        client = scope.get("client")
        line = {
            "event": "access",
            "request_id": rid,
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "ms": round((time.perf_counter() - started) * 1000, 1),
            "client": client[0] if client else None,
            **state["log"],
        }
        access_logger.info(json.dumps(line, default=str))
