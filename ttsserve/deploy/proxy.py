"""A small TCP (layer-4) load balancer for `ttsserve serve --data-parallel-size N`: least connections over
replicas that answer `/ready` 200, failover when a replica refuses the connection, bytes passed through
unbuffered in both directions (streamed audio reaches the client chunk by chunk).

Why layer 4: it cannot buffer, reorder or break HTTP (chunked streams, SSE, uploads, keep-alive all pass
through untouched), and it needs no HTTP parser. What it gives up: balancing is per client connection (an HTTP/1.1
client holds one connection per in-flight request, so this is least in-flight requests for the usual pooled
clients), and it cannot retry a request that a replica accepted and then failed. For per-request retries and
rate limits put nginx in front of the replica ports instead (deploy/nginx, docs/DEPLOY.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger("ttsserve.deploy.proxy")
_NO_REPLICA = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
               b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_NO_REPLICA_BODY = (b'{"error":{"message":"no replica is ready","type":"server_error","param":null,'
                    b'"code":"no_replica_ready"}}')


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
            logger.info("replica %s is %s%s", self.addr, "ready" if ready else "out of rotation",
                        f" ({why})" if why else "")
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
    except (OSError, asyncio.TimeoutError):
        return False
    try:
        writer.write(f"GET /ready HTTP/1.1\r\nhost: {b.addr}\r\nconnection: close\r\n\r\n".encode())
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), timeout)
        return status.split(b" ")[1:2] == [b"200"]
    except (OSError, asyncio.TimeoutError, IndexError):
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
    `probe_interval_s`. Use: `await lb.start()`, ..., `await lb.stop()`; or `await lb.serve_forever()`."""

    def __init__(self, host: str, port: int, backends: list[Backend], probe_interval_s: float = 1.0,
                 connect_timeout_s: float = 2.0) -> None:
        if not backends:
            raise ValueError("LoadBalancer: need at least one backend")
        self.host, self.port, self.backends = host, port, backends
        self.probe_interval_s, self.connect_timeout_s = probe_interval_s, connect_timeout_s
        self._server: asyncio.AbstractServer | None = None
        self._prober: asyncio.Task | None = None

    async def start(self) -> None:
        await self.probe_all()
        self._server = await asyncio.start_server(self._handle, self.host, self.port, reuse_address=True)
        self._prober = asyncio.create_task(self._probe_loop())
        logger.info("load balancer on %s:%d over %s", self.host, self.port,
                    ", ".join(b.addr for b in self.backends))

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

    async def _connect(self) -> tuple[Backend, asyncio.StreamReader, asyncio.StreamWriter] | None:
        """Connect to the best ready backend, failing over to the next on a refused or slow connect.
        Safe to retry: the client's bytes are read only after a backend accepted."""
        tried: set[int] = set()
        while (i := pick_backend(self.backends, tried)) is not None:
            tried.add(i)
            b = self.backends[i]
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection(b.host, b.port), self.connect_timeout_s)
                return b, r, w
            except (OSError, asyncio.TimeoutError) as e:
                b.set_ready(False, f"connect failed: {e!r}")
        return None

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        conn = await self._connect()
        if conn is None:
            client_w.write(_NO_REPLICA % (len(_NO_REPLICA_BODY), _NO_REPLICA_BODY))
            with contextlib.suppress(OSError):
                await client_w.drain()
            client_w.close()
            return
        b, up_r, up_w = conn
        b.active += 1
        b.total += 1
        # The replica's side decides when the exchange is over: a client that half-closes after its request
        # still gets the whole response; a replica that closes (done, or crashed) ends the client connection.
        to_replica = asyncio.create_task(_pipe(client_r, up_w))
        try:
            await _pipe(up_r, client_w)
        finally:
            to_replica.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await to_replica
            b.active -= 1
            for w in (up_w, client_w):
                w.close()
                with contextlib.suppress(OSError):
                    await w.wait_closed()
