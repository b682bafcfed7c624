"""A small TCP (layer-4) load balancer for `ttsserve serve --data-parallel-size N`: least connections over
replicas that answer `/ready` 200, failover when a replica refuses the connection or closes it without
answering, bytes passed through unbuffered in both directions (streamed audio reaches the client chunk by chunk).

Why layer 4: it cannot buffer, reorder or break HTTP (chunked streams, SSE, uploads, keep-alive all pass
through untouched), and it needs no HTTP parser. Replay: until a replica sends its first byte, the client's
bytes are kept (up to `replay_limit_bytes`), so a replica that dies after accepting (kill -9, OOM) before
answering costs nothing: the same bytes go to the next replica. That is safe because synthesis has no side
effects. What it gives up: balancing is per client connection (an HTTP/1.1 client holds one connection per
in-flight request, so this is least in-flight requests for the usual pooled clients), and once a replica has
answered on a connection, a later failure on it (a stream cut mid-way, a second keep-alive request) is the
client's to retry. For per-request retries and rate limits put nginx in front of the replica ports instead
(deploy/nginx, docs/DEPLOY.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger("ttsserve.deploy.proxy")
_NO_REPLICA = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)
_NO_REPLICA_BODY = (
    b'{"error":{"message":"no replica is ready","type":"server_error","param":null,"code":"no_replica_ready"}}'
)


@dataclass
class Backend:
    """One replica. `ready`: its last /ready probe answered 200 (and no connect failed since).
    `active`: client connections open to it now (the least-connections key)."""

    host: str
    port: int
    ready: bool = False
    active: int = 0
    total: int = 0
    last_change: float = 0.0

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def set_ready(self, ready: bool, why: str = "") -> None:
        if ready != self.ready:
            logger.info(
                "replica %s is %s%s", self.addr, "ready" if ready else "out of rotation", f" ({why})" if why else ""
            )
            self.ready, self.last_change = ready, time.monotonic()


def pick_backend(backends: list[Backend], exclude: set[int] = frozenset()) -> int | None:
    """Index of the ready backend with the fewest active connections (ties: the one used least in total,
    so idle replicas take turns); None when no ready backend is left outside `exclude`."""
    best = None
    for i, b in enumerate(backends):
        if not b.ready or i in exclude:
            continue
        if best is None or (b.active, b.total) < (backends[best].active, backends[best].total):
            best = i
    return best


async def probe_ready(b: Backend, timeout: float = 2.0) -> bool:
    """GET /ready on `b`; True iff the status is 200."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(b.host, b.port), timeout)
    except (TimeoutError, OSError):
        return False
    try:
        writer.write(f"GET /ready HTTP/1.1\r\nhost: {b.addr}\r\nconnection: close\r\n\r\n".encode())
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), timeout)
        return status.split(b" ")[1:2] == [b"200"]
    except (TimeoutError, OSError, IndexError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close; each chunk is written as soon as it is read (no buffering)."""
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, asyncio.IncompleteReadError):
        pass


class LoadBalancer:
    """Accepts on (host, port), forwards each connection to pick_backend(), probes /ready every
    `probe_interval_s`, replays a connection's first `replay_limit_bytes` to the next replica when one closes
    it without answering. Use: `await lb.start()`, ..., `await lb.stop()`; or `await lb.serve_forever()`."""

    def __init__(
        self,
        host: str,
        port: int,
        backends: list[Backend],
        probe_interval_s: float = 1.0,
        connect_timeout_s: float = 2.0,
        replay_limit_bytes: int = 1 << 20,
    ) -> None:
        if not backends:
            raise ValueError("LoadBalancer: need at least one backend")
        self.host, self.port, self.backends = host, port, backends
        self.probe_interval_s, self.connect_timeout_s = probe_interval_s, connect_timeout_s
        self.replay_limit_bytes = replay_limit_bytes
        self._server: asyncio.AbstractServer | None = None
        self._prober: asyncio.Task | None = None

    async def start(self) -> None:
        await self.probe_all()
        self._server = await asyncio.start_server(self._handle, self.host, self.port, reuse_address=True)
        self._prober = asyncio.create_task(self._probe_loop())
        logger.info("load balancer on %s:%d over %s", self.host, self.port, ", ".join(b.addr for b in self.backends))

    async def stop(self) -> None:
        if self._prober:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        if self._server:
            self._server.close()
            await self._server.wait_closed()

    async def serve_forever(self) -> None:
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def probe_all(self) -> None:
        results = await asyncio.gather(*(probe_ready(b) for b in self.backends))
        for b, ok in zip(self.backends, results):
            b.set_ready(ok, "" if ok else "/ready failed")

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await self.probe_all()

    async def _connect(self, tried: set[int]) -> tuple[Backend, asyncio.StreamReader, asyncio.StreamWriter] | None:
        """Connect to the best ready backend not in `tried` (which it extends), failing over to the next on
        a refused or slow connect; None when none is left."""
        while (i := pick_backend(self.backends, tried)) is not None:
            tried.add(i)
            b = self.backends[i]
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection(b.host, b.port), self.connect_timeout_s)
                return b, r, w
            except (TimeoutError, OSError) as e:
                b.set_ready(False, f"connect failed: {e!r}")
        return None

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        exchange = _Exchange(client_r, self.replay_limit_bytes)
        tried: set[int] = set()
        try:
            while True:
                conn = await self._connect(tried)
                if conn is None:  # nothing was answered yet: every earlier attempt closed unanswered
                    client_w.write(_NO_REPLICA % (len(_NO_REPLICA_BODY), _NO_REPLICA_BODY))
                    with contextlib.suppress(OSError):
                        await client_w.drain()
                    return
                b, up_r, up_w = conn
                b.active += 1
                b.total += 1
                try:
                    answered = await exchange.run(up_r, up_w, client_w)
                finally:
                    b.active -= 1
                    await _close(up_w)
                if answered or not exchange.can_replay():
                    return
                b.set_ready(False, "closed the connection without answering")
                logger.warning(
                    "replica %s closed a connection without answering; replaying %d bytes to the next replica",
                    b.addr,
                    exchange.buffered,
                )
        finally:
            await exchange.stop()
            await _close(client_w)


async def _close(w: asyncio.StreamWriter) -> None:
    w.close()
    with contextlib.suppress(OSError):
        await w.wait_closed()


class _Exchange:
    """One client connection's traffic across replica attempts. A pump copies client bytes to the current
    replica and, until the first reply byte (`committed`), keeps a copy for replay; more than `limit` bytes
    makes the connection unreplayable (the copy is dropped)."""

    def __init__(self, client_r: asyncio.StreamReader, limit: int) -> None:
        self.client_r, self.limit = client_r, limit
        self.replay: bytearray | None = bytearray()
        self.client_eof = False
        self.committed = False
        self.up_w: asyncio.StreamWriter | None = None
        self._pump: asyncio.Task | None = None

    @property
    def buffered(self) -> int:
        return len(self.replay) if self.replay is not None else 0

    def can_replay(self) -> bool:
        """A retry makes sense only for bytes the client sent that no replica answered."""
        return not self.committed and self.buffered > 0

    async def run(self, up_r: asyncio.StreamReader, up_w: asyncio.StreamWriter, client_w: asyncio.StreamWriter) -> bool:
        """Send what the client sent so far to this replica, then relay its reply to the client until it
        closes. Returns False iff the replica closed (or failed) before its first byte."""
        # No await between switching the writer and replaying: the pump's next chunk follows the replay.
        self.up_w = up_w
        if self.replay:
            up_w.write(bytes(self.replay))
        if self.client_eof and up_w.can_write_eof():
            up_w.write_eof()
        if self._pump is None:
            self._pump = asyncio.create_task(self._pump_client())
        try:
            first = await up_r.read(65536)
        except OSError:
            first = b""
        if not first:
            return False
        self.committed, self.replay = True, None
        client_w.write(first)
        with contextlib.suppress(OSError):
            await client_w.drain()
            await _pipe(up_r, client_w)
        return True

    async def _pump_client(self) -> None:
        try:
            while chunk := await self.client_r.read(65536):
                if self.replay is not None:
                    self.replay += chunk
                    if len(self.replay) > self.limit:
                        self.replay = None
                w = self.up_w
                w.write(chunk)
                with contextlib.suppress(OSError):  # a dead replica: the chunk is in the replay copy
                    await w.drain()
            self.client_eof = True
            if self.up_w.can_write_eof():
                self.up_w.write_eof()
        except (OSError, RuntimeError):
            pass

    async def stop(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
