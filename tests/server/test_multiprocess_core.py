"""The engine core in its own process and CoreClients talking to it over ZMQ (no HTTP): the wire format,
errors crossing the boundary with their messages, the global queue bound, aborts freeing KV blocks, API
servers that vanish or restart, and a core that dies under its clients."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import numpy as np
import pytest

from tests.server.multiproc_helpers import start_core, stop_process
from ttsserve.engine.core.client import CoreClient
from ttsserve.engine.core.messages import (
    CoreOutputs,
    ErrorInfo,
    RequestOutput,
    SegmentMsg,
    SynthesisMsg,
    core_decoder,
    decode_synthesis,
    encoder,
)
from ttsserve.engine.errors import EngineDeadError, EngineOverloadedError
from ttsserve.engine.synthesis import AudioOutput, SegmentSpan
from ttsserve.params import SamplingParams, SynthesisRequest, Voice

LONG = SamplingParams(seed=1, min_new_tokens=3000, max_new_tokens=3000)  # runs until aborted


def _req(text: str = "Hello there.", seed: int = 3, rid: str | None = None, params: SamplingParams | None = None):
    return SynthesisRequest(text, code_params=params or SamplingParams(seed=seed, max_new_tokens=24), request_id=rid)


async def _collect(client: CoreClient, req: SynthesisRequest) -> tuple[np.ndarray, AudioOutput]:
    chunks, final = [], None
    async for out in client.generate(req):
        chunks.append(out.samples)
        final = out
    return np.concatenate(chunks), final


async def _until(pred, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred():
            return True
        await asyncio.sleep(0.02)
    return await pred()


async def _idle(client: CoreClient) -> bool:
    stats = await client.call("stats")
    return stats["num_syntheses"] == 0 and stats["num_running"] == 0 and stats["kv_cache_usage"] == 0


@pytest.fixture(scope="module")
def core_address(tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('core')}/core.sock"
    proc = start_core(address, max_queue_len=2)
    yield address
    assert stop_process(proc, timeout_s=10) == 0  # SIGTERM: a clean, prompt exit


def test_wire_format_round_trips():
    voice = Voice(
        spk_emb=np.arange(8, dtype=np.float16),
        spk_smp=np.arange(12, dtype=np.int32).reshape(4, 3),
        txt_smp="the transcript",
        name="v",
    )
    req = SynthesisRequest(
        "text",
        voice,
        SamplingParams(temperature=(0.1, 0.2, 0.3, 0.4), seed=5),
        refine_text=True,
        refine_prompt="[oral_2]",
        code_prompt="[speed_3]",
        normalize=False,
        request_id="r",
    )
    back = decode_synthesis(encoder.encode(SynthesisMsg.of(req)))
    assert back.voice.spk_emb.dtype == np.float16 and np.array_equal(back.voice.spk_emb, voice.spk_emb)
    assert back.voice.spk_smp.shape == (4, 3) and np.array_equal(back.voice.spk_smp, voice.spk_smp)
    assert back.voice.key == voice.key  # the prefix cache sees the same voice
    assert back == SynthesisRequest(
        back.text,
        back.voice,
        *[
            getattr(req, f)
            for f in (
                "code_params",
                "refine_text",
                "refine_params",
                "refine_prompt",
                "code_prompt",
                "normalize",
                "split",
                "raw_text",
                "request_id",
            )
        ],
    )
    bad = msgspec.structs.replace(SynthesisMsg.of(req), code_params={"temperature": -1.0})
    with pytest.raises(ValueError, match="temperature must be > 0"):  # the dataclass checks run in the core
        decode_synthesis(encoder.encode(bad))
    from ttsserve.engine.core.messages import AddRequest, client_decoder

    add = AddRequest("r", msgspec.Raw(encoder.encode(SynthesisMsg.of(req))), [SegmentMsg("a b", ["#"])])
    back_add = client_decoder.decode(encoder.encode(add))
    again_req = decode_synthesis(back_add.request)
    assert back_add.segments == [SegmentMsg("a b", ["#"])]
    assert again_req.text == req.text and again_req.voice.key == voice.key
    assert client_decoder.decode(encoder.encode(AddRequest("r", add.request))).segments is None
    from ttsserve.text.segments import Segment

    ids = np.array([3, 70000, 1], np.int32)
    with_ids = AddRequest("r", add.request, [SegmentMsg.of(Segment(0, "a", [], ids))])
    back_seg = client_decoder.decode(encoder.encode(with_ids)).segments[0].segment(0)
    assert back_seg.code_ids.dtype == np.int32 and back_seg.code_ids.tolist() == [3, 70000, 1]
    assert SegmentMsg.of(Segment(0, "a", ["#"])) == SegmentMsg("a", ["#"])
    assert back_add.segments[0].segment(0).code_ids is None
    with pytest.raises(ValueError, match="segment 2: code_ids has 5 bytes, not whole int32 values"):
        SegmentMsg("a", [], b"12345").segment(2)
    out = AudioOutput("r", np.linspace(-1, 1, 7, dtype=np.float32), True, 3, "length", [1], None, ["#"])
    again = RequestOutput.of(out).output()
    assert (
        np.array_equal(again.samples, out.samples) and again.truncated_segments == [1] and again.dropped_chars == ["#"]
    )
    out.segments = [SegmentSpan(0, "a b", 0, 4), SegmentSpan(1, "c", 2, 7)]
    assert (
        core_decoder.decode(encoder.encode(CoreOutputs(outputs=[RequestOutput.of(out)]))).outputs[0].output().segments
        == out.segments
    )
    # an output encoded without the trailing segments field (an older core) still decodes, with none
    old = encoder.encode(CoreOutputs(outputs=[RequestOutput.of(out)]))
    legacy = msgspec.msgpack.decode(old)
    legacy["outputs"][0] = legacy["outputs"][0][:-1]
    assert core_decoder.decode(encoder.encode(legacy)).outputs[0].output().segments == []
    assert isinstance(ErrorInfo.of(ValueError("v")).exception(), ValueError)
    assert isinstance(ErrorInfo.of(EngineOverloadedError("o")).exception(), EngineOverloadedError)
    assert str(ErrorInfo.of(KeyError("k")).exception()) == "KeyError: 'k'"


def test_generate_errors_and_utilities_cross_the_boundary(core_address):
    from tests.server.conftest import make_real_engine

    async def main():
        client = CoreClient(core_address, 0)
        await client.start()
        assert client.ready and client.sample_rate == 24000 and "KV cache:" in client.memory_report()
        assert client.segment_msgs(_req())[0].code_ids is not None  # the ids below come from this process
        audio, final = await _collect(client, _req(rid="same"))
        assert final.finished and final.finish_reason == "length" and final.request_id == "same"
        with pytest.raises(ValueError, match="nothing speakable"):
            await _collect(client, _req("!!!"))
        assert np.array_equal(client.random_speaker(7), await client.call("random_speaker", 7))
        with pytest.raises(ValueError):
            client.parse_speaker("not a speaker")
        with pytest.raises(ValueError):
            await client.call("parse_speaker", "not a speaker")
        with pytest.raises(ValueError, match="unknown utility"):
            await client.call("no_such_method")
        wav = (0.1 * np.sin(np.arange(24000) / 10)).astype(np.float32)
        codes = await asyncio.to_thread(client.encode_reference_audio, wav, 24000)  # a worker thread, as the app
        assert codes.dtype == np.int32 and codes.shape[0] == 4 and codes.shape[1] > 0
        with pytest.raises(RuntimeError, match="worker thread"):
            client.encode_reference_audio(wav, 24000)
        await client.shutdown(1)
        return audio, codes

    audio, codes = asyncio.run(main())
    local = make_real_engine()

    async def single_process():
        await local.start()
        out, _ = await _collect(local, _req(rid="same"))
        await local.shutdown(1)
        return out

    assert np.array_equal(audio, asyncio.run(single_process()))  # the same engine, the same bits
    assert np.array_equal(
        codes, local.encode_reference_audio((0.1 * np.sin(np.arange(24000) / 10)).astype(np.float32), 24000)
    )


def test_api_server_tokenizes_as_the_core_and_bad_ids_are_rejected_by_id(core_address, monkeypatch):
    """The client tokenizes with the tokenizer from the core's CoreInfo: the ids the core's own front end
    makes (voices with and without a speaker, with an audio prompt; none with refine_text). Malformed ids
    are the caller's ValueError, rejected by id, and the core keeps serving."""
    from tests.server.conftest import REAL_ENGINE
    from ttsserve.config import EngineConfig
    from ttsserve.engine.frontend import FrontEnd
    from ttsserve.model.chattts import load_model

    model = load_model(EngineConfig(**REAL_ENGINE))  # the same dummy checkpoint the core built
    front = FrontEnd(model.tokenizer, model.gpt_config.num_vq)
    spk = np.random.default_rng(0).standard_normal(model.hidden_size).astype(np.float16)
    voices = [Voice(), Voice(spk_emb=spk), Voice(spk_emb=spk, spk_smp=np.ones((4, 3), np.int32), txt_smp="said so")]
    text = "Hello there, it is 3 o'clock. " + "这是一个很长的句子它包含了很多很多的汉字目的是让提示词变长。" * 4

    async def main():
        client = CoreClient(core_address, 6)
        await client.start()
        try:
            await checks(client)
        finally:
            await client.shutdown(1)

    async def checks(client: CoreClient):
        for voice in voices:
            req = SynthesisRequest(text, voice, code_prompt="[speed_2]")
            msgs = client.segment_msgs(req)
            assert len(msgs) >= 2
            for i, m in enumerate(msgs):
                ids, mask = front.code_inputs(m.text, req.code_prompt, voice)
                assert m.segment(i).code_ids.tolist() == ids[: int(mask.sum()), 0].tolist()
        assert all(m.code_ids is None for m in client.segment_msgs(SynthesisRequest(text, refine_text=True)))
        vocab = model.tokenizer.vocab_size
        bad = {
            b"": "segment 0: code_ids must be a non-empty",
            b"123": "not whole int32 values",
            np.array([1, vocab], "<i4").tobytes(): "segment 0: code_ids hold ids outside the text vocabulary",
        }
        for payload, match in bad.items():
            monkeypatch.setattr(client, "segment_msgs", lambda req: [SegmentMsg("hello", [], payload)])
            with pytest.raises(ValueError, match=match):
                await _collect(client, _req(rid="bad"))
        monkeypatch.undo()
        assert (await _collect(client, _req(rid="bad")))[1].finished  # the same id, now fine: the core serves on
        assert await _until(lambda: _idle(client))

    asyncio.run(main())


