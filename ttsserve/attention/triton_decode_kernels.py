"""The decode kernels: one new query per sequence, flash-decoding splits and their reduce (layout, tiles
and fp8 rules: triton_common.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from ttsserve.attention.triton_common import DECODE_VARYING, attend_tile, kv_tile_offsets, load_rope, store_new_rows


@triton.jit(do_not_specialize=DECODE_VARYING)
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
    cos_ptr,
    sin_ptr,
    qk_scale,
    num_splits,
    stride_cos,
    stride_sin,
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
    ROPE: tl.constexpr,
):
    """Grid (num_seqs, num_kv_heads, num_splits): the one new query of sequence b for the GROUP query heads
    that share KV head kv_h (the rows of a BLOCK_M >= 16 tile, padded with zero rows), over split s; the products
    are tl.dot on the tensor cores (the padding rows cost no memory traffic, and dot operands let Triton pipeline
    the KV loads). One query row per KV head on the CUDA cores instead: triton_decode_lanes.py.

    Context tokens 0..L-2 (L = seq_lens[b], read on the device) come from the cache; token L-1 is this
    step's k / v, taken from the inputs and stored at slot_mapping[b] by the program of its split, so no
    program reads a slot written in the same launch. Split s covers [s * split_len, (s + 1) * split_len),
    split_len = ceil(L / num_splits) rounded up to BLOCK_N.
    SPLIT=False: write the normalised output. SPLIT=True: write the unnormalised accumulator, running
    max (log2 domain) and denominator to part_o [B, H, S, D] / part_m / part_l [B, H, S] for the reduce.
    ROPE=True: q and the new k are unrotated; cos / sin [B, HEAD_DIM] (token stride stride_cos / stride_sin)
    rotate them here (load_rope), and the rotated k is what is stored and attended to.
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
    q_rows = q_ptr + b.to(tl.int64) * stride_qt + head[:, None] * stride_qh  # [BLOCK_M, 1]
    k_row = k_ptr + b.to(tl.int64) * stride_kt + kv_h * stride_kh
    if ROPE:
        cos = tl.load(cos_ptr + b.to(tl.int64) * stride_cos + d).to(tl.float32)
        sin = tl.load(sin_ptr + b.to(tl.int64) * stride_sin + d).to(tl.float32)
        q = load_rope(q_rows, row_valid[:, None], cos, sin, d, HEAD_DIM)
    else:
        cos = 0.0  # unused without ROPE
        sin = 0.0
        q = tl.load(q_rows + d[None, :], mask=row_valid[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_off = b.to(tl.int64) * stride_bt
    for start in range(lo, tl.minimum(hi, last), BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < tl.minimum(hi, last)
        off, blks = kv_tile_offsets(
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
        m_i, l_i, acc = attend_tile(q, k, v, ks, vs, valid[None, :], qk_scale, m_i, l_i, acc, FP8, IEEE)
    if (lo <= last) & (last < hi):  # this split holds the new token
        one = tl.arange(0, 1)
        k_new, v_new = store_new_rows(
            k_row + one[:, None] * 0,
            v_ptr + b.to(tl.int64) * stride_vt + kv_h * stride_vh + one[:, None] * 0,
            cache_ptr,
            scale_ptr,
            v_offset,
            sc_v_offset,
            stride_slot,
            stride_ch,
            sc_stride_blk,
            sc_stride_h,
            tl.load(slot_mapping_ptr + b).to(tl.int64),
            kv_h + one * 0,
            cos,
            sin,
            d,
            BLOCK_SIZE,
            HEAD_DIM,
            FP8,
            ROPE,
        )  # [1, D] each
        qk_new = tl.sum(q.to(tl.float32) * k_new, 1) * qk_scale
        m_new = tl.maximum(m_i, qk_new)
        alpha = tl.exp2(m_i - m_new)
        p_new = tl.exp2(qk_new - m_new)
        acc = acc * alpha[:, None] + p_new[:, None] * v_new
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


@triton.jit(do_not_specialize=["num_splits"])
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
