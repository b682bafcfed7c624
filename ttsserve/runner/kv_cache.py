"""The paged KV pool on the device, its host-side swap pool, and sizing it from a memory budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ttsserve.attention.backend import kv_cache_shape
from ttsserve.config import GPTConfig

logger = logging.getLogger(__name__)

FRAMES_PER_SECOND = 24000 / 512  # 46.875: one GPT step = one frame = 512 samples at 24 kHz
DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def concurrent_utterances(self, seconds: float = 30.0, prompt_len: int = 64) -> int:
        """How many utterances of `seconds` of audio (plus a prompt) fit at once, block-rounded."""
        tokens = prompt_len + int(seconds * FRAMES_PER_SECOND)
        blocks_each = -(-tokens // self.block_size)
        return self.num_blocks // blocks_each

    def report(self) -> str:
        gib = self.num_tokens * self.bytes_per_token / 2**30
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} = {self.num_tokens} frames "
                f"({gib:.2f} GiB, {self.bytes_per_token / 1024:.0f} KiB per frame); fits "
                f"{self.concurrent_utterances(30.0)} concurrent 30-s utterances "
                f"({self.concurrent_utterances(10.0)} of 10 s); swap space {self.num_cpu_blocks} blocks")


def plan_kv_cache(cfg: GPTConfig, dtype: torch.dtype, block_size: int, budget_bytes: int,
                  swap_bytes: int) -> KVCacheSpec:
    per_token = cfg.kv_bytes_per_token(torch.tensor([], dtype=dtype).element_size())
    per_block = per_token * block_size
    num_blocks = int(budget_bytes // per_block)
    if num_blocks < 2:
        raise ValueError(f"KV cache budget of {budget_bytes / 2**20:.1f} MiB holds fewer than 2 blocks "
                         f"({per_block / 2**20:.2f} MiB each): raise --kv-cache-memory / --gpu-memory-utilization")
    return KVCacheSpec(num_blocks, int(swap_bytes // per_block), block_size, per_token)


class KVCache:
    """Per-layer device caches [2, num_blocks, block_size, Hkv, D] and host swap caches of the same layout."""

    def __init__(self, cfg: GPTConfig, spec: KVCacheSpec, device: torch.device, dtype: torch.dtype) -> None:
        shape = kv_cache_shape(spec.num_blocks, spec.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.layers = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        cpu_shape = kv_cache_shape(spec.num_cpu_blocks, spec.block_size, cfg.num_kv_heads, cfg.head_dim)
        pin = device.type == "cuda"
        # Host blocks are always fully written by a swap-out before they are read: no need to zero them.
        self.cpu_layers = [torch.empty(cpu_shape, dtype=dtype, pin_memory=pin) for _ in range(cfg.num_layers)]
        self.spec = spec

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: mapping = [(gpu_block, cpu_block), ...]."""
        if not mapping:
            return
        src = torch.tensor([g for g, _ in mapping], device=self.layers[0].device)
        dst = torch.tensor([c for _, c in mapping])
        for dev, host in zip(self.layers, self.cpu_layers):
            host[:, dst] = dev[:, src].to("cpu")

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: mapping = [(cpu_block, gpu_block), ...]."""
        if not mapping:
            return
        src = torch.tensor([c for c, _ in mapping])
        dst = torch.tensor([g for _, g in mapping], device=self.layers[0].device)
        for dev, host in zip(self.layers, self.cpu_layers):
            dev[:, dst] = host[:, src].to(dev.device, non_blocking=True)
