"""The data-parallel load balancer (ttsserve/deploy/proxy.py) against fake replicas on loopback: least
connections, /ready probing, failover on a refused connect or a connection closed without an answer (the
request replayed), 503 when none is ready, unbuffered streaming.
Deterministic: the fake replicas are driven by events, not sleeps."""

from __future__ import annotations

import asyncio
import socket

import pytest

from ttsserve.deploy.proxy import Backend, LoadBalancer, pick_backend


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pick_backend_least_connections() -> None:
    bs = [
        Backend("h", 1, ready=True, active=2),
        Backend("h", 2, ready=True, active=1),
        Backend("h", 3, ready=False, active=0),
    ]
    assert pick_backend(bs) == 1  # the not-ready one never wins, even with 0 connections
    assert pick_backend(bs, exclude={1}) == 0
    assert pick_backend(bs, exclude={0, 1}) is None
    bs[0].active = 1
    bs[1].total = 5
    assert pick_backend(bs) == 0  # tie on active: the one used less in total
    assert pick_backend([Backend("h", 1)]) is None


class FakeReplica:
    """GET /ready -> 200 (or 503 when not ready). GET /stream -> a chunked body: chunk "<name>-1", then waits
    for `release`, then "<name>-2" and the end. GET /hold -> headers, then waits for `release`. With `drop`
    set it reads a request other than /ready and closes without a byte (a replica killed after accepting, its
    probe not yet failed), counting it in `dropped`; `requests` holds the raw heads of those it answered."""

    def __init__(self, name: str) -> None:
        self.name, self.port = name, _free_port()
        self.ready = True
        self.release = asyncio.Event()
        self.served = 0
        self.drop = False
        self.dropped = 0
        self.requests: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        line = await r.readline()
        head = line
        while (h := await r.readline()) not in (b"\r\n", b""):
            head += h
        path = line.split(b" ")[1]
        if path != b"/ready":
            if self.drop:
                self.dropped += 1
                w.close()
                return
            self.requests.append(head)
        if path == b"/ready":
            status = b"200 OK" if self.ready else b"503 Service Unavailable"
            w.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        else:
            self.served += 1
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            first = f"{self.name}-1".encode()
            w.write(b"%x\r\n%s\r\n" % (len(first), first))
            await w.drain()
            await self.release.wait()
            last = f"{self.name}-2".encode()
            w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last))
        await w.drain()
        w.close()


async def _open(port: int, path: str = "/stream") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    await w.drain()
    return r, w


async def _read_until(r: asyncio.StreamReader, needle: bytes, timeout: float = 5.0) -> bytes:
    buf = b""
    async with asyncio.timeout(timeout):
        while needle not in buf:
            chunk = await r.read(4096)
            if not chunk:
                break
            buf += chunk
    return buf


def _run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


async def _with_lb(test) -> None:
    reps = [FakeReplica("a"), FakeReplica("b")]
    for rep in reps:
        await rep.start()
    lb = LoadBalancer(
        "127.0.0.1", _free_port(), [Backend("127.0.0.1", rep.port) for rep in reps], probe_interval_s=0.05
    )
    await lb.start()
    try:
        await test(lb, reps)
    finally:
        for rep in reps:
            rep.release.set()
        await lb.stop()
        for rep in reps:
            if rep.server.is_serving():
                await rep.stop()


def test_streams_pass_through_unbuffered_and_spread_over_replicas() -> None:
    async def test(lb: LoadBalancer, reps: list[FakeReplica]) -> None:
        assert all(b.ready for b in lb.backends)
        # Two concurrent streams: least connections puts them on different replicas. Each replica holds its
        # stream open until released, so its first chunk can only reach us if the proxy forwards at once.
        r1, w1 = await _open(lb.port)
        head1 = await _read_until(r1, b"-1")
        r2, w2 = await _open(lb.port)
        head2 = await _read_until(r2, b"-1")
        names = {head1.split(b"-1")[0][-1:], head2.split(b"-1")[0][-1:]}
        assert names == {b"a", b"b"}
        assert [b.active for b in lb.backends] == [1, 1]
        for rep in reps:
            rep.release.set()
        tail1 = await _read_until(r1, b"0\r\n\r\n")
        assert tail1.endswith(b"-2\r\n0\r\n\r\n")
        await _read_until(r2, b"0\r\n\r\n")
        for w in (w1, w2):
            w.close()
        await asyncio.sleep(0.05)
        assert [b.active for b in lb.backends] == [0, 0]
        assert [rep.served for rep in reps] == [1, 1]

    _run(_with_lb(test))


