"""Container encoding at the HTTP edge: one continuous encoder per response (wav, pcm, flac, mp3, opus, aac).

Formats (OpenAI `response_format` names):
    wav   RIFF PCM s16le mono. Streamed: the 44-byte header carries 0xFFFFFFFF RIFF and data sizes (the
          "unknown length" convention; FFmpeg and libsndfile read it to EOF, tested). Non-streamed: real sizes.
    pcm   raw s16le mono, no header (as OpenAI's `pcm`).
    flac  native FLAC stream, s16. Streamed STREAMINFO has total_samples = 0 (unknown) and no MD5, which
          the FLAC format allows (FFmpeg decodes it; python-soundfile cannot, it seeks by the length);
          non-streamed output gets both.
    mp3   MPEG audio via libmp3lame. Non-streamed output also carries the LAME/Xing tag (gapless trim).
    opus  Ogg Opus via libopus. Opus only runs at 8/12/16/24/48 kHz: 22050 and 44100 are encoded at
          48000 (the Ogg header's input_sample_rate says 48000; decoders output 48 kHz for Opus anyway).
    aac   AAC-LC in an ADTS stream (what OpenAI returns for `aac`): every frame is self-delimiting, so the
          bytes can be played while they arrive; MP4/M4A could not be streamed without fragmenting.

Float -> int16: x is clipped to [-1, 1] and scaled by 32767 with rounding. The reference rescales each
call by its own peak (MODEL.md §7.4: 16383 when a chunk peaks in (1, 2]); per chunk that makes the loudness
of a streamed response jump between chunks, so we use one fixed scale and clip the rare overshoot.
Lossy codecs get the clipped float directly.
"""

from __future__ import annotations

import functools
import io
import struct
from fractions import Fraction

import av
import numpy as np

from ttsserve.audio.post import StreamResampler, as_mono_float32
from ttsserve.constants import SAMPLE_RATE

FORMATS: tuple[str, ...] = ("mp3", "opus", "aac", "flac", "wav", "pcm")
SAMPLE_RATES: tuple[int, ...] = (8000, 16000, 22050, 24000, 44100, 48000)
OPUS_RATES: tuple[int, ...] = (8000, 12000, 16000, 24000, 48000)

# audio/ogg is the registered type for Ogg Opus files (RFC 7845 section 9); audio/opus (RFC 7587) names
# RTP payloads, though browsers and HTTP clients accept either. pcm has no registered type for s16le;
# audio/pcm is what OpenAI-compatible servers send and clients ignore the type for raw PCM anyway.
_CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
# format -> (FFmpeg muxer, FFmpeg encoder, sample format fed to the encoder)
_AV_CODECS = {
    "mp3": ("mp3", "libmp3lame", "flt"),
    "opus": ("ogg", "libopus", "flt"),
    "aac": ("adts", "aac", "flt"),
    "flac": ("flac", "flac", "s16"),
}
# Mono 24 kHz speech: transparent enough at these rates, far below PCM's 384 kb/s.
BIT_RATES = {"mp3": 96_000, "opus": 48_000, "aac": 96_000}
# LAME's quality/speed knob (0 best and slowest .. 9; lame.h: "5 good quality, fast"). Best of 5 on the
# 2-core CPU machine, 96 kb/s 24-kHz mono, 1.37-s writes: on white noise (what dummy weights produce) FFmpeg's
# default (LAME's 3) encodes at 77x real time per core, 5 at 112x, 7 at 152x; on a voiced signal (harmonics
# of a 110-170 Hz pitch) 3, 5 and 7 all run at 95-120x and decode at the same 26.0 dB SNR.
_ENCODER_OPTIONS = {"libmp3lame": {"compression_level": "5"}}
# Ogg pages of at most 20 ms: without it the muxer holds about 1 s of audio per page, i.e. latency.
_MUXER_OPTIONS = {"ogg": {"page_duration": "20000"}}
_UNKNOWN_SIZE = 0xFFFFFFFF


