"""Uploaded audio files -> mono float32, with a duration cap that holds whatever the file claims.

Compressed silence is tiny: 20 minutes of 16 kHz FLAC silence is about 60 KB, so the 25 MB upload limit
alone admits files that decode to tens of GB. `decode_audio_file` therefore checks the duration the
container header states before decoding anything, and counts samples while decoding (a header may omit
the length, as a streamed FLAC does, or understate it), stopping one block past the cap. Memory is then
bounded by about twice `max_seconds * sample_rate * 4` bytes (the mono blocks and their concatenation),
never by the file's real length.

libsndfile is tried first (WAV, FLAC, OGG, MP3 ...), FFmpeg (PyAV) for everything else and for files
libsndfile cannot read to the end (a FLAC whose STREAMINFO says total_samples = 0).
"""

from __future__ import annotations

import io

import numpy as np

# libsndfile reports SF_COUNT_MAX frames when the header leaves the length unknown.
_UNKNOWN_FRAMES = 1 << 62
# Samples (frames x channels) per libsndfile read: 4 MB of float32 per block even at its 1024 channels.
_BLOCK_SAMPLES = 1 << 20


class AudioTooLongError(ValueError):
    """The audio lasts longer than the cap. `header_seconds`: what the header said (None: found by decoding)."""

    def __init__(self, max_seconds: float, header_seconds: float | None = None) -> None:
        how = f"its header says {header_seconds:.1f} s" if header_seconds is not None else "found while decoding"
        super().__init__(f"audio is longer than the {max_seconds:g} s limit ({how})")
        self.max_seconds = max_seconds
        self.header_seconds = header_seconds


def decode_audio_file(data: bytes, max_seconds: float) -> tuple[np.ndarray, int]:
    """An uploaded audio file -> (mono float32 [n], sample rate) with n <= max_seconds * rate.

    Raises AudioTooLongError (a ValueError) when the header says the audio is longer than `max_seconds`
    (nothing is decoded then) or as soon as decoding passes it; ValueError if the file cannot be decoded.
    Channels are averaged block by block, so a multi-channel file costs no more than a mono one.
    """
    if not max_seconds > 0:
        raise ValueError(f"max_seconds must be > 0, got {max_seconds}")
    got = _read_sndfile(data, max_seconds)
    return got if got is not None else _read_av(data, max_seconds)


def _check_header(seconds: float | None, max_seconds: float) -> None:
    if seconds is not None and seconds > max_seconds:
        raise AudioTooLongError(max_seconds, seconds)


def _read_sndfile(data: bytes, max_seconds: float) -> tuple[np.ndarray, int] | None:
    """libsndfile's decode, or None when libsndfile cannot read this file (FFmpeg gets to try)."""
    import soundfile as sf

    try:
        f = sf.SoundFile(io.BytesIO(data))
    except Exception:  # not a libsndfile format (or a broken header): FFmpeg may still read it
        return None
    with f:
        rate, channels = int(f.samplerate), max(1, int(f.channels))
        if f.frames >= _UNKNOWN_FRAMES or rate <= 0:
            return None  # libsndfile seeks by the length while reading, so it fails on these
        _check_header(f.frames / rate, max_seconds)
        limit = int(max_seconds * rate)
        block = max(1, _BLOCK_SAMPLES // channels)
        parts: list[np.ndarray] = []
        n = 0
        try:
            while n <= limit:  # reads at most limit + 1 frames: one past the cap proves "too long"
                x = f.read(min(block, limit + 1 - n), dtype="float32", always_2d=True)
                if not len(x):
                    break
                parts.append(x.mean(axis=1, dtype=np.float32))
                n += len(x)
        except Exception:  # a body libsndfile chokes on after a valid header: FFmpeg gets to try
            return None
    if n > limit:
        raise AudioTooLongError(max_seconds)
    return (np.concatenate(parts) if parts else np.zeros(0, np.float32)), rate


def _av_header_seconds(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:  # microseconds (AV_TIME_BASE); FFmpeg may estimate it from the bitrate
        return container.duration / 1e6
    return None


def _read_av(data: bytes, max_seconds: float) -> tuple[np.ndarray, int]:
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.audio[0]
            _check_header(_av_header_seconds(container, stream), max_seconds)
            rate = int(stream.rate or 0)
            parts = _decode_av_stream(container, stream, int(max_seconds * rate), max_seconds) if rate > 0 else []
    except AudioTooLongError:
        raise
    except Exception as e:  # PyAV raises many error types for garbage input
        raise ValueError(f"could not decode the audio file ({type(e).__name__})") from None
    if not parts:
        raise ValueError("the audio file holds no audio")
    return np.concatenate(parts), rate


def _decode_av_stream(container, stream, limit: int, max_seconds: float) -> list[np.ndarray]:
    """Mono float32 blocks of `stream`; AudioTooLongError once they hold more than `limit` samples."""
    import av

    # Planar float in the file's own layout, averaged here: FFmpeg's own downmix to mono is not the mean
    # (stereo gets 0.707 * (L + R), which can exceed 1), and libsndfile's path takes the mean.
    resampler = av.AudioResampler(format="fltp")
    parts: list[np.ndarray] = []
    n = 0
    for frame in _frames(container, stream):
        for out in resampler.resample(frame):
            parts.append(out.to_ndarray().mean(axis=0, dtype=np.float32))
            n += parts[-1].size
        if n > limit:
            raise AudioTooLongError(max_seconds)
    return parts


def _frames(container, stream):
    """The stream's decoded frames, then None (which flushes the resampler)."""
    yield from container.decode(stream)
    yield None
