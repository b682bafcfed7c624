"""The CUDA paged-attention backend: Triton kernels over the paged KV cache (imported only on CUDA).

One launch per layer and step (plus a small reduce when decode splits the context):
- decode-only batches (`md.max_query_len == 1`): `paged_decode_kernel`, one program per (sequence, KV
  head, split) with the context cut into `num_splits` pieces (flash-decoding), then
  `paged_decode_reduce_kernel` to merge the splits when there is more than one; given `rope` it also
  applies RoPE to q and the new k (no separate rotary kernel before it);
- any other batch (prefill, chunked prefill, decode mixed with prefill): `paged_prefill_kernel`, which
  takes a variable number of new queries per sequence (`rope` is applied in torch first).
Both also store this step's k / v at `md.slot_mapping` (slot < 0: skipped, so a runner may pad a
CUDA-graph batch with -1 slots and seq_len 0; such rows come out as zeros).

The cache of a layer is either a tensor of q's dtype or an `FP8KVCache` (ttsserve/layers/quant/kv_fp8.py: fp8
values plus per-token, per-head fp32 scales), which the same kernels read and write with FP8=True. With one query
head per KV head, an fp8 cache decodes on the CUDA cores (`TritonTuning.decode_lanes`): as a tensor-core operand
an fp8 tile reads back from shared memory a byte at a time and the kernel ran slower than on the bf16 cache with
half the bytes.

No device-to-host sync: launch shapes come from tensor shapes and the host ints of the metadata. The
decode path is CUDA-graph capturable: its launch shapes depend only on the batch size and the split
count, and each program reads its sequence's length on the device, so a graph captured once is right for
any context that fits the captured block table (the split count chosen at capture stays, which is only
a question of speed). Pass `num_splits` to pin it, e.g. for captures.
"""

from __future__ import annotations

import itertools

import torch
import triton

from ttsserve.attention.backend import AttentionMetadata, Rope, rope_qk
from ttsserve.attention.prefill_tiles import prefill_block_m
from ttsserve.attention.triton_decode_kernels import paged_decode_kernel, paged_decode_reduce_kernel
from ttsserve.attention.triton_decode_lanes import paged_decode_lanes_kernel
from ttsserve.attention.triton_prefill_kernels import paged_prefill_kernel, reshape_and_cache_kernel
from ttsserve.attention.triton_tuning import TritonTuning, choose_num_splits
from ttsserve.layers.quant.kv_fp8 import FP8_DTYPE, FP8KVCache, kv_scales_shape

SUPPORTED_HEAD_DIMS = (64,)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2E = 1.4426950408889634


