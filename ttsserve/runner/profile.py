"""Size the KV pool from what a worst-case step needs (CUDA only): gpu_memory_utilization is honoured.

budget = utilization * total - memory other users hold (CUDA context, other processes) - the weights
         - the peak activations of a max-size step - a reserve for the CUDA graphs and allocator slack.

The max-size step is profiled, not guessed: one forward of max_num_batched_tokens prompt tokens through the GPT
(paged attention over a temporary cache just big enough), the heads and the sampler for max_num_seqs rows, and
the vocoder stage's largest batched call.
"""

from __future__ import annotations

import gc
import logging

import torch

from ttsserve.attention.backend import PagedAttention, kv_cache_shape
from ttsserve.attention.torch_ref import make_metadata
from ttsserve.config import EngineConfig

logger = logging.getLogger(__name__)

GRAPH_RESERVE_BYTES = 256 << 20  # decode graphs' pool (measured ~100 MiB at 256 rows) + allocator slack


def kv_budget_after_profiling(model, cfg: EngineConfig) -> int:
    """Bytes the KV pool may take on model.device after a profiled max-size step (raises ValueError when
    nothing is left). cfg.max_num_seqs unset: the device's default rows are profiled (the engine may then
    lower them to what the pool holds, never raise them)."""
    from dataclasses import replace

    dev = model.device
    cfg = replace(cfg, max_num_seqs=cfg.default_max_num_seqs(dev.type))
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    weights = torch.cuda.memory_allocated(dev)
    others = total - free - torch.cuda.memory_reserved(dev)  # CUDA context + other processes
    torch.cuda.reset_peak_memory_stats(dev)
    temp = profile_max_step(model, cfg)
    torch.cuda.synchronize(dev)
    activations = torch.cuda.max_memory_allocated(dev) - weights - temp
    torch.cuda.empty_cache()
    # The vocoder's graphs keep a pool as large as its largest call for good (audio/vocoder_graphs.py), and
    # the piecewise prefill graphs one as large as a max-size step's largest piece, at most its activations.
    graph_pools = 0 if cfg.enforce_eager else profile_vocoder_call_bytes(model, cfg) + activations
    reserve = GRAPH_RESERVE_BYTES + graph_pools
    budget = int(cfg.gpu_memory_utilization * total - others - weights - activations - reserve)
    logger.info(
        "memory: %.2f GiB total x %.2f utilization; %.2f GiB used by others (context, processes), "
        "%.2f GiB weights, %.2f GiB peak activations of a max-size step, %.2f GiB graph reserve "
        "-> %.2f GiB for the KV cache",
        total / 2**30,
        cfg.gpu_memory_utilization,
        others / 2**30,
        weights / 2**30,
        activations / 2**30,
        reserve / 2**30,
        budget / 2**30,
    )
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache at gpu_memory_utilization="
            f"{cfg.gpu_memory_utilization} ({budget / 2**30:.2f} GiB): raise it or free the GPU"
        )
    return budget


@torch.inference_mode()
def profile_max_step(model, cfg: EngineConfig) -> int:
    """Run the largest step the engine can schedule; returns the bytes of temporary buffers (the scratch KV
    cache) that count in the peak but not as activations."""
    gcfg, dev, dtype = model.gpt_config, model.device, model.dtype
    max_len = min(cfg.max_model_len, gcfg.max_position_embeddings)
    tokens = max(1, min(cfg.max_num_batched_tokens, cfg.max_num_seqs * max_len))
    lens = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
    bs = cfg.block_size
    tables, next_block = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(list(range(next_block, next_block + nb)))
        next_block += nb
    shape = kv_cache_shape(next_block, bs, gcfg.num_kv_heads, gcfg.head_dim)
    caches = [torch.empty(shape, device=dev, dtype=dtype) for _ in range(gcfg.num_layers)]
    temp = sum(c.numel() * c.element_size() for c in caches)
    md = make_metadata(tables, [0] * len(lens), lens, bs, device=dev)
    x = torch.randn(tokens, gcfg.hidden_size, device=dev, dtype=dtype)
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    scale = gcfg.head_dim**-0.5
    from ttsserve.attention.backend import runner_backend

    backend, _ = runner_backend(dev, gcfg.head_dim)
    hidden = model.gpt(x, positions, PagedAttention(backend, caches, md, scale))
    del caches, x
    _profile_sampler(model, cfg, hidden[-1:].float().expand(cfg.max_num_seqs, -1).contiguous())
    del hidden
    _profile_vocoder(model, cfg)
    return temp


def _profile_sampler(model, cfg: EngineConfig, h: torch.Tensor) -> None:
    from ttsserve.sample.sampler import sample
    from ttsserve.sample.state import SamplingState

    n, gcfg = h.shape[0], model.gpt_config
    state = SamplingState(n, gcfg.num_vq, 16, h.device)
    rows = torch.arange(n, device=h.device)
    steps = torch.zeros(n, dtype=torch.int64, device=h.device)
    sample(model.embed.code_logits(h), state.batch(rows, steps, gcfg.num_vq, gcfg.audio_eos_id))
    sample(model.embed.text_logits(h)[:, None, :], state.batch(rows, steps, 1, 0))


def _profile_vocoder(model, cfg: EngineConfig, net_dtype: torch.dtype | None = None) -> None:
    from ttsserve.audio.stage_factory import model_audio_stage

    stage = model_audio_stage(model, cfg, deferred=False, net_dtype=net_dtype)
    stage.profile_max_call()


@torch.inference_mode()
def profile_vocoder_call_bytes(model, cfg: EngineConfig) -> int:
    """Peak bytes of the vocoder stage's largest call in the networks' serving dtype (what its graphs'
    pool keeps), measured."""
    from ttsserve.audio.stage_factory import vocoder_net_dtype

    dev = model.device
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    _profile_vocoder(model, cfg, vocoder_net_dtype(model))
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    gc.collect()
    torch.cuda.empty_cache()
    return peak
