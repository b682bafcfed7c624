"""The vocoder's graphed call (audio/vocoder_graphs.py) on the CPU: off CUDA the same padded static-buffer body
runs eagerly, so padding rows, padded frames and the scratch slot are checked here against the one-shot decode.
tests/gpu/test_gpu_vocoder_graphs.py replays the captured graphs against the eager call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from audio_stage_testutil import one_shot, random_nets, run_schedule
from hypothesis import given, settings
from hypothesis import strategies as st

from ttsserve.audio.incremental_stage import IncrementalAudioStage
from ttsserve.audio.vocoder_graphs import default_frame_buckets, default_row_buckets

_NETS = random_nets(3, hidden=64, dec_dim=32, dec_layers=2, voc_dim=32, voc_layers=2)[::2]


def _graphed_stage(**kwargs) -> IncrementalAudioStage:
    dec, vocos = _NETS
    stage = IncrementalAudioStage(dec, None, vocos, **kwargs)
    stage.enable_cuda_graphs(max_streams=2, row_buckets=[2, 4], frame_buckets=[4, 16, stage.max_call_frames])
    return stage


@settings(max_examples=10, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 70), st.integers(0, 30), st.integers(1, 9)), min_size=1, max_size=7),
    st.integers(1, 8),
)
def test_graphed_calls_equal_the_one_shot_decode(specs, first_chunk) -> None:
    """Up to 7 streams (more than the 6 slots planned: the slots grow and each bucket is 'captured' again), random
    starts and bursts; every call is padded to a (rows, frames) bucket and each stream equals its one-shot."""
    stage = _graphed_stage(first_chunk_frames=first_chunk, max_chunk_frames=first_chunk * 4, max_windows_per_call=4)
    dec, vocos = _NETS
    for i, (wav, frames) in run_schedule(stage, specs, len(specs)).items():
        assert wav.shape == (512 * frames.shape[0] - 256,)
        assert np.abs(wav - one_shot(dec, vocos, frames)).max() < 1e-5, f"stream {i}"
    assert stage.graphs[False].replays == stage.calls_total > 0  # every call took the graphed path
    assert stage.graphs[False].generation == stage.slot_generation  # never a replay over stale state


def test_calls_cut_by_width_equal_the_one_shot_decode(monkeypatch) -> None:
    """With a replay costing nothing every frame bucket of a step's rows is its own call: more calls than steps
    that decode, fewer padded cells, and each stream still its one-shot decode."""
    dec, vocos = _NETS
    specs = [(40, 0, 3), (25, 2, 1), (33, 5, 2), (18, 9, 3), (30, 11, 1)]  # first calls beside steady rows
    padded = {}
    for replay in (10**6, 0):
        monkeypatch.setattr("ttsserve.audio.incremental_stage.REPLAY_CELLS", replay)
        stage = IncrementalAudioStage(dec, None, vocos, first_chunk_frames=2, max_chunk_frames=8)
        stage.enable_cuda_graphs(max_streams=5, row_buckets=[1, 2, 4, 8], frame_buckets=[4, 8, stage.max_call_frames])
        steps = []
        stage_launch = stage._launch
        stage._launch = lambda: steps.append(stage.calls_total) or stage_launch()
        for i, (wav, frames) in run_schedule(stage, specs, 5).items():
            assert np.abs(wav - one_shot(dec, vocos, frames)).max() < 1e-5, f"stream {i}"
        padded[replay] = stage.frames_padded_total
        calls_per_step = np.diff(steps + [stage.calls_total])
        assert calls_per_step.max() == (1 if replay else 2), calls_per_step
    assert padded[0] < padded[10**6]


def test_growing_the_slots_recaptures_only_the_buckets_used() -> None:
    stage = _graphed_stage(first_chunk_frames=2, max_chunk_frames=8, max_windows_per_call=4)
    graphs = stage.graphs[False]
    assert len(graphs.graphs) == 2 * 3  # every bucket at start
    generation = stage.slot_generation
    dec, vocos = _NETS
    specs = [(30, 0, 1)] * 9  # 9 streams at once: more than the 6 slots planned
    for i, (wav, frames) in run_schedule(stage, specs, 3).items():
        assert np.abs(wav - one_shot(dec, vocos, frames)).max() < 1e-5, f"stream {i}"
    assert stage.slot_generation > generation and graphs.generation == stage.slot_generation
    assert 0 < len(graphs.graphs) < 2 * 3  # captured again as calls needed them, not all at once


def test_padding_rows_write_only_the_scratch_slot() -> None:
    stage = _graphed_stage(first_chunk_frames=2, max_chunk_frames=8)
    graphs = stage.graphs[False]
    owned = set(range(stage._num_slots)) - set(stage._free_slots) - {graphs.scratch_slot}
    before = {id(s): s.cache.clone() for s in stage._decoders[False].states}
    stage.add_request("a")
    stage.append("a", torch.randn(stage.first_chunk_frames + stage.right_context_frames, 64))
    assert stage.step()  # one row, padded to a bucket of 2
    slot = stage._state_slot["a"]
    for s in stage._decoders[False].states:
        changed = {i for i in range(s.cache.shape[0]) if not torch.equal(s.cache[i], before[id(s)][i])}
        assert changed <= {slot, graphs.scratch_slot} and not (changed & owned - {slot})


def test_buckets() -> None:
    assert default_row_buckets(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert default_row_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    assert default_row_buckets(3) == [1, 2, 3]
    assert default_frame_buckets(116) == [8, 16, 32, 64, 96, 116]
    assert default_frame_buckets(64) == [8, 16, 32, 64]
    assert default_frame_buckets(8) == [8]
    stage = _graphed_stage()
    graphs = stage.graphs[False]
    assert graphs.bucket(1, 1) == (2, 4) and graphs.bucket(3, 5) == (4, 16)
    assert graphs.fits(4, stage.max_call_frames) and not graphs.fits(5, 1)
    with pytest.raises(ValueError, match="positive"):
        type(graphs)(stage, False, [0], [4])


def test_deferred_buckets_replay_the_smallest_captured_one_that_holds_the_call() -> None:
    """defer=True captures the largest bucket only; calls replay the captured bucket with the fewest cells that
    holds them while capture_next() adds the others between steps, and every stream equals its one-shot decode;
    slots that grow drop the graphs and capture the largest again, the rest pending."""
    dec, vocos = _NETS
    stage = IncrementalAudioStage(dec, None, vocos, first_chunk_frames=2, max_chunk_frames=8, max_windows_per_call=4)
    top = stage.max_call_frames
    stage.enable_cuda_graphs(max_streams=2, row_buckets=[2, 4], frame_buckets=[4, 16, top], defer=True)
    graphs = stage.graphs[False]
    assert list(graphs.graphs) == [(4, top)] and graphs.num_pending == 5 and stage.graph_families() == [graphs]
    assert graphs.bucket(1, 1) == (4, top)
    graphs.capture_next()  # by cells, largest first: (4, 16) before (2, top)
    assert list(graphs.graphs) == [(4, top), (4, 16)] and graphs.bucket(1, 1) == (4, 16)
    assert graphs.bucket(3, 17) == (4, top)
    step = stage.step

    def step_then_capture():  # one deferred capture after every step, as the engine-core loop does
        chunks = step()
        if graphs.num_pending:
            graphs.capture_next()
        return chunks

    stage.step = step_then_capture
    for i, (wav, frames) in run_schedule(stage, [(30, 0, 1), (25, 2, 3), (12, 5, 1)], 4).items():
        assert np.abs(wav - one_shot(dec, vocos, frames)).max() < 1e-5, f"stream {i}"
    assert graphs.num_pending == 0 and len(graphs.graphs) == 6 and graphs.bucket(1, 1) == (2, 4)
    assert graphs.replays == stage.calls_total > 0
    stage.step = step
    for i in range(9):  # more streams than the slots planned for
        stage.add_request(f"grow{i}")
    stage.append("grow0", torch.randn(stage.first_chunk_frames + stage.right_context_frames, 64))
    stage.step()
    assert graphs.generation == stage.slot_generation and list(graphs.graphs) == [(4, top)]
    assert graphs.num_pending == 5
