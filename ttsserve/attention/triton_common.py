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

# Triton compiles a kernel per specialisation (an integer argument equal to 1 or divisible by 16, every constexpr
# value), on the first launch that needs it. The split count varies from call to call on the eager path (small
# batches of prompts just prefilled: 2-32 splits), and the block table's row stride is whatever width its caller
# cut: specialised on the first, a served step of a fresh server waited ~500 ms for a compile
# (docs/ARCHITECTURE.md, "Kernels compiled while serving"). Not specialised on, each decode kernel has one variant per
# constexpr set, all of them compiled before the engine is ready.
DECODE_VARYING = ["num_splits", "stride_bt"]


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
    q [N, D] fp32 (each lane's query row); k, v [N, D] (any dtype; fp8 scales in ks / vs [N]); valid [N]; m_l,
    l_l [N], acc_l [N, D]."""
    qk = tl.sum(k.to(tl.float32) * q, 1)
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
def merge_lanes(m_l, l_l, acc_l, BLOCK_N: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """attend_lanes' state over BLOCK_N * HEADS lanes, lane t * HEADS + h holding token t of head h ->
    (m [HEADS], l [HEADS], acc [HEADS, HEAD_DIM]): each head's running max, sum and accumulator."""
    m2 = tl.reshape(m_l, (BLOCK_N, HEADS))
    m = tl.max(m2, 0)
    w = tl.exp2(m2 - tl.where(m == -float("inf"), 0.0, m)[None, :])  # [BLOCK_N, HEADS]
    den = tl.sum(tl.reshape(l_l, (BLOCK_N, HEADS)) * w, 0)
    acc = tl.sum(tl.reshape(acc_l, (BLOCK_N, HEADS, HEAD_DIM)) * w[:, :, None], 0)
    return m, den, acc


@triton.jit
def load_rope(base, mask, cos, sin, d, HEAD_DIM: tl.constexpr):
    """RoPE of the head vectors at `base` (a pointer, or [R, 1] pointers to each row's first element; mask
    shaped like base + d) -> [HEAD_DIM] or [R, HEAD_DIM] in x's dtype: x * cos + rotate_half(x) * sin with x
    and cos / sin ([HEAD_DIM], fp32) in fp32, rounded once, as torch.compile's fusion of backend.apply_rope."""
    x = tl.load(base + d, mask=mask, other=0.0)
    partner = tl.load(base + (d + HEAD_DIM // 2) % HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
    partner = tl.where(d < HEAD_DIM // 2, -partner, partner)
    return (x.to(tl.float32) * cos + partner * sin).to(x.dtype)


@triton.jit
def store_new_rows(
    k_rows,
    v_rows,
    cache_ptr,
    scale_ptr,
    v_offset,
    sc_v_offset,
    stride_slot,
    stride_ch,
    sc_stride_blk,
    sc_stride_h,
    slot,
    heads,
    cos,
    sin,
    d,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    ROPE: tl.constexpr,
):
    """This step's k / v of the KV heads `heads` [H] (k_rows / v_rows: [H, 1] pointers to each head's inputs; k
    rotated first with ROPE), stored at `slot` (nothing when slot < 0) -> (k, v) fp32 [H, HEAD_DIM]: the values
    the cache holds (fp8-rounded for the fp8 cache), which is what this step attends to."""
    # conditions broadcast to full shape through * 0: Triton's CPU interpreter rejects scalar mask terms
    full = heads[:, None] * 0 + d[None, :] * 0
    if ROPE:
        k_raw = load_rope(k_rows, full == 0, cos, sin, d, HEAD_DIM)
    else:
        k_raw = tl.load(k_rows + d[None, :])
    v_raw = tl.load(v_rows + d[None, :])
    write = (full + slot) >= 0
    dst = cache_ptr + slot * stride_slot + heads[:, None] * stride_ch + d[None, :]
    if FP8:
        kq, ks = fp8_quant_rows(k_raw)
        vq, vs = fp8_quant_rows(v_raw)
        tl.store(dst, kq, mask=write)
        tl.store(dst + v_offset, vq, mask=write)
        sdst = scale_ptr + (slot // BLOCK_SIZE) * sc_stride_blk + heads * sc_stride_h + slot % BLOCK_SIZE
        swrite = (heads * 0 + slot) >= 0
        tl.store(sdst, ks, mask=swrite)
        tl.store(sdst + sc_v_offset, vs, mask=swrite)
        k_new = kq.to(tl.float32) * ks[:, None]
        v_new = vq.to(tl.float32) * vs[:, None]
    else:
        tl.store(dst, k_raw, mask=write)
        tl.store(dst + v_offset, v_raw, mask=write)
        k_new = k_raw.to(tl.float32)
        v_new = v_raw.to(tl.float32)
    return k_new, v_new
