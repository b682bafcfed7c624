"""The streaming stages' device side: a deferred stage hands out the calls the device has finished (a fake
event stands in for CUDA's on the CPU), and on CUDA a stage streams what the CPU's does."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from audio_stage_testutil import STAGES, joined, one_shot, random_nets, stream
from audio_stage_testutil import tiny as tiny  # a fixture, used by name

from ttsserve.audio.incremental_stage import IncrementalAudioStage
from ttsserve.audio.stage import AudioChunk


@pytest.mark.gpu
@pytest.mark.parametrize("own_stream", [False, True])
@pytest.mark.parametrize("stage_cls", STAGES)
def test_cuda_stage_matches_cpu(tiny, stage_cls, own_stream) -> None:
    """own_stream: the stage's device work on a CUDA stream of its own (use_own_stream), the frames appended
    from the caller's stream."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    dec, _, vocos = random_nets(12, hidden=768, dec_dim=512, dec_layers=12, voc_dim=512, voc_layers=8)
    frames = torch.randn(300, 768, generator=torch.Generator().manual_seed(13))
    ref = one_shot(dec, vocos, frames)
    dec_c, voc_c = copy.deepcopy(dec).cuda(), copy.deepcopy(vocos).cuda()
    stage = stage_cls(dec_c, None, voc_c, deferred=True)
    assert stage.device.type == "cuda"
    if own_stream:
        stage.use_own_stream()
        assert stage.stream is not None and stage.stream != torch.cuda.current_stream()
    wav = joined(stream(stage, "r", frames.cuda(), [1] * 300))
    assert np.abs(wav - ref).max() < 1e-4 * max(1.0, float(np.abs(ref).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("defer", [False, True])
def test_cuda_early_chunk_graphs_match_cpu(defer) -> None:
    """The early chunks' CUDA graphs (fp16 networks as the engine runs them, row buckets padded; deferred: the
    largest buckets first, the rest captured between steps while streams run) stream what the CPU's exact
    stage with the same early chunks streams, within fp16's error."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dec, _, vocos = random_nets(12, hidden=768, dec_dim=512, dec_layers=12, voc_dim=512, voc_layers=8)
    frames = torch.randn(3, 200, 768, generator=torch.Generator().manual_seed(14))
    kw = dict(first_chunk_frames=8, first_chunk_lookahead=16)
    wavs = {}
    for dev in ("cpu", "cuda"):
        d, v = copy.deepcopy(dec).to(dev), copy.deepcopy(vocos).to(dev)
        net = torch.float16 if dev == "cuda" else None
        stage = IncrementalAudioStage(d, None, v, deferred=dev == "cuda", net_dtype=net, **kw)
        stage.enable_cuda_graphs(4, defer=defer)
        got = {f"r{i}": [] for i in range(3)}
        for k in got:
            stage.add_request(k)
        for t in range(200):
            if t == 30:  # after the first early chunks, before the last (the engine syncs before a capture)
                torch.cuda.synchronize()
                for family in stage.graph_families():
                    while family.num_pending:
                        family.capture_next()
            stage.append_batch(list(got), frames[:, t].to(dev))
            if t == 199:
                for k in got:
                    stage.finish(k)
            for ch in stage.step():
                got[ch.req_id].append(ch)
        for ch in stage.flush():
            got[ch.req_id].append(ch)
        assert stage.early.decoder.calls >= 1 and len(got["r0"][0].samples) == 8 * 512
        wavs[dev] = {k: joined(v) for k, v in got.items()}
    for k, ref in wavs["cpu"].items():  # fp16 networks: 0.22 % relative L2 error on the waveform (stage_factory.py)
        assert np.linalg.norm(wavs["cuda"][k] - ref) / np.linalg.norm(ref) < 1e-2, k


class _FakeEvent:
    """A device call's completion the test controls: query() is True once done; synchronize() completes it."""

    def __init__(self) -> None:
        self.done, self.waited = False, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = self.waited = True


@pytest.mark.parametrize(
    "stage_cls",
    [*STAGES, functools.partial(IncrementalAudioStage, first_chunk_lookahead=3)],
    ids=["windowed", "incremental", "incremental-early-first-chunk"],
)
def test_deferred_calls_are_read_back_when_finished_without_waiting(tiny, stage_cls) -> None:
    """A deferred stage never waits for a call the device is still running (that wait held the served engine's
    host loop for the vocoder's device time every step): step() and poll() hand out the finished calls in
    launch order, and step() waits only when MAX_IN_FLIGHT calls would be in flight. The audio is unchanged."""
    dec, _, vocos = tiny
    frames = torch.randn(120, 64, generator=torch.Generator().manual_seed(21))
    ref = joined(stream(stage_cls(dec, None, vocos, first_chunk_frames=4, max_chunk_frames=8), "r", frames))
    stage = stage_cls(dec, None, vocos, first_chunk_frames=4, max_chunk_frames=8, deferred=True)
    events: list[_FakeEvent] = []
    to_host = stage._to_host

    def to_host_on_a_device(pieces):  # as on CUDA: the samples arrive when the event says so
        flat, _ = to_host(pieces)
        events.append(_FakeEvent())
        return flat, events[-1]

    stage._to_host = to_host_on_a_device
    stage.add_request("r")
    chunks: list[AudioChunk] = []
    for t in range(120):
        stage.append("r", frames[t : t + 1])
        launched = len(events)
        got = stage.step()
        if len(events) == launched or len(events) < 2:
            continue
        # two calls in flight now at most, and none was waited for while it stayed below that
        assert got == [] and not any(e.waited for e in events) and stage.has_pending
        assert stage.poll() == []  # the device has finished nothing
        events[-2].done = True
        polled = stage.poll()  # the older call, finished, leaves without a wait
        assert polled and all(ch.req_id == "r" for ch in polled) and stage.has_pending
        chunks += polled
        break
    for t in range(t + 1, 120):  # noqa: B020 (t continues from the loop above)  # now the device never finishes on its own: step() waits for the oldest
        stage.append("r", frames[t : t + 1])
        chunks += stage.step()
        assert len(stage._in_flight) <= stage.MAX_IN_FLIGHT
    stage.finish("r")
    chunks += stage.step()
    chunks += stage.flush()
    assert events and any(e.waited for e in events) and not stage.has_pending and stage.num_requests == 0
    assert stage.polled_total == 1 and stage.collects_total == len(events)
    np.testing.assert_allclose(joined(chunks), ref, atol=1e-6)
