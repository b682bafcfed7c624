"""`ttsserve bench serve`: an async HTTP load generator against a running server (httpx).

Load: a fixed number of concurrent clients (each sends its next request when the last one ends), or Poisson
arrivals at a target QPS (open loop). Each point is bounded by `num_requests` and by `duration` seconds.
Streaming requests ask for raw PCM by default (`response_format=pcm`: 16-bit little-endian mono), so received
bytes / 2 is exactly the number of samples; with `response_format=mp3` the samples are counted from the MP3
frame headers as they arrive (bench/mp3frames.py). Every chunk's arrival time is known:
- ttfa_s: send -> first audio byte; latency_s: send -> last byte.
- underruns: playback starts at the first byte and consumes 1 s of audio per second; a chunk that arrives
  after the received audio ran out is an underrun, and playback waits for it (stall_s adds the wait).
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import random
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ttsserve.bench.corpus import LANGS, LENGTHS, Sentence, select_texts
from ttsserve.bench.results import SAMPLE_RATE, RequestRecord, RunResult
from ttsserve.bench.server_metrics import parse_prometheus, server_figures
from ttsserve.constants import MODEL_NAME


@dataclass
class ServeSpec:
    """url: the server's base URL. endpoint: "speech" (/v1/audio/speech, OpenAI body) or "synthesize"
    (/synthesize). max_new_tokens: the frame cap per segment sent with every request (None: the server's).
    sample_rate: the PCM rate the server sends (24 kHz unless the request asks for another)."""

    url: str = "http://127.0.0.1:8000"
    endpoint: str = "speech"
    model: str = MODEL_NAME
    voice: str = "alloy"
    concurrency: Sequence[int] = ()
    qps: Sequence[float] = ()
    num_requests: int = 32
    duration: float = 120.0
    stream: bool = True
    max_new_tokens: int | None = 256
    seed: int = 0
    langs: Sequence[str] = LANGS
    text_lengths: Sequence[str] = LENGTHS
    timeout: float = 600.0
    allow_remote: bool = False
    sample_rate: int = SAMPLE_RATE
    response_format: str = "pcm"
    extra_body: dict = field(default_factory=dict)
    client_procs: int | None = None  # load-generator processes (bench/client_procs.py); None: auto_client_procs
    warmup_s: float = 0.0  # > 0: TTFA of the requests sent after this many seconds reported apart too

    def __post_init__(self) -> None:
        if self.response_format not in ("pcm", "mp3"):
            raise ValueError(
                f"response_format must be pcm|mp3 (the formats whose samples the client can count "
                f"as they arrive), got {self.response_format!r}"
            )
        if self.endpoint not in ("speech", "synthesize"):
            raise ValueError(f"endpoint must be speech|synthesize, got {self.endpoint!r}")
        if not self.concurrency and not self.qps:
            raise ValueError("give --concurrency and/or --qps")
        if any(c < 1 for c in self.concurrency) or any(not (q > 0) for q in self.qps):
            raise ValueError("concurrency values must be >= 1 and qps values > 0")
        if self.num_requests < 1 or not (self.duration > 0):
            raise ValueError("num_requests must be >= 1 and duration > 0")
        if not (0 <= self.warmup_s < self.duration):
            raise ValueError(f"warmup_s must be >= 0 and below duration ({self.duration:g}), got {self.warmup_s:g}")
        if self.client_procs is not None and self.client_procs < 1:
            raise ValueError(f"client_procs must be >= 1, got {self.client_procs}")
        check_loopback(self.url, self.allow_remote)

    @property
    def path(self) -> str:
        return "/v1/audio/speech" if self.endpoint == "speech" else "/synthesize"

    def body(self, text: str, index: int) -> dict:
        seed = self.seed * 1_000_003 + index
        if self.endpoint == "speech":
            body = {
                "model": self.model,
                "input": text,
                "voice": self.voice,
                "response_format": self.response_format,
                "stream_format": "audio",
                "seed": seed,
            }
        else:
            body = {
                "text": text,
                "voice": self.voice,
                "format": self.response_format,
                "stream": self.stream,
                "seed": seed,
            }
        if self.max_new_tokens is not None:
            body["max_new_tokens"] = self.max_new_tokens
        return body | self.extra_body


def check_loopback(url: str, allow_remote: bool) -> None:
    """ValueError unless `url` points at this machine (localhost, 127.0.0.0/8, ::1) or allow_remote is set:
    a load test must never hit someone else's server by accident."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be http(s)://host[:port], got {url!r}")
    if allow_remote or parts.hostname == "localhost":
        return
    try:
        if ipaddress.ip_address(parts.hostname).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"refusing to load-test non-loopback host {parts.hostname!r} (pass --allow-remote)")


