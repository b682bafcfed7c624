"""Llama building blocks with the exact numerics of HF LlamaModel (MODEL.md §3.1, §8.3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps), computed in fp32, cast back to x's dtype, then scaled by the weight."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """NeoX (rotate-half) RoPE over the full head_dim, looked up by integer position.

    The cos/sin table is computed once in fp32 exactly as HF does per call (inv_freq * float(position)),
    so a table lookup gives bitwise the same values; integer positions never pass through a low-precision
    dtype (MODEL.md §8.2).
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin): [T, 1, head_dim] in `dtype` (broadcast over heads)."""
        cos = self.cos_cached.index_select(0, positions)[:, None, :]
        sin = self.sin_cached.index_select(0, positions)[:, None, :]
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos / sin: [T, 1, head_dim]. Pairs dimension d with d + head_dim/2."""
    return x * cos + rotate_half(x) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * I] (gate first, then up) -> SiLU(gate) * up: [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
