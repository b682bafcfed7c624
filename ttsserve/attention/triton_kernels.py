"""Triton kernels of the paged-attention fast path (CUDA only; imported by attention/triton_paged.py).

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
write, for callers that only fill the cache.

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
def _fp8_quant_rows(x):
    """x: [R, D] -> (q [R, D] float8e4nv, scale [R] fp32): scale = amax / 448 (1 if amax == 0)."""
    xf = x.to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=1)
    scale = amax * 0.002232142857142857  # fp32(1 / 448): kv_fp8.INV_FP8_MAX
    scale = tl.where(scale > 0.0, scale, 1.0)
    q = tl.clamp(tl.div_rn(xf, scale[:, None]), -448.0, 448.0).to(tl.float8e4nv)
    return q, scale


@triton.jit
def reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_mapping_ptr,
    scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    v_offset,
    stride_slot,
    stride_ch,
    sc_v_offset,
    sc_stride_blk,
    sc_stride_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per new token: copy its k / v [Hkv, D] into the cache slot; slot < 0 means padding."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    # slot test broadcast to full shape first: Triton's CPU interpreter rejects a scalar term in a mask
    keep = (tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.int64) + slot) >= 0
    mask = (h[:, None] < NUM_KV_HEADS) & keep
    src_k = k_ptr + t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :]
    src_v = v_ptr + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :]
    dst = cache_ptr + slot * stride_slot + h[:, None] * stride_ch + d[None, :]
    k = tl.load(src_k, mask=mask, other=0.0)
    v = tl.load(src_v, mask=mask, other=0.0)
    if FP8:
        kq, ks = _fp8_quant_rows(k)
        vq, vs = _fp8_quant_rows(v)
        tl.store(dst, kq, mask=mask)
        tl.store(dst + v_offset, vq, mask=mask)
        hmask = (h < NUM_KV_HEADS) & ((h * 0 + slot) >= 0)
        sdst = scale_ptr + (slot // BLOCK_SIZE) * sc_stride_blk + h * sc_stride_h + slot % BLOCK_SIZE
        tl.store(sdst, ks, mask=hmask)
        tl.store(sdst + sc_v_offset, vs, mask=hmask)
    else:
        tl.store(dst, k, mask=mask)
        tl.store(dst + v_offset, v, mask=mask)


@triton.jit
def _kv_tile_offsets(
    block_tables_ptr, row_off, n, valid, kv_h, stride_slot, stride_ch, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """([BLOCK_N, HEAD_DIM] element offsets of the K rows of context tokens `n` (V is at + v_offset),
    [BLOCK_N] their physical blocks)."""
    blk = tl.load(block_tables_ptr + row_off + n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = blk * BLOCK_SIZE + (n % BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    return slot[:, None] * stride_slot + kv_h * stride_ch + d[None, :], blk


@triton.jit
def _write_new_kv(cache_ptr, v_offset, stride_slot, stride_ch, slot, kv_h, k_new, v_new, d, write):
    """Store one token's k / v [HEAD_DIM] of head kv_h at `slot` when `write` (scalar) and slot >= 0."""
    # conditions broadcast to full shape through d * 0: Triton's CPU interpreter rejects scalar mask terms
    mask = ((d * 0 + slot) >= 0) & ((d * 0 + write.to(tl.int32)) != 0)
    dst = cache_ptr + slot * stride_slot + kv_h * stride_ch + d
    tl.store(dst, k_new, mask=mask)
    tl.store(dst + v_offset, v_new, mask=mask)


