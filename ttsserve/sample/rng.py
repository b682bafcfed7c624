"""A counter-based hash RNG in plain torch integer ops: u = f(seed, step, row, vocab index).

Why: a seeded request must draw the same numbers whatever else is in the batch, at any batch position and
after preemption/recompute, without per-request torch.Generator objects or a Python loop. Every value is a
pure function of its key, so any batching gives the same draws. All integer math is int64 holding 32-bit
values, and every product stays below 2**63 in magnitude (no overflow), so CPU and CUDA give identical bits.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # domain-separation constants (odd, well-mixed bit patterns)
_ROW_SALT = 0x85EBCA6B
_STEP_SALT = 0xC2B2AE35


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32). A constant >= 2**31 is used as c - 2**32 (the same residue),
    so |x * c| < 2**63: no int64 overflow, and `& MASK32` of the two's-complement product is the residue."""
    return (x * (c - (1 << 32) if c >= 1 << 31 else c)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit finalizer with strong avalanche ("lowbias32"); x: int64 in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_keys(seeds: torch.Tensor, steps: torch.Tensor, num_rows: int) -> torch.Tensor:
    """seeds [B] int64 (>= 0), steps [B] int64 -> per-(request, row) 32-bit keys [B, num_rows] int64."""
    h = mix32((seeds & MASK32) ^ _GOLDEN)
    h = mix32(h ^ ((seeds >> 32) & MASK32))
    h = mix32(h ^ _mul32(steps & MASK32, _STEP_SALT))
    rows = torch.arange(num_rows, device=seeds.device, dtype=torch.int64)
    return mix32(h[:, None] ^ _mul32(rows + 1, _ROW_SALT)[None, :])


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, num_rows: int, vocab_size: int) -> torch.Tensor:
    """Uniform draws in the open interval (0, 1): [B, num_rows, vocab_size] fp32.

    u[b, r, v] depends only on (seeds[b], steps[b], r, v). 23 random bits, (k + 0.5) / 2**23, so every value
    is exact in fp32 and never 0 or 1.
    """
    keys = stream_keys(seeds.long(), steps.long(), num_rows)  # [B, R]
    v = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = mix32(keys[:, :, None] ^ v[None, None, :])
    h = mix32(h ^ _GOLDEN)  # a second round: v only perturbs the low bits of the first round's input
    return ((h >> 9).to(torch.float32) + 0.5) * (2.0**-23)
