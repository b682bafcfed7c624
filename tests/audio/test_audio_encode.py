"""Streaming and whole-file encoders, checked by decoding with independent decoders (PyAV, soundfile, numpy)."""

from __future__ import annotations

import io
import struct
import warnings

import av
import numpy as np
import pytest
import soundfile as sf
from hypothesis import given
from hypothesis import strategies as st

from ttsserve.audio import encode
from ttsserve.audio.encode import (
    FORMATS,
    StreamingEncoder,
    content_type,
    encode_audio,
    encoded_sample_rate,
    float_to_int16,
    validate_format,
    validate_sample_rate,
)
from ttsserve.audio.post import resample

IN_RATE = 24000
# Uneven chunk boundaries (including an empty chunk and a 1-sample chunk) over a 1.5 s signal.
CUTS = [0, 1, 1, 700, 5003, 5004, 17777, 30000, 36000]


def _signal(seconds: float = 1.5) -> np.ndarray:
    t = np.arange(int(seconds * IN_RATE)) / IN_RATE
    env = 0.6 + 0.4 * np.sin(2 * np.pi * 1.7 * t)  # slow envelope: a speech-like, non-stationary level
    x = env * (0.35 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1330 * t))
    return x.astype(np.float32)


def _stream(fmt: str, x: np.ndarray, sample_rate: int) -> tuple[bytes, list[bytes]]:
    enc = StreamingEncoder(fmt, sample_rate, IN_RATE)
    parts = [enc.write(x[a:b]) for a, b in zip(CUTS, CUTS[1:] + [x.size])]
    parts.append(enc.close())
    return b"".join(parts), parts