@triton.jit
def _write_new_kv_fp8(
    cache_ptr,
    scale_ptr,
    v_offset,
    sc_v_offset,
    stride_slot,
    stride_ch,
    sc_stride_blk,
    sc_stride_h,
    slot,
    kv_h,
    kq,
    ks,
    vq,
    vs,
    d,
    write,
    BLOCK_SIZE: tl.constexpr,
):
    """_write_new_kv for the fp8 cache: kq / vq [1, HEAD_DIM] fp8 and their scales ks / vs [1]."""
    one = tl.arange(0, 1)
    mask = ((d[None, :] * 0 + slot) >= 0) & ((d[None, :] * 0 + write.to(tl.int32)) != 0)
    dst = cache_ptr + slot * stride_slot + kv_h * stride_ch + d[None, :]
    tl.store(dst, kq, mask=mask)
    tl.store(dst + v_offset, vq, mask=mask)
    smask = ((one * 0 + slot) >= 0) & ((one * 0 + write.to(tl.int32)) != 0)
    sdst = scale_ptr + (slot // BLOCK_SIZE) * sc_stride_blk + kv_h * sc_stride_h + slot % BLOCK_SIZE + one
    tl.store(sdst, ks, mask=smask)
    tl.store(sdst + sc_v_offset, vs, mask=smask)


@triton.jit
def _attend_tile(q, k, v, ks, vs, mask, qk_scale, m_i, l_i, acc, FP8: tl.constexpr, IEEE: tl.constexpr):
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
def paged_decode_kernel(
    out_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    slot_mapping_ptr,
    scale_ptr,
    qk_scale,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    v_offset,
    stride_slot,
    stride_ch,
    sc_v_offset,
    sc_stride_blk,
    sc_stride_h,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
):
    """Grid (num_seqs, num_kv_heads, num_splits): the one new query of sequence b for the GROUP query heads
    that share KV head kv_h (the rows of a BLOCK_M >= 16 tile, padded with zero rows), over split s.

    Context tokens 0..L-2 (L = seq_lens[b], read on the device) come from the cache; token L-1 is this
    step's k / v, taken from the inputs and stored at slot_mapping[b] by the program of its split, so no
    program reads a slot written in the same launch. Split s covers [s * split_len, (s + 1) * split_len),
    split_len = ceil(L / num_splits) rounded up to BLOCK_N. The products are tl.dot on the tensor cores
    (the padding rows cost no memory traffic, and dot operands let Triton pipeline the KV loads).
    SPLIT=False: write the normalised output. SPLIT=True: write the unnormalised accumulator, running
    max (log2 domain) and denominator to part_o [B, H, S, D] / part_m / part_l [B, H, S] for the reduce.
    """
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = s * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    last = seq_len - 1

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    head = kv_h * GROUP + r
    row_valid = r < GROUP
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_valid[:, None], other=0.0
    )
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_off = b.to(tl.int64) * stride_bt
    for start in range(lo, tl.minimum(hi, last), BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < tl.minimum(hi, last)
        off, blks = _kv_tile_offsets(
            block_tables_ptr, row_off, n, valid, kv_h, stride_slot, stride_ch, BLOCK_SIZE, HEAD_DIM
        )
        k = tl.load(cache_ptr + off, mask=valid[:, None], other=0.0)
        v = tl.load(cache_ptr + v_offset + off, mask=valid[:, None], other=0.0)
        if FP8:
            soff = blks * sc_stride_blk + kv_h * sc_stride_h + n % BLOCK_SIZE
            ks = tl.load(scale_ptr + soff, mask=valid, other=0.0)
            vs = tl.load(scale_ptr + sc_v_offset + soff, mask=valid, other=0.0)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        else:
            ks = 1.0  # unused without FP8
            vs = 1.0
        m_i, l_i, acc = _attend_tile(q, k, v, ks, vs, valid[None, :], qk_scale, m_i, l_i, acc, FP8, IEEE)

    if (lo <= last) & (last < hi):  # this split holds the new token
        k_raw = tl.load(k_ptr + b.to(tl.int64) * stride_kt + kv_h * stride_kh + d)
        v_raw = tl.load(v_ptr + b.to(tl.int64) * stride_vt + kv_h * stride_vh + d)
        slot = tl.load(slot_mapping_ptr + b).to(tl.int64)
        if FP8:
            kq, ks_new = _fp8_quant_rows(k_raw[None, :])
            vq, vs_new = _fp8_quant_rows(v_raw[None, :])
            _write_new_kv_fp8(
                cache_ptr,
                scale_ptr,
                v_offset,
                sc_v_offset,
                stride_slot,
                stride_ch,
                sc_stride_blk,
                sc_stride_h,
                slot,
                kv_h,
                kq,
                ks_new,
                vq,
                vs_new,
                d,
                s >= 0,
                BLOCK_SIZE,
            )
            k_new = tl.sum(kq.to(tl.float32) * ks_new[:, None], 0)  # [1, D] -> [D]
            v_new = tl.sum(vq.to(tl.float32) * vs_new[:, None], 0)
        else:
            _write_new_kv(cache_ptr, v_offset, stride_slot, stride_ch, slot, kv_h, k_raw, v_raw, d, s >= 0)
            k_new = k_raw.to(tl.float32)
            v_new = v_raw.to(tl.float32)
        qk_new = tl.sum(q.to(tl.float32) * k_new[None, :], 1) * qk_scale
        m_new = tl.maximum(m_i, qk_new)
        alpha = tl.exp2(m_i - m_new)
        p_new = tl.exp2(qk_new - m_new)
        acc = acc * alpha[:, None] + p_new[:, None] * v_new[None, :]
        l_i = l_i * alpha + p_new
        m_i = m_new

    if SPLIT:
        part = (b.to(tl.int64) * NUM_HEADS + head) * num_splits + s
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_valid[:, None])
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )


