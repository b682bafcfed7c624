"""decode_audio_file: a duration cap checked from the header before decoding and enforced while decoding,
so memory stays bounded by the cap whatever the file claims (tracemalloc sees numpy's allocations)."""

from __future__ import annotations

import io
import tracemalloc

import numpy as np
import pytest
import soundfile as sf

from tests.server.helpers import silent_flac
from ttsserve.audio import decode
from ttsserve.audio.decode import AudioTooLongError, decode_audio_file

RATE = 16000
CAP_S = 30.0
CAP_BYTES = int(CAP_S * RATE) * 4  # the cap as mono float32: 1.9 MB; 20 minutes would be 77 MB


def _peak_bytes(fn, *args) -> tuple[BaseException | None, int]:
    tracemalloc.start()
    try:
        fn(*args)
        error = None
    except Exception as e:
        error = e
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return error, peak


def _sine(seconds: float, channels: int) -> np.ndarray:
    t = np.arange(round(seconds * RATE)) / RATE
    return np.stack([0.1 * (c + 1) * np.sin(2 * np.pi * 220 * t) for c in range(channels)], axis=1).astype(np.float32)


def _wav(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, RATE, format="WAV", subtype="FLOAT")
    return buf.getvalue()


@pytest.mark.parametrize("reader", [decode_audio_file, decode._read_av], ids=["libsndfile", "ffmpeg"])
def test_a_header_over_the_cap_is_refused_before_decoding(reader):
    data = silent_flac(20 * 60)
    assert len(data) < 100_000  # what makes it dangerous: tiny upload, 77 MB decoded
    error, peak = _peak_bytes(reader, data, CAP_S)
    assert isinstance(error, AudioTooLongError) and error.header_seconds == pytest.approx(1200)
    assert "30 s" in str(error)
    assert peak < CAP_BYTES / 4  # nothing was decoded


def test_a_header_without_the_length_stops_decoding_at_the_cap():
    data = silent_flac(20 * 60, length_in_header=False)
    error, peak = _peak_bytes(decode_audio_file, data, CAP_S)
    assert isinstance(error, AudioTooLongError) and error.header_seconds is None
    assert peak < 3 * CAP_BYTES  # the cap's worth of blocks plus their concatenation at most, not 20 minutes


@pytest.mark.parametrize("length_in_header", [True, False], ids=["header", "no-length"])
def test_the_cap_is_exact(length_in_header):
    exact = silent_flac(2.0, length_in_header=length_in_header)
    x, rate = decode_audio_file(exact, 2.0)
    assert rate == RATE and x.dtype == np.float32 and x.shape == (2 * RATE,)
    over = silent_flac(2.0 + 1 / RATE, length_in_header=length_in_header)
    with pytest.raises(AudioTooLongError):
        decode_audio_file(over, 2.0)


def test_multichannel_is_averaged_to_mono_by_both_decoders():
    x = _sine(1.5, channels=3)
    want = x.mean(axis=1)
    got, rate = decode_audio_file(_wav(x), CAP_S)  # libsndfile
    assert rate == RATE
    np.testing.assert_allclose(got, want, atol=1e-6)
    got, rate = decode._read_av(_wav(x), CAP_S)  # FFmpeg
    assert rate == RATE
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("data", [b"", b"RIFF garbage", bytes(1000)])
def test_garbage_is_a_plain_value_error(data):
    with pytest.raises(ValueError) as ei:
        decode_audio_file(data, CAP_S)
    assert not isinstance(ei.value, AudioTooLongError)
