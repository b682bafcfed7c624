"""The paged KV pool on the device, its host-side swap pool, and sizing it from a memory budget.

kv_cache_dtype "auto" stores K/V in the model dtype; "fp8" (CUDA only) stores e4m3 values plus one fp32
scale per token and head (ttsserve/layers/quant/kv_fp8.py), each layer an FP8KVCache instead of a tensor.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ttsserve.attention.backend import kv_cache_shape
from ttsserve.config import GPTConfig
from ttsserve.constants import FRAMES_PER_SECOND
from ttsserve.layers.quant.kv_fp8 import FP8KVCache, check_kv_cache_dtype, fp8_bytes_per_element

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    bytes_per_token: int
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "fp8"

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def concurrent_utterances(self, seconds: float = 30.0, prompt_len: int = 64) -> int:
        """How many utterances of `seconds` of audio (plus a prompt) fit at once, block-rounded."""
        tokens = prompt_len + int(seconds * FRAMES_PER_SECOND)
        blocks_each = -(-tokens // self.block_size)
        return self.num_blocks // blocks_each

    def rows_that_fit(self, cap: int, seconds: float = 10.0) -> int:
        """The batch rows worth scheduling: at most `cap`, and no more (rounded down to 16) than utterances of
        `seconds` the pool holds at once, so a full batch does not preempt itself (never below min(cap, 16))."""
        return min(cap, max(min(cap, 16), self.concurrent_utterances(seconds) // 16 * 16))

    def report(self) -> str:
        gib = self.num_tokens * self.bytes_per_token / 2**30
        kind = " fp8" if self.kv_cache_dtype == "fp8" else ""
        return (
            f"KV cache{kind}: {self.num_blocks} blocks x {self.block_size} = {self.num_tokens} frames "
            f"({gib:.2f} GiB, {self.bytes_per_token / 1024:.0f} KiB per frame); fits "
            f"{self.concurrent_utterances(30.0)} concurrent 30-s utterances "
            f"({self.concurrent_utterances(10.0)} of 10 s); swap space {self.num_cpu_blocks} blocks"
        )


def kv_bytes_per_token(cfg: GPTConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V of every layer for one frame (fp8: one byte a value plus a 4-byte scale per head)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "fp8":
        return int(cfg.kv_bytes_per_token(1) * fp8_bytes_per_element(cfg.head_dim))
    return cfg.kv_bytes_per_token(torch.tensor([], dtype=dtype).element_size())


def plan_kv_cache(
    cfg: GPTConfig,
    dtype: torch.dtype,
    block_size: int,
    budget_bytes: int,
    swap_bytes: int,
    kv_cache_dtype: str = "auto",
) -> KVCacheSpec:
    """How many blocks of `block_size` frames fit in `budget_bytes` (device) and `swap_bytes` (host)."""
    per_token = kv_bytes_per_token(cfg, dtype, kv_cache_dtype)
    per_block = per_token * block_size
    num_blocks = int(budget_bytes // per_block)
    if num_blocks < 2:
        raise ValueError(
            f"KV cache budget of {budget_bytes / 2**20:.1f} MiB holds fewer than 2 blocks "
            f"({per_block / 2**20:.2f} MiB each): raise --kv-cache-memory / --gpu-memory-utilization"
        )
    return KVCacheSpec(num_blocks, int(swap_bytes // per_block), block_size, per_token, kv_cache_dtype)


class KVCache:
    """Per-layer device caches [2, num_blocks, block_size, Hkv, D] and host swap caches of the same layout
    (FP8KVCache objects of that shape when spec.kv_cache_dtype == "fp8"; ValueError off CUDA)."""

    def __init__(self, cfg: GPTConfig, spec: KVCacheSpec, device: torch.device, dtype: torch.dtype) -> None:
        check_kv_cache_dtype(spec.kv_cache_dtype, device)
        shape = kv_cache_shape(spec.num_blocks, spec.block_size, cfg.num_kv_heads, cfg.head_dim)
        cpu_shape = kv_cache_shape(spec.num_cpu_blocks, spec.block_size, cfg.num_kv_heads, cfg.head_dim)
        t0 = time.perf_counter()
        # Host blocks are always fully written by a swap-out before they are read: no need to zero them. They
        # are pageable: swap_out / swap_in copy through the temporaries that gathering blocks by index makes,
        # never from or into the pool itself, so pinning it (page by page, GiBs of it) would only lengthen
        # the start.
        if spec.kv_cache_dtype == "fp8":
            self.layers = [FP8KVCache.zeros(shape, device) for _ in range(cfg.num_layers)]
            t1 = time.perf_counter()
            self.cpu_layers = [FP8KVCache.empty(cpu_shape, "cpu") for _ in range(cfg.num_layers)]
        else:
            self.layers = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
            t1 = time.perf_counter()
            self.cpu_layers = [torch.empty(cpu_shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.spec = spec
        # seconds the allocations took (the start-up log reports them): device pool, host swap pool
        self.alloc_s = (t1 - t0, time.perf_counter() - t1)

    @staticmethod
    def _parts(layer: torch.Tensor | FP8KVCache) -> tuple[torch.Tensor, ...]:
        """The tensors of one layer's cache, all indexed [2, block, ...]."""
        return (layer.data, layer.scales) if isinstance(layer, FP8KVCache) else (layer,)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: mapping = [(gpu_block, cpu_block), ...]."""
        if not mapping:
            return
        src = torch.tensor([g for g, _ in mapping], device=self.layers[0].device)
        dst = torch.tensor([c for _, c in mapping])
        for dev_layer, host_layer in zip(self.layers, self.cpu_layers):
            for dev, host in zip(self._parts(dev_layer), self._parts(host_layer)):
                host[:, dst] = dev[:, src].to("cpu")

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: mapping = [(cpu_block, gpu_block), ...]."""
        if not mapping:
            return
        src = torch.tensor([c for c, _ in mapping])
        dst = torch.tensor([g for _, g in mapping], device=self.layers[0].device)
        for dev_layer, host_layer in zip(self.layers, self.cpu_layers):
            for dev, host in zip(self._parts(dev_layer), self._parts(host_layer)):
                dev[:, dst] = host[:, src].to(dev.device, non_blocking=True)


