"""Numbers fixed by the ChatTTS model, and defaults shared by several layers (one definition each)."""

from __future__ import annotations

VERSION = "0.1.0"  # the package version (pyproject.toml says the same; ttsserve.__version__ is this)
MODEL_NAME = "chattts"  # the served model's id (`GET /v1/models`, the default `model` of a request)
SAMPLE_RATE = 24000  # Hz: the Vocos vocoder's output rate
SAMPLES_PER_FRAME = 512  # one GPT step = one code frame = 2 * the vocoder's 256-sample hop
FRAMES_PER_SECOND = SAMPLE_RATE / SAMPLES_PER_FRAME  # 46.875
DEFAULT_CPU_KV_BYTES = 1 << 30  # the KV pool on the CPU when EngineConfig.kv_cache_memory is unset


def speaker_stats(spk_stat, hidden_size: int):
    """The random-speaker table (std, mean), fp16 [hidden_size] each: the checkpoint's `spk_stat`, or N(0, 1)
    (std 1, mean 0) for a checkpoint without one."""
    if spk_stat is not None:
        return spk_stat
    import numpy as np

    return np.ones(hidden_size, np.float16), np.zeros(hidden_size, np.float16)
