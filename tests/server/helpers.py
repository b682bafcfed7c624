"""Decoding and signal helpers for server tests."""

from __future__ import annotations

import base64
import io
import json

import av
import numpy as np
import soundfile as sf

from tests.server.fake_engine import SAMPLES_PER_FRAME, FakeEngine


def decode(data: bytes, fmt: str, pcm_rate: int = 24000) -> tuple[np.ndarray, int]:
    """Any response format -> (mono float32 [n], sample rate)."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0, pcm_rate
    if fmt == "wav":
        return _sf_read(data, "float32")
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.audio[0]
        frames = [f.to_ndarray().astype(np.float32) for f in c.decode(stream)]
        rate = stream.codec_context.sample_rate
    # planar float [channels, n] or packed; take channel 0
    x = np.concatenate([f.reshape(f.shape[0], -1)[0] if f.ndim == 2 else f for f in frames])
    return x, rate


def decode_int16(data: bytes, fmt: str) -> np.ndarray:
    """Lossless formats -> the exact int16 samples."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2")
    if fmt == "flac":  # libsndfile cannot read a streamed FLAC (total_samples = 0); FFmpeg can
        with av.open(io.BytesIO(data)) as c:
            out = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
        assert out.dtype == np.int16
        return out
    return _sf_read(data, "int16")[0]


def _sf_read(data: bytes, dtype: str) -> tuple[np.ndarray, int]:
    """libsndfile read in blocks: a streamed FLAC says total_samples = 0 (unknown), so read to EOF."""
    out = []
    with sf.SoundFile(io.BytesIO(data)) as f:
        while True:
            block = f.read(65536, dtype=dtype, always_2d=True)
            out.append(block[:, 0])
            if len(block) < 65536:
                return np.concatenate(out), f.samplerate


def expected_sine(engine: FakeEngine, index: int = -1) -> np.ndarray:
    """The float32 samples the fake engine produced for its `index`-th request (uncapped length aside)."""
    req = engine.requests[index]
    frames = min(4 * len(req.text), req.code_params.max_new_tokens)
    t = np.arange(frames * SAMPLES_PER_FRAME) / engine.sample_rate
    return (0.3 * np.sin(2 * np.pi * engine._frequency(req) * t)).astype(np.float32)


def to_int16(x: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(x, -1, 1) * 32767.0).astype(np.int16)


def dominant_hz(x: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    return float(np.argmax(spec) * rate / x.size)


def parse_sse(body: bytes) -> list[dict]:
    events = []
    for block in body.decode().split("\n\n"):
        lines = [ln[len("data: ") :] for ln in block.splitlines() if ln.startswith("data: ")]
        if lines:
            events.append(json.loads("\n".join(lines)))
    return events


def sse_audio(events: list[dict]) -> bytes:
    return b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")


def wav_bytes(seconds: float, rate: int = 16000, hz: float = 220.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.2 * np.sin(2 * np.pi * hz * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


# The real engine gives a seeded request the same tokens whatever else runs, but batched float math (and
# prefix-cache hits vs. recompute) can move a sample by one int16 step: measured max |diff| = 1 LSB.
SAME_AUDIO_LSB = 2


def same_audio(a: bytes | np.ndarray, b: bytes | np.ndarray, max_lsb: int = SAME_AUDIO_LSB) -> bool:
    """Two s16 PCM signals (bytes or int16 arrays) of equal length that differ by at most max_lsb."""
    a = np.frombuffer(a, "<i2") if isinstance(a, bytes) else np.asarray(a)
    b = np.frombuffer(b, "<i2") if isinstance(b, bytes) else np.asarray(b)
    return a.shape == b.shape and (a.size == 0 or int(np.abs(a.astype(np.int32) - b).max()) <= max_lsb)


def silent_flac(seconds: float, rate: int = 16000, channels: int = 1, length_in_header: bool = True) -> bytes:
    """A FLAC of digital silence, written a minute at a time: 20 minutes is ~60 KB of file.

    length_in_header=False zeroes STREAMINFO's total_samples, as a streamed FLAC has it ("unknown").
    """
    buf = io.BytesIO()
    minute = np.zeros((60 * rate, channels), np.int16)
    with sf.SoundFile(buf, "w", samplerate=rate, channels=channels, format="FLAC", subtype="PCM_16") as f:
        for _ in range(int(seconds // 60)):
            f.write(minute)
        f.write(minute[: round(seconds % 60 * rate)])
    data = bytearray(buf.getvalue())
    if not length_in_header:
        # "fLaC", a 4-byte block header, then STREAMINFO: bytes 18..25 hold rate(20) channels(3) bits(5)
        # total_samples(36 bits).
        packed = int.from_bytes(data[18:26], "big")
        data[18:26] = (packed & ~((1 << 36) - 1)).to_bytes(8, "big")
    return bytes(data)
