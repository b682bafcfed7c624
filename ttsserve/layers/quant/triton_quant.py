"""Triton dequantize-and-multiply kernels for QuantLinear (CUDA only; imported by linear.quant_kernels).

One kernel; the launch shape is chosen per call from (M, N, K) by `choose_config`:
- decode (small M, GEMV-shaped): narrow N tiles so the grid covers the chip; for the long K = 3072
  reduction (down_proj) K is also split over SPLIT_K programs that write fp32 partial sums to a workspace
  [SPLIT_K, M, N], summed by torch (deterministic, unlike atomics, so a row's result does not depend on
  the batch it came in);
- prefill (large M): a plain tiled GEMM, no split.
Weights are dequantized in registers right after the load and never written back: int8 tiles are cast to
the activation dtype (exact: |q| <= 127) and the per-channel scale multiplies the fp32 accumulator once at
the end; int4 programs walk one group per step, unpack the split-halves bytes (quantize.py) into two
[GROUP/2, BLOCK_N] integer tiles (q - zero, exact in bf16), do two dots against the matching halves of the
activation slice and scale the group's partial product in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


# M, the rows of one call, varies with every batch: specialised on (1, divisible by 16), each new class compiled in
# a served step (docs/ARCHITECTURE.md, "Kernels compiled while serving"). The launch shapes by M
# (choose_config) are compiled before ready by TritonQuantKernels.precompile.
@triton.jit(do_not_specialize=["M"])
def quant_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_os,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K): out[split, m, n] = sum over this split's k range
    of x[m, k] * W[n, k]. int8: W = qweight * scales[n]. int4 (BLOCK_K == GROUP): W = (q - zero) * scale."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BITS == 8:
        for k0 in range(k_start, k_end, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_mask = rk < k_end
            x = tl.load(x_rows + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_cols + rk[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0)
            if IEEE:
                acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        scale = tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc * scale[None, :]
    else:
        HALF: tl.constexpr = GROUP // 2
        rh = tl.arange(0, HALF)
        for k0 in range(k_start, k_end, GROUP):
            g = k0 // GROUP
            b = tl.load(w_cols + (k0 // 2 + rh)[:, None], mask=n_mask[None, :], other=0)  # [HALF, BLOCK_N] uint8
            zero = tl.load(z_ptr + rn * stride_sn + g, mask=n_mask, other=0).to(tl.float32)
            scale = tl.load(s_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
            x_lo = tl.load(x_rows + (k0 + rh)[None, :], mask=m_mask[:, None], other=0.0)
            x_hi = tl.load(x_rows + (k0 + HALF + rh)[None, :], mask=m_mask[:, None], other=0.0)
            w_lo = ((b & 0xF).to(tl.float32) - zero[None, :]).to(x_lo.dtype)
            w_hi = ((b >> 4).to(tl.float32) - zero[None, :]).to(x_lo.dtype)
            if IEEE:
                part = tl.dot(x_lo, w_lo, input_precision="ieee") + tl.dot(x_hi, w_hi, input_precision="ieee")
            else:
                part = tl.dot(x_lo, w_lo) + tl.dot(x_hi, w_hi)
            acc += part * scale[None, :]
    out = out_ptr + pid_k.to(tl.int64) * stride_os + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class QuantMMConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def choose_config(m: int, n: int, k: int, bits: int, group_size: int | None, num_sms: int) -> QuantMMConfig:
    """Launch shape for an [m, k] x [k, n] product, from a sweep on an H200 (bench/decode_kernels.py --sweep; the
    GPT's four linear shapes at M = 1, 64, 256). What it found: every extra launch costs ~2-3 us, as much
    as a whole small product, so split K (its partial sums need a torch reduce) only for the long
    K = 3072 reduction and otherwise take the widest N tile that still gives one program per SM."""
    block_k = group_size if bits == 4 else (128 if m <= 512 else 64)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 512 else 128
    long_k = k >= 2048 and m <= 512
    block_n = 64 if long_k else 32
    if not long_k:
        for bn in (128, 64):
            if triton.cdiv(m, block_m) * triton.cdiv(n, bn) >= num_sms:
                block_n = bn
                break
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while long_k and tiles * split < num_sms and k // (2 * split) >= 2 * block_k:
        split *= 2
    return QuantMMConfig(block_m, block_n, block_k, split, 8 if block_m == 128 else 4, 3)


def first_rows_per_config(n: int, k: int, bits: int, group_size: int | None, max_rows: int, num_sms: int) -> list[int]:
    """The fewest rows (M) giving each distinct choose_config launch shape among M = 1..max_rows, ascending."""
    firsts: dict[QuantMMConfig, int] = {}
    for m in range(1, max_rows + 1):
        firsts.setdefault(choose_config(m, n, k, bits, group_size, num_sms), m)
    return sorted(firsts.values())


def quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    bits: int,
    group_size: int | None,
    num_sms: int,
    config: QuantMMConfig | None = None,
) -> torch.Tensor:
    """x: [M, K] (bf16 / fp16 / fp32, last dim contiguous) -> x @ W^T: [M, N] in x's dtype (see linear.py
    for the weight formats). `config` pins the launch shape (tests, sweeps)."""
    m, k = x.shape
    n = qweight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = config or choose_config(m, n, k, bits, group_size, num_sms)
    if bits == 4 and cfg.block_k != group_size:
        raise ValueError(f"int4 kernels walk one group per step: block_k must be {group_size}, got {cfg.block_k}")
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    if cfg.split_k == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        stride_os = 0
    else:
        out = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        stride_os = out.stride(0)
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    zeros = qzeros if qzeros is not None else scales
    quant_matmul_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        out.stride(-2),
        stride_os,
        BITS=bits,
        GROUP=group_size or 1,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out if cfg.split_k == 1 else out.sum(0).to(x.dtype)


class TritonQuantKernels:
    """QuantKernels on CUDA (linear.py's protocol)."""

    name = "triton"

    def __init__(self) -> None:
        self._num_sms: dict[torch.device, int] = {}

    def _sms(self, device: torch.device) -> int:
        if device not in self._num_sms:
            self._num_sms[device] = (
                torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
            )
        return self._num_sms[device]

    def int8_linear(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return quant_matmul(x, qweight, scales, None, 8, None, self._sms(x.device))

    def precompile(self, linears: list, max_rows: int, dtype: torch.dtype) -> int:
        """Compile every launch shape a call of 1..max_rows rows through these QuantLinears can take (one call
        of zeros each at the fewest rows giving it) -> the calls made. The engine's steps then compile nothing."""
        calls = 0
        shapes = {(q.out_features, q.in_features, q.bits, q.group_size): q for q in linears}
        for (n, k, bits, group), lin in shapes.items():
            for m in first_rows_per_config(n, k, bits, group, max_rows, self._sms(lin.qweight.device)):
                x = torch.zeros(m, k, dtype=dtype, device=lin.qweight.device)
                lin(x)
                calls += 1
        return calls

    def int4_linear(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        return quant_matmul(x, qweight, scales, qzeros, 4, group_size, self._sms(x.device))
