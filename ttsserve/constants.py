"""Numbers fixed by the ChatTTS model, and defaults shared by several layers (one definition each)."""

from __future__ import annotations

VERSION = "0.1.0"  # the package version (pyproject.toml says the same; ttsserve.__version__ is this)
MODEL_NAME = "chattts"  # the served model's id (`GET /v1/models`, the default `model` of a request)
SAMPLE_RATE = 24000  # Hz: the Vocos vocoder's output rate
SAMPLES_PER_FRAME = 512  # one GPT step = one code frame = 2 * the vocoder's 256-sample hop
FRAMES_PER_SECOND = SAMPLE_RATE / SAMPLES_PER_FRAME  # 46.875
# The longest reference recording a voice may be cloned from. Its DVAE codes become prompt positions (46.875 per
# second, MODEL.md §5.4 / §2.6) in front of the transcript and the text, and prompt plus output must fit the model's
# 4096 positions (MODEL.md §0, "Max positions"). 30 s is 1406 positions and leaves room for a full 2048-frame
# (44 s) segment plus about 640 text tokens; 60 s (2813 positions) would cut every segment to under 1283 frames
# even with no text at all.
MAX_REFERENCE_SECONDS = 30.0
DEFAULT_CPU_KV_BYTES = 1 << 30  # the KV pool on the CPU when EngineConfig.kv_cache_memory is unset


def speaker_stats(spk_stat, hidden_size: int):
    """The random-speaker table (std, mean), fp16 [hidden_size] each: the checkpoint's `spk_stat`, or N(0, 1)
    (std 1, mean 0) for a checkpoint without one."""
    if spk_stat is not None:
        return spk_stat
    import numpy as np

    return np.ones(hidden_size, np.float16), np.zeros(hidden_size, np.float16)
