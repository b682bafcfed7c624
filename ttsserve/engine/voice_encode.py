"""Reference recording -> audio-code prompt (ChatTTS's sample-audio speaker, MODEL.md §5.4)."""

from __future__ import annotations

import numpy as np
import torch

from ttsserve.constants import MAX_REFERENCE_SECONDS, SAMPLE_RATE


def encode_reference(model, wav: np.ndarray, sample_rate: int) -> np.ndarray:
    """wav: float [n] (or [n, channels]) at `sample_rate` -> int32 [num_vq, P] codes (P ~ 46.9 per second)."""
    from ttsserve.audio.post import resample

    wav = np.asarray(wav, dtype=np.float32)
    if wav.ndim == 2:
        wav = wav.mean(axis=1)
    if wav.ndim != 1 or wav.size < sample_rate // 10:
        raise ValueError("reference audio must be mono or multi-channel and at least 0.1 s long")
    if wav.size > MAX_REFERENCE_SECONDS * sample_rate:
        raise ValueError(f"reference audio is longer than {MAX_REFERENCE_SECONDS:.0f} s")
    if sample_rate != SAMPLE_RATE:
        wav = resample(wav, sample_rate, SAMPLE_RATE)
    with torch.inference_mode():
        codes = model.dvae.encode_wav(torch.from_numpy(wav).to(model.device))
    return codes[0].to(torch.int32).cpu().numpy()
