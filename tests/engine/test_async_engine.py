"""AsyncEngine: concurrent streams, bad input raised before streaming, cancellation frees blocks, the loop
survives an internal failure."""

import asyncio

import numpy as np
import pytest

from ttsserve.config import EngineConfig
from ttsserve.engine.core.async_engine import AsyncEngine
from ttsserve.params import SamplingParams, SynthesisRequest


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine.from_config(
        EngineConfig(
            load_format="dummy",
            dummy_size="tiny",
            dtype="float32",
            device="cpu",
            kv_cache_memory=8 << 20,
            swap_space=0.01,
        )
    )
    return eng


def _req(i: int, frames: int = 12) -> SynthesisRequest:
    return SynthesisRequest(
        f"hello world number {i}",
        code_params=SamplingParams(seed=i, min_new_tokens=frames, max_new_tokens=frames),
        request_id=f"a{i}",
    )


async def _collect(eng: AsyncEngine, req: SynthesisRequest):
    chunks, final = [], None
    async for out in eng.generate(req):
        chunks.append(out.samples)
        if out.finished:
            final = out
    return np.concatenate(chunks), final


def test_concurrent_streams_equal_solo_runs(engine):
    async def main():
        await engine.start()
        solo = [await _collect(engine, _req(i)) for i in range(3)]
        together = await asyncio.gather(*[_collect(engine, _req(i)) for i in range(12)])
        return solo, together

    solo, together = asyncio.run(main())
    for i in range(3):
        # same codes; the batched vocoder may differ in the last float bits
        np.testing.assert_allclose(solo[i][0], together[i][0], atol=1e-5, rtol=0)
    for audio, final in together:
        assert final.finish_reason == "length" and final.num_frames == 12
        assert audio.size == 512 * 12 - 256


def test_bad_input_raises_before_streaming(engine):
    async def main():
        await engine.start()
        with pytest.raises(ValueError, match="speed"):
            await _collect(engine, SynthesisRequest("hi", code_prompt="[speed_12]"))
        with pytest.raises(ValueError, match="nothing speakable"):
            await _collect(engine, SynthesisRequest("???"))
        return await _collect(engine, _req(99))  # the loop still serves

    audio, final = asyncio.run(main())
    assert final.finish_reason == "length"


def test_cancel_frees_blocks(engine):
    async def main():
        await engine.start()
        gen = engine.generate(_req(5, frames=400))
        await gen.__anext__()  # the stream is running
        await gen.aclose()  # the client went away
        for _ in range(200):
            await asyncio.sleep(0.02)
            s = engine.stats()
            if s["num_running"] == 0 and s["num_free_blocks"] == s["num_blocks"] and s["num_streams"] == 0:
                return s
        return engine.stats()

    s = asyncio.run(main())
    assert s["num_running"] == 0 and s["num_free_blocks"] == s["num_blocks"]


def test_internal_failure_fails_requests_and_loop_survives(engine, monkeypatch):
    runner = engine.engine.runner
    real_launch = runner.launch
    calls = {"n": 0}

    def flaky(sched, requests):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated kernel failure")
        return real_launch(sched, requests)

    async def main():
        await engine.start()
        monkeypatch.setattr(runner, "launch", flaky)
        failed = await _collect(engine, _req(7))
        monkeypatch.setattr(runner, "launch", real_launch)
        ok = await _collect(engine, _req(8))
        return failed, ok

    (_, failed), (_, ok) = asyncio.run(main())
    assert failed.finish_reason == "error" and "simulated kernel failure" in failed.error
    assert ok.finish_reason == "length"
    s = engine.stats()
    assert s["num_free_blocks"] == s["num_blocks"]


def test_pipelined_engine_streams_equal_the_synchronous_engine(engine):
    """AsyncEngine over an engine with asynchronous scheduling: concurrent streams, one cancelled midway,
    and the rest equal the synchronous engine's audio; every block is back at the end."""
    piped = AsyncEngine.from_config(
        EngineConfig(
            load_format="dummy",
            dummy_size="tiny",
            dtype="float32",
            device="cpu",
            kv_cache_memory=8 << 20,
            swap_space=0.01,
            async_scheduling=True,
        )
    )
    assert piped.engine.pipelined

    async def cancelled(eng: AsyncEngine) -> None:
        async for _ in eng.generate(_req(50, frames=200)):
            break  # the consumer leaves after the first chunk: the engine aborts it

    async def main(eng: AsyncEngine):
        await eng.start()
        out = await asyncio.gather(*[_collect(eng, _req(i, frames=10 + 3 * i)) for i in range(6)], cancelled(eng))
        for _ in range(100):
            if not eng.engine.has_unfinished():
                break
            await asyncio.sleep(0.02)
        return out[:6]

    want = asyncio.run(main(engine))
    got = asyncio.run(main(piped))
    for (a, fa), (b, fb) in zip(want, got):
        assert fb.finish_reason == "length" and fb.num_frames == fa.num_frames
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    kv = piped.engine.kv_manager
    assert not piped.engine.has_unfinished() and kv.num_free_blocks == piped.engine.kv_spec.num_blocks
    asyncio.run(piped.shutdown(drain_timeout_s=1))


def test_a_dead_engine_thread_ends_streams_and_refuses_requests():
    """An exception that escapes the loop itself (not a step's) kills the engine for good: the stream in flight
    ends with an error output, later requests get EngineDeadError, `dead` says why."""
    from ttsserve.engine.errors import EngineDeadError

    eng = AsyncEngine.from_config(
        EngineConfig(
            load_format="dummy",
            dummy_size="tiny",
            dtype="float32",
            device="cpu",
            kv_cache_memory=8 << 20,
            swap_space=0.01,
        )
    )

    def broken() -> bool:
        raise RuntimeError("simulated loop bug")

    async def main():
        await eng.start()
        gen = eng.generate(_req(60, frames=400))
        await gen.__anext__()
        eng.core.busy = broken
        rest = [out async for out in gen]
        with pytest.raises(EngineDeadError, match="simulated loop bug"):
            await eng.generate(_req(61)).__anext__()
        return rest

    rest = asyncio.run(main())
    assert rest[-1].finished and rest[-1].finish_reason == "error" and "simulated loop bug" in rest[-1].error
    assert eng.dead and not eng.ready and "simulated loop bug" in eng.dead_reason