def test_failover_when_a_replica_refuses_and_503_when_none_left() -> None:
    async def test(lb: LoadBalancer, reps: list[FakeReplica]) -> None:
        for rep in reps:
            rep.release.set()
        await reps[0].stop()  # crashed: connections refused, though the last probe said ready
        for _ in range(3):
            r, w = await _open(lb.port)
            body = await _read_until(r, b"0\r\n\r\n")
            assert b"b-1" in body and b"b-2" in body
            w.close()
        assert not lb.backends[0].ready and reps[1].served == 3
        await reps[1].stop()
        r, w = await _open(lb.port)
        body = await _read_until(r, b"}}")
        assert body.startswith(b"HTTP/1.1 503") and b"no_replica_ready" in body
        w.close()

    _run(_with_lb(test))


def test_a_request_a_replica_closed_unanswered_is_replayed_to_the_next() -> None:
    async def test(lb: LoadBalancer, reps: list[FakeReplica]) -> None:
        for rep in reps:
            rep.release.set()
        reps[0].drop = True  # accepts, reads, dies: the probe still says ready
        reps[1].drop = False
        for i in range(2):
            r, w = await asyncio.open_connection("127.0.0.1", lb.port)
            # The request arrives in two pieces, the second after the replica has seen the first.
            w.write(f"GET /stream?n={i} HTTP/1.1\r\n".encode())
            await w.drain()
            await asyncio.sleep(0.02)
            w.write(b"host: x\r\n\r\n")
            body = await _read_until(r, b"0\r\n\r\n")
            assert b"b-1" in body and b"b-2" in body
            w.close()
        assert [q.split(b"\r\n")[0] for q in reps[1].requests] == [
            b"GET /stream?n=0 HTTP/1.1",
            b"GET /stream?n=1 HTTP/1.1",
        ]
        assert all(q.endswith(b"host: x\r\n") for q in reps[1].requests)
        assert reps[0].requests == [] and reps[0].dropped >= 1

    _run(_with_lb(test))


def test_no_replay_past_the_limit() -> None:
    async def test(lb: LoadBalancer, reps: list[FakeReplica]) -> None:
        for rep in reps:
            rep.drop = True
        lb.replay_limit_bytes = 16
        r, w = await _open(lb.port, "/a-request-line-longer-than-sixteen-bytes")
        assert await _read_until(r, b"never") == b""  # closed, not retried, no 503 either
        w.close()
        assert sum(rep.dropped for rep in reps) == 1  # only the first replica saw it

    _run(_with_lb(test))


def test_ready_probe_takes_replicas_out_and_back() -> None:
    async def test(lb: LoadBalancer, reps: list[FakeReplica]) -> None:
        for rep in reps:
            rep.release.set()
        reps[0].ready = False  # e.g. still loading, or draining
        async with asyncio.timeout(5):
            while lb.backends[0].ready:
                await asyncio.sleep(0.02)
        for _ in range(2):
            r, w = await _open(lb.port)
            assert b"b-1" in await _read_until(r, b"0\r\n\r\n")
            w.close()
        reps[0].ready = True
        async with asyncio.timeout(5):
            while not lb.backends[0].ready:
                await asyncio.sleep(0.02)
        r, w = await _open(lb.port)
        assert b"a-1" in await _read_until(r, b"0\r\n\r\n")  # a: fewer served in total
        w.close()

    _run(_with_lb(test))


def test_load_balancer_needs_backends() -> None:
    with pytest.raises(ValueError, match="at least one backend"):
        LoadBalancer("127.0.0.1", 1, [])
