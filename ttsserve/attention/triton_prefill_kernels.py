"""The prefill kernel and the stand-alone cache write (layout, tiles and fp8 rules: triton_common.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from ttsserve.attention.triton_common import attend_tile, fp8_quant_rows, kv_tile_offsets


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
        kq, ks = fp8_quant_rows(k)
        vq, vs = fp8_quant_rows(v)
        tl.store(dst, kq, mask=mask)
        tl.store(dst + v_offset, vq, mask=mask)
        hmask = (h < NUM_KV_HEADS) & ((h * 0 + slot) >= 0)
        sdst = scale_ptr + (slot // BLOCK_SIZE) * sc_stride_blk + h * sc_stride_h + slot % BLOCK_SIZE
        tl.store(sdst, ks, mask=hmask)
        tl.store(sdst + sc_v_offset, vs, mask=hmask)
    else:
        tl.store(dst, k, mask=mask)
        tl.store(dst + v_offset, v, mask=mask)


@triton.jit(do_not_specialize=["stride_bt"])  # the block table's width: see triton_decode_kernels._VARYING
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
    tiles_ptr,
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
    TILED: tl.constexpr,
):
    """Grid (num_seqs, num_heads, cdiv(max_query_len, BLOCK_M)): BLOCK_M new queries of one sequence/head.
    TILED: grid (num_tiles, num_heads, 1) over the int32 [num_tiles, 2] table at tiles_ptr of (sequence, query
    block) pairs (attention/prefill_tiles.py), a (-1, -1) tile exiting at once: the launch a CUDA graph freezes.

    The q_len new queries of sequence b are the LAST q_len positions of its context of L = seq_lens[b]
    tokens, so query row r sits at position ctx_start + r (ctx_start = L - q_len) and attends to context
    tokens 0..that position. Keys before ctx_start come from the cache, the others from this step's k / v
    inputs (never from the cache, which this launch is writing: the first head of each KV group stores
    its tile's new k / v rows at their slot_mapping slots). FP8: the new rows were stored (quantized) by
    write_kv_cache before this launch, and every key comes from the cache: quantized here, each new key
    tile would be quantized again by every query tile and head that reads it (an IEEE division a value:
    5x the bf16 kernel's time per call served at 512 streams on an H100). Handles any q_len >= 1, so one
    launch serves mixed decode / chunked-prefill batches; programs past a sequence's q_len exit at once.
    """
    if TILED:
        b = tl.load(tiles_ptr + 2 * tl.program_id(0))
        mt = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
        if b < 0:
            return
    else:
        b = tl.program_id(0)
        mt = tl.program_id(2)
    h = tl.program_id(1)
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
    if not FP8:
        if h % GROUP == 0:
            slot = tl.load(slot_mapping_ptr + tok, mask=row_valid, other=-1).to(tl.int64)
            wmask = row_valid[:, None] & (slot[:, None] >= 0)
            dst = cache_ptr + slot[:, None] * stride_slot + kv_h * stride_ch + d[None, :]
            src_k = k_ptr + tok[:, None] * stride_kt + kv_h * stride_kh + d[None, :]
            src_v = v_ptr + tok[:, None] * stride_vt + kv_h * stride_vh + d[None, :]
            tl.store(dst, tl.load(src_k, mask=wmask, other=0.0), mask=wmask)
            tl.store(dst + v_offset, tl.load(src_v, mask=wmask, other=0.0), mask=wmask)

    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :], mask=row_valid[:, None], other=0.0)
    q_pos = ctx_start + rows
    # keys past the last valid query of this tile are masked for every row: stop there
    hi = ctx_start + tl.minimum((mt + 1) * BLOCK_M, q_len)

    if FP8:
        cache_end = seq_len  # every key from the cache
    else:
        cache_end = ctx_start
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_off = b.to(tl.int64) * stride_bt
    # the loop starts at key 0, which every row may see, so m_i is finite after the first tile
    for start in range(0, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < hi
        cached = n < cache_end
        off, blks = kv_tile_offsets(
            block_tables_ptr, row_off, n, cached, kv_h, stride_slot, stride_ch, BLOCK_SIZE, HEAD_DIM
        )
        k = tl.load(cache_ptr + off, mask=cached[:, None], other=0.0)
        v = tl.load(cache_ptr + v_offset + off, mask=cached[:, None], other=0.0)
        if FP8:
            soff = blks * sc_stride_blk + kv_h * sc_stride_h + n % BLOCK_SIZE
            ks = tl.load(scale_ptr + soff, mask=cached, other=1.0)
            vs = tl.load(scale_ptr + sc_v_offset + soff, mask=cached, other=1.0)
            # converted through a select so the tile becomes bf16 in registers: fed to the dot as loaded, the
            # fp8 tile is staged in shared memory and read back a byte at a time (sm_90, BLOCK_M 16: 32
            # ld.shared.b8 a thread per tile, compiled offline; none this way)
            k = tl.where(cached[:, None], k.to(tl.float32), 0.0).to(q.dtype)
            v = tl.where(cached[:, None], v.to(tl.float32), 0.0).to(q.dtype)
        else:
            new = valid & (n >= ctx_start)
            new_tok = (q_start + n - ctx_start).to(tl.int64)
            k_in = tl.load(
                k_ptr + new_tok[:, None] * stride_kt + kv_h * stride_kh + d[None, :], mask=new[:, None], other=0.0
            )
            v_in = tl.load(
                v_ptr + new_tok[:, None] * stride_vt + kv_h * stride_vh + d[None, :], mask=new[:, None], other=0.0
            )
            k = tl.where(cached[:, None], k, k_in)
            v = tl.where(cached[:, None], v, v_in)
            ks = 1.0  # unused without FP8
            vs = 1.0
        causal = valid[None, :] & (n[None, :] <= q_pos[:, None])
        m_i, l_i, acc = attend_tile(q, k, v, ks, vs, causal, qk_scale, m_i, l_i, acc, FP8, IEEE)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )
