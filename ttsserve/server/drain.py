"""Graceful drain on SIGTERM: keep listening, answer new requests 503, let accepted ones finish, then stop.

uvicorn on its own stops listening at the first signal, so during its drain new connections are refused
(or reset) and a load balancer's readiness probe never sees a 503. Here the first SIGTERM / SIGINT only
starts the drain (DrainState): every new request (on a new or a kept-alive connection) gets 503
`shutting_down` with Retry-After and `Connection: close`, /ready included (/health and /metrics still
answer), while the requests already accepted run to their end. Once none is left, or --drain-timeout
passed, uvicorn's own shutdown closes the listener and the lifespan stops the engine. A second signal stops
at once. The signal is not re-raised afterwards: a clean drain exits 0, in one process as under the launcher.

Under the launcher the API servers drain as a group (DrainGroup): one whose own requests are done keeps
answering 503 until every server's are, or its deadline passed. On Linux each has its own socket of one
SO_REUSEPORT group and the kernel hashes new connections over the open ones, so a server that closed early
reset the connections hashed to it in its last instants instead of answering them 503.
"""

from __future__ import annotations

import json
import logging
import signal
import time

import uvicorn

from ttsserve.server.errors import ApiError

logger = logging.getLogger("ttsserve.server")

RETRY_AFTER_S = 1
_PASS_THROUGH = ("/health", "/metrics")  # liveness and monitoring keep answering while draining


class DrainState:
    """Whether the server drains, and how many accepted HTTP requests are still being answered."""

    def __init__(self) -> None:
        self.deadline: float | None = None  # set when the drain starts
        self.in_flight = 0

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def start(self, timeout_s: float) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + timeout_s

    def done(self) -> bool:
        return self.draining and (self.in_flight == 0 or time.monotonic() >= self.deadline)


class DrainGroup:
    """The drain state of a launcher's N API servers: flags, a shared byte array [N] (multiprocessing.RawArray,
    1 = that server's requests are done, or it is not running), and this server's index in it."""

    def __init__(self, flags, index: int) -> None:
        self.flags, self.index = flags, index

    def drained(self) -> bool:
        """Mark this server drained -> whether every server is."""
        self.flags[self.index] = 1
        return all(self.flags)


class DrainMiddleware:
    """Pure ASGI: 503 + Retry-After + Connection: close for new requests while draining; counts the others."""

    def __init__(self, app, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.state.draining and scope["path"] not in _PASS_THROUGH:
            return await _refuse(send)
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


async def _refuse(send) -> None:
    err = ApiError(503, "the server is shutting down; retry on another instance", code="shutting_down")
    body = json.dumps(err.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM / SIGINT drains through `state` (see the module docstring)."""

    def __init__(
        self, config: uvicorn.Config, state: DrainState, drain_timeout_s: float, group: DrainGroup | None = None
    ) -> None:
        super().__init__(config)
        self.drain, self.drain_timeout_s, self.group = state, drain_timeout_s, group

    def handle_exit(self, sig: int, frame) -> None:  # a signal handler: only flags, the loop acts on them
        if self.drain.draining or self.should_exit:
            self.force_exit = self.should_exit = True
            return
        self.drain.start(self.drain_timeout_s)
        logger.info(
            "%s: draining (%d requests in flight; new ones get 503 for up to %.0f s)",
            signal.Signals(sig).name,
            self.drain.in_flight,
            self.drain_timeout_s,
        )

    async def on_tick(self, counter: int) -> bool:
        if self.drain.done() and not self.should_exit and self._group_done():
            # what is left of the drain bounds uvicorn's own wait for connections
            self.config.timeout_graceful_shutdown = max(1.0, self.drain.deadline - time.monotonic())
            logger.info("drained (%d requests still in flight): stopping", self.drain.in_flight)
            self.should_exit = True
        return await super().on_tick(counter)

    def _group_done(self) -> bool:
        """Alone, or every server of the group drained, or this one's deadline passed."""
        return self.group is None or self.group.drained() or time.monotonic() >= self.drain.deadline
