"""The windowed AudioStage's own properties: its left and right context match the networks' receptive field
(measured by impulse, and tight), a shorter lookahead trades exactness for latency, and its work and buffer stay
linear in the frames. The contract both stages share: tests/audio/test_audio_stage.py."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from audio_stage_testutil import _edge_heavy_nets, joined, one_shot, random_nets, stream
from audio_stage_testutil import tiny as tiny  # a fixture, used by name

from ttsserve.audio.stage import AudioStage, context_frames


@torch.no_grad()
def _sample_extent(dec, vocos, width: int, n: int, f: int) -> tuple[int, int]:
    """Impulse test in float64: samples changed by perturbing frame f, as (left, right) offsets from 512 f."""
    dec, vocos = copy.deepcopy(dec).double(), copy.deepcopy(vocos).double()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, width, generator=g, dtype=torch.float64)
    y = torch.randn(width, generator=g, dtype=torch.float64)
    base = vocos(dec(x.T[None]))[0]
    x[f] += y
    changed = torch.nonzero(vocos(dec(x.T[None]))[0] != base)[:, 0]
    return 512 * f - int(changed[0]), int(changed[-1]) - 512 * f


def _contexts_from_extent(left: int, right: int) -> tuple[int, int]:
    # frame a-L-1 must not reach sample 512 a; frame b+R must not reach sample 512 b - 1
    return right // 512, (left - 1) // 512 + 1


def test_receptive_field_measured_by_impulse_tiny(tiny) -> None:
    dec, _, vocos = tiny
    w = dec.receptive_field + vocos.receptive_field
    assert w == 24
    left, right = _sample_extent(dec, vocos, 64, 80, 40)
    # analytic: spectrum frames [2f - w, 2f + 1 + w], each reaching n_fft/2 - 1 samples around hop * t
    # (the periodic Hann window is 0 at its first sample)
    assert (left, right) == (256 * w + 511, 256 * (w + 1) + 511)
    stage = AudioStage(dec, None, vocos)
    assert _contexts_from_extent(left, right) == (stage.left_context_frames, stage.right_context_frames) == (13, 13)


def test_full_depth_receptive_field_and_stitching() -> None:
    # the real depth (12 decoder + 8 Vocos blocks) with small widths: W = 75 + 27 = 102 mel frames
    dec, _, vocos = random_nets(4, hidden=64, dec_dim=64, dec_layers=12, voc_dim=64, voc_layers=8)
    assert dec.receptive_field == 75 and vocos.receptive_field == 27
    stage = AudioStage(dec, None, vocos)
    assert (stage.left_context_frames, stage.right_context_frames) == context_frames(102, 1024, 256) == (52, 52)
    # the influence of the outermost taps falls below fp64 resolution: the measured field is a bit smaller
    left, right = _sample_extent(dec, vocos, 64, 160, 80)
    assert left <= 256 * 102 + 511 and right <= 256 * 103 + 511
    measured = _contexts_from_extent(left, right)
    assert 40 <= measured[0] <= 52 and 40 <= measured[1] <= 52
    frames = torch.randn(200, 64, generator=torch.Generator().manual_seed(5))
    wav = joined(stream(stage, "r", frames, [4] * 50))
    assert np.abs(wav - one_shot(dec, vocos, frames)).max() < 1e-5


@pytest.mark.parametrize("side", [None, "left", "right"])
def test_context_is_tight(side) -> None:
    dec, vocos = _edge_heavy_nets()
    frames = torch.randn(100, 64, generator=torch.Generator().manual_seed(6))
    stage = AudioStage(dec, None, vocos)
    if side is not None:  # one frame less context than derived
        setattr(stage, f"{side}_context_frames", getattr(stage, f"{side}_context_frames") - 1)
    diff = np.abs(joined(stream(stage, "r", frames, [4] * 25)) - one_shot(dec, vocos, frames)).max()
    assert (diff < 1e-5) if side is None else (diff > 1e-4)


def test_lookahead_trades_exactness_for_latency(tiny) -> None:
    dec, _, vocos = tiny
    frames = torch.randn(100, 64, generator=torch.Generator().manual_seed(7))
    ref = one_shot(dec, vocos, frames)
    diffs = {}
    for lookahead in (1, 4, 13):
        stage = AudioStage(dec, None, vocos, lookahead_frames=lookahead)
        stage.add_request("r")
        first_at = None
        for i in range(100):
            stage.append("r", frames[i : i + 1])
            if stage.step() and first_at is None:
                first_at = i + 1
        stage.finish("r")
        stage.step()
        assert first_at == 8 + lookahead  # first_chunk_frames + lookahead frames before the first audio
        stage2 = AudioStage(dec, None, vocos, lookahead_frames=lookahead)
        diffs[lookahead] = float(np.abs(joined(stream(stage2, "r", frames)) - ref).max())
    assert diffs[13] < 1e-5 < diffs[1]  # 13 = exact right context of the tiny model


@pytest.mark.parametrize("n", [400, 1600])
def test_work_is_linear_in_frames(tiny, n) -> None:
    dec, _, vocos = tiny
    stage = AudioStage(dec, None, vocos)
    chunks = stream(stage, "r", torch.randn(n, 64, generator=torch.Generator().manual_seed(9)))
    ctx = stage.left_context_frames + stage.right_context_frames
    ramp = 4  # chunks 8, 16, 32 before reaching 64
    assert len(chunks) == stage.calls_total <= ramp + n // 64 + 1
    assert stage.frames_decoded_total <= n + stage.calls_total * ctx
    assert stage.frames_decoded_total <= 2.5 * n
    # frames no window needs are dropped: the per-request buffer never grew
    assert stage._pools[False].capacity == 2 * (ctx + 64)


def test_burst_larger_than_buffer_grows_it(tiny) -> None:
    dec, _, vocos = tiny
    stage = AudioStage(dec, None, vocos)
    frames = torch.randn(500, 64, generator=torch.Generator().manual_seed(10))
    chunks = stream(stage, "r", frames, [500])  # all at once, then one step emits every ready window
    assert np.abs(joined(chunks) - one_shot(dec, vocos, frames)).max() < 1e-5
    assert stage.calls_total == 2


def test_short_request_emits_everything_on_finish(tiny) -> None:
    dec, _, vocos = tiny
    stage = AudioStage(dec, None, vocos, lookahead_frames=1)
    frames = torch.randn(3, 64, generator=torch.Generator().manual_seed(11))
    stage.add_request("r")
    stage.append("r", frames)
    assert stage.step() == []
    stage.finish("r")
    (chunk,) = stage.step()
    assert chunk.is_final and chunk.start_sample == 0 and chunk.samples.shape == (512 * 3 - 256,)
    assert np.abs(chunk.samples - one_shot(dec, vocos, frames)).max() < 1e-5
    assert stage.num_requests == 0 and stage.step() == []


@pytest.mark.parametrize("lookahead", [None, 4])
def test_shape_buckets_pad_calls_and_change_no_sample(tiny, lookahead) -> None:
    """With shape_buckets (the CUDA default) every network call has a power-of-two row count and a width on the
    bucket grid, and each request's audio is what the unpadded calls give."""
    dec, dvae, vocos = tiny
    g = torch.Generator().manual_seed(5)
    lengths = {"a": 75, "b": 9, "c": 33}
    frames = {k: torch.randn(n, 64, generator=g) for k, n in lengths.items()}
    codes = torch.randint(0, 625, (29, 4), generator=g)
    shapes: list[tuple[int, ...]] = []
    hook = vocos.register_forward_pre_hook(lambda _m, args: shapes.append(tuple(args[0].shape)))
    try:
        out = {}
        for buckets in (False, True):
            stage = AudioStage(dec, dvae, vocos, lookahead_frames=lookahead, shape_buckets=buckets)
            got = {k: [] for k in [*lengths, "q"]}
            for k in got:
                stage.add_request(k, use_codes=k == "q")
            shapes.clear()
            for t in range(80):
                live = [k for k in lengths if t < lengths[k]]
                if live:
                    stage.append_batch(live, torch.stack([frames[k][t] for k in live]))
                if t < len(codes):
                    stage.append("q", codes[t : t + 1])
                for k in got:
                    if t == (len(codes) if k == "q" else lengths[k]):
                        stage.finish(k)
                for ch in stage.step():
                    got[ch.req_id].append(ch)
            out[buckets] = {k: joined(v) for k, v in got.items()}
            assert len(shapes) >= 5
            if buckets:
                assert all(b & (b - 1) == 0 and t % 32 == 0 for b, _, t in shapes), shapes
            else:
                assert any(t % 32 for _, _, t in shapes), "the schedule must make widths off the grid"
    finally:
        hook.remove()
    for k in out[False]:
        np.testing.assert_allclose(out[True][k], out[False][k], rtol=0, atol=1e-6, err_msg=k)
