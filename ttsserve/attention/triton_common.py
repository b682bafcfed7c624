"""Triton helpers shared by the paged-attention kernels (CUDA only; triton_decode_kernels.py and
triton_prefill_kernels.py build on them, attention/triton_paged.py launches the kernels).

Cache layout (one layer): kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous, so
the K of slot `s` (= block_id * block_size + offset) and head `h` starts at `s * stride_slot + h * stride_ch`
and its V `v_offset` (= kv_cache.stride(0)) elements later.

Every kernel gathers KV tiles of BLOCK_N tokens through the block table (token n lives in block
`block_table[n // BLOCK_SIZE]` at offset `n % BLOCK_SIZE`), so one tile may span several pages and any
block size works. Scores are kept in the log2 domain (q pre-scaled by scale * log2(e)) so the softmax
uses exp2. Accumulation is fp32 whatever the input dtype.

The attention kernels also store this step's k / v into the cache (one launch per layer instead of two):
the new tokens' keys / values are read from the k / v inputs, never back from the cache, so no program
depends on a store of another program of the same launch. `reshape_and_cache_kernel` is the stand-alone
write, for callers that only fill the cache, and for the prefill kernel on an fp8 cache: there it quantizes the
new rows in a launch of its own first and the kernel reads every key from the cache (so a new key tile is not
quantized again by every query tile reading it).

FP8=True (the fp8 KV cache, ttsserve/layers/quant/kv_fp8.py): the cache holds float8e4nv values and a parallel
fp32 tensor `scales` [2, num_blocks, num_kv_heads, block_size] holds one scale per token and head (the
scale of token offset o of block blk and head h at blk * sc_stride_blk + h * sc_stride_h + o, V's
sc_v_offset later). The writes quantize (amax of the 64 values * fp32(1/448), an IEEE division, round to
nearest even: kv_fp8.py's rule); the reads convert the fp8
tile to the query dtype (exact) for the dot and apply the scales to the score columns (QK^T) and to the
probabilities (PV). A new token of this step enters its own attention already fp8-rounded, so every read
of a token, in this step or a later one, sees the same value.

All loop bounds come from device tensors (seq_lens, cu_seqlens_q), never from host values baked into the
launch, so a CUDA graph captured once stays correct for any context lengths that fit its block table.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp8_quant_rows(x):
    """x: [R, D] -> (q [R, D] float8e4nv, scale [R] fp32): scale = amax / 448 (1 if amax == 0)."""
    xf = x.to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=1)
    scale = amax * 0.002232142857142857  # fp32(1 / 448): kv_fp8.INV_FP8_MAX
    scale = tl.where(scale > 0.0, scale, 1.0)
    q = tl.clamp(tl.div_rn(xf, scale[:, None]), -448.0, 448.0).to(tl.float8e4nv)
    return q, scale


@triton.jit
def kv_tile_offsets(
    block_tables_ptr, row_off, n, valid, kv_h, stride_slot, stride_ch, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """([BLOCK_N, HEAD_DIM] element offsets of the K rows of context tokens `n` (V is at + v_offset),
    [BLOCK_N] their physical blocks)."""
    blk = tl.load(block_tables_ptr + row_off + n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = blk * BLOCK_SIZE + (n % BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    return slot[:, None] * stride_slot + kv_h * stride_ch + d[None, :], blk


@triton.jit
def attend_tile(q, k, v, ks, vs, mask, qk_scale, m_i, l_i, acc, FP8: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step over a KV tile, shared by the decode and prefill kernels.
    q [M, D]; k, v [N, D] (fp8 tiles already cast to q's dtype, their per-token scales in ks / vs [N]);
    mask [M, N] or [1, N]: the keys each row may see; qk_scale includes log2(e) (exp2 below).
    Returns the updated running max m_i [M], sum l_i [M] and unnormalised output acc [M, D]."""
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if FP8:
        qk = qk * ks[None, :]
    qk = tl.where(mask, qk * qk_scale, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:
        pw = p * vs[None, :]
    else:
        pw = p
    if IEEE:
        pv = tl.dot(pw.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(pw.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def attend_lanes(q, k, v, ks, vs, valid, qk_scale, m_l, l_l, acc_l, FP8: tl.constexpr):
    """The online softmax of one query row over a KV tile on the CUDA cores, each of the tile's BLOCK_N token
    positions a lane with its own running max / sum / accumulator (merge_lanes combines them once, after the
    loop), so the loop has no reduction across warps. For one query per KV head (GROUP == 1) a tensor-core
    dot wastes 15 of its 16 rows, and an fp8 tile must be staged in shared memory and read back a byte at a
    time to become a dot operand; here it converts in registers.
    q [D] fp32; k, v [N, D] (any dtype; fp8 scales in ks / vs [N]); valid [N]; m_l, l_l [N], acc_l [N, D]."""
    qk = tl.sum(k.to(tl.float32) * q[None, :], 1)
    if FP8:
        qk = qk * ks
    qk = tl.where(valid, qk * qk_scale, -float("inf"))
    m_new = tl.maximum(m_l, qk)
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a lane with no token yet: weights 0, not NaN
    alpha = tl.exp2(m_l - m_safe)
    p = tl.exp2(qk - m_safe)
    if FP8:
        pw = p * vs
    else:
        pw = p
    acc_l = acc_l * alpha[:, None] + pw[:, None] * v.to(tl.float32)
    return m_new, l_l * alpha + p, acc_l


@triton.jit
def merge_lanes(m_l, l_l, acc_l):
    """attend_lanes' per-lane state -> (m, l, acc [D]): one row's running max, sum (scalars) and accumulator."""
    m = tl.max(m_l, 0)
    w = tl.exp2(m_l - tl.where(m == -float("inf"), 0.0, m))
    return m, tl.sum(l_l * w, 0), tl.sum(acc_l * w[:, None], 0)