def test_client_warms_the_text_path_with_the_core_tokenizer_before_it_is_ready(core_address, monkeypatch):
    """An API server's first request must not pay the normalizer's imports on its event loop (0.33 s measured,
    queueing all of a burst's first requests behind it): start() runs the text path once, tokenizer included."""
    import ttsserve.engine.input_processor as processor_mod

    seen = []
    real = processor_mod.warm_up_text_path
    monkeypatch.setattr(processor_mod, "warm_up_text_path", lambda tok: seen.append((tok, real(tok))) or 0.0)

    async def main():
        client = CoreClient(core_address, 9)
        assert not client.ready
        await client.start()
        try:
            assert client.ready and len(seen) == 1
            tok, _ = seen[0]
            assert tok is not None and tok is client.processor.tokenizer
        finally:
            await client.shutdown(1)

    asyncio.run(main())


def test_two_clients_share_one_core_and_its_queue_bound(core_address):
    async def main():
        a, b = CoreClient(core_address, 1), CoreClient(core_address, 2)
        await a.start()
        await b.start()
        solo = await _collect(a, _req(seed=11))
        # the same X-Request-ID reaching two API servers is two requests, not a clash
        together = await asyncio.gather(_collect(a, _req(seed=11, rid="x")), _collect(b, _req(seed=12, rid="x")))
        # batched float math may move a sample by ~1e-7 (tests/server/helpers.py: SAME_AUDIO_LSB)
        assert np.abs(together[0][0] - solo[0]).max() < 1e-4 and not np.allclose(together[1][0], solo[0], atol=1e-2)
        # max_queue_len=2 holds across API servers: two long requests through `a` fill the core
        long_a = [a.generate(_req(rid=f"long{i}", params=LONG)) for i in range(2)]
        for gen in long_a:
            await anext(gen)
        with pytest.raises(EngineOverloadedError, match="too many requests"):
            await anext(b.generate(_req()))
        for gen in long_a:
            await gen.aclose()  # the consumer goes away: the core aborts and frees the blocks
        assert await _until(lambda: _idle(b))
        assert (await _collect(b, _req()))[1].finished
        await a.shutdown(1)
        await b.shutdown(1)

    asyncio.run(main())


