"""The engine's streaming vocoder stage: which stage (exact incremental, or windowed with a shorter lookahead),
in which network dtype, and built for a loaded model with an EngineConfig's chunking."""

from __future__ import annotations

import torch

from ttsserve.audio.decoder_net import DVAE, HiddenDecoder
from ttsserve.audio.incremental_stage import IncrementalAudioStage
from ttsserve.audio.stage import AudioStage
from ttsserve.audio.stream_base import StreamingStage
from ttsserve.audio.vocos import Vocos


def vocoder_net_dtype(model) -> torch.dtype | None:
    """The Decoder / Vocos dtype the engine runs for a ChatTTSModel (None: the checkpoint's, fp32).

    With a 16-bit GPT on CUDA the networks run in fp16: on an H200 3.7x faster than fp32 and as fast as bf16,
    with 0.22% relative L2 error on the waveform against bf16's 1.8% (53 vs 35 dB SNR,
    benchmarks/gpu_bench.py). The fp32 GPT (the parity path) keeps fp32 networks."""
    if model.device.type == "cuda" and model.dtype in (torch.bfloat16, torch.float16):
        return torch.float16
    if model.device.type == "cpu" and model.dtype == torch.bfloat16:
        from ttsserve.platform import cpu_has_native_bf16

        # CPUs with native bf16 dot products (AVX512_BF16 / AMX): 2x faster than fp32 at 35 dB SNR
        # (benchmarks/cpu_parity.py); elsewhere oneDNN emulates bf16 and fp32 is faster
        return torch.bfloat16 if cpu_has_native_bf16() else None
    return None


def make_audio_stage(
    decoder: HiddenDecoder | None, dvae: DVAE | None, vocos: Vocos, *, lookahead_frames: int | None = None, **kwargs
) -> StreamingStage:
    """The engine's stage: incremental when exact (lookahead None; first_chunk_lookahead: early chunks),
    windowed with a shorter lookahead."""
    if lookahead_frames is None:
        return IncrementalAudioStage(decoder, dvae, vocos, **kwargs)
    if kwargs.pop("first_chunk_lookahead", None) is not None:
        raise ValueError("first_chunk_lookahead applies to the exact vocoder only: unset lookahead_frames")
    if kwargs.pop("cadence", 1) != 1:
        raise ValueError("vocoder_cadence applies to the exact vocoder only: unset lookahead_frames")
    return AudioStage(decoder, dvae, vocos, lookahead_frames=lookahead_frames, **kwargs)


def model_audio_stage(model, cfg, **kwargs) -> StreamingStage:
    """make_audio_stage for a loaded ChatTTSModel with an EngineConfig's chunking (kwargs: cadence, deferred,
    net_dtype): the engine's stage and the memory profile's build it the same way."""
    return make_audio_stage(
        model.decoder,
        None,
        model.vocos,
        first_chunk_frames=cfg.first_chunk_frames,
        max_chunk_frames=cfg.max_chunk_frames,
        lookahead_frames=cfg.lookahead_frames,
        first_chunk_lookahead=cfg.first_chunk_lookahead_frames,
        device=model.device,
        **kwargs,
    )
