"""Grouped residual FSQ of the ChatTTS DVAE (MODEL.md §5.3, §5.4), 2024 semantics (vector_quantize_pytorch < 1.26).

Codebook row q = g * R + r (group g, residual r). Each row holds one index in [0, L^D) (L = 5 levels, D = 4 dims,
so 625 codes); digit d of an index is `(idx // L^d) % L` (d = 0 least significant). Residual r is scaled by
`(L - 1)^-r` (1, 0.25), not the `L^-r` of library versions >= 1.26.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class _FSQGroup(nn.Module):
    """The two projections of one group; the FSQ grid itself has no weights."""

    def __init__(self, dim: int, fsq_dim: int) -> None:
        super().__init__()
        self.project_in = nn.Linear(dim, fsq_dim)
        self.project_out = nn.Linear(fsq_dim, dim)


class GFSQ(nn.Module):
    """Groups x residuals of a D-dim FSQ with `levels` levels per dim (odd `levels` only, as in ChatTTS).

    dim: channels of the DVAE latent ([B, dim, N]); group g owns channels g*dim/G .. (g+1)*dim/G - 1.
    """

    def __init__(self, dim: int, num_groups: int = 2, num_residuals: int = 2, fsq_dim: int = 4, levels: int = 5):
        super().__init__()
        if levels % 2 != 1:
            raise ValueError(f"GFSQ: only odd level counts are supported, got {levels}")
        if dim % num_groups:
            raise ValueError(f"GFSQ: dim {dim} is not divisible by {num_groups} groups")
        self.dim, self.num_groups, self.num_residuals = dim, num_groups, num_residuals
        self.fsq_dim, self.levels = fsq_dim, levels
        self.rvqs = nn.ModuleList(_FSQGroup(dim // num_groups, fsq_dim) for _ in range(num_groups))
        # Non-persistent like the library's: derived, never read from the checkpoint.
        self.register_buffer("basis", levels ** torch.arange(fsq_dim), persistent=False)

    @property
    def num_codebooks(self) -> int:
        return self.num_groups * self.num_residuals

    @property
    def codebook_size(self) -> int:
        return self.levels**self.fsq_dim

    def _scale(self, r: int) -> float:
        return float(self.levels - 1) ** (-r)

    def dequantize(self, codes: Tensor) -> Tensor:
        """codes: LongTensor [B, G*R, N] in [0, L^D) -> latent [B, dim, N] (group 0 = first half of channels)."""
        if codes.dim() != 3 or codes.shape[1] != self.num_codebooks:
            raise ValueError(f"GFSQ.dequantize: codes must be [B, {self.num_codebooks}, N], got {tuple(codes.shape)}")
        half = self.levels // 2
        # [B, Q, N, D] digits -> values in {-1, -1/2, 0, 1/2, 1} for L = 5
        digits = (codes.long().unsqueeze(-1) // self.basis) % self.levels
        values = (digits - half).to(self.rvqs[0].project_out.weight.dtype) / half
        outs = []
        for g, grp in enumerate(self.rvqs):
            rows = values[:, g * self.num_residuals : (g + 1) * self.num_residuals]
            z = sum(rows[:, r] * self._scale(r) for r in range(self.num_residuals))
            outs.append(grp.project_out(z))  # [B, N, dim/G]
        return torch.cat(outs, dim=-1).transpose(1, 2)

    def quantize(self, x: Tensor) -> Tensor:
        """x: latent [B, dim, N] -> LongTensor codes [B, G*R, N] (MODEL.md §5.4: no input clamp, 2.002 * tanh)."""
        if x.dim() != 3 or x.shape[1] != self.dim:
            raise ValueError(f"GFSQ.quantize: x must be [B, {self.dim}, N], got {tuple(x.shape)}")
        half = self.levels // 2
        # (L - 1) * (1 + 1e-3) / 2 evaluated in fp32, as the library does (2.002 for L = 5)
        half_l = torch.tensor((self.levels - 1) * (1 + 1e-3) / 2, dtype=torch.float32).item()
        xt = x.transpose(1, 2)
        width = self.dim // self.num_groups
        codes = []
        for g, grp in enumerate(self.rvqs):
            res = grp.project_in(xt[..., g * width : (g + 1) * width])  # [B, N, D]
            for r in range(self.num_residuals):
                s = self._scale(r)
                qz = torch.round(half_l * torch.tanh(res / s)) / half
                codes.append(((qz * half + half).round().long() * self.basis).sum(-1))
                res = res - qz * s
        return torch.stack(codes, dim=1)
