"""One incremental ConvNeXt block (audio/incremental.py `_block`) as two Triton kernels around the two GEMMs,
and the masked input buffer of the pipeline's other convs as one.

CUDA only (imported by incremental.py when a block runs on CUDA and triton imports). The torch path is a dozen
small kernels per block (cache gather, cat, mask, tail gather and scatter, a slow depthwise conv, transposes,
LayerNorm, GELU, scale, residual add); on a GPU they cost more than the block's GEMMs. Here a block is:

1. `_front_kernel`, per (row, tile of output frames), all channels: the buffer (the slot's cached 2r frames, then
   the new frames) masked by absolute frame as `Rows.frame_mask` does, the dilated depthwise conv and the
   LayerNorm over channels -> h [B * W, C] row-major, the first GEMM's input;
2. Linear1 + bias + GELU (`linear_gelu`: cuBLAS then erf GELU in place, or with GELU_EPILOGUE one cuBLASLt GEMM
   with GELU in its epilogue), Linear2 + bias (cuBLAS);
3. `_back_kernel`, per (row, frame tile, channel tile): out = buffer at the conv's output frames (the residual)
   + scale * y, and the row's new cache tail (the buffer's positions count .. count + 2r - 1).

Layout: out is [B, C, W] with channels the contiguous axis (a [B, W, C] tensor transposed), like h and y, so the
blocks after the first read, and every kernel writes, along contiguous channels; the Vocos' final LayerNorm
reads it transposed without a copy. Tiles are [frames, channels] so that channels run across a warp's threads.

The tail is written in the back kernel because the front kernel's programs of one row all read the old cache:
writing it there would race with them. In the back kernel only frame tile 0 reads the cache (BLOCK_W >= r), and
that program reads everything it needs before its barrier and its stores. The cache stays [slots, C, 2r], the
torch path's layout.

Exactness: every buffer position outside [0, limit) reads as 0 (a masked load, where the torch path multiplies
by the 0/1 mask), the conv output is rounded to the activation dtype before the LayerNorm as the torch path's
conv output is, and the LayerNorm, the scale and the residual add run in fp32 and round once; in fp32 the result
equals the torch path up to summation order.

The other convs (conv_in, out_conv, the Vocos embed: dense, cuDNN's) keep F.conv1d; `_buffer_kernel` replaces
their cache gather, cat, mask, tail gather and scatter with one launch that writes the buffer and the tail.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ttsserve.audio.decoder_net import ConvNeXtBlock

# W, lag and the strides vary with the call's width and the conv: not specialised on (beyond a stride of 1, which
# says which axis of x is contiguous), so each conv compiles one or two variants, not one per bucket width
_STRIDES = ["stride_xb", "stride_xc", "stride_xw", "stride_cache"]
# the front kernel's tiles past the cached positions read x through one plain pointer (False: every tile picks the
# cache or x per position; benchmarks/convnext_micro.py times both)
INTERIOR_TILES = True
# Linear1's bias and GELU in the GEMM's epilogue in fp16 / bf16 (linear_gelu; False: erf GELU as its own kernel).
# TTSSERVE_VOCODER_FUSED=0 turns it off, with incremental.TRITON_ISTFT
GELU_EPILOGUE = os.environ.get("TTSSERVE_VOCODER_FUSED", "1") != "0"


@triton.jit
def _buffer_tile(
    x_row, cache_row, c, p, cm, first, limit, W, stride_xc, stride_xw, R2: tl.constexpr, X_ONLY: tl.constexpr
):
    """Buffer positions p (position 0 is frame `first`) of channels c, fp32, in the broadcast shape of c and p
    (one of them a column, the other a row): zero where the frame lies outside [0, limit) or p is past the
    buffer (2r + W positions: 2r cached, then W new). One load through a pointer picked per position: two
    loads (cache, x) per tap made the conv kernel spill. X_ONLY: every p >= 2r, so the pointer is x's alone (one
    plain pointer, which the compiler can vectorize)."""
    frame = first + p
    ok = (frame >= 0) & (frame < limit) & (p < R2 + W)
    in_x = x_row + c * stride_xc + (p - R2) * stride_xw  # int32 offsets: a row holds < 2^31 elements
    if not X_ONLY:
        in_x = tl.where(p < R2, cache_row + c * R2 + p, in_x)
    return tl.load(in_x, mask=cm & ok, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["W", "lag"], do_not_specialize_on_alignment=_STRIDES)
def _front_kernel(
    x_ptr,
    cache_ptr,
    slots_ptr,
    start_ptr,
    limit_ptr,
    conv_w_ptr,
    conv_b_ptr,
    ln_w_ptr,
    ln_b_ptr,
    h_ptr,
    C,
    W,
    lag,
    eps,
    stride_xb,
    stride_xc,
    stride_xw,
    stride_cache,
    R2: tl.constexpr,
    KSIZE: tl.constexpr,
    DIL: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    X_ALIGNED: tl.constexpr,
    INTERIOR: tl.constexpr,
):
    """Grid (B, cdiv(W, BLOCK_W)); BLOCK_C >= C. h[b * W + k, :] = LN(dwconv(buffer)[k]) for output frames k of
    this tile; output k is centred on buffer position r + k (frame start - lag - r + k)."""
    b = tl.program_id(0)
    k = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)[:, None]  # [BLOCK_W, 1]
    c = tl.arange(0, BLOCK_C)[None, :]  # [1, BLOCK_C]
    cm = c < C
    first = tl.load(start_ptr + b) - lag - R2
    limit = tl.load(limit_ptr + b)
    if X_ALIGNED:  # x's channels contiguous, its strides multiples of 8 elements (_channels_aligned)
        stride_xb = tl.multiple_of(stride_xb, 8)
        stride_xw = tl.multiple_of(stride_xw, 8)
    x_row = x_ptr + b.to(tl.int64) * stride_xb
    cache_row = cache_ptr + tl.load(slots_ptr + b) * stride_cache
    acc = tl.zeros([BLOCK_W, BLOCK_C], dtype=tl.float32)
    # a loop, not unrolled: unrolled, every tap's tile is live at once and spills. A tile whose taps all read x
    # (buffer positions >= 2r) takes the loop with x's pointer alone, not one picked per position
    if INTERIOR and tl.program_id(1) * BLOCK_W >= R2:
        for t in range(KSIZE):
            v = _buffer_tile(x_row, cache_row, c, k + t * DIL, cm, first, limit, W, stride_xc, stride_xw, R2, True)
            acc += tl.load(conv_w_ptr + c * KSIZE + t, mask=cm, other=0.0).to(tl.float32) * v
    else:
        for t in range(KSIZE):
            v = _buffer_tile(x_row, cache_row, c, k + t * DIL, cm, first, limit, W, stride_xc, stride_xw, R2, False)
            acc += tl.load(conv_w_ptr + c * KSIZE + t, mask=cm, other=0.0).to(tl.float32) * v
    acc += tl.load(conv_b_ptr + c, mask=cm, other=0.0).to(tl.float32)
    acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)  # the torch path's conv writes the activation dtype
    mean = tl.sum(acc, axis=1)[:, None] / C  # padded channels hold exact zeros
    diff = tl.where(cm, acc - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1)[:, None] / C + eps)
    ln_w = tl.load(ln_w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    ln_b = tl.load(ln_b_ptr + c, mask=cm, other=0.0).to(tl.float32)
    h = diff * rstd * ln_w + ln_b
    tl.store(h_ptr + (b * W + k).to(tl.int64) * C + c, h.to(h_ptr.dtype.element_ty), mask=cm & (k < W))


@triton.jit(do_not_specialize=["W", "lag"], do_not_specialize_on_alignment=_STRIDES)
def _back_kernel(
    x_ptr,
    cache_ptr,
    slots_ptr,
    start_ptr,
    count_ptr,
    limit_ptr,
    y_ptr,
    scale_ptr,
    out_ptr,
    C,
    W,
    lag,
    stride_xb,
    stride_xc,
    stride_xw,
    stride_cache,
    R: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Grid (B, cdiv(W, BLOCK_W), cdiv(C, BLOCK_C)); BLOCK_W >= R, TAIL >= 2R. y, out: [B * W, C] row-major
    (Linear2's output; out read as [B, C, W] channels-contiguous). out[b * W + k] = buffer[r + k] + scale *
    y[b * W + k]; frame tile 0 also writes cache[slot, c, j] = buffer[count + j] for j < 2r."""
    b = tl.program_id(0)
    tile = tl.program_id(1)
    k = tile * BLOCK_W + tl.arange(0, BLOCK_W)[:, None]  # [BLOCK_W, 1]
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]  # [1, BLOCK_C]
    cm = c < C
    first = tl.load(start_ptr + b) - lag - 2 * R
    limit = tl.load(limit_ptr + b)
    x_row = x_ptr + b.to(tl.int64) * stride_xb
    cache_row = cache_ptr + tl.load(slots_ptr + b) * stride_cache
    res = _buffer_tile(x_row, cache_row, c, k + R, cm, first, limit, W, stride_xc, stride_xw, 2 * R, False)
    at = (b * W + k).to(tl.int64) * C + c
    y = tl.load(y_ptr + at, mask=cm & (k < W), other=0.0).to(tl.float32)
    out = res + tl.load(scale_ptr + c, mask=cm, other=0.0).to(tl.float32) * y
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=cm & (k < W))
    if tile == 0:
        j = tl.arange(0, TAIL)[:, None]  # [TAIL, 1]
        count = tl.load(count_ptr + b)
        tail = _buffer_tile(x_row, cache_row, c, count + j, cm, first, limit, W, stride_xc, stride_xw, 2 * R, False)
        tl.debug_barrier()  # every thread of this program has read the old cache (res, tail) before any store
        tl.store(cache_row + c * (2 * R) + j, tail.to(cache_ptr.dtype.element_ty), mask=cm & (j < 2 * R))


