"""Connection-level limits for uvicorn: read timeouts, a cap on open connections, and a log of every
connection the server closes on its own.

uvicorn has a keep-alive idle timeout but no header or body read timeout, and its `limit_concurrency` only
answers once a request's headers are in (a silent socket holds its file descriptor for good, and past the fd
limit accept() fails and clients are reset). So the HTTP protocol is subclassed here (a timer per phase):

- header timeout: from the connection's start, or the first byte of a request on a kept-alive one, to the end
  of its headers. Silent connections are closed; a partial request gets 408.
- body timeout: from the end of the headers to the end of the body (a total, so a trickle cannot extend it);
  408 unless the response already started.
- a 408 or 503 is followed by a lingering close: the write side is shut and what the client still sends is
  read and dropped until it closes (or LINGER_S), because closing a socket with bytes unread, or with bytes
  still arriving, makes the kernel answer with a reset that destroys the status before the client reads it.
- keep-alive: uvicorn's timer, but it leaves a connection whose next request is already in the socket.
- max connections: a connection over the cap is answered 503 (`Connection: close`, `Retry-After`) at once
  and closed, so a flood of sockets gets a status instead of a reset from the kernel.

Every such close is counted; `ConnectionLog` writes one rate-limited line with the counts.
"""

from __future__ import annotations

import asyncio
import logging
import select
import time

logger = logging.getLogger("ttsserve.server")

LOG_INTERVAL_S = 10.0  # at most one summary line per interval (the first close of a burst is logged at once)
LINGER_S = 1.0  # how long a connection answered 408 / 503 waits for the client to read it and close
LINGER_MAX = 64  # connections lingering at once; more are closed at once (fds are the scarce thing)
REASONS = ("shed", "header_timeout", "body_timeout", "keep_alive")


def _response(status: int, reason: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n%s\r\n%s"
        % (status, reason.encode(), len(body), extra, body)
    )


SHED_RESPONSE = _response(
    503,
    "Service Unavailable",
    b'{"error":{"message":"too many open connections; retry shortly","type":"server_error",'
    b'"code":"server_overloaded"}}',
    b"retry-after: 1\r\n",
)
TIMEOUT_RESPONSE = _response(
    408,
    "Request Timeout",
    b'{"error":{"message":"the request was not received in time","type":"invalid_request_error",'
    b'"code":"request_timeout"}}',
)


class ConnectionLog:
    """Counts of server-side closes by reason, logged as one line at most every LOG_INTERVAL_S."""

    def __init__(self, max_connections: int, interval_s: float = LOG_INTERVAL_S) -> None:
        self.max_connections = max_connections
        self.interval_s = interval_s
        self.pending = dict.fromkeys(REASONS, 0)
        self.total = dict.fromkeys(REASONS, 0)
        self.last_log = -float("inf")
        self.flush_handle: asyncio.TimerHandle | None = None
        self.open = 0  # connections open now (served, not shed)

    def closed(self, reason: str, client) -> None:
        self.pending[reason] += 1
        self.total[reason] += 1
        logger.debug("closed connection from %s: %s", _addr(client), reason)
        if self.flush_handle is not None:
            return
        wait = self.last_log + self.interval_s - time.monotonic()
        if wait <= 0:
            self.flush()
        else:
            self.flush_handle = asyncio.get_running_loop().call_later(wait, self.flush)

    def flush(self) -> None:
        self.flush_handle = None
        counts = {k: v for k, v in self.pending.items() if v}
        if not counts:
            return
        self.last_log = time.monotonic()
        self.pending = dict.fromkeys(REASONS, 0)
        level = logging.INFO if set(counts) == {"keep_alive"} else logging.WARNING
        logger.log(
            level,
            "closed connections: %s (open %d, --max-connections %d; since start: %s)",
            ", ".join(f"{k} {v}" for k, v in counts.items()),
            self.open,
            self.max_connections,
            ", ".join(f"{k} {v}" for k, v in self.total.items() if v),
        )


