"""Audio post-processing on float32 mono arrays: resampling, volume normalization, silence trimming.

Every function takes and returns 1-D float32 arrays `[num_samples]`. The streaming classes keep the
state needed so that processing a signal chunk by chunk gives what one call on the whole signal gives
(exactly for the resampler; by a documented rule for the normalizer).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import soxr

from ttsserve.constants import SAMPLE_RATE

# soxr "HQ" is 20-bit precision; more than 16-bit output can show, and fast enough per chunk.
RESAMPLE_QUALITY = "HQ"


def as_mono_float32(x: np.ndarray, name: str = "samples") -> np.ndarray:
    """Return `x` as a contiguous 1-D float32 array, or raise ValueError naming what is wrong."""
    x = np.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"{name} must be a 1-D mono array [num_samples], got shape {x.shape}")
    if not (np.issubdtype(x.dtype, np.floating) or x.size == 0):
        raise ValueError(f"{name} must be floating point in [-1, 1], got dtype {x.dtype}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_rate(rate: int, name: str) -> int:
    if not isinstance(rate, (int, np.integer)) or isinstance(rate, bool) or rate <= 0:
        raise ValueError(f"{name} must be a positive integer in Hz, got {rate!r}")
    return int(rate)


def resample(x: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Resample a whole signal with soxr.

    Args:
        x: [n] float32.
    Returns:
        [round(n * to_rate / from_rate)] float32; `x` itself when the rates are equal.
    """
    x = as_mono_float32(x)
    from_rate, to_rate = _check_rate(from_rate, "from_rate"), _check_rate(to_rate, "to_rate")
    if from_rate == to_rate or x.size == 0:
        return x
    return soxr.resample(x, from_rate, to_rate, quality=RESAMPLE_QUALITY).astype(np.float32, copy=False)


class StreamResampler:
    """Chunked resampling (soxr.ResampleStream).

    The concatenation of `process()` outputs plus `flush()` equals `resample()` of the concatenated input
    (soxr's stream is chunking-invariant; tests check it). Output lags input by the filter delay, so a
    call may return fewer samples than its input implies (or none); `flush()` returns the rest.
    """

    def __init__(self, from_rate: int, to_rate: int) -> None:
        self.from_rate = _check_rate(from_rate, "from_rate")
        self.to_rate = _check_rate(to_rate, "to_rate")
        self._stream = (
            None
            if self.from_rate == self.to_rate
            else soxr.ResampleStream(self.from_rate, self.to_rate, 1, dtype="float32", quality=RESAMPLE_QUALITY)
        )
        self._flushed = False

    def process(self, x: np.ndarray) -> np.ndarray:
        """[n] float32 in -> [m] float32 out, m ~ n * to_rate / from_rate minus what the filter holds back."""
        if self._flushed:
            raise ValueError("StreamResampler.process() called after flush()")
        x = as_mono_float32(x)
        if self._stream is None or x.size == 0:
            return x
        return self._stream.resample_chunk(x)

    def flush(self) -> np.ndarray:
        """Return the samples the filter still holds; the resampler is finished afterwards."""
        if self._flushed:
            return np.zeros(0, np.float32)
        self._flushed = True
        if self._stream is None:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(np.zeros(0, np.float32), last=True)


# ---------------------------------------------------------------- volume


def apply_gain(x: np.ndarray, gain: float) -> np.ndarray:
    """`x` times `gain`, clipped to [-1, 1] (a gain above 1 saturates rather than wrapping in 16-bit output)."""
    if gain == 1.0:
        return x
    return np.clip(x * np.float32(gain), -1.0, 1.0).astype(np.float32, copy=False)


def db_to_amplitude(db: float) -> float:
    return float(10.0 ** (db / 20.0))


