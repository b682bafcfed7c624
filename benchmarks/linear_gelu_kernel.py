"""Linear1 + bias + exact-erf GELU of a vocoder ConvNeXt block as one Triton GEMM, measured against cuBLAS's
Linear then torch's GELU by benchmarks/convnext_micro.py and not kept: on an H100 it saved 0-7.5 us of 21-91 us a
block, on an H200 it lost 0-7.5 us of 24-82 (the Triton GEMM is slower than cuBLAS's by about what the separate
GELU costs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit(do_not_specialize=["M"])
def _linear_gelu_kernel(
    a_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),), N % BLOCK_N == K % BLOCK_K == 0: y [M, N] = exact-erf GELU of
    a [M, K] @ w [N, K]^T + bias, all row-major, accumulated and activated in fp32, rounded once. Programs walk
    the N tiles of one M tile together, so that tile of a stays in L2."""
    num_n = N // BLOCK_N
    pm, pn = tl.program_id(0) // num_n, tl.program_id(0) % num_n
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
    w = w_ptr + rn[None, :] * K + rk[:, None]  # a [BLOCK_K, BLOCK_N] tile of w^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        acc = tl.dot(tl.load(a, mask=rm[:, None] < M, other=0.0), tl.load(w), acc)
        a += BLOCK_K
        w += BLOCK_K
    acc += tl.load(bias_ptr + rn)[None, :].to(tl.float32)
    y = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)


def linear_gelu(h: Tensor, linear: torch.nn.Linear, block=(128, 128, 64), num_warps: int = 8, num_stages: int = 3):
    """GELU(F.linear(h, linear.weight, linear.bias)) in one kernel: h [M, K] row-major -> [M, N]."""
    m, k = h.shape
    n = linear.out_features
    bm, bn, bk = block
    assert h.is_contiguous() and linear.weight.is_contiguous() and n % bn == 0 and k % bk == 0
    y = torch.empty(m, n, dtype=h.dtype, device=h.device)
    _linear_gelu_kernel[(triton.cdiv(m, bm) * (n // bn),)](
        h,
        linear.weight,
        linear.bias,
        y,
        m,
        n,
        k,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y
