"""Per-key rate limits shared by N API-server processes: one RateLimiter, checked in one place.

A RateLimiter per process would let a key through N times its limit (each process counts only what it
saw). So the launcher runs the one RateLimiter behind a ZMQ ROUTER (RateLimitService, a thread of the
launcher process, which has nothing else to do), and every API server's SharedRateLimiter asks it:
same limits, same sliding windows, same 429 messages and Retry-After as a single-process server.

A check is one local IPC round trip (tens of microseconds) made synchronously on the API server's event
loop, as RateLimiter.check is; only servers with a limit configured make it. If the service does not
answer within `timeout_s` the request gets 503 (fail closed: a limit that silently stops holding is
worse than a refused request).
"""

from __future__ import annotations

import itertools
import logging
import threading

import msgspec
import zmq

from ttsserve.server.errors import ApiError
from ttsserve.server.limits import RateLimiter

logger = logging.getLogger("ttsserve.server")


class RateCheck(msgspec.Struct, array_like=True, frozen=True):
    seq: int  # echoed, so a late reply to an abandoned check is never taken for the current one
    identity: str
    num_chars: int


class RateVerdict(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    status: int  # 0: allowed; else the ApiError status (429)
    message: str = ""
    code: str | None = None
    headers: dict[str, str] = {}


_encoder = msgspec.msgpack.Encoder()
_check_decoder = msgspec.msgpack.Decoder(RateCheck)
_verdict_decoder = msgspec.msgpack.Decoder(RateVerdict)


class RateLimitService:
    """The limiter's home: answers RateChecks at `address` from a daemon thread until stop()."""

    def __init__(self, limiter: RateLimiter, address: str) -> None:
        self.limiter = limiter
        self.address = address
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ttsserve-rate-limits", daemon=True)

    def start(self) -> RateLimitService:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.destroy(linger=0)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(200):
                continue
            ident, payload = self._sock.recv_multipart()
            try:
                check = _check_decoder.decode(payload)
            except msgspec.DecodeError as e:
                logger.error("rate-limit service: dropped an undecodable check: %s", e)
                continue
            self._sock.send_multipart([ident, _encoder.encode(self.verdict(check))])

    def verdict(self, check: RateCheck) -> RateVerdict:
        try:
            self.limiter.check(check.identity, check.num_chars)
        except ApiError as e:
            return RateVerdict(check.seq, e.status, e.message, e.code, dict(e.headers or {}))
        return RateVerdict(check.seq, 0)


class SharedRateLimiter:
    """RateLimiter's `check(identity, num_chars)` contract, answered by a RateLimitService."""

    def __init__(self, address: str, timeout_s: float = 2.0) -> None:
        self.address = address
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context()
        self._sock = self._connect()
        self._seq = itertools.count()
        self._lock = threading.Lock()  # one check at a time on the socket (it is not thread-safe)

    def _connect(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        return sock

    def check(self, identity: str, num_chars: int) -> None:
        """Consume quota or raise ApiError (429 with Retry-After; 503 if the service does not answer)."""
        with self._lock:
            seq = next(self._seq)
            self._sock.send(_encoder.encode(RateCheck(seq, identity, num_chars)))
            while True:
                if not self._sock.poll(self.timeout_ms):
                    raise ApiError(
                        503,
                        "rate limiter unavailable; retry later",
                        code="rate_limiter_unavailable",
                        headers={"Retry-After": "1"},
                    )
                verdict = _verdict_decoder.decode(self._sock.recv())
                if verdict.seq == seq:
                    break
        if verdict.status:
            raise ApiError(verdict.status, verdict.message, code=verdict.code, headers=verdict.headers or None)

    def close(self) -> None:
        self._ctx.destroy(linger=0)