class _Playback:
    """The underrun model of one stream (see the module docstring)."""

    def __init__(self, sample_rate: int) -> None:
        self.rate = sample_rate
        self.play_end: float | None = None  # when the audio received so far finishes playing
        self.underruns, self.stall_s = 0, 0.0

    def receive(self, t: float, samples: int) -> None:
        if samples <= 0:
            return
        if self.play_end is None:
            self.play_end = t
        elif t > self.play_end:
            self.underruns += 1
            self.stall_s += t - self.play_end
            self.play_end = t
        self.play_end += samples / self.rate


CLIENT_KEEPALIVE_S = 2.0


async def one_request(client, spec: ServeSpec, sentence: Sentence, index: int) -> RequestRecord:
    """Send one request and time its bytes; errors become a record with status set, never an exception."""
    import httpx

    rec = RequestRecord(f"serve-{index}", sentence.id, sent_at=time.time())
    play, count = _Playback(spec.sample_rate), _sample_counter(spec.response_format)
    t0 = time.perf_counter()
    try:
        # the id joins this record with the server's access log (admit_ms, ttfa_ms: benchmarks/ttfa_split.py)
        headers = {"x-request-id": rec.request_id}
        async with client.stream("POST", spec.path, json=spec.body(sentence.text, index), headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                rec.status, rec.latency_s = str(resp.status_code), time.perf_counter() - t0
                return rec
            async for chunk in resp.aiter_bytes():
                now = time.perf_counter() - t0
                n = count(chunk)
                if n and rec.ttfa_s is None:
                    rec.ttfa_s = now
                rec.num_samples += n
                if spec.stream:
                    play.receive(now, n)
    except httpx.TimeoutException:
        rec.status = "timeout"
    except httpx.HTTPError as e:
        rec.status = type(e).__name__
    rec.latency_s = time.perf_counter() - t0
    if not spec.stream and rec.status == "ok":
        rec.ttfa_s = rec.latency_s  # a non-streaming client has nothing to play before the whole file
    rec.underruns, rec.stall_s = play.underruns, play.stall_s
    rec.finish_reason = "stop" if rec.status == "ok" else None
    return rec


def _sample_counter(fmt: str):
    """bytes of a stream, in order -> samples they complete."""
    if fmt == "mp3":
        from ttsserve.bench.mp3frames import Mp3FrameCounter

        return Mp3FrameCounter().feed
    pending = b""

    def pcm(chunk: bytes) -> int:
        nonlocal pending
        pending += chunk
        n = len(pending) // 2
        pending = pending[2 * n :]
        return n

    return pcm


Items = list[tuple[int, Sentence]]  # (global request index, text): the index names the request and seeds it


class _Clients:
    """An httpx client for each request in flight, reused by the next request: one shared client's pool (httpcore)
    assigns every queued request by scanning every connection, which at 64 streams a process took most of the
    client's CPU (1.5 M idle checks over 256 requests under cProfile); a client here holds one connection."""

    def __init__(self, make) -> None:
        self._make, self._free, self._all = make, [], []

    async def send(self, spec: ServeSpec, sentence: Sentence, index: int) -> RequestRecord:
        client = self._free.pop() if self._free else self._new()
        try:
            return await one_request(client, spec, sentence, index)
        finally:
            self._free.append(client)

    def _new(self):
        self._all.append(self._make())
        return self._all[-1]

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._all))


