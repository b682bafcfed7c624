"""Per-key rate limits shared by N API-server processes: one RateLimiter, checked in one place.

A RateLimiter per process would let a key through N times its limit (each process counts only what it
saw). So the launcher runs the one RateLimiter behind a ZMQ ROUTER (RateLimitService, a thread of the
launcher process, which has nothing else to do), and every API server's SharedRateLimiter asks it:
same limits, same sliding windows, same 429 messages and Retry-After as a single-process server, and the
same refund: a request the API server then refuses with 503 gives its quota back (RateRefund), so a refused
request is not charged in either mode.

A check is one local IPC round trip (tens of microseconds) made synchronously on the API server's event
loop, as RateLimiter.check is; only servers with a limit configured make it. If the service does not
answer within `timeout_s` the request gets 503 (fail closed: a limit that silently stops holding is
worse than a refused request).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec
import zmq

from ttsserve.server.errors import ApiError
from ttsserve.server.limits import RateLimiter

logger = logging.getLogger("ttsserve.server")


# A refund kept longer than this is dropped: the window its quota came from has passed by then.
REFUND_TTL_S = 120.0
MAX_PENDING_REFUNDS = 1 << 17  # bounds the service's memory under any request rate


class RateCheck(msgspec.Struct, array_like=True, frozen=True, tag=True):
    seq: int  # echoed, so a late reply to an abandoned check is never taken for the current one
    identity: str
    num_chars: int


class RateRefund(msgspec.Struct, array_like=True, frozen=True, tag=True):
    """Give back the quota of an allowed check (its verdict's refund_id); no reply."""

    refund_id: int


class RateVerdict(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    status: int  # 0: allowed; else the ApiError status (429)
    message: str = ""
    code: str | None = None
    headers: dict[str, str] = {}
    refund_id: int = -1  # allowed: the id a RateRefund names


_encoder = msgspec.msgpack.Encoder()
_check_decoder = msgspec.msgpack.Decoder(RateCheck | RateRefund)
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
        self._refunds: OrderedDict[int, tuple[float, Callable[[], None]]] = OrderedDict()
        self._refund_ids = itertools.count()
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
                msg = _check_decoder.decode(payload)
            except msgspec.DecodeError as e:
                logger.error("rate-limit service: dropped an undecodable check: %s", e)
                continue
            if isinstance(msg, RateRefund):
                self.refund(msg.refund_id)
            else:
                self._sock.send_multipart([ident, _encoder.encode(self.verdict(msg))])

    def verdict(self, check: RateCheck) -> RateVerdict:
        try:
            refund = self.limiter.check(check.identity, check.num_chars)
        except ApiError as e:
            return RateVerdict(check.seq, e.status, e.message, e.code, dict(e.headers or {}))
        now = time.monotonic()
        refunds = self._refunds
        while refunds and (len(refunds) >= MAX_PENDING_REFUNDS or next(iter(refunds.values()))[0] < now - REFUND_TTL_S):
            refunds.popitem(last=False)
        refund_id = next(self._refund_ids)
        refunds[refund_id] = (now, refund)
        return RateVerdict(check.seq, 0, refund_id=refund_id)

    def refund(self, refund_id: int) -> None:
        entry = self._refunds.pop(refund_id, None)
        if entry is not None:
            entry[1]()


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

    def check(self, identity: str, num_chars: int) -> Callable[[], None]:
        """Consume quota or raise ApiError (429 with Retry-After; 503 if the service does not answer).
        Returns the refund (RateLimiter.check's contract): calling it gives the quota back, once."""
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
        return functools.partial(self._refund, [verdict.refund_id])

    def _refund(self, pending: list[int]) -> None:
        if not pending:  # emptied, so a second call refunds nothing
            return
        with self._lock:
            self._sock.send(_encoder.encode(RateRefund(pending.pop())))

    def close(self) -> None:
        self._ctx.destroy(linger=0)
