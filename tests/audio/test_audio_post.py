"""Resampling, volume normalization, silence trimming, speed mapping and pitch-preserving time stretch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ttsserve.audio.post import (
    StreamNormalizer,
    StreamResampler,
    normalize_volume,
    resample,
    trim_silence,
)
from ttsserve.audio.speed import (
    SPEED_TOKEN_RATES,
    StreamTimeStretcher,
    atempo_stages,
    speed_to_prompt,
    speed_token,
    time_stretch,
)

RATE = 24000
CUTS = [0, 1, 1, 999, 4096, 11111, 20000]


def _sine(freq: float, seconds: float, rate: int = RATE, amp: float = 0.5) -> np.ndarray:
    return (amp * np.sin(2 * np.pi * freq * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def _chunks(x: np.ndarray) -> list[np.ndarray]:
    return [x[a:b] for a, b in zip(CUTS, CUTS[1:] + [x.size])]


def _dominant_hz(x: np.ndarray, rate: int) -> float:
    """Peak of the Hann-windowed spectrum of the middle of x, refined by parabolic interpolation."""
    mid = x[x.size // 8 : x.size - x.size // 8].astype(np.float64)
    spec = np.abs(np.fft.rfft(mid * np.hanning(mid.size)))
    k = int(np.argmax(spec[1:-1])) + 1
    a, b, c = np.log(spec[k - 1 : k + 2] + 1e-12)
    return (k + 0.5 * (a - c) / (a - 2 * b + c)) * rate / mid.size


# ---------------------------------------------------------------- resampling


@pytest.mark.parametrize("to_rate", [8000, 16000, 22050, 44100, 48000])
def test_resample_length_and_frequency(to_rate):
    x = _sine(440.0, 1.0)
    y = resample(x, RATE, to_rate)
    assert y.dtype == np.float32 and y.size == to_rate
    assert _dominant_hz(x, RATE) == pytest.approx(440.0, abs=0.5)
    assert _dominant_hz(y, to_rate) == pytest.approx(440.0, abs=0.5)
    assert np.abs(y).max() == pytest.approx(0.5, abs=0.02)


def test_resample_same_rate_is_identity():
    x = _sine(300.0, 0.1)
    np.testing.assert_array_equal(resample(x, RATE, RATE), x)


@pytest.mark.parametrize("to_rate", [16000, 44100])
def test_stream_resampler_equals_whole(to_rate):
    x = np.random.default_rng(0).uniform(-0.5, 0.5, 30000).astype(np.float32)
    rs = StreamResampler(RATE, to_rate)
    parts = [rs.process(c) for c in _chunks(x)]
    y = np.concatenate(parts + [rs.flush()])
    np.testing.assert_array_equal(y, resample(x, RATE, to_rate))
    assert sum(p.size for p in parts) > 0.9 * y.size  # it streams: only the filter tail waits for flush
    with pytest.raises(ValueError, match="after flush"):
        rs.process(x)


def test_resample_rejects_bad_input():
    with pytest.raises(ValueError, match="to_rate"):
        resample(np.zeros(10, np.float32), RATE, 0)
    with pytest.raises(ValueError, match="1-D"):
        resample(np.zeros((1, 10), np.float32), RATE, 16000)


# ---------------------------------------------------------------- volume


def test_normalize_peak():
    x = _sine(200.0, 0.2, amp=0.1)
    y = normalize_volume(x, target_dbfs=-6.0, mode="peak")
    assert np.abs(y).max() == pytest.approx(10 ** (-6 / 20), rel=1e-5)
    np.testing.assert_allclose(y / np.abs(y).max(), x / np.abs(x).max(), atol=1e-6)


def test_normalize_rms_and_peak_limit():
    x = _sine(200.0, 0.2, amp=0.1)  # rms = 0.1/sqrt(2)
    y = normalize_volume(x, target_dbfs=-20.0, mode="rms")
    assert np.sqrt(np.mean(y.astype(np.float64) ** 2)) == pytest.approx(0.1, rel=1e-4)
    spiky = np.zeros(24000, np.float32)
    spiky[100] = 0.5  # tiny rms, big peak: the rms gain would clip, so the peak limit wins
    z = normalize_volume(spiky, target_dbfs=-10.0, mode="rms", max_gain_db=60.0)
    assert np.abs(z).max() == pytest.approx(1.0, rel=1e-6)


def test_normalize_gain_cap_and_silence():
    quiet = _sine(200.0, 0.1, amp=1e-4)
    y = normalize_volume(quiet, target_dbfs=0.0, max_gain_db=20.0)
    assert np.abs(y).max() == pytest.approx(1e-3, rel=1e-4)  # capped at +20 dB, not boosted to 0 dBFS
    silent = np.zeros(100, np.float32)
    np.testing.assert_array_equal(normalize_volume(silent), silent)
    with pytest.raises(ValueError, match="mode"):
        normalize_volume(quiet, mode="lufs")
    with pytest.raises(ValueError, match="target_dbfs"):
        normalize_volume(quiet, target_dbfs=3.0)


def test_stream_normalizer_never_clips_and_gain_only_falls():
    target = 10 ** (-3 / 20)
    amps = [0.05, 0.2, 0.1, 0.9, 0.3, 1.6]
    norm = StreamNormalizer(target_dbfs=-3.0, max_gain_db=30.0)
    gains, outs = [], []
    for amp in amps:
        outs.append(norm.process(_sine(300.0, 0.05, amp=amp)))
        gains.append(norm.gain)
    assert max(np.abs(o).max() for o in outs) <= target * (1 + 1e-6)
    assert all(g1 >= g2 for g1, g2 in zip(gains, gains[1:]))
    assert np.abs(outs[0]).max() == pytest.approx(target, rel=1e-3)  # first chunk is brought to target
    assert np.abs(outs[-1]).max() == pytest.approx(target, rel=1e-3)


def test_stream_normalizer_steady_signal_matches_whole():
    x = _sine(300.0, 0.5, amp=0.2)
    norm = StreamNormalizer(target_dbfs=-1.0)
    y = np.concatenate([norm.process(c) for c in _chunks(x)])
    np.testing.assert_allclose(y, normalize_volume(x, target_dbfs=-1.0), atol=1e-5)


# ---------------------------------------------------------------- trimming


def test_trim_silence_ends_only():
    tone = _sine(300.0, 0.1)
    gap = np.zeros(4800, np.float32)  # 200 ms of internal silence must stay
    x = np.concatenate([np.zeros(12000, np.float32), tone, gap, tone, np.zeros(6000, np.float32)])
    y = trim_silence(x, RATE, threshold_db=-50.0, keep_ms=10.0)
    keep = 240
    first = 12000 + int(np.flatnonzero(np.abs(tone) > 10 ** (-50 / 20))[0])
    last = 12000 + tone.size + gap.size + int(np.flatnonzero(np.abs(tone) > 10 ** (-50 / 20))[-1])
    np.testing.assert_array_equal(y, x[first - keep : last + 1 + keep])
    assert y.size == 2 * tone.size + gap.size + 2 * keep - 1  # a sine starts at 0: first sample is silent


def test_trim_silence_threshold_noise_and_edges():
    rng = np.random.default_rng(1)
    noise = (rng.uniform(-1, 1, 24000) * 1e-4).astype(np.float32)  # -80 dBFS floor
    x = noise.copy()
    x[10000:11000] += _sine(500.0, 1000 / RATE)
    y = trim_silence(x, RATE, threshold_db=-60.0, keep_ms=0.0)
    assert 990 <= y.size <= 1000
    assert trim_silence(noise, RATE, threshold_db=-60.0).size == 0
    loud = _sine(500.0, 0.1, amp=0.9)
    assert trim_silence(loud, RATE, keep_ms=100.0).size == loud.size  # keep clamps to the signal
    with pytest.raises(ValueError, match="keep_ms"):
        trim_silence(x, RATE, keep_ms=-1)


# ---------------------------------------------------------------- speed mapping


def test_speed_to_prompt_normal_and_bounds():
    assert speed_to_prompt(1.0) == (5, 1.0)
    assert speed_to_prompt(0.25) == (0, pytest.approx(0.5))
    assert speed_to_prompt(4.0) == (9, pytest.approx(4.0 / 1.4))
    assert speed_to_prompt(1.2) == (7, pytest.approx(1.0))
    assert SPEED_TOKEN_RATES[5] == 1.0 and speed_token(5) == "[speed_5]"


def test_speed_to_prompt_is_monotone_and_exact():
    speeds = np.linspace(0.25, 4.0, 301)
    prev_n = 0
    for s in speeds:
        n, residual = speed_to_prompt(float(s))
        assert n >= prev_n
        prev_n = n
        assert SPEED_TOKEN_RATES[n] * residual == pytest.approx(s)
        if 0.5 <= s <= 1.4:  # inside the token range the stretch only fine-tunes: at most half the
            assert abs(math.log(residual)) <= math.log(0.6 / 0.5) / 2 + 1e-9  # widest log gap


@pytest.mark.parametrize("bad", [0.2, 4.01, 0.0, -1.0, float("nan"), float("inf"), True, "1.0", None])
def test_speed_out_of_range(bad):
    with pytest.raises(ValueError, match="speed"):
        speed_to_prompt(bad)
    with pytest.raises(ValueError, match="speed"):
        time_stretch(np.zeros(10, np.float32), bad, RATE)


def test_atempo_stages():
    for f in (0.25, 0.3, 0.5, 0.9, 1.7, 2.0, 3.0, 4.0):
        stages = atempo_stages(f)
        assert all(0.5 <= s <= 2.0 for s in stages)
        assert math.prod(stages) == pytest.approx(f)
    assert atempo_stages(1.0) == []
    assert len(atempo_stages(4.0)) == 2 and len(atempo_stages(0.25)) == 2


# ---------------------------------------------------------------- time stretch


@pytest.mark.parametrize("factor", [0.25, 0.6, 1.5, 3.0])
def test_time_stretch_duration_and_pitch(factor):
    x = _sine(440.0, 1.0)
    y = time_stretch(x, factor, RATE)
    assert y.dtype == np.float32
    assert y.size == round(x.size / factor)  # flush pads/cuts atempo's end-of-stream error
    frames = y[: y.size // 480 * 480].reshape(-1, 480)  # 20 ms frames
    rms = np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1))
    assert rms[:-5].min() > 0.3  # steady level (0.354) except in the last 100 ms: no dropouts
    assert _dominant_hz(y, RATE) == pytest.approx(440.0, abs=2.0)


def test_time_stretch_identity():
    x = _sine(440.0, 0.1)
    np.testing.assert_array_equal(time_stretch(x, 1.0, RATE), x)


@pytest.mark.parametrize("factor", [0.7, 2.5])
def test_stream_time_stretcher_matches_whole(factor):
    x = _sine(330.0, 1.0)
    st = StreamTimeStretcher(factor, RATE)
    parts = [st.process(c) for c in _chunks(x)]
    y = np.concatenate(parts + [st.flush()])
    whole = time_stretch(x, factor, RATE)
    assert y.size == whole.size == round(x.size / factor)
    assert sum(p.size for p in parts) > 0.8 * y.size  # output follows input, not held until flush
    assert _dominant_hz(y, RATE) == pytest.approx(330.0, abs=2.0)
    with pytest.raises(ValueError, match="after flush"):
        st.process(x)
