"""The one attention interface of the GPT, and backend selection.

The GPT calls `ctx.attend(layer_idx, q, k, v)` for every layer (q / k already rotated), or
`ctx.attend(layer_idx, q, k, v, rope=(cos, sin))` with q / k unrotated: the CUDA decode kernel then applies RoPE
in registers, every other path rotates in torch first (`rope_qk`). The context decides where K/V live:
- `DenseAttention` (attention/dense.py): one sequence, a growing dense cache; the single-request oracle.
- `PagedAttention` (attention/torch_ref.py on CPU, attention/triton_paged.py on CUDA): a flat batch of
  many sequences whose K/V live in fixed-size blocks addressed by `block_tables` / `slot_mapping`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

# (cos, sin) of the new tokens' positions: [T, 1, head_dim] (or [T, head_dim]) in the model dtype, as
# RotaryEmbedding (model/layers.py) returns them.
Rope = tuple[torch.Tensor, torch.Tensor]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX (rotate-half) RoPE over the whole head: x [T, heads, D] * cos + rotate_half(x) * sin, in x's
    dtype op by op (the arithmetic of model/layers.apply_rotary). cos / sin broadcast over the heads."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope_qk(q: torch.Tensor, k: torch.Tensor, rope: Rope | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated by rope = (cos, sin); unchanged when rope is None (already rotated)."""
    if rope is None:
        return q, k
    cos, sin = (t.view(t.shape[0], 1, t.shape[-1]) for t in rope)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class AttentionContext(Protocol):
    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope | None = None
    ) -> torch.Tensor:
        """Causal attention of the new tokens over their sequence's whole context.

        q: [T, num_heads, head_dim], k / v: [T, num_kv_heads, head_dim]. rope None: q and k are already
        rotated; else (cos, sin) to rotate them with (the stored k is the rotated one).
        Stores k / v for later steps and returns [T, num_heads, head_dim].
        """
        ...


@dataclass
class AttentionMetadata:
    """A flat batch: the new tokens of B sequences laid end to end (T tokens in all).

    cu_seqlens_q: [B + 1] int32, offsets of each sequence's new tokens in the flat batch.
    seq_lens:     [B] int32, context length of each sequence after this step
                  (num_computed_tokens + number of new tokens).
    block_tables: [B, max_num_blocks] int32, physical block ids of each sequence (padding: 0).
    slot_mapping: [T] int64, KV slot of each new token: block_id * block_size + offset.
    max_query_len / max_seq_len: host ints, so kernels need no device-to-host sync.
    *_cpu: host copies the CPU reference path iterates over.
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    cu_seqlens_q_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Per-layer KV cache: [2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


class PagedAttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """Write k / v into `kv_cache` at `md.slot_mapping`, then attend (causal within each sequence).

        q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: kv_cache_shape(...); rope: see AttentionContext.attend.
        Returns [T, Hq, D].
        """
        ...


class PagedAttention:
    """AttentionContext over per-layer paged caches and one step's metadata."""

    def __init__(
        self, backend: PagedAttentionBackend, kv_caches: list[torch.Tensor], md: AttentionMetadata, scale: float
    ) -> None:
        self.backend, self.kv_caches, self.md, self.scale = backend, kv_caches, md, scale

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope | None = None
    ) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.kv_caches[layer_idx], self.md, self.scale, rope)


def select_backend(device: torch.device) -> PagedAttentionBackend:
    """Chosen once at start-up: Triton on CUDA, the torch reference elsewhere."""
    if device.type == "cuda":
        from ttsserve.attention.triton_paged import TritonPagedAttention  # CUDA-only import

        return TritonPagedAttention()
    from ttsserve.attention.torch_ref import TorchPagedAttention

    return TorchPagedAttention()


def runner_backend(device: torch.device, head_dim: int):
    """(attention backend, CUDA-graph capturable): the selected backend, or the torch reference where the
    Triton kernels do not support the head size (e.g. tiny test models on CUDA; no graphs then)."""
    backend = select_backend(device)
    if backend.name == "triton":
        from ttsserve.attention.triton_paged import SUPPORTED_HEAD_DIMS

        if head_dim in SUPPORTED_HEAD_DIMS:
            return backend, True
        logging.getLogger(__name__).warning(
            "head_dim %d is not supported by the Triton kernels: torch reference attention, no CUDA graphs", head_dim
        )
        from ttsserve.attention.torch_ref import TorchPagedAttention

        return TorchPagedAttention(), False
    return backend, False
