"""Both streaming stages (windowed AudioStage, IncrementalAudioStage): streamed chunks == one-shot decode,
batched == single, request lifecycle. The windowed stage's context and lookahead:
tests/audio/test_windowed_stage.py; the incremental stage's own properties: tests/audio/test_incremental_stage.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from audio_stage_testutil import STAGES, joined, one_shot, random_nets, stream
from audio_stage_testutil import tiny as tiny  # a fixture, used by name

from ttsserve.audio.stage import AudioChunk, AudioStage


@pytest.mark.parametrize("stage_cls", STAGES)
@pytest.mark.parametrize("n", [1, 7, 8, 21, 22, 60, 257])
def test_stitched_equals_one_shot_tiny(tiny, n, stage_cls) -> None:
    dec, _, vocos = tiny
    frames = torch.randn(n, 64, generator=torch.Generator().manual_seed(n))
    wav = joined(stream(stage_cls(dec, None, vocos), "r", frames))
    ref = one_shot(dec, vocos, frames)
    assert wav.shape == (512 * n - 256,)
    assert np.abs(wav - ref).max() < 1e-5


@pytest.mark.parametrize("stage_cls", STAGES)
def test_own_stream_is_a_no_op_off_cuda(tiny, stage_cls) -> None:
    """use_own_stream() (EngineConfig.audio_stream) on the CPU: no stream, the same audio."""
    dec, _, vocos = tiny
    frames = torch.randn(40, 64, generator=torch.Generator().manual_seed(40))
    stage = stage_cls(dec, None, vocos)
    stage.use_own_stream()
    assert stage.stream is None
    assert np.abs(joined(stream(stage, "r", frames)) - one_shot(dec, vocos, frames)).max() < 1e-5


@pytest.mark.parametrize("stage_cls", STAGES)
def test_stitched_equals_one_shot_dvae_codes(tiny, stage_cls) -> None:
    _, dvae, vocos = tiny
    codes = torch.randint(0, 625, (90, 4), generator=torch.Generator().manual_seed(1))
    stage = stage_cls(None, dvae, vocos, first_chunk_frames=4, max_chunk_frames=16)
    wav = joined(stream(stage, "c", codes, [3] * 30, use_codes=True))
    assert np.abs(wav - one_shot(dvae, vocos, codes, codes=True)).max() < 1e-5


@pytest.mark.parametrize("stage_cls", STAGES)
def test_stitched_equals_one_shot_real_sizes_in_bursts(stage_cls) -> None:
    dec, _, vocos = random_nets(0, hidden=768, dec_dim=512, dec_layers=2, voc_dim=512, voc_layers=2)
    frames = torch.randn(150, 768, generator=torch.Generator().manual_seed(2))
    bursts = [5, 1, 17, 40, 2, 64, 21]
    wav = joined(stream(stage_cls(dec, None, vocos, first_chunk_frames=4, max_chunk_frames=32), "r", frames, bursts))
    ref = one_shot(dec, vocos, frames)
    assert np.abs(ref).max() > 0.05  # a meaningful signal
    assert np.abs(wav - ref).max() < 1e-4


@pytest.mark.parametrize("stage_cls", STAGES)
def test_batched_step_equals_single_requests(tiny, stage_cls) -> None:
    dec, dvae, vocos = tiny
    g = torch.Generator().manual_seed(8)
    lengths = {"a": 70, "b": 3, "c": 41, "d": 0}
    frames = {k: torch.randn(n, 64, generator=g) for k, n in lengths.items()}
    codes = torch.randint(0, 625, (50, 4), generator=g)
    stage = stage_cls(dec, dvae, vocos)
    got: dict[str, list[AudioChunk]] = {k: [] for k in [*lengths, "q"]}
    for k in got:
        stage.add_request(k, use_codes=k == "q")
    for t in range(80):
        live = [k for k in lengths if t < lengths[k]]
        if live:  # one frame of every live request in one write, as the engine does
            stage.append_batch(live, torch.stack([frames[k][t] for k in live]))
        if t < 50:
            stage.append("q", codes[t : t + 1])
        for k in [*lengths, "q"]:
            if t == (50 if k == "q" else lengths[k]):
                stage.finish(k)
        calls = stage.calls_total
        for ch in stage.step():
            got[ch.req_id].append(ch)
        assert stage.calls_total - calls <= 1  # never one call per request
    assert stage.num_requests == 0
    for k in lengths:  # each request alone, same append schedule
        single = stage_cls(dec, None, vocos)
        alone = stream(single, k, frames[k]) if lengths[k] else stream(single, k, frames[k], [])
        assert [(c.start_sample, len(c.samples), c.is_final) for c in got[k]] == [
            (c.start_sample, len(c.samples), c.is_final) for c in alone
        ]
        assert np.abs(joined(got[k]) - joined(alone)).max(initial=0.0) < 1e-6
    assert np.abs(joined(got["q"]) - one_shot(dvae, vocos, codes, codes=True)).max() < 1e-5


@pytest.mark.parametrize("stage_cls", STAGES)
def test_zero_frame_request_emits_one_empty_final_chunk(tiny, stage_cls) -> None:
    dec, _, vocos = tiny
    stage = stage_cls(dec, None, vocos)
    stage.add_request("z")
    assert stage.step() == []
    stage.finish("z")
    (chunk,) = stage.step()
    assert chunk.req_id == "z" and chunk.is_final and chunk.samples.size == 0 and chunk.start_sample == 0
    assert stage.calls_total == 0 and stage.num_requests == 0


@pytest.mark.parametrize("stage_cls", STAGES)
def test_abort_frees_state_and_slot(tiny, stage_cls) -> None:
    dec, _, vocos = tiny
    stage = stage_cls(dec, None, vocos)
    stage.add_request("a")
    stage.append("a", torch.randn(40, 64))
    slot = stage._streams["a"].slot
    stage.abort("a")
    assert stage.num_requests == 0 and stage.step() == []
    stage.abort("a")  # idempotent
    with pytest.raises(ValueError, match="unknown request 'a'"):
        stage.append("a", torch.randn(1, 64))
    stage.add_request("a")  # the id and the slot can be reused
    assert stage._streams["a"].slot == slot and stage._streams["a"].num_frames == 0


@pytest.mark.parametrize("stage_cls", STAGES)
def test_bad_inputs_raise_value_error(tiny, stage_cls) -> None:
    dec, dvae, vocos = tiny
    with pytest.raises(ValueError, match="lookahead_frames"):
        AudioStage(dec, None, vocos, lookahead_frames=0)
    with pytest.raises(ValueError, match="first_chunk_frames"):
        stage_cls(dec, None, vocos, first_chunk_frames=16, max_chunk_frames=8)
    with pytest.raises(ValueError, match="needs a decoder or a dvae"):
        stage_cls(None, None, vocos)
    stage = stage_cls(dec, None, vocos)
    with pytest.raises(ValueError, match="no DVAE"):
        stage.add_request("q", use_codes=True)
    stage.add_request("r")
    with pytest.raises(ValueError, match="already exists"):
        stage.add_request("r")
    with pytest.raises(ValueError, match=r"must be \[n, 64\]"):
        stage.append("r", torch.randn(2, 63))
    with pytest.raises(ValueError, match="float hidden states"):
        stage.append("r", torch.zeros(2, 64, dtype=torch.long))
    stage.finish("r")
    with pytest.raises(ValueError, match="finished"):
        stage.append("r", torch.randn(1, 64))


@pytest.mark.parametrize("stage_cls", STAGES)
def test_bf16_frame_buffer_decodes_in_the_networks_dtype(tiny, stage_cls) -> None:
    dec, _, vocos = tiny
    frames = torch.randn(40, 64, generator=torch.Generator().manual_seed(14))
    stage = stage_cls(dec, None, vocos, dtype=torch.bfloat16)
    assert stage._pools[False].data.dtype == torch.bfloat16
    wav = joined(stream(stage, "r", frames))
    assert np.abs(wav - one_shot(dec, vocos, frames.bfloat16().float())).max() < 1e-5


@pytest.mark.parametrize("stage_cls", STAGES)
def test_multi_frame_append_batch_equals_frame_by_frame(tiny, stage_cls) -> None:
    """A decode burst's frames [m, n, C] (step-major) in one write give the pool, and so the audio, of m
    single-frame writes; 201 frames run past the pool's capacity (its slots shift or grow on the way)."""
    dec, _, vocos = tiny
    g = torch.Generator().manual_seed(9)
    frames = torch.randn(201, 3, 64, generator=g)  # [t, request, C]
    ids = ["x", "y", "z"]
    out = {}
    for m in (1, 3):
        stage = stage_cls(dec, None, vocos)
        for k in ids:
            stage.add_request(k)
        chunks = {k: [] for k in ids}
        for t in range(0, 201, m):
            stage.append_batch(ids, frames[t : t + m] if m > 1 else frames[t])
            if t + m == 201:
                for k in ids:
                    stage.finish(k)
            for ch in stage.step():
                chunks[ch.req_id].append(ch)
        while stage.num_requests:
            for ch in stage.step():
                chunks[ch.req_id].append(ch)
        out[m] = {k: joined(v) for k, v in chunks.items()}
    for k in ids:
        assert len(out[3][k]) == len(out[1][k]) > 0
        assert np.abs(out[3][k] - out[1][k]).max() < 1e-6
    stage = stage_cls(dec, None, vocos)
    stage.add_request("x")
    with pytest.raises(ValueError, match=r"\[m, 1, C\]"):
        stage.append_batch(["x"], torch.zeros(2, 2, 64))


