"""50 concurrent streaming clients against the real engine: all succeed, and each one's audio is its solo
run's audio (same seed), i.e. continuous batching does not leak one request into another."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.server.helpers import same_audio

NUM_CLIENTS = 50
NUM_KINDS = 10  # 10 distinct (text, seed, voice) requests, each sent by 5 clients at once
TEXTS = [
    "Good morning.",
    "How are you today?",
    "The quick brown fox.",
    "Streaming audio works.",
    "One more sentence here.",
]


def _body(i: int) -> dict:
    k = i % NUM_KINDS
    return {
        "model": "tts-1",
        "input": TEXTS[k % len(TEXTS)],
        "voice": ["alloy", "echo"][k // len(TEXTS)],
        "seed": 1000 + k,
        "response_format": "pcm",
    }


async def _stream(client: httpx.AsyncClient, i: int) -> tuple[int, bytes, int, float]:
    t0 = time.perf_counter()
    chunks, ttfa = [], None
    async with client.stream("POST", "/v1/audio/speech", json=_body(i)) as r:
        async for chunk in r.aiter_bytes():
            ttfa = ttfa or time.perf_counter() - t0
            chunks.append(chunk)
        return r.status_code, b"".join(chunks), len(chunks), ttfa or 0.0


def test_50_concurrent_streams_equal_their_solo_runs(serve_real):
    srv, eng = serve_real()
    with srv.client() as c:  # solo runs, one at a time
        solo = {k: c.post("/v1/audio/speech", json=_body(k)).content for k in range(NUM_KINDS)}

    async def run_all():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 5)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_stream(client, i) for i in range(NUM_CLIENTS)))

    t0 = time.perf_counter()
    results = asyncio.run(run_all())
    wall = time.perf_counter() - t0
    assert [r[0] for r in results] == [200] * NUM_CLIENTS
    for i, (_, audio, _, _) in enumerate(results):
        assert len(audio) > 0 and same_audio(audio, solo[i % NUM_KINDS]), f"client {i} differs from its solo run"
    assert sum(r[2] > 1 for r in results) > NUM_CLIENTS // 2  # most arrived in several chunks
    assert len({solo[k] for k in range(NUM_KINDS)}) == NUM_KINDS  # the kinds really differ
    stats = eng.stats()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    print(f"\n50 concurrent streams: wall {wall:.2f} s, max TTFA {max(r[3] for r in results):.2f} s")
