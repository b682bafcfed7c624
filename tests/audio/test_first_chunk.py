"""The exact stage's early chunks (first_chunk_lookahead, audio/first_chunk.py): the first audio leaves after
first_chunk_frames + L frames and equals the windowed stage's first chunk at lookahead L, each early chunk is the
one-shot decode of its window, the exact stage's first samples follow as soon as it has them, and every later
sample is the exact one; code streams, short finished streams and the bucketed decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from audio_stage_testutil import joined, one_shot
from audio_stage_testutil import tiny as tiny  # a fixture, used by name
from hypothesis import given, settings
from hypothesis import strategies as st

from ttsserve.audio.first_chunk import EarlyChunkDecoder, early_chunk_ends
from ttsserve.audio.incremental_stage import IncrementalAudioStage
from ttsserve.audio.stage import AudioStage
from ttsserve.config import EngineConfig

F, L = 4, 3  # the tiny networks' exact right context is 13 frames


def _frames(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))


def _chunks_at(stage, req_id: str, frames: torch.Tensor) -> tuple[list[int], list]:
    """Append one frame a step; -> (frames in when each chunk came, every chunk)."""
    stage.add_request(req_id)
    chunks, at = [], []
    for i in range(frames.shape[0]):
        stage.append(req_id, frames[i : i + 1])
        new = stage.step()
        chunks += new
        at += [i + 1] * len(new)
    stage.finish(req_id)
    chunks += stage.step()
    return at, chunks + stage.flush()


def test_early_chunk_ends_are_the_fewest_that_keep_ahead_of_the_speed_floor() -> None:
    assert early_chunk_ends(8, 16, 60) == [8, 24]  # real size: windows 24 and 40 frames
    assert early_chunk_ends(8, 16, 60, min_speed=2.125) == [8, 25, 32]
    assert early_chunk_ends(8, 16, 60, min_speed=6) == [8]  # one chunk covers the exact stage's 44 frames
    assert early_chunk_ends(8, 52, 60) == [] == early_chunk_ends(8, 60, 60)


def _underruns(ends: list[int], lookahead: int, exact_first_call: int, speed: float) -> bool:
    """A stream generating `speed` frames per frame played: does any chunk (each early one at its window, the
    exact stage's first past the last end) leave after the audio out has played?"""
    start, out = ends[0] + lookahead, ends[0]
    for at, end in [(e + lookahead, e) for e in ends[1:]] + [(ends[-1] + exact_first_call, None)]:
        if (at - start) / speed > out + 1e-9:
            return True
        out = end
    return False


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    first=st.integers(1, 16),
    lookahead=st.integers(1, 40),
    context=st.integers(1, 80),
    speed=st.floats(1.2, 6.0),
)
def test_early_chunks_keep_ahead_at_the_floor_unless_no_window_can(first, lookahead, context, speed) -> None:
    call = first + context
    ends = early_chunk_ends(first, lookahead, call, min_speed=speed)
    if first + lookahead >= call:
        assert ends == []
        return
    assert ends[0] == first and ends == sorted(set(ends)) and ends[-1] + lookahead < call
    assert all(b - first <= speed * a + 1e-9 for a, b in zip(ends, ends[1:]))  # each leaves before the last plays
    if _underruns(ends, lookahead, call, speed):  # only where the next chunk's window would be as late as the exact
        assert min(call, int(first + speed * ends[-1])) + lookahead >= call
    else:
        assert len(ends) == 1 or _underruns(ends[:-1], lookahead, call, speed)  # no chunk more than needed


