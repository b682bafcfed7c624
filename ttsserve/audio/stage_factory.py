"""The streaming vocoder stage of a loaded model, chunked as an EngineConfig says."""

from __future__ import annotations

from ttsserve.audio.incremental_stage import make_audio_stage
from ttsserve.audio.stream_base import StreamingStage


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
        device=model.device,
        **kwargs,
    )