async def _closed_loop(clients: _Clients, spec: ServeSpec, items: Items, concurrency: int, on_done) -> list:
    deadline = time.perf_counter() + spec.duration
    pending = iter(items)
    records: list[RequestRecord] = []

    async def worker() -> None:
        for i, sentence in pending:
            if time.perf_counter() >= deadline:
                return
            records.append(await clients.send(spec, sentence, i))
            on_done()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


async def _open_loop(clients: _Clients, spec: ServeSpec, items: Items, qps: float, seed: int, on_done) -> list:
    """Poisson arrivals at `qps` for spec.duration seconds. Each arrival time is the previous one plus a drawn
    gap (the first at the start), and each request is sent at its time, so the time a send takes never
    stretches the gaps: sleeping a drawn gap after each send lowered the offered rate by that time (400 req/s
    asked, 361 sent from 4 processes on an H100 host)."""
    rng = random.Random(seed)
    start = time.perf_counter()
    at, tasks = 0.0, []

    async def timed(i: int, sentence: Sentence) -> RequestRecord:
        rec = await clients.send(spec, sentence, i)
        on_done()
        return rec

    for i, sentence in items:
        if at >= spec.duration:
            break
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))  # 0: behind schedule, still yields
        tasks.append(asyncio.create_task(timed(i, sentence)))
        at += rng.expovariate(qps)
    return list(await asyncio.gather(*tasks))


async def drive_load(
    spec: ServeSpec, load_kind: str, load: float, items: Items, seed: int, on_done=lambda: None
) -> tuple[list[RequestRecord], float, float]:
    """Run one share of a load point from this process -> (records, the CPU this process used per wall
    second while it ran: 1.0 = one core busy, where one Python client stops keeping up, and the longest time
    its event loop was late: every request of the process waits that long, which TTFA then counts)."""
    import httpx

    # An idle connection is dropped by the client before any server's keep-alive timer can close it (uvicorn's
    # default is 5 s, as httpx's expiry): with equal timers a request sent as the server closes is reset.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=CLIENT_KEEPALIVE_S)
    cpu0, t0 = time.process_time(), time.perf_counter()
    stop = asyncio.Event()
    lag = asyncio.create_task(_loop_lag(stop))
    tls = ssl.create_default_context()  # one for every client: each would load the CA bundle (~30 ms) itself
    clients = _Clients(lambda: httpx.AsyncClient(base_url=spec.url, timeout=spec.timeout, limits=limits, verify=tls))
    try:
        if load_kind == "concurrency":
            records = await _closed_loop(clients, spec, items, int(load), on_done)
        else:
            records = await _open_loop(clients, spec, items, float(load), seed, on_done)
    finally:
        stop.set()  # the lag probe ends with the load, whatever ended it
        await clients.aclose()
    return records, (time.process_time() - cpu0) / max(time.perf_counter() - t0, 1e-9), await lag


LAG_TICK_S = 0.05


async def _loop_lag(stop: asyncio.Event) -> float:
    """The most a LAG_TICK_S sleep of this event loop overslept until `stop`: how long the loop was held
    (a busy or descheduled client). At 512 streams from 4 processes on an H100 host, one process's first
    chunks all arrived 2.5 s late while the server's logs showed no delay."""
    worst = 0.0
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(LAG_TICK_S)
        worst = max(worst, time.perf_counter() - t - LAG_TICK_S)
    return worst


async def _scrape(client) -> dict[str, float]:
    """Unlabelled and labelled samples of the server's /metrics ({} when it has none)."""
    try:
        resp = await client.get("/metrics", timeout=10.0)
    except Exception:  # a missing or failing /metrics must not fail the benchmark
        return {}
    return parse_prometheus(resp.text) if resp.status_code == 200 else {}


