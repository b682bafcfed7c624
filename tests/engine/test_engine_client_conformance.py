"""The EngineClient contract (engine/protocol.py), checked against every implementation: the in-process
AsyncEngine and a CoreClient of a real engine-core process, both on the tiny dummy model, and the server
tests' FakeEngine. Then the two real modes side by side: the same seeded request gives the same audio, and
the same bad input the same typed error."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import get_args

import numpy as np
import pytest

from tests.server.conftest import REAL_ENGINE
from tests.server.fake_engine import FakeEngine
from tests.server.multiproc_helpers import start_core, stop_process
from ttsserve.config import EngineConfig
from ttsserve.engine.errors import EngineOverloadedError, InvalidRequestError
from ttsserve.engine.protocol import EngineClient
from ttsserve.engine.synthesis import CROSSFADE_SAMPLES, AudioOutput, FinishReason
from ttsserve.params import SamplingParams, SynthesisRequest

QUEUE = 2  # max_queue_len of every implementation here
ENGINE = {**REAL_ENGINE, "max_queue_len": QUEUE}
LONG = SamplingParams(seed=1, min_new_tokens=3000, max_new_tokens=3000)  # runs until aborted
# what the server's metrics and the ops endpoints read
STATS_KEYS = {
    "num_running",
    "num_waiting",
    "num_swapped",
    "kv_cache_usage",
    "num_preemptions_total",
    "num_swaps_total",
    "step_time_ms_ema",
    "num_streams",
}
_indices = itertools.count(20)
_SENTENCE = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch and wonders whether the"
    " rain will come before the harvest is finished this year, because the clouds in the west look heavy and dark."
)
# three sentences too long to share a segment (text/split.py packs up to ~300 Latin characters)
MULTI = " ".join([_SENTENCE.replace("quick", "slow"), _SENTENCE, _SENTENCE.replace("fox", "cat")])


@pytest.fixture(scope="module")
def core_address(tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('conformance')}/core.sock"
    proc = start_core(address, max_queue_len=QUEUE)
    yield address
    assert stop_process(proc, timeout_s=10) == 0


@pytest.fixture(scope="module")
def local_engine():
    from ttsserve.engine.engine import Engine

    return Engine(EngineConfig(**ENGINE))


def _make(kind: str, request) -> EngineClient:
    if kind == "async_engine":
        from ttsserve.engine.core.async_engine import AsyncEngine

        return AsyncEngine(request.getfixturevalue("local_engine"))
    if kind == "core_client":
        from ttsserve.engine.core.client import CoreClient

        return CoreClient(request.getfixturevalue("core_address"), next(_indices))
    if kind == "dp_client":  # the data-parallel client over one core: the path of `serve --api-server-count`
        from ttsserve.engine.core.dp_client import DPClient

        return DPClient([request.getfixturevalue("core_address")], next(_indices))
    return FakeEngine(max_queue_len=QUEUE)


@pytest.fixture(params=["async_engine", "core_client", "dp_client", "fake"])
def make_client(request):
    return lambda: _make(request.param, request)


def run(client: EngineClient, body) -> object:
    """asyncio.run(body(client)) between the client's start and its shutdown."""

    async def main():
        await client.start()
        try:
            return await body(client)
        finally:
            await client.shutdown(1)

    return asyncio.run(main())


def _req(text: str = "Hello there.", seed: int = 3, rid: str | None = None, params: SamplingParams | None = None):
    return SynthesisRequest(text, code_params=params or SamplingParams(seed=seed, max_new_tokens=24), request_id=rid)


async def _collect(client: EngineClient, req: SynthesisRequest) -> tuple[np.ndarray, list[AudioOutput]]:
    outs = [out async for out in client.generate(req)]
    return np.concatenate([o.samples for o in outs]), outs