@pytest.mark.parametrize("first", [F, 2])
def test_early_chunks_leave_after_their_lookahead_and_the_rest_is_exact(tiny, first) -> None:
    dec, _, vocos = tiny
    frames = _frames(90, 1)
    exact_at, exact = _chunks_at(IncrementalAudioStage(dec, None, vocos, first_chunk_frames=first), "r", frames)
    stage = IncrementalAudioStage(dec, None, vocos, first_chunk_frames=first, first_chunk_lookahead=L)
    early_at, early = _chunks_at(stage, "r", frames)
    first_call = first + stage.right_context_frames
    ends = stage.early.decoder.ends
    assert ends == early_chunk_ends(first, L, first_call) and len(ends) >= 2
    assert exact_at[0] == first_call
    # one chunk per early end as its window comes in, then the exact stage's as soon as it has new samples
    assert early_at[: len(ends) + 1] == [e + L for e in ends] + [ends[-1] + first_call]
    assert [c.start_sample for c in early[: len(ends)]] == [512 * e for e in [0, *ends[:-1]]]
    windowed = _chunks_at(AudioStage(dec, None, vocos, first_chunk_frames=first, lookahead_frames=L), "r", frames)[1]
    np.testing.assert_allclose(early[0].samples, windowed[0].samples, rtol=0, atol=1e-6)
    got, ref = joined(early), one_shot(dec, vocos, frames)
    for k, e in enumerate(ends):  # each early chunk: its window's one-shot decode
        lo = 512 * (ends[k - 1] if k else 0)
        np.testing.assert_allclose(got[lo : 512 * e], one_shot(dec, vocos, frames[: e + L])[lo : 512 * e], atol=1e-5)
    head = 512 * ends[-1]
    assert got.shape == ref.shape == joined(exact).shape
    np.testing.assert_allclose(got[head:], ref[head:], rtol=0, atol=1e-5)  # exact from the last early end
    seam = np.abs(got[:head] - ref[:head]).max()
    assert 0 < seam < 0.1 * np.abs(ref).max()  # approximate, and close


def test_streams_at_different_early_chunks_share_a_step(tiny) -> None:
    """Streams started as far apart as the early windows are due for different early chunks in the same steps (one
    call for all): each stream's audio is what it gets alone."""
    dec, _, vocos = tiny
    widths = _early_stage(dec, vocos).early.decoder.widths
    gap = widths[1] - widths[0]  # a stream's second window comes in with the next stream's first
    frames = {k: _frames(40, 20 + i) for i, k in enumerate("abc")}
    alone = {k: joined(_chunks_at(_early_stage(dec, vocos), k, f)[1]) for k, f in frames.items()}
    stage, got = _early_stage(dec, vocos), {k: [] for k in frames}
    ends, due = [], stage.early.due

    def counted(streams):  # the chunk ends due in each step
        rows = due(streams)
        ends.append({end for *_, end in rows})
        return rows

    stage.early.due = counted
    for t in range(40 + 2 * gap):
        live = [k for i, k in enumerate(frames) if 0 <= t - gap * i < 40]
        for k in [k for i, k in enumerate(frames) if t == gap * i]:
            stage.add_request(k)
        stage.append_batch(live, torch.stack([frames[k][t - gap * "abc".index(k)] for k in live]))
        for k in [k for i, k in enumerate(frames) if t - gap * i == 39]:
            stage.finish(k)
        for ch in stage.step():
            got[ch.req_id].append(ch)
    for ch in stage.flush():
        got[ch.req_id].append(ch)
    assert max(map(len, ends)) >= 2
    assert not stage.early._awaiting  # each stream left the set: a step looks at the few streams still early
    for k in frames:
        np.testing.assert_allclose(joined(got[k]), alone[k], rtol=0, atol=1e-6, err_msg=k)


def _early_stage(dec, vocos) -> IncrementalAudioStage:
    return IncrementalAudioStage(dec, None, vocos, first_chunk_frames=2, first_chunk_lookahead=L)


