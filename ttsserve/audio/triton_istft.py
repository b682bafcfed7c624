"""The Vocos ISTFT head of the streaming vocoder (audio/incremental.py `IncrementalVocos._overlap_add`) as two Triton
kernels around cuFFT's irfft.

The torch path is about 40 small kernels a call (counted from its ops; benchmarks/istft_micro.py counts them on a
GPU), most of them passes over fp32 tensors of [B, W, n_fft] (50 MB at 512 rows x 24 frames): the spectrum's
promotion, exp, clamp, cos, sin and products; a transposed copy for the irfft; the window and mask products; two
overlap-adds of n_fft / hop strided adds each into zeros; the stack, the tails' gather, add and scatter; the
division. Here:

1. `_spectrum_kernel`, one program per (row, frame): the head's Linear output [n_fft + 2] (log-magnitude, then
   phase) -> the complex spectrum [n_fft / 2 + 1] as interleaved fp32, frames contiguous, so the irfft reads it
   in place;
2. `torch.fft.irfft` over the last axis -> frames [B, W, n_fft] fp32;
3. `_overlap_add_kernel`, one program per row: each output position sums its n_fft / hop frames (windowed,
   masked), and the window envelope the same way, adds the slot's unfinished tail, writes the row's new tail
   (positions hop * count .. + n_fft - hop) and the samples divided by the envelope.

Exactness: the same operations in the same order as the torch path, in fp32 (frame j of an output chunk is
added in the order overlap_add adds it, the old tail after the frames, the division rounded as torch's); the
compiler may contract a product and a sum into one fma, so results agree to fp32 rounding, not bitwise.
The old tail is read before any program writes a new one: one program owns a row, reads its tail into
registers first and passes a barrier before its first store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _spectrum_kernel(x_ptr, out_ptr, N_BINS: tl.constexpr, BLOCK: tl.constexpr):
    """x [R, 2 * N_BINS] (any float dtype, row-major) -> out [R, N_BINS, 2] fp32: mag = min(exp(x[:N_BINS]), 100),
    (mag cos(phase), mag sin(phase)) with phase = x[N_BINS:]."""
    r = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    m = k < N_BINS
    row = x_ptr + r * (2 * N_BINS)
    mag = tl.load(row + k, mask=m, other=0.0).to(tl.float32)
    phase = tl.load(row + N_BINS + k, mask=m, other=0.0).to(tl.float32)
    mag = tl.minimum(tl.exp(mag), 100.0, propagate_nan=tl.PropagateNan.ALL)  # exp: ex2.approx, ~2 ulp
    pair = tl.interleave(mag * tl.cos(phase), mag * tl.sin(phase))  # [2 * BLOCK]: re, im, re, im, ...
    j = tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + r * (2 * N_BINS) + j, pair, mask=j < 2 * N_BINS)


@triton.jit(do_not_specialize=["W", "lag"])
def _overlap_add_kernel(
    frames_ptr,
    window_ptr,
    tails_ptr,
    slots_ptr,
    start_ptr,
    count_ptr,
    limit_ptr,
    out_ptr,
    W,
    lag,
    HOP: tl.constexpr,
    N_FFT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program b: row b's frames [W, N_FFT] fp32 -> out[b] [HOP * W] fp32, and tails[slots[b]] [2, N_FFT - HOP]
    (sums, envelope) advanced by the row's count frames. Frame k is valid where its absolute frame
    start - lag + k lies in [0, limit) and k < count. BLOCK >= N_FFT - HOP: the old tail lies in the first tile."""
    OV: tl.constexpr = N_FFT - HOP
    b = tl.program_id(0)
    slot = tl.load(slots_ptr + b)
    first = tl.load(start_ptr + b) - lag
    count = tl.load(count_ptr + b)
    limit = tl.load(limit_ptr + b)
    t = tl.arange(0, BLOCK)
    tail = tails_ptr + slot * (2 * OV)
    old_z = tl.load(tail + t, mask=t < OV, other=0.0)
    old_e = tl.load(tail + OV + t, mask=t < OV, other=0.0)
    tl.debug_barrier()  # every old value read before this program's first store to the tail
    frames = frames_ptr + b.to(tl.int64) * W * N_FFT
    total = HOP * W + OV
    for p0 in range(0, total, BLOCK):
        p = p0 + t
        chunk = p // HOP
        z = tl.zeros([BLOCK], dtype=tl.float32)
        e = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(N_FFT // HOP):  # frame chunk - j covers p at offset p - HOP * (chunk - j)
            k = chunk - j
            o = p - HOP * k
            inside = (k >= 0) & (k < W) & (p < total)
            valid = ((first + k >= 0) & (first + k < limit) & (k < count)).to(tl.float32)
            w = tl.load(window_ptr + o, mask=inside, other=0.0)
            z += tl.load(frames + k * N_FFT + o, mask=inside, other=0.0) * w * valid
            e += w * w * valid
        z = tl.where(p < OV, z + old_z, z)  # t == p in the first tile, the only one with p < OV
        e = tl.where(p < OV, e + old_e, e)
        j = p - HOP * count
        keep = (j >= 0) & (j < OV)
        tl.store(tail + j, z, mask=keep)
        tl.store(tail + OV + j, e, mask=keep)
        tl.store(out_ptr + b * (HOP * W) + p, tl.math.div_rn(z, tl.maximum(e, 1e-11)), mask=p < HOP * W)


def spectrum(x: Tensor) -> Tensor:
    """The ISTFT head's Linear output x [B, W, n_fft + 2] -> complex64 spectrum [B, W, n_fft / 2 + 1] (frames
    contiguous: irfft reads it in place). ISTFTHead.spectrum, transposed."""
    b, w, n = x.shape
    x = x.contiguous()
    out = torch.empty(b, w, n // 2, 2, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n // 2)
    _spectrum_kernel[(b * w,)](x, out, N_BINS=n // 2, BLOCK=block, num_warps=4)
    return torch.view_as_complex(out)


def istft_overlap_add(head, feats: Tensor, rows, tails: Tensor, lag: int) -> Tensor:
    """`IncrementalVocos._overlap_add` fused: feats [B, W, dim] -> wav [B, hop * W] fp32, tails [slots, 2, n_fft -
    hop] fp32 advanced for rows.slots. No host sync: graph-capturable."""
    n_fft, hop = head.n_fft, head.hop_length
    assert n_fft % hop == 0 and tails.is_contiguous() and tails.dtype == torch.float32
    frames = torch.fft.irfft(spectrum(head.out(feats)), n=n_fft, dim=2)  # [B, W, n_fft] fp32, contiguous
    b, w = frames.shape[:2]
    window = head.window.to(torch.float32)
    out = torch.empty(b, hop * w, dtype=torch.float32, device=feats.device)
    _overlap_add_kernel[(b,)](
        frames,
        window,
        tails,
        rows.slots,
        rows.start,
        rows.count,
        rows.limit,
        out,
        w,
        lag,
        HOP=hop,
        N_FFT=n_fft,
        BLOCK=max(triton.next_power_of_2(n_fft - hop), 256),
        num_warps=4,
    )
    return out
