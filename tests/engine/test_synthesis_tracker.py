import numpy as np

from ttsserve.engine.synthesis import CROSSFADE_SAMPLES, SynthesisTracker


def _collect(outs):
    audio = [o.samples for o in outs if not o.finished]
    final = [o for o in outs if o.finished]
    return (np.concatenate(audio) if audio else np.zeros(0, np.float32)), final


def test_single_segment_streams_through_unchanged():
    t = SynthesisTracker("r", 1, [])
    a = np.arange(1000, dtype=np.float32)
    t.add_audio(0, a[:300])
    got1, fin = _collect(t.drain())
    assert np.array_equal(got1, a[:300]) and not fin
    t.add_audio(0, a[300:])
    t.finish_segment(0, "stop")
    got2, fin = _collect(t.drain())
    assert np.array_equal(got2, a[300:]) and fin[0].finish_reason == "stop"


def test_segments_released_in_order_with_crossfade():
    t = SynthesisTracker("r", 2, [])
    s0, s1 = np.ones(2000, np.float32), np.full(3000, 2.0, np.float32)
    t.add_audio(1, s1)  # the later segment finishes first: nothing may leave before segment 0
    t.finish_segment(1, "length")
    got, fin = _collect(t.drain())
    assert got.size == 0 and not fin
    t.add_audio(0, s0)
    t.finish_segment(0, "stop")
    got, fin = _collect(t.drain())
    n = CROSSFADE_SAMPLES
    assert got.size == s0.size + s1.size - n
    assert np.all(got[: s0.size - n] == 1.0) and np.all(got[s0.size :] == 2.0)
    mid = got[s0.size - n : s0.size]
    assert np.all(np.diff(mid) >= 0) and 1.0 <= mid.min() and mid.max() <= 2.0  # a monotone fade 1 -> 2
    assert fin[0].finish_reason == "length" and fin[0].truncated_segments == [1]


def test_error_finishes_stream():
    t = SynthesisTracker("r", 3, ["?"])
    t.fail("boom")
    _, fin = _collect(t.drain())
    assert fin[0].finish_reason == "error" and fin[0].error == "boom" and fin[0].dropped_chars == ["?"]
    assert t.drain() == []