@pytest.mark.parametrize("stage_cls", STAGES)
def test_append_batch_counts_keep_each_rows_first_frames(tiny, stage_cls) -> None:
    """append_batch(ids, [4, n, C], counts): request i gets frames[:counts[i], i] (a burst cut by EOS, a row
    whose results were dropped: 0, its id not live), the same audio as appending those frames one by one;
    the rows run past the pool's capacity together, so their slots shift in one batched move."""
    dec, _, vocos = tiny
    g = torch.Generator().manual_seed(21)
    ids = ["x", "y", "z"]
    bursts = [torch.randn(4, 4, 64, generator=g) for _ in range(60)]  # [m, rows (ids + a dead row), C]
    counts = [np.array([4, 4 - t % 5 % 4, 4 if t % 7 else 0, 0]) for t in range(60)]
    out = {}
    for batched in (True, False):
        stage = stage_cls(dec, None, vocos)
        for k in ids:
            stage.add_request(k)
        chunks = {k: [] for k in ids}
        for frames, c in zip(bursts, counts):
            if batched:
                stage.append_batch([*ids, "gone"], frames, c)
            else:
                for i, k in enumerate(ids):
                    for j in range(c[i]):
                        stage.append(k, frames[j, i : i + 1])
            for ch in stage.step():
                chunks[ch.req_id].append(ch)
        for k in ids:
            stage.finish(k)
        while stage.num_requests:
            for ch in stage.step():
                chunks[ch.req_id].append(ch)
        out[batched] = {k: joined(v) for k, v in chunks.items()}
    for k in ids:
        assert len(out[True][k]) == len(out[False][k]) > 0
        assert np.array_equal(out[True][k], out[False][k])