@triton.jit
def paged_decode_reduce_kernel(
    out_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
):
    """Grid (num_seqs, num_heads): merge the per-split partial softmaxes into the output row."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_POW2)
    d = tl.arange(0, HEAD_DIM)
    smask = s < num_splits
    base = (b.to(tl.int64) * NUM_HEADS + h) * num_splits
    m = tl.load(part_m_ptr + base + s, mask=smask, other=-float("inf"))
    l = tl.load(part_l_ptr + base + s, mask=smask, other=0.0)  # noqa: E741 (the softmax denominator)
    o = tl.load(part_o_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == -float("inf"), 0.0, m_max)  # all splits empty: weights exp2(-inf) = 0
    w = tl.exp2(m - m_max)
    den = tl.sum(l * w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def paged_prefill_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    slot_mapping_ptr,
    scale_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    v_offset,
    stride_slot,
    stride_ch,
    sc_v_offset,
    sc_stride_blk,
    sc_stride_h,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
):
    """Grid (num_seqs, num_heads, cdiv(max_query_len, BLOCK_M)): BLOCK_M new queries of one sequence/head.

    The q_len new queries of sequence b are the LAST q_len positions of its context of L = seq_lens[b]
    tokens, so query row r sits at position ctx_start + r (ctx_start = L - q_len) and attends to context
    tokens 0..that position. Keys before ctx_start come from the cache, the others from this step's k / v
    inputs (never from the cache, which this launch is writing: the first head of each KV group stores
    its tile's new k / v rows at their slot_mapping slots). Handles any q_len >= 1, so one launch serves
    mixed decode / chunked-prefill batches; programs past a sequence's q_len exit at once.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    mt = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    if mt * BLOCK_M >= q_len:
        return
    kv_h = h // GROUP
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_start = seq_len - q_len

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len
    d = tl.arange(0, HEAD_DIM)
    tok = (q_start + rows).to(tl.int64)
    if h % GROUP == 0:
        slot = tl.load(slot_mapping_ptr + tok, mask=row_valid, other=-1).to(tl.int64)
        wmask = row_valid[:, None] & (slot[:, None] >= 0)
        dst = cache_ptr + slot[:, None] * stride_slot + kv_h * stride_ch + d[None, :]
        k_rows = tl.load(k_ptr + tok[:, None] * stride_kt + kv_h * stride_kh + d[None, :], mask=wmask, other=0.0)
        v_rows = tl.load(v_ptr + tok[:, None] * stride_vt + kv_h * stride_vh + d[None, :], mask=wmask, other=0.0)
        if FP8:
            kq, ks_rows = _fp8_quant_rows(k_rows)
            vq, vs_rows = _fp8_quant_rows(v_rows)
            tl.store(dst, kq, mask=wmask)
            tl.store(dst + v_offset, vq, mask=wmask)
            sdst = scale_ptr + (slot // BLOCK_SIZE) * sc_stride_blk + kv_h * sc_stride_h + slot % BLOCK_SIZE
            smask = row_valid & (slot >= 0)
            tl.store(sdst, ks_rows, mask=smask)
            tl.store(sdst + sc_v_offset, vs_rows, mask=smask)
        else:
            tl.store(dst, k_rows, mask=wmask)
            tl.store(dst + v_offset, v_rows, mask=wmask)

    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :], mask=row_valid[:, None], other=0.0)
    q_pos = ctx_start + rows
    # keys past the last valid query of this tile are masked for every row: stop there
    hi = ctx_start + tl.minimum((mt + 1) * BLOCK_M, q_len)

    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_off = b.to(tl.int64) * stride_bt
    # the loop starts at key 0, which every row may see, so m_i is finite after the first tile
    for start in range(0, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < hi
        cached = n < ctx_start
        new = valid & (n >= ctx_start)
        off, blks = _kv_tile_offsets(
            block_tables_ptr, row_off, n, cached, kv_h, stride_slot, stride_ch, BLOCK_SIZE, HEAD_DIM
        )
        new_tok = (q_start + n - ctx_start).to(tl.int64)
        k_cached = tl.load(cache_ptr + off, mask=cached[:, None], other=0.0)
        v_cached = tl.load(cache_ptr + v_offset + off, mask=cached[:, None], other=0.0)
        k_in = tl.load(
            k_ptr + new_tok[:, None] * stride_kt + kv_h * stride_kh + d[None, :], mask=new[:, None], other=0.0
        )
        v_in = tl.load(
            v_ptr + new_tok[:, None] * stride_vt + kv_h * stride_vh + d[None, :], mask=new[:, None], other=0.0
        )
        if FP8:
            # new tokens enter already fp8-rounded, exactly as the store above wrote them
            kq, ks_in = _fp8_quant_rows(k_in)
            vq, vs_in = _fp8_quant_rows(v_in)
            soff = blks * sc_stride_blk + kv_h * sc_stride_h + n % BLOCK_SIZE
            ks = tl.where(cached, tl.load(scale_ptr + soff, mask=cached, other=1.0), ks_in)
            vs = tl.where(cached, tl.load(scale_ptr + sc_v_offset + soff, mask=cached, other=1.0), vs_in)
            k = tl.where(cached[:, None], k_cached.to(tl.float32), kq.to(tl.float32)).to(q.dtype)
            v = tl.where(cached[:, None], v_cached.to(tl.float32), vq.to(tl.float32)).to(q.dtype)
        else:
            k = tl.where(cached[:, None], k_cached, k_in)
            v = tl.where(cached[:, None], v_cached, v_in)
            ks = 1.0  # unused without FP8
            vs = 1.0
        causal = valid[None, :] & (n[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _attend_tile(q, k, v, ks, vs, causal, qk_scale, m_i, l_i, acc, FP8, IEEE)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )
