"""The engine's streaming vocoder stage, built from its config: the stage, its dtype, its CUDA graphs."""

from __future__ import annotations

from ttsserve.config import EngineConfig


def build_audio_stage(cfg: EngineConfig, model, cadence: int, cuda_graphs: bool, defer: bool):
    """The StreamingStage of `model` (a ChatTTSModel) for `cfg`, deferred (its calls read back later) on CUDA.
    cuda_graphs: capture the exact stage's call graphs (defer: the largest bucket only; graph_families() hold
    the rest for the engine's deferred captures)."""
    from ttsserve.audio.stage_factory import model_audio_stage, vocoder_net_dtype

    cuda = model.device.type == "cuda"
    stage = model_audio_stage(model, cfg, cadence=cadence, deferred=cuda, net_dtype=vocoder_net_dtype(model))
    if cuda_graphs and hasattr(stage, "enable_cuda_graphs"):
        # every (rows, frames) bucket of the engine's calls has a graph (the largest at least): the eager
        # call, which a warm-up would prepare, never runs
        stage.enable_cuda_graphs(cfg.max_num_seqs, defer=defer)
    elif cuda:
        stage.profile_max_call(1)  # warm-up: the first real call must not pay the kernel selection
    if cuda and cfg.audio_stream:
        stage.use_own_stream()
    return stage
