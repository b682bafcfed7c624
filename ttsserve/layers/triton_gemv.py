"""One-row decode linears with their neighbours fused, as Triton GEMV kernels (CUDA): a layer in 5 kernels.

At one stream an H100 decode frame is ~180 kernels of 2-6 us each and takes ~0.7 ms, 6x the 0.11 ms it needs to
read the weights (docs/benchmarks-history.md, "One stream"). A layer there is add+RMSNorm, qkv, attention, o,
add+RMSNorm, gate_up, SiLU-and-mul and down (a split-K GEMM plus its reduce): 9 kernels. Two designs were
measured before and not kept: GEMVs for qkv, o and down one for one (their kernels shorter under the profiler,
the wall unchanged; benchmarks/gemv_kernel.py) and tensor-core tiles with the norm or SiLU-and-mul as a
prologue (slower kernels, every program recomputing SiLU over K; benchmarks/fused_linear_kernels.py). Here the
kernel count falls and the fused work stays small: each norm goes into the GEMV that reads its output (every
program recomputes the row's statistics, 768 values), SiLU-and-mul into gate_up's epilogue (a program computes
matching gate and up columns), and down reads its whole K in one program (no reduce kernel). A layer is
norm+qkv, attention, o, norm+gate_up+SiLU, down. On an H100 a frame's linears take 0.32 ms this way against 0.49
through cuBLAS (benchmarks/gemv_layer_micro.py), and one 10-s utterance 0.30 s instead of 0.39; the default for the
one-stream decode graph ($TTSSERVE_DECODE_GEMV=0 turns it off, config.py).

Arithmetic (x's dtype, bf16 on the GPU), the same as layers/triton_fused.py and cuBLAS up to summation order:
- the residual sum s = residual + x rounded to x's dtype, rmsnorm(s) as triton_fused's, rounded to x's dtype;
- a GEMV's products and sums in fp32, the result rounded once to x's dtype (gate and up each, then
  silu(gate) rounded, times up, rounded).

Contract: one row (x [1, K] or [K]), weights [N, K] contiguous with K <= MAX_NORM_K where a norm is fused. The
residual sum is written by the first program to a new tensor (never in place: other programs still read the
residual).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_NORM_K = 4096  # a fused norm loads its whole row per program
# One-row tiles, the best of `benchmarks/gemv_layer_micro.py --sweep` on an H100 (a frame's linears 0.32 ms; the
# same kernels at BLOCK_N 2, NORM_BLOCK_N 8 took 0.72): one output column a program (two with a fused norm: the
# row's statistics recomputed by half as many programs), one warp, BLOCK_K 1024 (a 768-wide row in one pass, down's
# 3,072 in three).
BLOCK_N, NORM_BLOCK_N, BLOCK_K, NUM_WARPS = 1, 2, 1024, 1


@triton.jit
def _norm_gemv_kernel(
    x_ptr,
    res_ptr,
    nw_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    N,
    K,
    eps,
    HAS_RES: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N),): y = rmsnorm(x (+ res)) * nw; out[n] = y @ w[n] (GATED: silu(y @ w[n]) *
    (y @ w[N + n]), w holding gate rows then up rows); with HAS_RES program 0 stores x + res to sum."""
    pid = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    x = tl.load(x_ptr + ks, mask=kmask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + ks, mask=kmask, other=0.0).to(tl.float32)).to(x.dtype)
        if pid == 0:
            tl.store(sum_ptr + ks, x, mask=kmask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / K + eps)
    nw = tl.load(nw_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
    y = ((xf * inv).to(x.dtype).to(tl.float32) * nw).to(x.dtype).to(tl.float32)
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < N
    wmask = nmask[:, None] & kmask[None, :]
    w = tl.load(w_ptr + ns[:, None].to(tl.int64) * K + ks[None, :], mask=wmask, other=0.0)
    acc = tl.sum(w.to(tl.float32) * y[None, :], axis=1)
    if GATED:
        wu = tl.load(w_ptr + (ns + N)[:, None].to(tl.int64) * K + ks[None, :], mask=wmask, other=0.0)
        up = tl.sum(wu.to(tl.float32) * y[None, :], axis=1).to(x.dtype).to(tl.float32)
        g = acc.to(x.dtype).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
        acc = silu * up
    tl.store(out_ptr + ns, acc.to(x.dtype), mask=nmask)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N),): out[n] = x @ w[n], the whole K per program (no split-K, no reduce kernel)."""
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < N
    rows = w_ptr + ns[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = tl.load(x_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(rows + ks[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + ns, acc.to(out_ptr.dtype.element_ty), mask=nmask)


def _row(x: torch.Tensor) -> torch.Tensor:
    assert x.numel() == x.shape[-1], f"one row expected, got {tuple(x.shape)}"
    return x.reshape(-1) if x.is_contiguous() else x.reshape(-1).contiguous()


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, K] (+ residual [1, K]) -> (rmsnorm(x + residual) * norm_weight @ weight.T [1, N], x + residual [1, K]);
    gated: weight [2 I, K] (gate rows, then up rows) and the first output is silu(gate) * up [1, I]. Without a
    residual the second output is x itself."""
    k = x.shape[-1]
    assert k <= MAX_NORM_K and weight.shape[1] == k and weight.is_contiguous()
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    x1 = _row(x)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    total = torch.empty_like(x1) if residual is not None else x1
    _norm_gemv_kernel[(triton.cdiv(n, NORM_BLOCK_N),)](
        x1,
        _row(residual) if residual is not None else x1,
        norm_weight,
        weight,
        out,
        total,
        n,
        k,
        eps,
        HAS_RES=residual is not None,
        GATED=gated,
        BLOCK_N=NORM_BLOCK_N,
        BLOCK_K=triton.next_power_of_2(k),
        num_warps=NUM_WARPS,
    )
    return out.view(1, n), total.view(1, k)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] -> x @ weight.T [1, N] in x's dtype; weight [N, K] contiguous."""
    n, k = weight.shape
    assert x.shape[-1] == k and weight.is_contiguous()
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](
        _row(x),
        weight,
        out,
        n,
        k,
        BLOCK_N=BLOCK_N,
        BLOCK_K=min(BLOCK_K, triton.next_power_of_2(k)),
        num_warps=NUM_WARPS,
    )
    return out.view(1, n)
