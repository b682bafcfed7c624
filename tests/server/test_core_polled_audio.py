"""The engine core hands out a deferred vocoder call's audio in mid-step once the device has it
(Engine.step(emit=...) -> poll_audio), instead of at the end of the step. The CUDA engine's mode is
forced on the CPU engine (off CUDA a call has no event, so every poll finds it done): the audio is the same
as the plain engine's and every call's audio leaves through the poll, once; the in-process AsyncEngine too."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from tests.server.conftest import REAL_ENGINE
from ttsserve.config import EngineConfig
from ttsserve.engine.core.async_engine import AsyncEngine
from ttsserve.engine.core.client import CoreClient
from ttsserve.engine.core.proc import EngineCoreProc
from ttsserve.engine.engine import Engine
from ttsserve.params import SamplingParams, SynthesisRequest

CUDA_SCHEDULE = dict(async_scheduling=True, num_scheduler_steps=8, vocoder_cadence=1, admission_interval=1)


def _requests() -> list[SynthesisRequest]:
    return [
        SynthesisRequest(
            f"Polled audio number {i}.",
            request_id=f"p{i}",
            code_params=SamplingParams(seed=i, min_new_tokens=40 + 9 * i, max_new_tokens=40 + 9 * i),
        )
        for i in range(4)
    ]


def _plain_audio() -> dict[str, np.ndarray]:
    eng = Engine(EngineConfig(**{**REAL_ENGINE, **CUDA_SCHEDULE}))
    audio: dict[str, list] = {}
    for req in _requests():
        eng.add_synthesis(req)
    while eng.has_unfinished():
        for out in eng.step():
            audio.setdefault(out.request_id, []).append(out.samples)
    return {rid: np.concatenate(a) for rid, a in audio.items()}


async def _generate_all(client) -> dict[str, np.ndarray]:
    await client.start()

    async def one(req):
        chunks = [out.samples async for out in client.generate(req)]
        return req.request_id, np.concatenate(chunks)

    got = dict(await asyncio.gather(*(one(r) for r in _requests())))
    await client.shutdown(1)
    return got


def _deferred_engine() -> Engine:
    engine = Engine(EngineConfig(**{**REAL_ENGINE, **CUDA_SCHEDULE}))
    engine.audio.deferred = True
    return engine


def _check(got: dict[str, np.ndarray], engine: Engine) -> None:
    want = _plain_audio()
    assert set(got) == set(want)
    for rid, audio in want.items():
        np.testing.assert_allclose(got[rid], audio, atol=1e-4, rtol=0)  # batching may move a sample by ~1e-7
    stats = engine.stats()
    assert stats["audio_collects_total"] > 4 and stats["audio_polled_total"] == stats["audio_collects_total"]


def test_core_hands_out_deferred_audio_in_mid_step(tmp_path):
    engine = _deferred_engine()
    core = EngineCoreProc(engine, f"ipc://{tmp_path}/core.sock", drain_timeout_s=5)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    try:
        got = asyncio.run(_generate_all(CoreClient(f"ipc://{tmp_path}/core.sock", 0)))
    finally:
        core.request_stop()
        loop.join(10)
    assert not loop.is_alive()
    _check(got, engine)


def test_async_engine_hands_out_deferred_audio_in_mid_step():
    engine = _deferred_engine()
    _check(asyncio.run(_generate_all(AsyncEngine(engine))), engine)