def plan_engine_batch(cfg, model) -> tuple:
    """(cfg with max_num_seqs resolved, the KV pool). max_num_seqs not given: the device's default
    (EngineConfig.default_max_num_seqs), and where the pool comes from the device's memory (CUDA without
    --kv-cache-memory) no more rows than it holds 10-s utterances (KVCacheSpec.rows_that_fit)."""
    from dataclasses import replace

    rows = cfg.default_max_num_seqs(model.device.type)
    spec = plan_engine_kv_cache(replace(cfg, max_num_seqs=rows), model)
    if cfg.max_num_seqs is None and model.device.type == "cuda" and cfg.kv_cache_memory is None:
        rows = spec.rows_that_fit(rows)
    return replace(cfg, max_num_seqs=rows), spec


def plan_engine_kv_cache(cfg, model) -> KVCacheSpec:
    """The engine's KV pool for `cfg` (EngineConfig) and its loaded model: --kv-cache-memory when given; on CUDA
    what the memory profile leaves (runner/profile.py); on a CPU at most DEFAULT_CPU_KV_BYTES."""
    from ttsserve.constants import DEFAULT_CPU_KV_BYTES

    swap = int(cfg.swap_space * 2**30)
    if cfg.kv_cache_memory is not None:
        budget = cfg.kv_cache_memory
    elif model.device.type == "cuda":
        from ttsserve.runner.profile import kv_budget_after_profiling

        budget = kv_budget_after_profiling(model, cfg)
    else:
        # Never more than max_num_seqs full-length sequences hold: a one-shot run (`ttsserve say`) that sets
        # max_num_seqs to its segment count gets a pool for that request, not the server's default.
        per_seq = -(-cfg.max_model_len // cfg.block_size) * cfg.block_size
        need = cfg.max_num_seqs * per_seq * kv_bytes_per_token(model.gpt_config, model.dtype, cfg.kv_cache_dtype)
        budget = min(DEFAULT_CPU_KV_BYTES, need)
    return plan_kv_cache(model.gpt_config, model.dtype, cfg.block_size, budget, swap, kv_cache_dtype=cfg.kv_cache_dtype)


def allocate_kv_cache(cfg: GPTConfig, spec: KVCacheSpec, device: torch.device, dtype: torch.dtype) -> Future:
    """A Future of KVCache(cfg, spec, device, dtype). On CUDA it is built on a helper thread and this returns at
    once: allocating and zeroing the device pool (most of the GPU) is driver work that releases the GIL, which
    the runner overlaps with torch.compile's imports. The caller must not
    capture a CUDA graph before .result() returned (a capture forbids other threads' allocations). Elsewhere
    the cache is built here."""
    fut: Future = Future()
    if device.type != "cuda":
        fut.set_result(KVCache(cfg, spec, device, dtype))
        return fut
    index = device.index if device.index is not None else torch.cuda.current_device()

    def build() -> None:
        try:
            with torch.cuda.device(index):  # the current device is per thread
                fut.set_result(KVCache(cfg, spec, device, dtype))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller (an OOM, say)
            fut.set_exception(e)

    threading.Thread(target=build, name="ttsserve-kv-alloc", daemon=True).start()
    return fut