CLIENTS_PER_PROC = 32  # closed-loop streams one Python client process keeps up with (on the 16-core H200 host)
RATE_PER_PROC = 50.0  # open-loop arrivals a second per process: about as many streams at once (~1 s each)


def auto_client_procs(load_kind: str, load: float) -> int:
    """Client processes for a point when --client-procs is not given: one per 32 closed-loop streams or 50
    open-loop req/s, at most half this machine's cores (the server usually shares them). On an H200 host one
    process at 128 streams measured TTFA p99 7.3 s against 0.73 s for four; on an H100 host, four at 512 streams
    gave TTFA p99 1.07 s (one process's first chunks arrived together 2.5 s late, the server's logs showing no
    delay) where eight gave 0.41 s."""
    import os

    per_proc = CLIENTS_PER_PROC if load_kind == "concurrency" else RATE_PER_PROC
    return max(1, min(math.ceil(load / per_proc), (os.cpu_count() or 2) // 2))


async def run_point(spec: ServeSpec, load_kind: str, load: float, progress: bool = True) -> RunResult:
    """One load point: requests until num_requests or duration, with /metrics sampled twice a second. With
    more than one client process the load is spread over them (bench/client_procs.py)."""
    import httpx
    from tqdm import tqdm

    from ttsserve.bench.client_procs import drive_in_processes

    texts = select_texts(spec.num_requests, seed=spec.seed, langs=tuple(spec.langs), lengths=tuple(spec.text_lengths))
    items = list(enumerate(texts))
    procs = spec.client_procs or auto_client_procs(load_kind, load)
    async with httpx.AsyncClient(base_url=spec.url, timeout=spec.timeout) as client:
        before = await _scrape(client)
        samples: list[dict] = []
        stop = asyncio.Event()

        async def sampler() -> None:  # every 0.5 s while the load runs (not at its start, not after it)
            while True:
                try:
                    await asyncio.wait_for(stop.wait(), 0.5)
                    return
                except TimeoutError:
                    samples.append(await _scrape(client))

        sampler_task = asyncio.create_task(sampler())
        if procs == 1:
            bar = tqdm(total=len(texts), unit="req", disable=not progress, leave=False, desc=f"{load_kind} {load:g}")
            t0 = time.perf_counter()
            records, cpu, stall = await drive_load(spec, load_kind, load, items, spec.seed, lambda: bar.update(1))
            wall, client_cpu, client_stall = time.perf_counter() - t0, [cpu], [stall]
            bar.close()
        else:
            records, client_cpu, client_stall, wall = await drive_in_processes(spec, load_kind, load, items, procs)
        stop.set()
        await sampler_task
        after = await _scrape(client)
    figures = server_figures(samples, before, after, wall)
    mem = [v for k, v in figures["server_metrics_peak"].items() if "memory" in k and "bytes" in k]
    kv = [v for k, v in figures["server_metrics_peak"].items() if "kv_cache_usage" in k]
    return RunResult(
        "server",
        "serve",
        load_kind,
        load,
        wall,
        sorted(records, key=lambda r: r.request_id),
        peak_memory_bytes=int(max(mem)) if mem else None,
        memory_kind="server_metrics" if mem else None,
        kv_cache_usage_peak=max(kv) if kv else None,
        preemptions=figures["preemptions"],
        extra={
            "stream": spec.stream,
            "endpoint": spec.path,
            "client_cpu": client_cpu,
            "client_stall_s": client_stall,
            **({"warmup_s": spec.warmup_s} if spec.warmup_s else {}),
            **{k: v for k, v in figures.items() if k != "preemptions"},
        },
    )


def run_serving(spec: ServeSpec, progress: bool = True) -> list[RunResult]:
    """Every concurrency point, then every QPS point, in order."""
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the report
    points = [("concurrency", float(c)) for c in spec.concurrency] + [("qps", float(q)) for q in spec.qps]
    return [asyncio.run(run_point(spec, kind, load, progress)) for kind, load in points]