def test_code_streams_and_short_finished_streams_stay_exact(tiny) -> None:
    dec, dvae, vocos = tiny
    stage = IncrementalAudioStage(dec, dvae, vocos, first_chunk_frames=F, first_chunk_lookahead=L)
    codes = torch.randint(0, 625, (40, 4), generator=torch.Generator().manual_seed(2))
    lengths = {"long": 60, "short": F + L - 1}
    frames = {k: _frames(n, 3 + n) for k, n in lengths.items()}
    got = {k: [] for k in [*lengths, "q"]}
    for k in got:
        stage.add_request(k, use_codes=k == "q")
    first_at = {}
    for t in range(60):
        live = [k for k in lengths if t < lengths[k]]
        stage.append_batch(live, torch.stack([frames[k][t] for k in live]))
        if t < len(codes):
            stage.append("q", codes[t : t + 1])
        for k in got:
            if t + 1 == (len(codes) if k == "q" else lengths[k]):
                stage.finish(k)
        for ch in stage.step():
            first_at.setdefault(ch.req_id, t + 1)
            got[ch.req_id].append(ch)
    assert first_at["long"] == F + L and first_at["q"] > F + L  # codes: the exact right context
    assert stage.early.decoder.calls == len(stage.early.decoder.ends)  # only the long hidden-state stream went early
    head = 512 * stage.early.decoder.ends[-1]
    np.testing.assert_allclose(joined(got["q"]), one_shot(dvae, vocos, codes, codes=True), rtol=0, atol=1e-5)
    np.testing.assert_allclose(joined(got["short"]), one_shot(dec, vocos, frames["short"]), rtol=0, atol=1e-5)
    np.testing.assert_allclose(
        joined(got["long"])[head:], one_shot(dec, vocos, frames["long"])[head:], rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("defer", [False, True])
def test_one_call_decodes_each_row_as_its_window_alone(tiny, defer) -> None:
    """Rows of different windows share a call (each masked to its own window, its samples the one-shot decode of
    that window); calls pad to a row bucket, deferred to the largest until capture_next() took the rest."""
    dec, _, vocos = tiny
    early = EarlyChunkDecoder(dec, vocos, [F, 2 * F], L, max_rows=6)
    assert early.row_buckets == [1, 2, 4, 6] and early.widths == [F + L, 2 * F + L] and early.width == 2 * F + L
    x = _frames(6 * early.width, 4).view(6, early.width, 64)
    widths = [F + L, 2 * F + L, F + L, F + L, 2 * F + L, 2 * F + L]
    alone = [one_shot(dec, vocos, x[r, :w])[: 512 * (w - L)] for r, w in enumerate(widths)]
    eager = early(x, widths)  # graphs not enabled: the plain decode
    assert eager.shape == (6, 512 * 2 * F) and eager.dtype == torch.float32
    for r, w in enumerate(widths):
        np.testing.assert_allclose(eager[r, : 512 * (w - L)].numpy(), alone[r], rtol=0, atol=1e-5)
    narrow = early(x[[0, 2], : F + L], [F + L] * 2)  # eager: as wide as the call's widest window
    np.testing.assert_allclose(narrow.numpy(), eager[[0, 2], : 512 * F].numpy(), rtol=0, atol=1e-5)
    early.enable_graphs(defer=defer)
    assert early.num_pending == (3 if defer else 0)  # the 3 smaller buckets
    for _ in range(2):
        early(x[[5, 4, 3, 2, 1, 0]], widths[::-1])  # leaves other rows in the static buffers
        for b in (1, 3, 6):  # buckets 1, 4 (a padding row), 6; deferred at first: 6 for all
            np.testing.assert_allclose(early(x[:b], widths[:b]).numpy(), eager[:b].numpy(), rtol=0, atol=1e-6)
        while early.num_pending:
            early.capture_next()
    assert sorted(early.graphs) == early.row_buckets


def test_the_stage_hands_its_early_buckets_to_the_deferred_captures(tiny) -> None:
    dec, _, vocos = tiny
    stage = IncrementalAudioStage(dec, None, vocos, first_chunk_frames=F, first_chunk_lookahead=L)
    stage.enable_cuda_graphs(4, row_buckets=[2, 4], frame_buckets=[8, 17], defer=True)
    early = stage.early.decoder
    assert early in stage.graph_families() and early.num_pending == len(early.row_buckets) - 1


def test_no_early_decoder_where_the_exact_chunk_is_as_early(tiny) -> None:
    dec, _, vocos = tiny
    assert IncrementalAudioStage(dec, None, vocos, first_chunk_frames=F, first_chunk_lookahead=13).early is None
    with pytest.raises(ValueError, match="first_chunk_lookahead"):
        IncrementalAudioStage(dec, None, vocos, first_chunk_lookahead=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"first_chunk_lookahead_frames": 0}, "first_chunk_lookahead_frames must be >= 1"),
        ({"first_chunk_lookahead_frames": 16, "lookahead_frames": 16}, "exact vocoder only"),
    ],
)
def test_engine_config_rejects_bad_first_chunk_lookahead(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_a_failed_capture_leaves_the_plain_decode(tiny, caplog) -> None:
    dec, _, vocos = tiny
    early = EarlyChunkDecoder(dec, vocos, [F], L, max_rows=4)
    x = _frames(3 * (F + L), 6).view(3, F + L, 64)
    ref = early(x, [F + L] * 3)
    early.device = torch.device("cuda")  # its capture path; on a machine without CUDA every allocation there fails
    early.enable_graphs()
    assert early.x is None and not early.graphs and "decoding eagerly" in caplog.text
    np.testing.assert_array_equal(early(x, [F + L] * 3).numpy(), ref.numpy())