def _decode_av(data: bytes) -> tuple[np.ndarray, int]:
    """Decode with FFmpeg (PyAV) to float64 [n] and the decoded rate."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]  # mono: planar or packed
        rate = stream.codec_context.sample_rate
    out = np.concatenate(frames)
    if out.dtype == np.int16:
        return out / 32768.0, rate
    assert np.issubdtype(out.dtype, np.floating), out.dtype
    return out.astype(np.float64), rate


def _decode_int16_av(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
    out = np.concatenate(frames)
    assert out.dtype == np.int16
    return out


def _aligned_corr(a: np.ndarray, b: np.ndarray, max_lag: int = 4000) -> tuple[float, int]:
    """Normalized correlation of a[lag:] with b at the best lag in [-max_lag, max_lag] (codec delay)."""
    n = a.size + b.size
    xc = np.fft.irfft(np.fft.rfft(a, n) * np.conj(np.fft.rfft(b, n)), n)  # xc[k] = sum_i a[i + k] b[i]
    lags = np.r_[0 : max_lag + 1, -max_lag:0]
    lag = int(lags[np.argmax(xc[lags])])
    aa, bb = (a[lag:], b) if lag >= 0 else (a, b[-lag:])
    m = min(aa.size, bb.size)
    aa, bb = aa[:m], bb[:m]
    return float(np.dot(aa, bb) / (np.linalg.norm(aa) * np.linalg.norm(bb) + 1e-12)), lag


def _opus_head_rate(data: bytes) -> int:
    i = data.index(b"OpusHead")
    return struct.unpack_from("<I", data, i + 12)[0]


# ---------------------------------------------------------------- validation


def test_content_types():
    assert {f: content_type(f) for f in FORMATS} == {
        "mp3": "audio/mpeg",
        "opus": "audio/ogg",
        "aac": "audio/aac",
        "flac": "audio/flac",
        "wav": "audio/wav",
        "pcm": "audio/pcm",
    }


@pytest.mark.parametrize("bad", ["ogg", "MP3", "", "vorbis", None])
def test_bad_format_names_the_value(bad):
    with pytest.raises(ValueError, match="unsupported audio format") as e:
        validate_format(bad)
    assert repr(bad) in str(e.value) and "mp3" in str(e.value)
    with pytest.raises(ValueError):
        StreamingEncoder(bad, 24000)
    with pytest.raises(ValueError):
        encode_audio(np.zeros(10, np.float32), bad, 24000)


@pytest.mark.parametrize("bad", [11025, 12000, 0, -24000, 24000.5, True, "24000"])
def test_bad_sample_rate_names_the_value(bad):
    with pytest.raises(ValueError, match="unsupported sample rate") as e:
        validate_sample_rate(bad)
    assert "22050" in str(e.value)
    with pytest.raises(ValueError):
        StreamingEncoder("wav", bad)


def test_missing_ffmpeg_encoder_is_reported_at_validation(monkeypatch):
    monkeypatch.setattr(encode, "_encoder_available", lambda codec: codec != "libmp3lame")
    with pytest.raises(ValueError, match="libmp3lame"):
        validate_format("mp3")
    assert validate_format("opus") == "opus"


def test_opus_rate_mapping():
    assert encoded_sample_rate("opus", 24000) == 24000
    assert encoded_sample_rate("opus", 22050) == 48000
    assert encoded_sample_rate("opus", 44100) == 48000
    assert encoded_sample_rate("mp3", 22050) == 22050


def test_bad_samples_rejected():
    enc = StreamingEncoder("pcm", 24000)
    with pytest.raises(ValueError, match="1-D"):
        enc.write(np.zeros((2, 10), np.float32))
    with pytest.raises(ValueError, match="floating"):
        enc.write(np.zeros(10, np.int16))
    enc.close()
    with pytest.raises(ValueError, match="after close"):
        enc.write(np.zeros(10, np.float32))
    assert enc.close() == b""


# ---------------------------------------------------------------- quantization


def test_float_to_int16_clips_and_rounds():
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 1.7, -3.0, np.nan, 1e-5, np.inf, -np.inf, 1e34, -3e38], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 1e34 * 32767 overflows float32 if scaled before the clip
        got = float_to_int16(x).tolist()
    assert got == [0, 16384, -16384, 32767, -32767, 32767, -32767, 0, 0, 32767, -32767, 32767, -32767]


@given(
    st.lists(
        st.floats(width=32) | st.floats(-1.5, 1.5, width=32) | st.sampled_from([np.nan, np.inf, -np.inf]), max_size=64
    ),
    st.sampled_from([np.float32, np.float64]),
)
def test_float_to_int16_is_the_clipped_rounded_rule(values: list[float], dtype) -> None:
    """Any floats (NaN, infinities, subnormals, values either side of a rounding tie): NaN -> 0, then
    round(clip(x, -1, 1) * 32767) in float32, one array op at a time; and never a NaN cast to int16 (undefined
    in C, numpy warns), even where the platform's cast happens to give 0."""
    x = np.array(values, dtype=dtype)
    want = np.nan_to_num(x.astype(np.float32), nan=0.0, posinf=1.0, neginf=-1.0)
    want = np.rint(np.clip(want, -1.0, 1.0) * np.float32(32767.0)).astype(np.int16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = float_to_int16(x)
    np.testing.assert_array_equal(got, want)


def test_fixed_scale_across_chunks():
    """A loud chunk must not change the scale of the next one (the reference's per-chunk rescale would)."""
    enc = StreamingEncoder("pcm", 24000)
    loud = np.frombuffer(enc.write(np.full(100, 1.5, np.float32)), np.int16)
    quiet = np.frombuffer(enc.write(np.full(100, 0.5, np.float32)) + enc.close(), np.int16)
    assert (loud == 32767).all()
    assert (quiet == 16384).all()


# ---------------------------------------------------------------- lossless formats


@pytest.mark.parametrize("sample_rate", [24000, 16000, 44100])
@pytest.mark.parametrize("fmt", ["pcm", "wav", "flac"])
def test_lossless_stream_equals_whole_and_source(fmt, sample_rate):
    x = _signal()
    streamed, _ = _stream(fmt, x, sample_rate)
    whole = encode_audio(x, fmt, sample_rate, IN_RATE)
    expected = float_to_int16(resample(x, IN_RATE, sample_rate))
    assert expected.size == round(x.size * sample_rate / IN_RATE)
    if fmt == "pcm":
        assert streamed == whole
        np.testing.assert_array_equal(np.frombuffer(streamed, "<i2"), expected)
        return
    # soundfile (libsndfile) reads the whole file; PyAV (FFmpeg) reads the stream.
    ref, rate = sf.read(io.BytesIO(whole), dtype="int16")
    assert rate == sample_rate
    np.testing.assert_array_equal(ref, expected)
    np.testing.assert_array_equal(_decode_int16_av(streamed), expected)
    np.testing.assert_array_equal(_decode_int16_av(whole), expected)


def test_streamed_wav_header_unknown_sizes_and_decodes():
    x = _signal()
    streamed, parts = _stream("wav", x, 24000)
    assert parts[0][:4] == b"RIFF" and parts[0][8:16] == b"WAVEfmt "
    assert struct.unpack_from("<I", streamed, 4)[0] == 0xFFFFFFFF
    assert streamed[36:40] == b"data" and struct.unpack_from("<I", streamed, 40)[0] == 0xFFFFFFFF
    channels, rate, byte_rate, align, bits = struct.unpack_from("<HIIHH", streamed, 22)
    assert (channels, rate, byte_rate, align, bits) == (1, 24000, 48000, 2, 16)
    data, sf_rate = sf.read(io.BytesIO(streamed), dtype="int16")
    assert sf_rate == 24000
    np.testing.assert_array_equal(data, float_to_int16(x))
    np.testing.assert_array_equal(_decode_int16_av(streamed), float_to_int16(x))


def test_whole_wav_header_has_real_sizes():
    x = _signal()
    whole = encode_audio(x, "wav", 24000)
    assert len(whole) == 44 + 2 * x.size
    assert struct.unpack_from("<I", whole, 4)[0] == 36 + 2 * x.size
    assert struct.unpack_from("<I", whole, 40)[0] == 2 * x.size
    info = sf.info(io.BytesIO(whole))
    assert (info.frames, info.samplerate, info.channels, info.subtype) == (x.size, 24000, 1, "PCM_16")


# ---------------------------------------------------------------- lossy formats

# Extra decoded samples allowed (at the output rate) for encoder delay + padding when nothing trims them.
_LOSSY_SLACK = {"mp3": 3 * 1152, "aac": 3 * 1024, "opus": 3 * 960}


@pytest.mark.parametrize("sample_rate", [24000, 16000, 44100])
@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac"])
def test_lossy_stream_and_whole_decode_close(fmt, sample_rate):
    x = _signal()
    streamed, parts = _stream(fmt, x, sample_rate)
    whole = encode_audio(x, fmt, sample_rate, IN_RATE)
    assert sum(len(p) for p in parts[:-1]) > 0, "nothing was emitted before close(): not streaming"

    rate = encoded_sample_rate(fmt, sample_rate)
    if fmt == "opus":
        assert _opus_head_rate(streamed) == _opus_head_rate(whole) == rate
        rate = 48000  # Opus decoders always output 48 kHz
    reference = resample(x, IN_RATE, rate).astype(np.float64)
    for data in (streamed, whole):
        y, decoded_rate = _decode_av(data)
        assert decoded_rate == rate
        assert reference.size - 100 <= y.size <= reference.size + _LOSSY_SLACK[fmt] * rate // sample_rate
        corr, lag = _aligned_corr(y, reference)
        assert corr > 0.98, (fmt, sample_rate, corr, lag)
        assert 0 <= lag <= _LOSSY_SLACK[fmt] * rate // sample_rate
    ys, _ = _decode_av(streamed)
    yw, _ = _decode_av(whole)
    assert _aligned_corr(ys, yw)[0] > 0.99


def test_ogg_pages_flush_within_a_chunk():
    """Opus bytes must follow the audio closely (20 ms pages), not once per second of audio."""
    x = _signal(1.0)
    enc = StreamingEncoder("opus", 24000)
    sizes = [len(enc.write(c)) for c in np.split(x, 10)]  # 100 ms chunks
    enc.close()
    assert sum(1 for s in sizes if s > 0) >= 8


@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus"])
def test_interleaved_encoders_are_independent(fmt):
    """Two responses encoded at once (interleaved writes) give the same output as each one alone."""
    x, y = _signal(0.5), _signal(0.5)[::-1].copy()
    alone = [_stream(fmt, s, 24000)[0] for s in (x, y)]
    a, b = StreamingEncoder(fmt, 24000), StreamingEncoder(fmt, 24000)
    out_a, out_b = bytearray(), bytearray()
    for lo, hi in zip(CUTS, CUTS[1:] + [x.size]):
        out_a += a.write(x[lo:hi])
        out_b += b.write(y[lo:hi])
    out_a += a.close()
    out_b += b.close()
    if fmt == "opus":  # Ogg picks a random stream serial number per stream: compare the audio
        for got, want in zip((out_a, out_b), alone):
            np.testing.assert_array_equal(_decode_av(bytes(got))[0], _decode_av(want)[0])
    else:
        assert [bytes(out_a), bytes(out_b)] == alone
