"""Served throughput with the engine in the HTTP process (--api-server-count 0) against the engine core in its
own process and N API servers (--api-server-count N), through the real HTTP server.

Each point starts `ttsserve serve` on a free loopback port, waits until every API server answers /ready,
warms up with one round of requests, then runs `--concurrency` closed-loop clients for `--duration` seconds,
each streaming /v1/audio/speech in `--format` and reading every byte. Throughput is audio-seconds per second
from the server's own counter (ttsserve_audio_seconds_total, summed over API servers), over the wall time
between two scrapes; time to first audio is the client's (send -> first byte), p50 and p99. Seeded texts,
frame count fixed by min_new_tokens = max_new_tokens. Usage:

    python3 benchmarks/api_servers.py --counts 0,2 --concurrency 16 --duration 30 --format mp3 -- \
        --load-format dummy --dummy-size tiny --device cpu --kv-cache-memory 256MiB --swap-space 0
    python3 benchmarks/api_servers.py --encoders    # how fast one core encodes each format (x real time)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _audio_seconds(url: str) -> float:
    m = re.search(r"^ttsserve_audio_seconds_total (\S+)$", httpx.get(url + "/metrics", timeout=30).text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait_ready(url: str, proc: subprocess.Popen, count: int, timeout_s: float = 600) -> None:
    seen, deadline = set(), time.monotonic() + timeout_s
    while len(seen) < max(count, 1):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not become ready (exit {proc.poll()})")
        try:
            r = httpx.get(url + "/ready", timeout=2)
            if r.status_code == 200:
                seen.add(r.headers.get("x-api-server", "single"))
                continue
        except httpx.TransportError:
            pass
        time.sleep(0.2)


async def _client(c: httpx.AsyncClient, body: dict, stop_at: float, ttfa: list[float], seed: int) -> int:
    done = 0
    while time.monotonic() < stop_at:
        t0 = time.perf_counter()
        first = None
        async with c.stream("POST", "/v1/audio/speech", json={**body, "seed": seed + done}) as r:
            r.raise_for_status()
            async for chunk in r.aiter_bytes():
                if first is None and chunk:
                    first = time.perf_counter() - t0
        ttfa.append(first or 0.0)
        done += 1
    return done


async def _load(url: str, a: argparse.Namespace, duration: float) -> tuple[int, list[float]]:
    body = {
        "model": "tts-1",
        "input": "The quick brown fox jumps over the lazy dog.",
        "voice": "alloy",
        "response_format": a.format,
        "min_new_tokens": a.frames,
        "max_new_tokens": a.frames,
    }
    ttfa: list[float] = []
    limits = httpx.Limits(max_connections=a.concurrency * 2, max_keepalive_connections=0)  # a connection each
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        stop_at = time.monotonic() + duration
        counts = await asyncio.gather(*[_client(c, body, stop_at, ttfa, 1000 * i) for i in range(a.concurrency)])
    return sum(counts), ttfa


def run_point(count: int, a: argparse.Namespace) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "ttsserve.entrypoints.serve",
        *a.serve_flags,
        "--port",
        str(port),
        "--api-server-count",
        str(count),
        "--voices-db",
        ":memory:",
        "--max-new-tokens",
        str(a.frames),
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TTSSERVE_CPU_COMPILE": os.environ.get("TTSSERVE_CPU_COMPILE", "0")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(url, proc, count)
        asyncio.run(_load(url, a, 0.1))  # warm-up: one request per client
        before, t0 = _audio_seconds(url), time.perf_counter()
        n, ttfa = asyncio.run(_load(url, a, a.duration))
        wall, after = time.perf_counter() - t0, _audio_seconds(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {
        "api_server_count": count,
        "concurrency": a.concurrency,
        "format": a.format,
        "frames": a.frames,
        "requests": n,
        "wall_s": round(wall, 2),
        "audio_s_per_s": round((after - before) / wall, 2),
        "ttfa_p50_s": round(float(np.percentile(ttfa, 50)), 3),
        "ttfa_p99_s": round(float(np.percentile(ttfa, 99)), 3),
    }


def encoder_speeds(seconds: float = 30.0, chunk: int = 2048) -> dict[str, float]:
    """x real time of one StreamingEncoder per format on one core, fed `chunk`-sample pieces as a stream is."""
    from ttsserve.audio.encode import StreamingEncoder

    rng = np.random.default_rng(0)
    n = int(24000 * seconds)
    x = (0.3 * np.sin(np.arange(n) / 7) + 0.01 * rng.standard_normal(n)).astype(np.float32)
    speeds = {}
    for fmt in ("mp3", "opus", "aac", "flac", "wav", "pcm"):
        best = float("inf")
        for _ in range(2):
            enc = StreamingEncoder(fmt, 24000, input_rate=24000)
            t0 = time.perf_counter()
            for i in range(0, n, chunk):
                enc.write(x[i : i + chunk])
            enc.close()
            best = min(best, time.perf_counter() - t0)
        speeds[fmt] = round(seconds / best, 1)
    return speeds


def main() -> None:
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="0,2", help="--api-server-count values, e.g. 0,2,4")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load per point")
    ap.add_argument("--format", default="mp3")
    ap.add_argument("--frames", type=int, default=96, help="frames per request (96 = 2.05 s of audio)")
    ap.add_argument("--encoders", action="store_true", help="only time the container encoders on one core")
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if a.encoders:
        print(json.dumps({"x_real_time_per_core": encoder_speeds()}))
        return
    a.serve_flags = serve_flags
    rows = [run_point(int(n), a) for n in a.counts.split(",")]
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