@functools.cache
def _encoder_available(codec: str) -> bool:
    try:
        av.codec.Codec(codec, "w")
    except ValueError:  # av.codec.codec.UnknownCodecError is a ValueError
        return False
    return True


def validate_format(fmt: str) -> str:
    """Return `fmt` if it names a format whose encoder exists, else raise ValueError."""
    if fmt not in FORMATS:
        raise ValueError(f"unsupported audio format {fmt!r}; allowed: {', '.join(FORMATS)}")
    if fmt in _AV_CODECS and not _encoder_available(_AV_CODECS[fmt][1]):
        raise ValueError(
            f"audio format {fmt!r} needs the FFmpeg encoder {_AV_CODECS[fmt][1]!r}, "
            f"which the FFmpeg bundled with PyAV {av.__version__} lacks"
        )
    return fmt


def validate_sample_rate(sample_rate: int) -> int:
    """Return `sample_rate` if it is an allowed output rate, else raise ValueError."""
    if isinstance(sample_rate, bool) or sample_rate not in SAMPLE_RATES:
        raise ValueError(f"unsupported sample rate {sample_rate!r}; allowed: {', '.join(map(str, SAMPLE_RATES))}")
    return int(sample_rate)


def content_type(fmt: str) -> str:
    """HTTP Content-Type of a format (raises ValueError for an unknown one)."""
    return _CONTENT_TYPES[validate_format(fmt)]


def encoded_sample_rate(fmt: str, sample_rate: int) -> int:
    """The rate actually written: `sample_rate`, except 48000 for opus when Opus cannot run at it."""
    validate_format(fmt)
    sample_rate = validate_sample_rate(sample_rate)
    if fmt == "opus" and sample_rate not in OPUS_RATES:
        return 48000
    return sample_rate


def float_to_int16(x: np.ndarray) -> np.ndarray:
    """[n] float -> [n] int16: NaN -> 0, clip to [-1, 1], round(x * 32767). Clipped into one new float32 array
    and scaled and rounded in it (every API server converts each chunk: 13.5 against 27.5 us for a 6.5-frame
    chunk made a new array per operation). Clipping first: a float32 beyond 1.04e34 scaled would overflow."""
    y = np.clip(np.asarray(x, dtype=np.float32), -1.0, 1.0)  # +-inf too
    np.multiply(y, np.float32(32767.0), out=y)
    if not np.isfinite(y).all():  # NaN: left by the clip
        np.nan_to_num(y, copy=False, nan=0.0)
    return np.rint(y, out=y).astype(np.int16)


def wav_header(sample_rate: int, num_samples: int | None = None) -> bytes:
    """44-byte canonical RIFF/WAVE header for mono s16le; `num_samples=None` writes 0xFFFFFFFF sizes."""
    if num_samples is None:
        riff_size = data_size = _UNKNOWN_SIZE
    else:
        data_size = 2 * num_samples
        riff_size = 36 + data_size
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, 2 * sample_rate, 2, 16)
        + b"data"
        + struct.pack("<I", data_size)
    )


class _DrainSink:
    """Write-only, non-seekable file object for PyAV: muxers then stream and never seek back."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        return len(data)

    def drain(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class _AvWriter:
    """One PyAV container + encoder stream writing into `sink` (a _DrainSink or a seekable BytesIO)."""

    def __init__(self, fmt: str, rate: int, sink: _DrainSink | io.BytesIO) -> None:
        muxer, codec, self._sample_fmt = _AV_CODECS[fmt]
        self._container = av.open(sink, "w", format=muxer, options=_MUXER_OPTIONS.get(muxer, {}))
        self._stream = self._container.add_stream(
            codec, rate=rate, layout="mono", options=_ENCODER_OPTIONS.get(codec, {})
        )
        if fmt in BIT_RATES:
            self._stream.bit_rate = BIT_RATES[fmt]
        self._rate = rate
        self._pts = 0

    def encode(self, x: np.ndarray) -> None:
        """x: [n] float32 at the stream rate. PyAV re-blocks it into the codec's frame size."""
        if x.size == 0:
            return
        if self._sample_fmt == "s16":
            data = float_to_int16(x)
        else:
            data = np.clip(np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)
        frame = av.AudioFrame.from_ndarray(data[None, :], format=self._sample_fmt, layout="mono")
        frame.sample_rate = self._rate
        frame.pts = self._pts
        frame.time_base = Fraction(1, self._rate)
        self._pts += x.size
        self._mux(frame)

    def close(self) -> None:
        self._mux(None)  # drains the encoder (and PyAV's re-blocking FIFO)
        self._container.close()  # writes the trailer

    def _mux(self, frame: av.AudioFrame | None) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)