def test_vanished_or_restarted_api_server_loses_its_requests(core_address):
    async def main():
        gone = CoreClient(core_address, 3)
        await gone.start()
        await anext(gone.generate(_req(params=LONG)))
        await _crash(gone)  # no abort ever comes; the core's next send finds nobody
        watcher = CoreClient(core_address, 4)
        await watcher.start()
        assert await _until(lambda: _idle(watcher))
        first = CoreClient(core_address, 5)
        await first.start()
        await anext(first.generate(_req(params=LONG)))
        first._tasks[0].cancel()  # a hung process: its connection stays up, so only a new Hello can tell
        restarted = CoreClient(core_address, 5)
        await restarted.start()  # the same identity takes over and says Hello: the old requests are aborted
        assert await _until(lambda: _idle(watcher))
        await _crash(first)
        await watcher.shutdown(1)
        await restarted.shutdown(1)

    asyncio.run(main())


def test_core_death_fails_in_flight_requests_and_a_new_core_is_reconnected(tmp_path):
    address = f"ipc://{tmp_path}/core.sock"
    procs = [start_core(address)]

    async def main():
        client = CoreClient(address, 0)
        await client.start()
        gen = client.generate(_req(params=LONG))
        await anext(gen)
        os.kill(procs[0].pid, signal.SIGKILL)
        final = await asyncio.wait_for(_last(gen), 10)
        assert final.finished and final.finish_reason == "error" and "engine core" in final.error
        assert client.dead and not client.ready and client.stats() == {"num_streams": 0}
        with pytest.raises(EngineDeadError, match="engine core"):
            await anext(client.generate(_req()))
        with pytest.raises(RuntimeError, match="engine core"):
            await client.call("stats")
        # the launcher's new core at the same address: the client says hello again and serves
        procs.append(await asyncio.to_thread(start_core, address))

        async def back() -> bool:
            return client.ready

        assert await _until(back, 20)
        assert not client.dead and client.dead_reason is None
        samples, final = await _collect(client, _req())
        assert final.finish_reason in ("stop", "length") and samples.size
        await asyncio.wait_for(client.shutdown(5), 5)

    try:
        asyncio.run(main())
    finally:
        for proc in procs:
            stop_process(proc)


