"""DPClient (engine/core/dp_client.py): routing by outstanding work, prefix-cache affinity, and failure, over
stand-in core clients (the real ZMQ path is tests/deploy/test_deploy_data_parallel.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ttsserve.engine.core.dp_client import DPClient
from ttsserve.engine.errors import CoreUnreachableError, EngineDeadError, EngineOverloadedError
from ttsserve.engine.load import OutstandingWork, estimate_frames
from ttsserve.engine.synthesis import AudioOutput
from ttsserve.params import SamplingParams, SynthesisRequest, Voice


class StandInCore:
    """A CoreClient's routing surface: its reported stats, readiness, and a scripted generate."""

    def __init__(self, outstanding: int = 0) -> None:
        self.outstanding = outstanding
        self.unreported_frames = 0
        self.ready, self.dead, self.stalled, self.dead_reason = True, False, False, None
        self.fail_with: Exception | None = None  # raised before the first output
        self.got: list[str] = []

    def report(self, outstanding: int) -> None:
        """A stats report that counts every request sent so far."""
        self.outstanding, self.unreported_frames = outstanding, 0

    @property
    def outstanding_frames(self) -> int:
        return self.outstanding + self.unreported_frames

    def stats(self) -> dict:
        return {"outstanding_frames": self.outstanding, "num_streams": 0}

    def core_state(self, i: int) -> dict:
        return {"core": i, "ready": self.ready, "reason": self.dead_reason, "pid": None}

    async def generate(self, req, frames: int = 0):
        self.got.append(req.text)
        self.unreported_frames += frames
        if self.fail_with is not None:
            raise self.fail_with
        yield AudioOutput(req.request_id or "r", np.zeros(4, np.float32), True, finish_reason="stop")


def _dp(*cores: StandInCore) -> DPClient:
    dp = DPClient([f"ipc:///nowhere/{i}" for i in range(len(cores))])
    dp.clients = list(cores)
    return dp


def _req(text: str = "Hello there.", frames: int = 0, voice: Voice | None = None) -> SynthesisRequest:
    params = SamplingParams(min_new_tokens=frames, max_new_tokens=max(frames, 2048))
    return SynthesisRequest(text, voice=voice or Voice(), code_params=params)


def _send(dp: DPClient, req: SynthesisRequest) -> list[AudioOutput]:
    async def go():
        return [o async for o in dp.generate(req)]

    return asyncio.run(go())


def test_estimate_follows_text_length_and_the_frame_bounds() -> None:
    short, long = estimate_frames(_req("Hi.")), estimate_frames(_req("Hello there, " * 10 + "friend."))
    assert 1 <= short < long
    assert estimate_frames(_req("Hi.", frames=500)) == 500  # min_new_tokens is a floor
    assert estimate_frames(_req("你好" * 40)) > estimate_frames(_req("ab" * 40))  # CJK speaks slower per char


def test_outstanding_work_counts_down_with_delivered_audio() -> None:
    w = OutstandingWork()
    w.add("a", 100)
    w.add("b", 10)
    w.delivered("a", 512 * 30, finished=False)
    assert w.total == 80
    w.delivered("b", 512 * 50, finished=False)  # longer than its estimate: keeps one frame until it ends
    assert w.total == 71
    w.delivered("b", 0, finished=True)
    w.remove("a")
    assert w.total == 0 and len(w) == 0


def test_routes_to_the_least_outstanding_work_not_the_fewest_requests() -> None:
    busy, idle = StandInCore(outstanding=5000), StandInCore(outstanding=0)
    dp = _dp(busy, idle)
    for i in range(4):
        _send(dp, _req(f"request {i}."))
    assert busy.got == [] and len(idle.got) == 4


def test_requests_a_report_does_not_count_yet_count_until_one_does() -> None:
    a, b = StandInCore(), StandInCore()
    dp = _dp(a, b)
    long = _req("x", frames=1000)
    _send(dp, long)  # to a (tie: rotation); a's load is now 1000 in this server's view
    _send(dp, _req("y", frames=10))
    _send(dp, _req("z", frames=10))
    assert a.got == ["x"] and b.got == ["y", "z"]
    a.report(0)  # a report that counts it (and says it is done): the local charge is dropped
    b.report(500)
    _send(dp, _req("w", frames=10))
    assert a.got[-1] == "w"


def test_a_voice_with_an_audio_prompt_sticks_to_one_core_while_the_load_allows() -> None:
    cores = [StandInCore(), StandInCore(), StandInCore()]
    dp = _dp(*cores)
    voice = Voice(spk_smp=np.arange(8, dtype=np.int32).reshape(4, 2), txt_smp="a saved voice")
    for i in range(6):
        _send(dp, _req(f"sentence {i}.", voice=voice))
    counts = [len(c.got) for c in cores]
    assert sorted(counts) == [0, 0, 6], counts  # every request where the prompt's blocks are cached
    home = counts.index(6)
    cores[home].report(100_000)  # far past AFFINITY_SLACK of the others: spill over
    _send(dp, _req("spill.", voice=voice))
    assert cores[home].got[-1] != "spill."
    plain = [len(c.got) for c in cores]
    for i in range(6):  # a voice without an audio prompt has no blocks worth chasing: least load
        _send(dp, _req(f"plain {i}."))
    assert [len(c.got) for c in cores][home] == plain[home]


def test_a_request_no_core_admitted_goes_to_another_core() -> None:
    a, b = StandInCore(), StandInCore(outstanding=10)
    a.fail_with = CoreUnreachableError("the engine core process is gone")
    dp = _dp(a, b)
    outs = _send(dp, _req("hello."))
    assert outs[-1].finished and a.got == ["hello."] and b.got == ["hello."]


def test_a_full_core_passes_the_request_on() -> None:
    a, b = StandInCore(), StandInCore(outstanding=10)
    a.fail_with = EngineOverloadedError("too many requests in flight (64)")
    outs = _send(_dp(a, b), _req("hello."))
    assert outs[-1].finished and b.got == ["hello."]


def test_a_request_lost_with_its_core_is_not_retried() -> None:
    """Admitted, then the core died: it fails with 503 (it may be what killed the core)."""
    a, b = StandInCore(), StandInCore(outstanding=10)
    a.fail_with = EngineDeadError("the engine core process is gone")
    with pytest.raises(EngineDeadError):
        _send(_dp(a, b), _req("hello."))
    assert b.got == []


def test_cores_that_are_down_take_nothing_and_all_down_is_dead() -> None:
    a, b = StandInCore(), StandInCore(outstanding=10_000)
    a.ready, a.dead, a.dead_reason = False, True, "the engine core process is gone"
    dp = _dp(a, b)
    _send(dp, _req("hello."))
    assert a.got == [] and b.got == ["hello."]
    assert dp.ready and not dp.dead and [c["ready"] for c in dp.cores()] == [False, True]
    b.ready, b.dead, b.dead_reason = False, True, "stalled"
    assert dp.dead and "core 0" in dp.dead_reason and "core 1" in dp.dead_reason
    with pytest.raises(EngineDeadError):
        _send(dp, _req("hello."))


def test_stats_sum_counts_and_keep_each_core() -> None:
    a, b = StandInCore(outstanding=3), StandInCore(outstanding=4)
    st = _dp(a, b).stats()
    assert st["outstanding_frames"] == 7 and set(st["cores"]) == {"0", "1"}
    assert st["cores"]["1"]["outstanding_frames"] == 4
