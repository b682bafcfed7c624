"""The decode kernel for one query row per KV head (GROUP == 1, ChatTTS's case) on the CUDA cores: one program
per (sequence, HEADS KV heads, split), each tile row a (token, head) lane with its own online softmax (layout,
tiles and fp8 rules: triton_common.py).

For one query per KV head a tensor-core dot wastes 15 of its 16 rows, and an fp8 tile must be staged in shared
memory and read back a byte at a time to become a dot operand; here a tile converts in registers. A program takes
HEADS adjacent heads of its sequence, so a token's keys are read as one HEADS * 64-value run (256 bytes of an fp8
cache at 4 heads, instead of 64), and the block-table reads, the sequence's bookkeeping and the loop's
synchronisation are shared by the heads: at 512 rows of 32 frames a program's fixed work was most of the
kernel's time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ttsserve.attention.triton_common import DECODE_VARYING, attend_lanes, load_rope, merge_lanes, store_new_rows


@triton.jit(do_not_specialize=DECODE_VARYING)
def paged_decode_lanes_kernel(
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
    HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    FP8: tl.constexpr,
    ROPE: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    """Grid (num_seqs, NUM_HEADS // HEADS, num_splits): the one new query of sequence b for heads
    h0 .. h0 + HEADS - 1 (h0 = HEADS * program_id(1)) over split s, in tiles of BLOCK_N tokens: tile row
    r = t * HEADS + h is token t of head h0 + h (so a token's heads are adjacent in the cache and in the tile).

    The context, splits, the new token (stored by the program of the split that holds it, and its rows' first
    update), SPLIT and ROPE are as in paged_decode_kernel. The lanes are merged per head after the loop
    (triton_common.merge_lanes). LOOP_STAGES: the loop's software pipeline depth (tl.range's num_stages: every
    load of the loop in flight through cp.async; the kernel's num_stages pipelines only loads that feed a dot,
    and the lanes have none); None: not pipelined.
    """
    ROWS: tl.constexpr = BLOCK_N * HEADS
    b = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * HEADS
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = s * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    last = seq_len - 1
    end = tl.minimum(hi, last)  # this split's cached tokens: [lo, end)

    r = tl.arange(0, ROWS)
    rt = r // HEADS  # each row's token in the tile
    rh = h0 + r % HEADS  # each row's head
    hh = h0 + tl.arange(0, HEADS)  # the program's heads
    d = tl.arange(0, HEAD_DIM)
    q_rows = q_ptr + b * stride_qt + rh[:, None] * stride_qh  # [ROWS, 1]: a head's query repeats down its rows
    if ROPE:
        cos = tl.load(cos_ptr + b * stride_cos + d).to(tl.float32)
        sin = tl.load(sin_ptr + b * stride_sin + d).to(tl.float32)
        q = load_rope(q_rows, rt[:, None] >= 0, cos, sin, d, HEAD_DIM).to(tl.float32)
    else:
        cos = 0.0  # unused without ROPE
        sin = 0.0
        q = tl.load(q_rows + d[None, :]).to(tl.float32)
    m_l = tl.full([ROWS], -float("inf"), dtype=tl.float32)
    l_l = tl.zeros([ROWS], dtype=tl.float32)
    acc_l = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    if (lo <= last) & (last < hi):  # this split holds the new token: the first update of token 0's rows
        k_new, v_new = store_new_rows(
            k_ptr + b * stride_kt + hh[:, None] * stride_kh,
            v_ptr + b * stride_vt + hh[:, None] * stride_vh,
            cache_ptr,
            scale_ptr,
            v_offset,
            sc_v_offset,
            stride_slot,
            stride_ch,
            sc_stride_blk,
            sc_stride_h,
            tl.load(slot_mapping_ptr + b).to(tl.int64),
            hh,
            cos,
            sin,
            d,
            BLOCK_SIZE,
            HEAD_DIM,
            FP8,
            ROPE,
        )  # [HEADS, D] -> every row its head's (token 0's rows attend to it, the others mask it)
        if HEADS == 1:
            k_new = tl.broadcast_to(k_new, (ROWS, HEAD_DIM))
            v_new = tl.broadcast_to(v_new, (ROWS, HEAD_DIM))
        else:
            k_new = tl.reshape(tl.broadcast_to(k_new[None, :, :], (BLOCK_N, HEADS, HEAD_DIM)), (ROWS, HEAD_DIM))
            v_new = tl.reshape(tl.broadcast_to(v_new[None, :, :], (BLOCK_N, HEADS, HEAD_DIM)), (ROWS, HEAD_DIM))
        m_l, l_l, acc_l = attend_lanes(q, k_new, v_new, 1.0, 1.0, rt == 0, qk_scale, m_l, l_l, acc_l, False)
    row_off = b * stride_bt
    for start in tl.range(lo, end, BLOCK_N, num_stages=LOOP_STAGES):
        n = start + rt
        valid = n < end
        blk = tl.load(block_tables_ptr + row_off + n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = (blk * BLOCK_SIZE + n % BLOCK_SIZE)[:, None] * stride_slot + rh[:, None] * stride_ch + d[None, :]
        k = tl.load(cache_ptr + off, mask=valid[:, None], other=0.0)
        v = tl.load(cache_ptr + v_offset + off, mask=valid[:, None], other=0.0)
        if FP8:
            soff = blk * sc_stride_blk + rh * sc_stride_h + n % BLOCK_SIZE
            ks = tl.load(scale_ptr + soff, mask=valid, other=0.0)
            vs = tl.load(scale_ptr + sc_v_offset + soff, mask=valid, other=0.0)
        else:
            ks = 1.0  # unused without FP8
            vs = 1.0
        m_l, l_l, acc_l = attend_lanes(q, k, v, ks, vs, valid, qk_scale, m_l, l_l, acc_l, FP8)
    m, den, o = merge_lanes(m_l, l_l, acc_l, BLOCK_N, HEADS, HEAD_DIM)
    if SPLIT:
        part = (b * NUM_HEADS + hh) * num_splits + s
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], o)
        tl.store(part_m_ptr + part, m)
        tl.store(part_l_ptr + part, den)
    else:
        out = o / tl.where(den > 0.0, den, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ot + hh[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty))