async def _idle(client: EngineClient, timeout_s: float = 10.0) -> dict:
    """The client's stats once nothing is in flight (the core's stats lag by up to ~0.05 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = client.stats()
        if (
            s["num_streams"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0
        ) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.02)


def test_is_an_engine_client_with_model_info(make_client):
    client = make_client()
    assert isinstance(client, EngineClient)

    async def body(c: EngineClient):
        assert c.ready and not c.dead and c.dead_reason is None
        assert c.model_name == "chattts" and c.sample_rate == 24000
        assert "KV cache" in c.memory_report()
        assert STATS_KEYS <= set(c.stats()), STATS_KEYS - set(c.stats())

    run(client, body)
    assert not client.ready


def test_profiling_off_is_an_invalid_request_on_every_client(make_client, monkeypatch):
    """Without $TTSSERVE_TORCH_PROFILER_DIR (engine/profiler.py) start / stop refuse with the typed error and its
    message, across the process boundary too; the client keeps serving."""
    monkeypatch.delenv("TTSSERVE_TORCH_PROFILER_DIR", raising=False)

    async def body(c: EngineClient):
        for call, needle in ((c.start_profile, "profiling is off"), (c.stop_profile, "not running")):
            with pytest.raises(InvalidRequestError, match=needle):
                await call()
        audio, _ = await _collect(c, _req())
        return audio

    assert run(make_client(), body).size > 0


def test_a_request_streams_audio_to_one_finished_output(make_client):
    async def body(c: EngineClient):
        audio, outs = await _collect(c, _req(rid="mine"))
        return audio, outs, await _idle(c)

    audio, outs, stats = run(make_client(), body)
    assert audio.dtype == np.float32 and audio.size > 0
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason in get_args(FinishReason) and outs[-1].num_frames > 0
    assert {o.request_id for o in outs} == {"mine"}  # the caller's id, whatever the client keys it by
    assert stats["num_streams"] == 0 and stats["num_running"] == 0


def _spans(outs: list[AudioOutput]) -> list[tuple[int, str, int, int]]:
    return [(s.index, s.text, s.start, s.end) for o in outs for s in o.segments]


def test_segment_spans_cover_the_audio_in_order(make_client):
    async def body(c: EngineClient):
        return await _collect(c, _req(MULTI, rid="spans"))

    audio, outs = run(make_client(), body)
    spans = _spans(outs)
    assert [i for i, *_ in spans] == list(range(len(spans))) and spans
    assert spans[0][2] == 0 and spans[-1][3] == audio.size
    for (_, _, s0, e0), (_, _, s1, e1) in itertools.pairwise(spans):
        assert s0 <= s1 <= e0 <= e1 and e0 - s1 <= CROSSFADE_SAMPLES  # contiguous up to the crossfade
    assert " ".join(t for _, t, *_ in spans).split() == MULTI.split()


@pytest.mark.parametrize(
    ("req", "param"),
    [
        (SynthesisRequest("???"), "text"),
        (SynthesisRequest("[laugh_0] !!"), "text"),
    ],
    ids=["punctuation", "only-tags"],
)
def test_bad_input_raises_invalid_request_before_any_output(make_client, req, param):
    async def body(c: EngineClient):
        gen = c.generate(req)
        with pytest.raises(InvalidRequestError) as info:
            await anext(gen)
        await _collect(c, _req())  # the engine still serves
        return info.value, await _idle(c)

    err, stats = run(make_client(), body)
    assert isinstance(err, ValueError) and err.param == param
    assert stats["num_streams"] == 0


def test_queue_full_raises_overloaded_and_closing_frees_the_requests(make_client):
    async def body(c: EngineClient):
        gens = [c.generate(_req(rid=f"long{i}", params=LONG)) for i in range(QUEUE)]
        for gen in gens:
            assert not (await anext(gen)).finished
        with pytest.raises(EngineOverloadedError):
            await anext(c.generate(_req()))
        for gen in gens:
            await gen.aclose()  # the consumer goes away: the request is aborted, its blocks freed
        idle = await _idle(c)
        _, outs = await _collect(c, _req())  # room again
        return idle, outs[-1]

    idle, final = run(make_client(), body)
    assert idle["num_streams"] == 0 and idle["num_running"] == 0 and idle["kv_cache_usage"] == 0
    assert final.finished and final.finish_reason != "error"


def test_abort_ends_the_stream_and_frees_the_request(make_client):
    async def body(c: EngineClient):
        gen = c.generate(_req(rid="victim", params=LONG))
        first = await anext(gen)
        await c.abort("victim")
        rest = [out async for out in gen]
        await c.abort("no-such-request")  # unknown ids: no-op
        return first, rest, await _idle(c)

    first, rest, idle = run(make_client(), body)
    assert not first.finished
    assert rest and rest[-1].finished and rest[-1].finish_reason == "abort" and rest[-1].request_id == "victim"
    assert idle["num_streams"] == 0 and idle["num_running"] == 0 and idle["kv_cache_usage"] == 0


def test_random_speaker_is_deterministic(make_client):
    async def body(c: EngineClient):
        a, b, other = c.random_speaker(7), c.random_speaker(7), c.random_speaker(8)
        with pytest.raises(ValueError):
            c.parse_speaker("not a speaker")
        return a, b, other

    a, b, other = run(make_client(), body)
    assert a.dtype == np.float16 and a.ndim == 1 and a.size > 0
    assert np.array_equal(a, b) and not np.array_equal(a, other)


# ---- the two real modes, side by side --------------------------------------------------------------------
def test_in_process_and_multiprocess_serve_the_same(local_engine, core_address):
    from ttsserve.engine.core.async_engine import AsyncEngine
    from ttsserve.engine.core.client import CoreClient

    bad = [
        SynthesisRequest("???"),
        SynthesisRequest("hi", code_prompt="[speed_12]"),
        SynthesisRequest("hi", refine_text=True, refine_prompt="[oral_2]x"),
    ]

    async def body(c: EngineClient):
        errors = []
        for req in bad:
            with pytest.raises(InvalidRequestError) as info:
                await anext(c.generate(req))
            errors.append((type(info.value), str(info.value), info.value.param))
        audio, outs = await _collect(c, _req("Hello there. It is 3 o'clock.", seed=11, rid="same"))
        _, multi = await _collect(c, _req(MULTI, seed=12))
        return errors, audio, outs[-1], c.random_speaker(5), _spans(multi)

    local = run(AsyncEngine(local_engine), body)
    remote = run(CoreClient(core_address, next(_indices)), body)
    assert local[0] == remote[0] and [p for *_, p in local[0]] == ["text", "code_prompt", "refine_prompt"]
    assert np.array_equal(local[1], remote[1])  # the same engine, the same bits
    for field in ("finish_reason", "num_frames", "truncated_segments", "dropped_chars", "request_id"):
        assert getattr(local[2], field) == getattr(remote[2], field), field
    assert np.array_equal(local[3], remote[3])
    assert local[4] == remote[4] and len(local[4]) == 3  # the same segments at the same samples