@triton.jit(do_not_specialize=["W", "lag"], do_not_specialize_on_alignment=_STRIDES)
def _buffer_kernel(
    x_ptr,
    cache_ptr,
    slots_ptr,
    start_ptr,
    count_ptr,
    limit_ptr,
    buf_ptr,
    C,
    W,
    lag,
    stride_xb,
    stride_xc,
    stride_xw,
    stride_cache,
    R2: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Grid (B, cdiv(C, BLOCK_C)); TAIL >= R2 > 0. buf [B, C, R2 + W] contiguous = the masked buffer; then
    cache[slot, c, j] = buf[c, count + j] for j < R2. One program owns its (row, channels): it reads the old
    cache before its barrier and its cache stores. Tiles are [channels, positions]: buf is position-contiguous."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]  # [BLOCK_C, 1]
    cm = c < C
    first = tl.load(start_ptr + b) - lag - R2
    limit = tl.load(limit_ptr + b)
    x_row = x_ptr + b.to(tl.int64) * stride_xb
    cache_row = cache_ptr + tl.load(slots_ptr + b) * stride_cache
    buf_row = buf_ptr + b.to(tl.int64) * C * (R2 + W)
    for p0 in range(0, R2 + W, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)[None, :]  # [1, BLOCK_P]
        v = _buffer_tile(x_row, cache_row, c, p, cm, first, limit, W, stride_xc, stride_xw, R2, False)
        tl.store(buf_row + c * (R2 + W) + p, v.to(buf_ptr.dtype.element_ty), mask=cm & (p < R2 + W))
    j = tl.arange(0, TAIL)[None, :]  # [1, TAIL]
    count = tl.load(count_ptr + b)
    tail = _buffer_tile(x_row, cache_row, c, count + j, cm, first, limit, W, stride_xc, stride_xw, R2, False)
    tl.debug_barrier()
    tl.store(cache_row + c * R2 + j, tail.to(cache_ptr.dtype.element_ty), mask=cm & (j < R2))


def masked_buffer(state, x: Tensor, rows) -> Tensor:
    """ConvState's buffer: x [B, C, W] (any strides) -> [B, C, 2r + W] contiguous, position 0 = frame
    start - lag - 2r, zero outside [0, limit); state.cache[rows.slots] advanced as the torch path does. r > 0."""
    b, c, w = x.shape
    r2, cache = 2 * state.r, state.cache
    assert rows.reach - state.lag - r2 >= 0, "a conv reaches further back than the pipeline planned"
    assert cache.is_contiguous() and cache.shape[1:] == (c, r2) and r2 > 0
    assert cache.dtype == x.dtype, "one load reads the cache and x: one dtype"
    buf = torch.empty(b, c, r2 + w, dtype=x.dtype, device=x.device)
    _buffer_kernel[(b, triton.cdiv(c, 32))](
        x,
        cache,
        rows.slots,
        rows.start,
        rows.count,
        rows.limit,
        buf,
        c,
        w,
        state.lag,
        *x.stride(),
        cache.stride(0),
        R2=r2,
        TAIL=triton.next_power_of_2(r2),
        BLOCK_C=32,
        BLOCK_P=64,
        num_warps=4,
    )
    return buf


def linear_gelu(h: Tensor, linear: torch.nn.Linear) -> Tensor:
    """GELU(h @ W^T + b): h [M, K] row-major -> [M, N]. In fp16 / bf16 with GELU_EPILOGUE, one cuBLASLt GEMM whose
    epilogue adds the bias and applies GELU to the fp32 accumulator before its one rounding, instead of GELU's own
    pass over [M, N] (27.8 of the 67.2 us of the Vocos' Linear1 + GELU at 512 rows x 24 frames, H200). cuBLASLt's GELU
    is the tanh form, at most 4.7e-4 from erf's (at x = 2.7), and the separate path rounds twice (the GEMM's output,
    then GELU's): against fp32 erf GELU of std-1 inputs the relative error is 2.9e-4 against 3.2e-4 in fp16, 1.7e-3
    against 2.6e-3 in bf16 (benchmarks/gelu_epilogue_error.py). fp32 (the CPU reference) keeps erf."""
    if GELU_EPILOGUE and h.dtype in (torch.float16, torch.bfloat16):
        return torch._addmm_activation(linear.bias, h, linear.weight.t(), use_gelu=True)
    return torch.ops.aten.gelu_(F.linear(h, linear.weight, linear.bias))  # exact erf GELU, in place


def _channels_aligned(x: Tensor) -> bool:
    """Whether x [B, C, W] has contiguous channels and row and frame strides that are multiples of 8 elements
    (16 bytes in fp16), so the front kernel may load 8 channels at a time. x's own address is Triton's to check."""
    return x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.stride(2) % 8 == 0


def convnext_block(block: ConvNeXtBlock, state, x: Tensor, rows) -> Tensor:
    """`_block(block, state, x, rows)` fused: x [B, C, W] (any strides) -> [B, C, W] (channels contiguous), and
    state.cache[rows.slots] advanced to each row's last 2r masked input frames. No host sync, no allocation
    but h, Linear1's (GELU applied), Linear2's and out: graph-capturable."""
    b, c, w = x.shape
    r, conv, cache = state.r, state.conv, state.cache
    assert rows.reach - state.lag - 2 * r >= 0, "a conv reaches further back than the pipeline planned"
    assert cache.is_contiguous() and cache.shape[1:] == (c, 2 * r) and r > 0
    assert cache.dtype == x.dtype, "one load reads the cache and x: one dtype"
    ksize, dil = conv.kernel_size[0], conv.dilation[0]
    block_c = triton.next_power_of_2(c)
    block_w = max(1, min(16, 4096 // block_c))  # sm_90: 8 x 512 at 8 warps: 128 registers, no spills
    h = torch.empty(b * w, c, dtype=x.dtype, device=x.device)
    _front_kernel[(b, triton.cdiv(w, block_w))](
        x,
        cache,
        rows.slots,
        rows.start,
        rows.limit,
        conv.weight,
        conv.bias,
        block.norm.weight,
        block.norm.bias,
        h,
        c,
        w,
        state.lag,
        block.norm.eps,
        *x.stride(),
        cache.stride(0),
        R2=2 * r,
        KSIZE=ksize,
        DIL=dil,
        BLOCK_C=block_c,
        BLOCK_W=block_w,
        X_ALIGNED=_channels_aligned(x),
        INTERIOR=INTERIOR_TILES,
        num_warps=8 if block_c * block_w >= 4096 else 4,
    )
    y = F.linear(linear_gelu(h, block.pwconv1), block.pwconv2.weight, block.pwconv2.bias)
    out = torch.empty(b, w, c, dtype=x.dtype, device=x.device)
    back_w = max(32, triton.next_power_of_2(r))
    _back_kernel[(b, triton.cdiv(w, back_w), triton.cdiv(c, 64))](
        x,
        cache,
        rows.slots,
        rows.start,
        rows.count,
        rows.limit,
        y,
        getattr(block, block.scale_name),
        out,
        c,
        w,
        state.lag,
        *x.stride(),
        cache.stride(0),
        R=r,
        TAIL=triton.next_power_of_2(2 * r),
        BLOCK_C=64,
        BLOCK_W=back_w,
        num_warps=4,
    )
    return out.transpose(1, 2)