def test_a_stopped_core_is_stalled_for_its_clients_until_it_turns_again(tmp_path):
    address = f"ipc://{tmp_path}/core.sock"
    proc = start_core(address)

    async def main():
        client = CoreClient(address, 0, stall_timeout_s=1.0)
        await client.start()
        await asyncio.sleep(1.5)  # idle: the core's heartbeats keep it alive
        assert client.ready and not client.dead
        os.kill(proc.pid, signal.SIGSTOP)
        try:

            async def stalled() -> bool:
                return client.stalled

            assert await _until(stalled, 5)
            assert "stalled" in client.dead_reason and not client.ready
            with pytest.raises(EngineDeadError, match="stalled"):
                await anext(client.generate(_req()))
        finally:
            os.kill(proc.pid, signal.SIGCONT)

        async def alive() -> bool:
            return client.ready

        assert await _until(alive, 5)
        await client.shutdown(5)

    try:
        asyncio.run(main())
    finally:
        stop_process(proc)


async def _crash(client: CoreClient) -> None:
    """What a killed API-server process leaves behind: a closed connection and nothing else."""
    for t in client._tasks:
        t.cancel()
    await asyncio.gather(*client._tasks, return_exceptions=True)
    client._ctx.destroy(linger=0)


async def _last(gen):
    out = None
    async for out in gen:  # noqa: B007 (the last output is read after the loop)
        pass
    return out
