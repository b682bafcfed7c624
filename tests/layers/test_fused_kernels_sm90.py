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


def test_one_row_gemv_kernels_compile_for_sm90() -> None:
    """layers/triton_gemv.py's kernels at the GPT's one-row shapes: norm + qkv (first layer: no residual), norm +
    gate_up + SiLU (with the residual), and the plain GEMVs of o and down."""
    from ttsserve.layers import triton_gemv

    bf16 = torch.bfloat16
    x, nw = torch.zeros(1, HIDDEN, dtype=bf16), torch.ones(HIDDEN, dtype=bf16)
    with compile_only_for_sm90() as compiled:
        triton_gemv.norm_linear(x, None, nw, 1e-6, torch.zeros(3 * HEADS * HEAD_DIM, HIDDEN, dtype=bf16))
        triton_gemv.norm_linear(x, x.clone(), nw, 1e-6, torch.zeros(2 * INTERMEDIATE, HIDDEN, dtype=bf16), gated=True)
        triton_gemv.linear(x, torch.zeros(HIDDEN, HIDDEN, dtype=bf16))
        triton_gemv.linear(torch.zeros(1, INTERMEDIATE, dtype=bf16), torch.zeros(HIDDEN, INTERMEDIATE, dtype=bf16))
    assert [name for name, _ in compiled] == ["_norm_gemv_kernel"] * 2 + ["_gemv_kernel"] * 2
    assert [(kw["HAS_RES"], kw["GATED"]) for _, kw in compiled[:2]] == [(False, False), (True, True)]
