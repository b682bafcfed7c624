"""The fp8 KV cache (`kv_cache_dtype="fp8"`, CUDA only): layout, the quantization rule, and its torch reference.

Choice: DYNAMIC scales, one per (token, KV head), stored beside the cache; no calibration.
- A static per-layer / per-head scale needs a calibration pass per checkpoint and clips whatever the
  calibration never saw (a loud speaker prompt, a long generation drifting); a per-block scale cannot be
  fixed when a block's first token is written (its later tokens arrive in later steps) without
  re-quantizing the block. A per-token scale is known the moment the token's k / v exist, is computed
  inside the fused KV write from the 64 values it stores, and never changes afterwards.
- Cost: one fp32 scale per 64 one-byte values, 1.0625 bytes per element against 2 for bf16: 1.88x the
  frames (streams) per byte of cache. Reading it costs one extra load per token and head; the kernels
  apply it to the score columns (QK^T) and to the probabilities (PV) instead of to the tile.

Rule (the same in torch and Triton, bit for bit on a GPU): amax = max |x| over head_dim (fp32);
scale = amax * fp32(1/448) (1 when amax == 0); q = e4m3(clamp(x / scale, -448, 448)) rounding to
nearest even, the division IEEE-rounded. (A multiply, not amax / 448: torch on CUDA divides by a Python
scalar through its reciprocal, Triton's div_rn does not, and the two differ in the last bit now and then.)
The dequantized value is float(q) * scale.

Layout of one layer: data [2 (k, v), num_blocks, block_size, num_kv_heads, head_dim] float8_e4m3fn (the
kv_cache_shape of attention/backend.py) and scales [2, num_blocks, num_kv_heads, block_size] fp32:
head-major inside a block, so a kernel reading one head's run of tokens reads consecutive scales (a
token-major layout would gather one 4-byte value per 32-byte sector).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_FP8_MAX = 1.0 / FP8_MAX  # rounded to fp32 where used (torch.float32 here, a fp32 literal in Triton)
KV_CACHE_DTYPES = ("auto", "fp8")


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device | None = None) -> None:
    """ValueError for an unknown name, or fp8 anywhere but CUDA."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "fp8" and device is not None and device.type != "cuda":
        raise ValueError(
            f"kv_cache_dtype fp8 needs a CUDA device (the Triton attention kernels read it); "
            f"the {device.type} backend supports only kv_cache_dtype auto"
        )


def kv_scales_shape(num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
    return (2, num_blocks, num_kv_heads, block_size)


@dataclass
class FP8KVCache:
    """One layer's fp8 cache: `data` (fp8, the usual cache shape) and `scales` (fp32, one per token and head).

    Passed wherever a layer's cache tensor goes (PagedAttention hands it to the backend unchanged); the
    Triton backend recognises it. shape / dtype / device describe `data`.
    """

    data: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def zeros(cls, shape: tuple[int, ...], device: torch.device | str, pin_memory: bool = False) -> FP8KVCache:
        return cls._allocate(shape, device, pin_memory, torch.zeros, torch.ones)

    @classmethod
    def empty(cls, shape: tuple[int, ...], device: torch.device | str, pin_memory: bool = False) -> FP8KVCache:
        """Uninitialised (for host swap pools, fully written by a swap-out before any read)."""
        return cls._allocate(shape, device, pin_memory, torch.empty, torch.empty)

    @classmethod
    def _allocate(
        cls, shape: tuple[int, ...], device: torch.device | str, pin_memory: bool, data_fn, scales_fn
    ) -> FP8KVCache:
        _, num_blocks, block_size, num_kv_heads, _ = shape
        data = data_fn(shape, dtype=FP8_DTYPE, device=device, pin_memory=pin_memory)
        scales = scales_fn(
            kv_scales_shape(num_blocks, block_size, num_kv_heads),
            dtype=torch.float32,
            device=device,
            pin_memory=pin_memory,
        )
        return cls(data, scales)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The cache as the kernels see it: [2, num_blocks, block_size, Hkv, D] in `dtype`."""
        return (self.data.float() * self.scales.transpose(2, 3)[..., None]).to(dtype)


def fp8_bytes_per_element(head_dim: int) -> float:
    return 1.0 + 4.0 / head_dim


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] float -> (q float8_e4m3fn [..., D], scale fp32 [...]) by the module's rule."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = amax * torch.tensor(INV_FP8_MAX, dtype=torch.float32, device=amax.device)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(xf / scale[..., None], -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fake_quantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """x quantized and dequantized (in x's dtype): the value every later attention step reads back."""
    q, scale = quantize_fp8_rows(x)
    return (q.float() * scale[..., None]).to(x.dtype)


def write_kv_fp8(cache: FP8KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The torch reference of the fused write: k / v [T, Hkv, D] quantized into `cache` at slot_mapping
    (slots < 0 skipped)."""
    _, num_blocks, block_size, hkv, d = cache.data.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    data = cache.data.view(2, num_blocks * block_size, hkv, d)
    for i, x in enumerate((k[keep], v[keep])):
        q, s = quantize_fp8_rows(x)  # s: [T, Hkv]
        data[i].view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))  # no fp8 index_copy on CPU
        cache.scales[i, slots // block_size, :, slots % block_size] = s