class TritonPagedAttention:
    """PagedAttentionBackend on CUDA. kv_cache: [2, num_blocks, block_size, num_kv_heads, 64], contiguous.

    num_splits: pin the decode split count (None: `choose_num_splits` per call).
    """

    name = "triton"

    def __init__(self, num_splits: int | None = None, tuning: TritonTuning | None = None) -> None:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        self.num_splits = num_splits
        self.tuning = tuning or TritonTuning()
        self._num_sms: dict[torch.device, int] = {}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | FP8KVCache,
        md: AttentionMetadata,
        scale: float,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """Write k / v into `kv_cache` at `md.slot_mapping`, then attend causally within each sequence.

        q: [T, Hq, 64]; k, v: [T, Hkv, 64] (last dim contiguous, any token / head strides);
        kv_cache: [2, num_blocks, md.block_size, Hkv, 64] of q's dtype, or an FP8KVCache of that shape;
        rope: None (q / k rotated already) or (cos, sin), [T, 1, 64] or [T, 64], last dim contiguous.
        Returns a new [T, Hq, 64].
        """
        _check_inputs(q, k, v, kv_cache, md)
        if rope is not None:
            _check_rope(rope, q)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] == 0:
            return out
        if md.is_decode_only:
            assert q.shape[0] == md.seq_lens.shape[0], "decode batches have one token per sequence"
            num_seqs, num_kv_heads, sms = md.seq_lens.shape[0], k.shape[1], self._sm_count(q.device)
            heads = 1
            if self.tuning.uses_lanes(q.shape[1] // num_kv_heads, isinstance(kv_cache, FP8KVCache)):
                heads = self.tuning.lanes_heads(num_seqs, num_kv_heads, sms)
            num_splits = self.num_splits
            if num_splits is None:
                num_splits = choose_num_splits(num_seqs * num_kv_heads // heads, md.max_seq_len, sms, self.tuning)
            paged_decode(out, q, k, v, kv_cache, md, scale, num_splits, self.tuning, rope, heads)
        else:
            q, k = rope_qk(q, k, rope)
            paged_prefill(out, q, k, v, kv_cache, md, scale, self.tuning)
        return out

    def prefill_tiled(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | FP8KVCache,
        md: AttentionMetadata,
        scale: float,
        tiles: torch.Tensor,
        block_m: int,
    ) -> None:
        """forward() of a prefill batch (q / k rotated) into out, over the tile table `tiles` (int32
        [num_tiles, 2], attention/prefill_tiles.py) at block_m: a launch a CUDA graph may capture with static
        metadata; padding rows past the step's tokens take slot -1 and are in no tile."""
        _check_inputs(q, k, v, kv_cache, md)
        paged_prefill(out, q, k, v, kv_cache, md, scale, self.tuning, tiles, block_m)

    def precompile_decode(self, kv_cache: torch.Tensor | FP8KVCache, num_heads: int, dtype: torch.dtype) -> None:
        """Compile the decode kernels now: one sequence with one split and with two (the split variant with its
        reduce), for the lanes with each number of heads a program may take, with RoPE applied before the kernel
        (the eager path, as GPT.forward does) and in it (the decode graphs' fused step). Otherwise the eager path
        (a few prompts just prefilled, decoding through the general path) would compile in a served step, and so
        would the graphs whose capture is deferred past start-up (a bucket of tens of rows takes one or two
        heads a program, which neither the largest nor the smallest bucket reaches): 1.0-1.1 s a kernel on an
        empty cache. Writes nothing (slot -1)."""
        cache, _ = _split_cache(kv_cache)
        num_kv_heads, head_dim, dev = cache.shape[3], cache.shape[4], cache.device
        q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=dev)
        kv = torch.zeros(2, 1, num_kv_heads, head_dim, dtype=dtype, device=dev)
        md = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=dev),
            seq_lens=torch.ones(1, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=dev),
            max_query_len=1,
            max_seq_len=1,
            block_size=cache.shape[2],
            cu_seqlens_q_cpu=[0, 1],
            seq_lens_cpu=[1],
        )
        cos = torch.zeros(1, 1, head_dim, dtype=dtype, device=dev)  # as GPT.rotary's cos / sin: [T, 1, D]
        lanes = self.tuning.uses_lanes(num_heads // num_kv_heads, isinstance(kv_cache, FP8KVCache))
        for heads in self.tuning.lanes_heads_choices(num_kv_heads) if lanes else [1]:
            for splits, rope in itertools.product((1, 2), (None, (cos, cos))):
                out = torch.empty_like(q)
                paged_decode(out, q, kv[0], kv[1], kv_cache, md, 1.0, splits, self.tuning, rope, heads)

    def _sm_count(self, device: torch.device) -> int:
        if device not in self._num_sms:
            self._num_sms[device] = (
                torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
            )
        return self._num_sms[device]


def _split_cache(kv_cache: torch.Tensor | FP8KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values, scales or None)."""
    if isinstance(kv_cache, FP8KVCache):
        return kv_cache.data, kv_cache.scales
    return kv_cache, None


def _scale_args(cache: torch.Tensor, scales: torch.Tensor | None) -> tuple:
    """(scale_ptr, sc_v_offset, sc_stride_blk, sc_stride_h); a dense cache passes itself, unused."""
    if scales is None:
        return cache, 0, 0, 0
    return scales, scales.stride(0), scales.stride(1), scales.stride(2)


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | FP8KVCache, md: AttentionMetadata
) -> None:
    """Shape / dtype / layout checks on host metadata only (no device sync)."""
    head_dim = q.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"TritonPagedAttention supports head_dim {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"TritonPagedAttention supports dtypes {SUPPORTED_DTYPES}, got q of {q.dtype}")
    kv_cache, scales = _split_cache(kv_cache)
    if scales is not None:
        if kv_cache.dtype != FP8_DTYPE or scales.dtype != torch.float32:
            raise ValueError(
                f"an FP8KVCache holds {FP8_DTYPE} values and float32 scales, got {kv_cache.dtype} and {scales.dtype}"
            )
        if tuple(scales.shape) != kv_scales_shape(*kv_cache.shape[1:4]) or not scales.is_contiguous():
            raise ValueError(
                f"FP8KVCache scales must be contiguous {kv_scales_shape(*kv_cache.shape[1:4])}, "
                f"got {tuple(scales.shape)}"
            )
        if not (k.dtype == v.dtype == q.dtype):
            raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    elif not (k.dtype == v.dtype == kv_cache.dtype == q.dtype):
        raise ValueError(
            f"q, k, v and kv_cache must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}, {kv_cache.dtype}"
        )
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != head_dim:
        raise ValueError(
            f"expected q [T, Hq, D] and k, v [T, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    num_kv_heads = k.shape[1]
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or kv_cache.shape[2] != md.block_size
        or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim)
    ):
        raise ValueError(
            f"kv_cache must be [2, num_blocks, {md.block_size}, {num_kv_heads}, {head_dim}], "
            f"got {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v must be contiguous in their last (head_dim) dimension")
    if md.slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {md.slot_mapping.shape[0]} slots for {k.shape[0]} tokens")
    if md.block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")


def _check_rope(rope: Rope, q: torch.Tensor) -> None:
    """cos / sin: one [head_dim] row per token, contiguous in head_dim, on q's device."""
    num_tokens, head_dim = q.shape[0], q.shape[-1]
    for t in rope:
        if t.shape[0] != num_tokens or t.shape[-1] != head_dim or t.numel() != num_tokens * head_dim:
            raise ValueError(f"rope cos / sin must be [{num_tokens}, 1, {head_dim}], got {tuple(t.shape)}")
        if t.stride(-1) != 1 or t.device != q.device or not t.is_floating_point():
            raise ValueError("rope cos / sin must be floating point, on q's device, contiguous in head_dim")


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | FP8KVCache, slot_mapping: torch.Tensor
) -> None:
    """kv_cache[0 / 1].view(-1, Hkv, D)[slot_mapping[t]] = k[t] / v[t] for every t with slot >= 0
    (quantized, with its scales stored, for an FP8KVCache)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    cache, scales = _split_cache(kv_cache)
    reshape_and_cache_kernel[(num_tokens,)](
        k,
        v,
        cache,
        slot_mapping,
        _scale_args(cache, scales)[0],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cache.stride(0),
        cache.stride(2),
        cache.stride(3),
        *_scale_args(cache, scales)[1:],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        FP8=scales is not None,
        BLOCK_SIZE=cache.shape[2],
        num_warps=4,
    )


def paged_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor | FP8KVCache,
    md: AttentionMetadata,
    scale: float,
    num_splits: int,
    tuning: TritonTuning,
    rope: Rope | None = None,
    lanes_heads: int = 1,
) -> None:
    """out[b] = attention of q[b] ([Hq, D], one new token per sequence) over its md.seq_lens[b] tokens,
    the last being k[b] / v[b], which are also stored at md.slot_mapping[b]. With rope = (cos, sin), q[b]
    and k[b] are rotated in the kernel first (cos / sin [B, 1, D] or [B, D]). lanes_heads: KV heads a program
    when the lanes decode (TritonTuning.lanes_heads; it divides the KV heads)."""
    kv_cache, scales = _split_cache(kv_cache)
    scale_ptr, *scale_strides = _scale_args(kv_cache, scales)
    num_seqs, num_heads, head_dim = md.seq_lens.shape[0], q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    split = num_splits > 1
    lanes = tuning.uses_lanes(group, scales is not None)
    if split:
        part_o = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((2, num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_m, part_l = part_ml[0], part_ml[1]
    else:
        part_o = part_m = part_l = out  # unused by the SPLIT=False specialisation
    cos, sin = rope if rope is not None else (q, q)  # q: an unused pointer for ROPE=False
    args = (
        out,
        part_o,
        part_m,
        part_l,
        q,
        k,
        v,
        kv_cache,
        md.block_tables,
        md.seq_lens,
        md.slot_mapping,
        scale_ptr,
        cos,
        sin,
        scale * LOG2E,
        num_splits,
        cos.stride(0),
        sin.stride(0),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        md.block_tables.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        *scale_strides,
    )
    fp8, use_rope = scales is not None, rope is not None
    if lanes:
        assert num_kv_heads % lanes_heads == 0 and tuning.decode_lanes_rows % lanes_heads == 0
        paged_decode_lanes_kernel[(num_seqs, num_kv_heads // lanes_heads, num_splits)](
            *args,
            NUM_HEADS=num_heads,
            HEADS=lanes_heads,
            BLOCK_SIZE=md.block_size,
            HEAD_DIM=head_dim,
            BLOCK_N=tuning.decode_lanes_rows // lanes_heads,
            SPLIT=split,
            FP8=fp8,
            ROPE=use_rope,
            LOOP_STAGES=tuning.decode_lanes_num_stages,
            num_warps=tuning.decode_lanes_num_warps,
            num_stages=tuning.decode_num_stages,
        )
    else:
        paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
            *args,
            NUM_HEADS=num_heads,
            GROUP=group,
            BLOCK_SIZE=md.block_size,
            HEAD_DIM=head_dim,
            BLOCK_M=max(16, triton.next_power_of_2(group)),
            BLOCK_N=tuning.decode_block_n,
            SPLIT=split,
            IEEE=q.dtype == torch.float32,
            FP8=fp8,
            ROPE=use_rope,
            num_warps=tuning.decode_num_warps,
            num_stages=tuning.decode_num_stages,
        )
    if split:
        paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            part_o,
            part_m,
            part_l,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            # one variant for every split count up to the tuning's cap (no compile per new count while serving)
            SPLITS_POW2=triton.next_power_of_2(max(num_splits, tuning.max_splits, 2)),
            num_warps=1,
        )


def paged_prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor | FP8KVCache,
    md: AttentionMetadata,
    scale: float,
    tuning: TritonTuning,
    tiles: torch.Tensor | None = None,
    block_m: int | None = None,
) -> None:
    """Causal attention of each sequence's new queries (the last q_len of its context) over its context;
    also stores k / v at md.slot_mapping. tiles: the launch over a tile table instead of the sequences (int32
    [num_tiles, 2] built by attention/prefill_tiles.py with block_m, which must be given with it): its grid
    depends on no step's lengths, so a CUDA graph may capture it."""
    assert (tiles is None) == (block_m is None), "a tile table comes with the block_m it was built for"
    if isinstance(kv_cache, FP8KVCache):  # quantized once, here; the kernel reads every key from the cache
        write_kv_cache(k, v, kv_cache, md.slot_mapping)
    kv_cache, scales = _split_cache(kv_cache)
    scale_ptr, *scale_strides = _scale_args(kv_cache, scales)
    num_seqs, num_heads, head_dim = md.seq_lens.shape[0], q.shape[1], q.shape[2]
    group = num_heads // k.shape[1]
    if tiles is not None:
        grid = (tiles.shape[0], num_heads, 1)
    else:
        block_m = tuning.prefill_block_m or prefill_block_m(md.max_query_len)
        grid = (num_seqs, num_heads, triton.cdiv(md.max_query_len, block_m))
    ieee = q.dtype == torch.float32
    block_n, warps, stages = tuning.prefill_block_n, tuning.prefill_num_warps, tuning.prefill_num_stages
    if ieee:
        # fp32 dots run on FMA units: at the bf16 tiles (64 x 64, 2 stages) the sm_90 build has 32 registers and
        # a 6,968-byte stack per thread (cuobjdump -res-usage); 32-token KV tiles, 8 warps and 1 stage build to
        # ~100 registers without spills
        block_n, warps, stages = 32, 8, 1
    paged_prefill_kernel[grid](
        out,
        q,
        k,
        v,
        kv_cache,
        md.block_tables,
        md.seq_lens,
        md.cu_seqlens_q,
        md.slot_mapping,
        md.slot_mapping if tiles is None else tiles,  # unread without TILED
        scale_ptr,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        md.block_tables.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        *scale_strides,
        GROUP=group,
        BLOCK_SIZE=md.block_size,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=ieee,
        FP8=scales is not None,
        TILED=tiles is not None,
        num_warps=warps,
        num_stages=stages,
    )
