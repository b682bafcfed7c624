"""The GPT's fused decode kernels (layers/triton_fused.py: RMSNorm with and without the residual add, SiLU-and-mul,
the rotary embedding of q and k) compile for sm_90 through the functions that launch them, on a machine without a
GPU (tests/sm90_compile.py), at the ChatTTS GPT's sizes in bf16."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sm90_compile import compile_only_for_sm90  # noqa: E402

from ttsserve.layers import triton_fused  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, HEAD_DIM = 768, 3072, 12, 64


def test_fused_kernels_compile_for_sm90() -> None:
    t, bf16 = 5, torch.bfloat16
    x = torch.zeros(t, HIDDEN, dtype=bf16)
    w = torch.ones(HIDDEN, dtype=bf16)
    with compile_only_for_sm90() as compiled:
        triton_fused.rmsnorm(x, w, 1e-6)
        triton_fused.add_rmsnorm(x, x.clone(), w, 1e-6)
        triton_fused.silu_mul(torch.zeros(t, 2 * INTERMEDIATE, dtype=bf16))
        cos = torch.zeros(t, 1, HEAD_DIM, dtype=bf16)
        triton_fused.qkv_rotary(torch.zeros(t, 3 * HEADS * HEAD_DIM, dtype=bf16), cos, cos, HEADS, HEADS, HEAD_DIM)
    names = [name for name, _ in compiled]
    assert names == ["_rmsnorm_kernel", "_rmsnorm_kernel", "_silu_mul_kernel", "_rope_kernel"], names
    assert [kw.get("HAS_RES") for _, kw in compiled[:2]] == [False, True]