class StreamingEncoder:
    """Continuous encoder for one response.

    Args:
        fmt: one of FORMATS. sample_rate: output rate, one of SAMPLE_RATES.
        input_rate: rate of the float samples given to `write` (ChatTTS: 24000).
    `write(samples [n] float32) -> bytes` returns the encoded bytes ready now (often b"" while a codec
    fills a frame); `close() -> bytes` flushes resampler, encoder and muxer and returns the tail. The
    concatenation of all returned bytes is one valid stream in the format. Not thread-safe.
    Closed without any samples: wav gives a bare header, flac a header-only stream, mp3/opus/aac b"".
    Decoders see the codec's priming samples in streamed mp3 (1105) and in aac (1024, ADTS has no
    field to trim them); Ogg Opus carries pre-skip and the whole-file mp3 a LAME tag, so those trim.
    """

    def __init__(self, fmt: str, sample_rate: int = SAMPLE_RATE, input_rate: int = SAMPLE_RATE) -> None:
        self.fmt = validate_format(fmt)
        self.sample_rate = encoded_sample_rate(fmt, sample_rate)
        self.input_rate = input_rate
        self._resampler = StreamResampler(input_rate, self.sample_rate)
        self._sink = _DrainSink()
        self._writer = _AvWriter(fmt, self.sample_rate, self._sink) if fmt in _AV_CODECS else None
        self._header = wav_header(self.sample_rate) if fmt == "wav" else b""
        self.closed = False

    def write(self, samples: np.ndarray) -> bytes:
        if self.closed:
            raise ValueError("StreamingEncoder.write() called after close()")
        return self._encode(self._resampler.process(as_mono_float32(samples)))

    def close(self) -> bytes:
        if self.closed:
            return b""
        out = self._encode(self._resampler.flush())
        self.closed = True
        if self._writer is not None:
            self._writer.close()
            out += self._sink.drain()
        return out

    def _encode(self, x: np.ndarray) -> bytes:
        head, self._header = self._header, b""
        if self._writer is None:
            return head + float_to_int16(x).tobytes() if x.size else head
        self._writer.encode(x)
        return self._sink.drain()


def encode_audio(samples: np.ndarray, fmt: str, sample_rate: int = SAMPLE_RATE, input_rate: int = SAMPLE_RATE) -> bytes:
    """Encode a whole signal `samples` [n] float32 (at `input_rate`) into one file of format `fmt`.

    Same resampling and quantization as StreamingEncoder (lossless formats decode to identical samples),
    but with a seekable output so headers carry real sizes (wav sizes, FLAC total samples and MD5, the
    mp3 LAME tag).
    """
    fmt = validate_format(fmt)
    rate = encoded_sample_rate(fmt, sample_rate)
    resampler = StreamResampler(input_rate, rate)
    x = resampler.process(as_mono_float32(samples))
    x = np.concatenate([x, resampler.flush()])
    if fmt in ("wav", "pcm"):
        pcm = float_to_int16(x).tobytes()
        return wav_header(rate, x.size) + pcm if fmt == "wav" else pcm
    buf = io.BytesIO()
    writer = _AvWriter(fmt, rate, buf)
    writer.encode(x)
    writer.close()
    return buf.getvalue()
