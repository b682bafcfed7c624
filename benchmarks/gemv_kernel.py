"""A linear of a few rows as one Triton GEMV kernel: y [M, N] = x [M, K] @ w [N, K]^T for M <= MAX_ROWS. Measured
and not kept (benchmarks/small_m_gemv.py times it; BENCHMARKS.md).

Why it was tried: at one stream a decode step is kernel bound; under torch.profiler its linears took 0.40 of the
0.68 ms a frame's kernels took on an H100, cuBLAS's picks for one row (a 64x8 tile; split-K plus a reduce kernel
for the down projection) 3.2-5.7 us a linear where reading the weights needs 0.35-2.8 us. One program per
BLOCK_N output columns reads its [BLOCK_N, K] slice of w once and every row of x, products summed without
tensor cores: many programs reading at once, no reduce kernel.

What it gave (H100, bf16, in CUDA graphs): at one row, tile (2, 1024, 1), qkv 768 -> 2304 2.90 us against
cuBLAS's 3.21, o 768 -> 768 2.21 against 3.22, down 3072 -> 768 3.54 against 5.68, gate_up 768 -> 6144 5.51
against 4.34; every shape slower from 4 rows. Launched with programmatic dependent launch (pdl=True: the first
weight tile read before waiting for the previous kernel) the four linears took 18.1 us against 12.5 without.
Wired into the decode graphs for one row (qkv, o and down; commit `8804420`), the linears' kernels took 0.32
ms a frame instead of 0.40 under the profiler (two leases), but one 10-s utterance took 326-328 ms with it and
326-331 ms without, interleaved in one call (bench offline, 3 rounds each), and py-spy found the step loop
waiting for the device in 74 % of its samples with it against 68 % without: the wall did not move, so it is not
kept.

Arithmetic: products and sums in fp32, the result rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 8


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N),): out[:M, n-block] = x[:M] @ w[n-block].T; EVEN: N % BLOCK_N == K % BLOCK_K == 0.
    USE_GDC (launched with programmatic dependent launch): the next kernel may start at once, and this one reads
    its first weight tile (which no kernel writes) before it waits for the previous kernel's writes."""
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    rmask, nmask = rows < M, ns < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_ptrs = w_ptr + ns[:, None].to(tl.int64) * stride_w
    x_ptrs = x_ptr + rows[:, None] * stride_x
    ks = tl.arange(0, BLOCK_K)
    if EVEN:
        w = tl.load(w_ptrs + ks[None, :])
    else:
        w = tl.load(w_ptrs + ks[None, :], mask=nmask[:, None] & (ks < K)[None, :], other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptrs + ks[None, :], mask=rmask[:, None] & (ks < K)[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        ks += BLOCK_K  # the next tile (past the end: masked, nothing read)
        w = tl.load(w_ptrs + ks[None, :], mask=nmask[:, None] & (ks < K)[None, :], other=0.0)
    tl.store(
        out_ptr + rows[:, None] * stride_o + ns[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & nmask[None, :],
    )


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    block_n: int,
    block_k: int,
    num_warps: int,
    out: torch.Tensor | None = None,
    pdl: bool = False,
):
    """x [M, K] (M <= MAX_ROWS, unit column stride), w [N, K] (unit column stride) -> x @ w.T [M, N]."""
    m, k = x.shape
    n = w.shape[0]
    assert 1 <= m <= MAX_ROWS and w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN=n % block_n == 0 and k % block_k == 0,
        USE_GDC=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
    )
    return out
