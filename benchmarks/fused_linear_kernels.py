"""A decode layer's small ops fused into the linear that follows them, for batches of at most 16 rows (CUDA):
add_rmsnorm + linear (the qkv and gate_up projections) and silu_mul + linear (the down projection), one Triton
kernel each instead of two launches, the single-stream lever of a kernel-count-bound step (about 190 kernels a
frame). Measured and not kept (benchmarks/small_batch_fusion.py times them against the pairs; BENCHMARKS.md): on
an H100 at 1-16 rows the norm fusions ran at 0.58-0.95x the pair's speed and the SiLU one at 0.08-0.26x (every
program recomputes its prologue over the whole reduction), and a 10-s utterance took 0.65 s against 0.37 s.
Rounding as layers/triton_fused.py's kernels round; the product accumulates in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsserve.layers import triton_fused

MAX_ROWS = 16  # one BLOCK_M of rows: every program reads all of them
ADD_RMSNORM, SILU_MUL = 1, 2  # the kernel's PROLOGUE (0: none)


@triton.jit
def _prologue_linear_kernel(
    h_ptr,
    res_ptr,
    nw_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    M,
    N,
    K,
    stride_h,
    stride_r,
    stride_w,
    stride_o,
    stride_s,
    eps,
    PROLOGUE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N),): out[:M, n-block] = prologue(h) @ w[n-block].T, w [N, K] row-major.
    ADD_RMSNORM: x = rmsnorm(h + res) * nw (program 0 also stores h + res to sum); SILU_MUL: h is [M, 2K] and
    x = silu(h[:, :K]) * h[:, K:]; rounding as layers/triton_fused.py's kernels round."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < M
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < N
    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            m2 = rmask[:, None] & (ks < K)[None, :]
            h = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=m2, other=0.0)
            r = tl.load(res_ptr + rows[:, None] * stride_r + ks[None, :], mask=m2, other=0.0)
            s = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
            if pid == 0:
                tl.store(sum_ptr + rows[:, None] * stride_s + ks[None, :], s, mask=m2)
            sf = s.to(tl.float32)
            ss += tl.sum(sf * sf, axis=1)
        inv = 1.0 / tl.sqrt(ss / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        m2 = rmask[:, None] & kmask[None, :]
        h = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=m2, other=0.0)
        if PROLOGUE == 1:
            r = tl.load(res_ptr + rows[:, None] * stride_r + ks[None, :], mask=m2, other=0.0)
            s = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
            nw = tl.load(nw_ptr + ks, mask=kmask, other=0.0)
            x = ((s.to(tl.float32) * inv[:, None]).to(h.dtype).to(tl.float32) * nw.to(tl.float32)[None, :]).to(h.dtype)
        elif PROLOGUE == 2:
            u = tl.load(h_ptr + rows[:, None] * stride_h + K + ks[None, :], mask=m2, other=0.0)
            g = h.to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(h.dtype)
            x = (silu.to(tl.float32) * u.to(tl.float32)).to(h.dtype)
        else:
            x = h
        w = tl.load(w_ptr + ns[:, None] * stride_w + ks[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(
        out_ptr + rows[:, None] * stride_o + ns[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & nmask[None, :],
    )


def prologue_linear(h, weight, prologue, residual=None, norm_weight=None, eps=1e-6, block_n=32, block_k=128):
    """prologue(h) @ weight.T -> ([M, N] in h's dtype, h + residual for ADD_RMSNORM else None); h [M, K] (SILU_MUL:
    [M, 2K]), weight [N, K], M <= MAX_ROWS, unit column strides."""
    m = h.shape[0]
    n, k = weight.shape
    assert m <= MAX_ROWS and weight.stride(1) == 1 and h.stride(1) == 1
    out = torch.empty(m, n, dtype=h.dtype, device=h.device)
    total = torch.empty(m, k, dtype=h.dtype, device=h.device) if prologue == ADD_RMSNORM else out
    res = residual if residual is not None else h
    nw = norm_weight if norm_weight is not None else weight
    _prologue_linear_kernel[(triton.cdiv(n, block_n),)](
        h,
        res,
        nw,
        weight,
        out,
        total,
        m,
        n,
        k,
        h.stride(0),
        res.stride(0),
        weight.stride(0),
        out.stride(0),
        total.stride(0),
        eps,
        PROLOGUE=prologue,
        IEEE=h.dtype == torch.float32,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out, (total if prologue == ADD_RMSNORM else None)


def _fusable_weight(x: torch.Tensor, linear) -> torch.Tensor | None:
    """The [N, K] weight when the kernel takes x [T, *] and `linear`: 1 <= T <= MAX_ROWS, unit column strides,
    a plain bias-free nn.Linear; else None (the caller runs the pair)."""
    if not 1 <= x.shape[0] <= MAX_ROWS or x.stride(1) != 1 or type(linear) is not torch.nn.Linear:
        return None
    w = linear.weight
    return w if linear.bias is None and w.stride(1) == 1 else None


def add_rmsnorm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, linear
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rmsnorm(residual + x) * norm_weight), residual + x) for x, residual [T, K]."""
    w = _fusable_weight(x, linear)
    if w is None or residual.stride(1) != 1:
        normed, total = triton_fused.add_rmsnorm(x, residual, norm_weight, eps)
        return linear(normed), total
    return prologue_linear(x, w, ADD_RMSNORM, residual, norm_weight, eps)


def silu_mul_linear(gate_up: torch.Tensor, linear) -> torch.Tensor:
    """linear(silu(gate_up[:, :K]) * gate_up[:, K:]) for gate_up [T, 2K]."""
    w = _fusable_weight(gate_up, linear)
    if w is None:
        return linear(triton_fused.silu_mul(gate_up))
    return prologue_linear(gate_up, w, SILU_MUL)[0]