def normalize_volume(
    x: np.ndarray,
    target_dbfs: float = -3.0,
    mode: Literal["peak", "rms"] = "peak",
    max_gain_db: float = 30.0,
) -> np.ndarray:
    """Scale a whole signal to a target level without clipping.

    Rule: gain = target / level, where level is max|x| ("peak") or sqrt(mean(x^2)) ("rms"), then
    gain = min(gain, 10^(max_gain_db/20), 1/max|x|) so that silence or noise is never boosted by more than
    `max_gain_db` and the result never exceeds full scale (RMS targets are peak-limited, not clipped).

    Args:
        x: [n] float32. target_dbfs: level in dB relative to full scale (<= 0).
    Returns:
        [n] float32, `x * gain`; a silent (all-zero) or empty input is returned unchanged.
    """
    x = as_mono_float32(x)
    if mode not in ("peak", "rms"):
        raise ValueError(f"mode must be 'peak' or 'rms', got {mode!r}")
    if not (target_dbfs <= 0.0):
        raise ValueError(f"target_dbfs must be <= 0 dBFS, got {target_dbfs}")
    peak = float(np.max(np.abs(x))) if x.size else 0.0
    if peak == 0.0:
        return x
    level = peak if mode == "peak" else float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))
    gain = min(db_to_amplitude(target_dbfs) / level, db_to_amplitude(max_gain_db), 1.0 / peak)
    return (x * np.float32(gain)).astype(np.float32, copy=False)


class StreamNormalizer:
    """Streaming peak normalization with a running gain that never clips.

    Rule: before each chunk, running_peak = max(running_peak, max|chunk|) and
    gain = min(10^(max_gain_db/20), 10^(target_dbfs/20) / running_peak). The running peak only grows, so
    the gain only falls: no emitted sample ever exceeds the target peak, and no sample already sent needs
    revisiting. The first chunks may be louder relative to later ones than in `normalize_volume`
    (which sees the true peak); with speech the peak is usually reached within the first sentence.
    """

    def __init__(self, target_dbfs: float = -3.0, max_gain_db: float = 30.0) -> None:
        if not (target_dbfs <= 0.0):
            raise ValueError(f"target_dbfs must be <= 0 dBFS, got {target_dbfs}")
        self._target = db_to_amplitude(target_dbfs)
        self._max_gain = db_to_amplitude(max_gain_db)
        self.running_peak = 0.0
        self.gain = 1.0

    def process(self, x: np.ndarray) -> np.ndarray:
        """[n] float32 -> [n] float32 scaled by the current gain."""
        x = as_mono_float32(x)
        if x.size:
            self.running_peak = max(self.running_peak, float(np.max(np.abs(x))))
        if self.running_peak > 0.0:
            self.gain = min(self._max_gain, self._target / self.running_peak)
        return (x * np.float32(self.gain)).astype(np.float32, copy=False)


# ---------------------------------------------------------------- trimming


def trim_silence(
    x: np.ndarray,
    sample_rate: int = SAMPLE_RATE,
    threshold_db: float = -50.0,
    keep_ms: float = 50.0,
) -> np.ndarray:
    """Remove leading and trailing silence; the middle is never touched.

    A sample is "sound" when |x| > 10^(threshold_db/20). The result runs from `keep_ms` before the first
    sound sample to `keep_ms` after the last one (clamped to the signal).

    Args:
        x: [n] float32.
    Returns:
        a view `x[start:end]`, [end - start] float32; an empty array when no sample is sound.
    """
    x = as_mono_float32(x)
    sample_rate = _check_rate(sample_rate, "sample_rate")
    if keep_ms < 0:
        raise ValueError(f"keep_ms must be >= 0, got {keep_ms}")
    loud = np.flatnonzero(np.abs(x) > db_to_amplitude(threshold_db))
    if loud.size == 0:
        return x[:0]
    keep = int(round(keep_ms * sample_rate / 1000.0))
    start = max(0, int(loud[0]) - keep)
    end = min(x.size, int(loud[-1]) + 1 + keep)
    return x[start:end]