def _addr(client) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def _socket_has_data(transport) -> bool:
    """True when the socket has bytes (or an EOF) waiting that the event loop has not delivered yet."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        return bool(select.select([sock.fileno()], [], [], 0)[0])
    except (OSError, ValueError):
        return False


class TimeoutsMixin:
    """Put before uvicorn's HttpToolsProtocol or H11Protocol. Class attributes set by `protocol_class`."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    conn_log: ConnectionLog
    lingering: set = set()

    def connection_made(self, transport) -> None:
        self._shed = len(self.server_state.connections) >= self.max_connections
        self._header_timer = self._body_timer = self._linger_timer = None
        self._seen_cycle = None
        self._request_bytes = False
        if self._shed:
            return self._shed_connection(transport)
        super().connection_made(transport)
        self.conn_log.open += 1
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    # ---- shedding ---------------------------------------------------------------------------------------
    def _shed_connection(self, transport) -> None:
        """Answer 503 before reading anything and close."""
        self.transport = transport
        self.client = transport.get_extra_info("peername")
        self._answer_and_close("shed", SHED_RESPONSE)

    def _answer_and_close(self, reason: str, response: bytes | None) -> None:
        """Write `response` (None: close without a word), then close lingering: shut the write side and read
        and drop what still comes until the client closes or LINGER_S passes."""
        transport = self.transport
        self.conn_log.closed(reason, self.client)
        if response is not None:
            transport.write(response)
        if response is None or len(self.lingering) >= LINGER_MAX or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        transport.resume_reading()  # a paused transport would leave the client's bytes unread: a reset
        self.lingering.add(self)
        self._linger_timer = self.loop.call_later(LINGER_S, transport.close)

    # ---- reading ----------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self in self.lingering:
            return  # answered and closing: the bytes are read only so that the close stays clean
        idle = self.cycle is None or self.cycle.response_complete
        super().data_received(data)
        cycle = self.cycle
        if cycle is not None and cycle is not self._seen_cycle:  # a request's headers are complete
            self._seen_cycle = cycle
            self._request_bytes = False
            self._header_timer = _cancel(self._header_timer)
            if cycle.more_body and not cycle.response_complete:
                self._body_timer = self.loop.call_later(self.body_timeout_s, self._on_body_timeout)
        elif idle:  # part of a request's head: its timer runs from the connection's start or this first byte
            self._request_bytes = True
            if self._header_timer is None and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)
        if self._body_timer is not None and (cycle is None or not cycle.more_body):
            self._body_timer = _cancel(self._body_timer)

    def on_response_complete(self) -> None:
        self._body_timer = _cancel(self._body_timer)  # answered (413, an error) before the body was in
        super().on_response_complete()

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        # a request began and stalled: say so; a silent connection is just closed
        self._answer_and_close("header_timeout", TIMEOUT_RESPONSE if self._request_bytes else None)

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or not cycle.more_body:
            return
        started = cycle.response_started
        cycle.disconnected = True  # the app waiting for the body sees a disconnect now, and writes nothing more
        cycle.message_event.set()
        self._answer_and_close("body_timeout", None if started else TIMEOUT_RESPONSE)

    def timeout_keep_alive_handler(self) -> None:
        self.timeout_keep_alive_task = None
        if self.transport.is_closing():
            return
        if _socket_has_data(self.transport):  # the next request is here, unread: closing would reset it
            return
        self._answer_and_close("keep_alive", None)

    def connection_lost(self, exc) -> None:
        self._linger_timer = _cancel(self._linger_timer)
        self.lingering.discard(self)
        if self._shed:
            return
        self._header_timer = _cancel(self._header_timer)
        self._body_timer = _cancel(self._body_timer)
        self.conn_log.open -= 1
        super().connection_lost(exc)

    def eof_received(self):
        if self in self.lingering or self._shed:
            self.transport.close()  # the client read the answer and closed its side
            return None
        return super().eof_received()


def _cancel(handle) -> None:
    if handle is not None:
        handle.cancel()
    return None


def protocol_class(header_timeout_s: float, body_timeout_s: float, max_connections: int) -> type:
    """uvicorn's HTTP protocol (httptools when installed, else h11) with the limits above, for one process."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    attrs = {
        "header_timeout_s": header_timeout_s,
        "body_timeout_s": body_timeout_s,
        "max_connections": max_connections,
        "conn_log": ConnectionLog(max_connections),
        "lingering": set(),
    }
    return type("TTSServeHTTPProtocol", (TimeoutsMixin, base), attrs)
