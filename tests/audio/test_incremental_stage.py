"""IncrementalAudioStage: each frame decoded once, exact at any schedule, state that is clean on slot reuse.

The contract it shares with the windowed stage (stitched == one-shot, batched == single, lifecycle, errors) is
tested for both in tests/audio/test_audio_stage.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from audio_stage_testutil import (  # noqa: F401
    _edge_heavy_nets,
    joined,
    one_shot,
    random_nets,
    run_schedule,
    stream,
    tiny,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ttsserve.audio.incremental_stage import IncrementalAudioStage
from ttsserve.audio.stage import AudioStage, context_frames
from ttsserve.audio.stage_factory import make_audio_stage


@pytest.mark.parametrize("n", [400, 1600])
def test_each_frame_is_decoded_once(tiny, n) -> None:  # noqa: F811
    dec, _, vocos = tiny
    stage = IncrementalAudioStage(dec, None, vocos)
    frames = torch.randn(n, 64, generator=torch.Generator().manual_seed(n))
    chunks = stream(stage, "r", frames)
    assert np.abs(joined(chunks) - one_shot(dec, vocos, frames)).max() < 1e-5
    # the real frames once, plus the zero frames that flush the conv lag at the end
    assert n < stage.frames_decoded_total <= n + stage.right_context_frames
    assert len(chunks) == stage.calls_total <= 4 + n // 64 + 1  # chunks 8, 16, 32, then 64
    assert stage._pools[False].capacity == 2 * 64  # pending frames only: the buffer never grew
    windowed = AudioStage(dec, None, vocos)
    stream(windowed, "r", frames)
    assert windowed.frames_decoded_total > 1.3 * stage.frames_decoded_total


def test_full_depth_first_audio_after_first_chunk_plus_exact_right_context() -> None:
    dec, _, vocos = random_nets(4, hidden=64, dec_dim=64, dec_layers=12, voc_dim=64, voc_layers=8)
    stage = IncrementalAudioStage(dec, None, vocos)
    assert stage.right_context_frames == context_frames(102, 1024, 256)[1] == 52
    frames = torch.randn(200, 64, generator=torch.Generator().manual_seed(5))
    stage.add_request("r")
    chunks, first_at = [], None
    for i in range(200):
        stage.append("r", frames[i : i + 1])
        new = stage.step()
        if new and first_at is None:
            first_at = i + 1
            assert new[0].samples.shape == (512 * 8,)  # exactly the first chunk
        chunks += new
    stage.finish("r")
    chunks += stage.step()
    assert first_at == 8 + 52
    assert np.abs(joined(chunks) - one_shot(dec, vocos, frames)).max() < 1e-5


def test_exact_where_only_the_outermost_taps_matter() -> None:
    dec, vocos = _edge_heavy_nets()
    frames = torch.randn(100, 64, generator=torch.Generator().manual_seed(6))
    for bursts in ([1] * 100, [4] * 25, [37, 1, 62]):
        wav = joined(stream(IncrementalAudioStage(dec, None, vocos), "r", frames, bursts))
        assert np.abs(wav - one_shot(dec, vocos, frames)).max() < 1e-5


def test_a_reused_slot_starts_clean(tiny) -> None:  # noqa: F811
    dec, _, vocos = tiny
    stage = IncrementalAudioStage(dec, None, vocos)
    g = torch.Generator().manual_seed(7)
    stage.add_request("a")
    for _ in range(40):  # several calls: the conv caches and the overlap-add tail hold a's audio
        stage.append("a", torch.randn(1, 64, generator=g) * 3)
        stage.step()
    slot = stage._state_slot["a"]
    stage.abort("a")
    frames = torch.randn(50, 64, generator=g)
    stage.add_request("b")
    assert stage._state_slot["b"] == slot
    chunks = []
    for i in range(50):
        stage.append("b", frames[i : i + 1])
        chunks += stage.step()
    stage.finish("b")
    chunks += stage.step()
    assert np.abs(joined(chunks) - one_shot(dec, vocos, frames)).max() < 1e-5


def test_each_chunk_owns_its_samples(tiny) -> None:  # noqa: F811
    """The chunks of one call are copies, not views of the call's transfer buffer: an output that passes a chunk's
    samples on (SynthesisTracker's streaming path) must not keep the buffer or the other streams' audio alive."""
    dec, _, vocos = tiny
    stage = IncrementalAudioStage(dec, None, vocos)
    for k in "abc":
        stage.add_request(k)
    stage.append_batch(list("abc"), torch.randn(60, 3, 64, generator=torch.Generator().manual_seed(12)))
    chunks = [c for c in stage.step() if c.samples.size]
    assert len(chunks) == 3 and stage.calls_total == 1
    assert all(c.samples.flags.owndata and c.samples.base is None for c in chunks)


def test_a_burst_is_decoded_in_bounded_calls_within_one_step(tiny) -> None:  # noqa: F811
    dec, _, vocos = tiny
    stage = IncrementalAudioStage(dec, None, vocos)
    frames = torch.randn(500, 64, generator=torch.Generator().manual_seed(10))
    stage.add_request("r")
    stage.append("r", frames)
    chunks = stage.step()  # all but a remainder shorter than a chunk, and the right context, in one step
    emitted = sum(len(c.samples) for c in chunks)
    assert 512 * (500 - stage.right_context_frames - 64) <= emitted < 512 * (500 - stage.right_context_frames)
    assert stage.calls_total <= -(-500 // stage.max_call_frames)
    stage.finish("r")
    chunks += stage.step()
    assert np.abs(joined(chunks) - one_shot(dec, vocos, frames)).max() < 1e-5


def test_deferred_gives_the_same_chunks_one_step_later(tiny) -> None:  # noqa: F811
    dec, _, vocos = tiny
    frames = torch.randn(90, 64, generator=torch.Generator().manual_seed(11))
    now, later = IncrementalAudioStage(dec, None, vocos), IncrementalAudioStage(dec, None, vocos, deferred=True)
    a, b = stream(now, "r", frames), stream(later, "r", frames)
    assert [(c.start_sample, len(c.samples), c.is_final) for c in a] == [
        (c.start_sample, len(c.samples), c.is_final) for c in b
    ]
    assert np.array_equal(joined(a), joined(b))


def test_decoder_and_dvae_of_different_depths_in_one_batch() -> None:
    dec, _, vocos = random_nets(0, hidden=64, dec_dim=64, dec_layers=2, voc_dim=64, voc_layers=2)
    dvae = random_nets(1, hidden=64, dec_dim=64, dec_layers=3, voc_dim=64, voc_layers=2, dvae=True)[1]
    stage = IncrementalAudioStage(dec, dvae, vocos, first_chunk_frames=4, max_chunk_frames=16)
    assert stage._lag[False] != stage._lag[True]
    g = torch.Generator().manual_seed(12)
    frames, codes = torch.randn(70, 64, generator=g), torch.randint(0, 625, (55, 4), generator=g)
    stage.add_request("h")
    stage.add_request("c", use_codes=True)
    got = {"h": [], "c": []}
    for t in range(72):
        if t < 70:
            stage.append("h", frames[t : t + 1])
        if t < 55:
            stage.append("c", codes[t : t + 1])
        for k, end in (("h", 70), ("c", 55)):
            if t == end:
                stage.finish(k)
        for ch in stage.step():
            got[ch.req_id].append(ch)
    assert np.abs(joined(got["h"]) - one_shot(dec, vocos, frames)).max() < 1e-5
    assert np.abs(joined(got["c"]) - one_shot(dvae, vocos, codes, codes=True)).max() < 1e-5


def test_profiling_call_leaves_live_streams_and_counters_alone(tiny) -> None:  # noqa: F811
    dec, _, vocos = tiny
    stage = IncrementalAudioStage(dec, None, vocos)
    frames = torch.randn(60, 64, generator=torch.Generator().manual_seed(13))
    stage.add_request("r")
    chunks = []
    for i in range(60):
        stage.append("r", frames[i : i + 1])
        chunks += stage.step()
        if i == 30:
            before = (stage.calls_total, stage.frames_decoded_total, stage.num_requests)
            stage.profile_max_call(3)
            assert (stage.calls_total, stage.frames_decoded_total, stage.num_requests) == before
    stage.finish("r")
    chunks += stage.step()
    assert np.abs(joined(chunks) - one_shot(dec, vocos, frames)).max() < 1e-5


def test_the_engine_picks_the_incremental_stage_when_exact(tiny) -> None:  # noqa: F811
    dec, _, vocos = tiny
    assert type(make_audio_stage(dec, None, vocos)) is IncrementalAudioStage
    assert type(make_audio_stage(dec, None, vocos, lookahead_frames=4)) is AudioStage


@settings(max_examples=12, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 70), st.integers(0, 30), st.integers(1, 9)), min_size=1, max_size=4),
    st.integers(1, 8),
    st.integers(0, 3),
)
def test_any_schedule_of_many_streams_is_exact(specs, first_chunk, extra_max) -> None:
    """Streams of random length start at random steps and append random bursts; each equals its one-shot."""
    dec, vocos = _TINY_NETS
    stage = IncrementalAudioStage(
        dec,
        None,
        vocos,
        first_chunk_frames=first_chunk,
        max_chunk_frames=first_chunk << extra_max,
        max_windows_per_call=3,
    )
    results = run_schedule(stage, specs, seed=len(specs))
    for i, (n, _, _) in enumerate(specs):
        wav, frames = results[i]
        assert wav.shape == (max(0, 512 * n - 256),)
        if n:
            assert np.abs(wav - one_shot(dec, vocos, frames)).max() < 1e-5


_TINY_NETS = random_nets(3, hidden=64, dec_dim=32, dec_layers=2, voc_dim=32, voc_layers=2)[::2]


def test_state_per_request_of_the_real_sizes() -> None:
    dec, _, vocos = random_nets(0, hidden=768, dec_dim=512, dec_layers=12, voc_dim=512, voc_layers=8)
    stage = IncrementalAudioStage(dec, None, vocos)
    # decoder: conv_in 384 and 128 channels x 2 frames, 12 blocks x 512 x 12, out_conv 384 x 2; Vocos: embed
    # 100 x 6, 8 blocks x 512 x 6; the overlap-add's sums and envelope 2 x 768; fp32
    values = 384 * 2 + 128 * 2 + 12 * 512 * 12 + 384 * 2 + 100 * 6 + 8 * 512 * 6 + 2 * 768
    assert stage.state_bytes_per_request == 4 * values  # ~0.4 MB, against 104 frames of context per chunk
    assert stage.right_context_frames == 52
