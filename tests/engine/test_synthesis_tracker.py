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


def _run_random(rng, lengths, order_seed):
    """Feed segments of the given lengths in random chunks and random interleaving; -> (audio, spans, raw)."""
    raw = [rng.standard_normal(n).astype(np.float32) + 10 * (i + 1) for i, n in enumerate(lengths)]
    t = SynthesisTracker("r", len(lengths), [], [f"s{i}" for i in range(len(lengths))])
    events = []
    for i, a in enumerate(raw):
        cuts = sorted(rng.integers(0, a.size + 1, size=rng.integers(0, 4)).tolist())
        events.append([("audio", i, p) for p in np.split(a, cuts)] + [("finish", i, None)])
    outs = []
    order = np.random.default_rng(order_seed)
    while any(events):
        live = [e for e in events if e]
        kind, i, piece = live[order.integers(len(live))].pop(0)
        t.add_audio(i, piece) if kind == "audio" else t.finish_segment(i, "stop")
        outs.extend(t.drain())
    audio, fin = _collect(outs)
    spans = [s for o in outs for s in o.segments]
    assert len(fin) == 1
    return audio, spans, raw


def test_segment_spans_locate_each_segment_in_the_output():
    rng = np.random.default_rng(0)
    for trial in range(200):
        lengths = rng.integers(0, 2500, size=rng.integers(1, 6)).tolist()
        audio, spans, raw = _run_random(rng, lengths, trial)
        assert [s.index for s in spans] == list(range(len(lengths)))
        assert [s.text for s in spans] == [f"s{i}" for i in range(len(lengths))]
        assert spans[0].start == 0 and spans[-1].end == audio.size
        for i, s in enumerate(spans):
            assert 0 <= s.end - s.start <= lengths[i]
            if i:
                assert spans[i - 1].start <= s.start and spans[i - 1].end <= s.end
                assert 0 <= spans[i - 1].end - s.start <= CROSSFADE_SAMPLES
        # outside every fade, the output is exactly that segment's audio (its true start: end - length)
        for i, s in enumerate(spans):
            lo = max([p.end for p in spans[:i]], default=0)
            hi = min([p.end - lengths[p.index] for p in spans[i + 1 :]], default=audio.size)
            true_start = s.end - lengths[i]
            if hi > lo:
                assert np.array_equal(audio[lo:hi], raw[i][lo - true_start : hi - true_start])
            assert s.start == max(true_start, spans[i - 1].start if i else 0)  # exact unless clamped in order


def test_spans_ride_on_outputs_once():
    t = SynthesisTracker("r", 2, [], ["a", "b"])
    t.add_audio(0, np.ones(1000, np.float32))
    t.finish_segment(0, "stop")
    first = t.drain()
    assert [s.text for o in first for s in o.segments] == ["a"]
    t.add_audio(1, np.ones(1000, np.float32))
    t.finish_segment(1, "stop")
    second = t.drain()
    spans = [s for o in second for s in o.segments]
    assert [(s.text, s.start, s.end) for s in spans] == [("b", 1000 - CROSSFADE_SAMPLES, 2000 - CROSSFADE_SAMPLES)]
