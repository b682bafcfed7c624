"""The decode kernels: one new query per sequence, flash-decoding splits and their reduce (layout, tiles
and fp8 rules: triton_common.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from ttsserve.attention.triton_common import attend_lanes, attend_tile, fp8_quant_rows, kv_tile_offsets, merge_lanes


@triton.jit
def _load_rope(base, mask, cos, sin, d, HEAD_DIM: tl.constexpr):
    """RoPE of the head vectors at `base` (a pointer, or [R, 1] pointers to each row's first element; mask
    shaped like base + d) -> [HEAD_DIM] or [R, HEAD_DIM] in x's dtype: x * cos + rotate_half(x) * sin with x
    and cos / sin ([HEAD_DIM], fp32) in fp32, rounded once, as torch.compile's fusion of backend.apply_rope."""
    x = tl.load(base + d, mask=mask, other=0.0)
    partner = tl.load(base + (d + HEAD_DIM // 2) % HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
    partner = tl.where(d < HEAD_DIM // 2, -partner, partner)
    return (x.to(tl.float32) * cos + partner * sin).to(x.dtype)


@triton.jit
def _write_new_kv(cache_ptr, v_offset, stride_slot, stride_ch, slot, kv_h, k_new, v_new, d):
    """Store one token's k / v [HEAD_DIM] of head kv_h at `slot` when slot >= 0."""
    # the condition broadcast to full shape through d * 0: Triton's CPU interpreter rejects scalar mask terms
    mask = (d * 0 + slot) >= 0
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
    BLOCK_SIZE: tl.constexpr,
):
    """_write_new_kv for the fp8 cache: kq / vq [1, HEAD_DIM] fp8 and their scales ks / vs [1]."""
    one = tl.arange(0, 1)
    mask = (d[None, :] * 0 + slot) >= 0
    dst = cache_ptr + slot * stride_slot + kv_h * stride_ch + d[None, :]
    tl.store(dst, kq, mask=mask)
    tl.store(dst + v_offset, vq, mask=mask)
    smask = (one * 0 + slot) >= 0
    sdst = scale_ptr + (slot // BLOCK_SIZE) * sc_stride_blk + kv_h * sc_stride_h + slot % BLOCK_SIZE + one
    tl.store(sdst, ks, mask=smask)
    tl.store(sdst + sc_v_offset, vs, mask=smask)


@triton.jit
def _store_new_token(
    k_row,
    v_row,
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
    cos,
    sin,
    d,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    ROPE: tl.constexpr,
):
    """Store this step's k / v of head kv_h (at k_row / v_row; k rotated first with ROPE) at `slot` ->
    (k, v) fp32 [HEAD_DIM]: the values the cache now holds (fp8-rounded for the fp8 cache)."""
    if ROPE:
        k_raw = _load_rope(k_row, d < HEAD_DIM, cos, sin, d, HEAD_DIM)
    else:
        k_raw = tl.load(k_row + d)
    v_raw = tl.load(v_row + d)
    if FP8:
        kq, ks = fp8_quant_rows(k_raw[None, :])
        vq, vs = fp8_quant_rows(v_raw[None, :])
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
            ks,
            vq,
            vs,
            d,
            BLOCK_SIZE,
        )
        k_new = tl.sum(kq.to(tl.float32) * ks[:, None], 0)  # [1, D] -> [D]
        v_new = tl.sum(vq.to(tl.float32) * vs[:, None], 0)
    else:
        _write_new_kv(cache_ptr, v_offset, stride_slot, stride_ch, slot, kv_h, k_raw, v_raw, d)
        k_new = k_raw.to(tl.float32)
        v_new = v_raw.to(tl.float32)
    return k_new, v_new


# Triton compiles a kernel per specialisation (an integer argument equal to 1 or divisible by 16, every constexpr
# value), on the first launch that needs it. The split count varies from call to call on the eager path (small
# batches of prompts just prefilled: 2-32 splits), and the block table's row stride is whatever width its caller
# cut: specialised on the first, a served step of a fresh server waited ~500 ms for a compile
# (docs/ARCHITECTURE.md, "Kernels compiled while serving"). Not specialised on, each kernel has one variant per
# constexpr set, all of them compiled before the engine is ready.
_VARYING = ["num_splits", "stride_bt"]


@triton.jit(do_not_specialize=_VARYING)
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
    LANES: tl.constexpr = False,
    LOOP_STAGES: tl.constexpr = None,
):
    """Grid (num_seqs, num_kv_heads, num_splits): the one new query of sequence b for the GROUP query heads
    that share KV head kv_h (the rows of a BLOCK_M >= 16 tile, padded with zero rows; one row with LANES),
    over split s.

    Context tokens 0..L-2 (L = seq_lens[b], read on the device) come from the cache; token L-1 is this
    step's k / v, taken from the inputs and stored at slot_mapping[b] by the program of its split, so no
    program reads a slot written in the same launch. Split s covers [s * split_len, (s + 1) * split_len),
    split_len = ceil(L / num_splits) rounded up to BLOCK_N. LANES=False: the products are tl.dot on the
    tensor cores (the padding rows cost no memory traffic, and dot operands let Triton pipeline the KV loads).
    LANES=True (GROUP == 1, BLOCK_M == 1): the one query row on the CUDA cores, each of the tile's BLOCK_N token
    positions a lane with its own softmax state, merged after the loop (triton_common.attend_lanes).
    LOOP_STAGES: the loop's software pipeline depth (tl.range's num_stages: every load in the loop, the tiles in
    flight through cp.async); None leaves the kernel's num_stages, which pipelines only loads that feed a dot,
    so the lanes, which have none, need it.
    SPLIT=False: write the normalised output. SPLIT=True: write the unnormalised accumulator, running
    max (log2 domain) and denominator to part_o [B, H, S, D] / part_m / part_l [B, H, S] for the reduce.
    ROPE=True: q and the new k are unrotated; cos / sin [B, HEAD_DIM] (token stride stride_cos / stride_sin)
    rotate them here (_load_rope), and the rotated k is what is stored and attended to.
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
        q = _load_rope(q_rows, row_valid[:, None], cos, sin, d, HEAD_DIM)
    else:
        cos = 0.0  # unused without ROPE
        sin = 0.0
        q = tl.load(q_rows + d[None, :], mask=row_valid[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if LANES:  # BLOCK_M == 1
        q_vec = tl.sum(q.to(tl.float32), 0)
        m_l = tl.full([BLOCK_N], -float("inf"), dtype=tl.float32)
        l_l = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_l = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        if (lo <= last) & (last < hi):  # this split holds the new token: lane 0's first update
            k_new, v_new = _store_new_token(
                k_row,
                v_ptr + b.to(tl.int64) * stride_vt + kv_h * stride_vh,
                cache_ptr,
                scale_ptr,
                v_offset,
                sc_v_offset,
                stride_slot,
                stride_ch,
                sc_stride_blk,
                sc_stride_h,
                tl.load(slot_mapping_ptr + b).to(tl.int64),
                kv_h,
                cos,
                sin,
                d,
                BLOCK_SIZE,
                HEAD_DIM,
                FP8,
                ROPE,
            )
            zero = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
            first = tl.arange(0, BLOCK_N) == 0
            kn, vn = zero + k_new[None, :], zero + v_new[None, :]
            m_l, l_l, acc_l = attend_lanes(q_vec, kn, vn, 1.0, 1.0, first, qk_scale, m_l, l_l, acc_l, False)
    row_off = b.to(tl.int64) * stride_bt
    for start in tl.range(lo, tl.minimum(hi, last), BLOCK_N, num_stages=LOOP_STAGES):
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
        else:
            ks = 1.0  # unused without FP8
            vs = 1.0
        if LANES:
            m_l, l_l, acc_l = attend_lanes(q_vec, k, v, ks, vs, valid, qk_scale, m_l, l_l, acc_l, FP8)
        else:
            if FP8:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            m_i, l_i, acc = attend_tile(q, k, v, ks, vs, valid[None, :], qk_scale, m_i, l_i, acc, FP8, IEEE)
    if LANES:  # GROUP == 1: head kv_h
        m, den, o = merge_lanes(m_l, l_l, acc_l)
        if SPLIT:
            part = (b.to(tl.int64) * NUM_HEADS + kv_h) * num_splits + s
            tl.store(part_o_ptr + part * HEAD_DIM + d, o)
            tl.store(part_m_ptr + part, m)
            tl.store(part_l_ptr + part, den)
        else:
            out = o / tl.where(den > 0.0, den, 1.0)
            tl.store(out_ptr + b.to(tl.int64) * stride_ot + kv_h * stride_oh + d, out.to(out_ptr.dtype.element_ty))
    else:
        if (lo <= last) & (last < hi):  # this split holds the new token
            k_new, v_new = _store_new_token(
                k_row,
                v_ptr + b.to(tl.int64) * stride_vt + kv_h * stride_vh,
                cache_ptr,
                scale_ptr,
                v_offset,
                sc_v_offset,
                stride_slot,
                stride_ch,
                sc_stride_blk,
                sc_stride_h,
                tl.load(slot_mapping_ptr + b).to(tl.int64),
                kv_h,
                cos,
                sin,
                d,
                BLOCK_SIZE,
                HEAD_DIM,
                FP8,
                ROPE,
            )
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
