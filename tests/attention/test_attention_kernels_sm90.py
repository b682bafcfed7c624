"""The decode and prefill attention kernels compile for sm_90 through the code that launches them, on a machine
without a GPU (tests/sm90_compile.py): every decode variant `precompile_decode` launches (one split and two, RoPE
before and in the kernel, each lanes head count), and the prefill kernel at each query tile it picks (16, 32 and
64 rows, and fp32's own tiles) with the KV write before it on an fp8 cache, with the bf16 and the fp8 KV cache;
and its tile-table launch (the full prefill graphs') at each of those tiles."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sm90_compile import compile_only_for_sm90  # noqa: E402

from ttsserve.attention.backend import AttentionMetadata, kv_cache_shape  # noqa: E402
from ttsserve.attention.prefill_tiles import max_prefill_tiles, prefill_tiles  # noqa: E402
from ttsserve.attention.triton_paged import TritonPagedAttention  # noqa: E402
from ttsserve.layers.quant.kv_fp8 import FP8KVCache  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 12, 64  # the ChatTTS GPT's


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_kernels_compile_for_sm90(fp8: bool) -> None:
    shape = kv_cache_shape(4, 16, NUM_KV_HEADS, HEAD_DIM)
    cache = FP8KVCache.zeros(shape, "cpu") if fp8 else torch.zeros(shape, dtype=torch.bfloat16)
    with compile_only_for_sm90() as compiled:
        TritonPagedAttention().precompile_decode(cache, NUM_HEADS, torch.bfloat16)
    names = [name for name, _ in compiled]
    assert names and all("decode" in n or "reduce" in n for n in names), names
    if fp8:
        assert any("lanes" in n for n in names), names


def _prefill_metadata(new: list[int], cached: list[int], block_size: int, num_blocks: int) -> AttentionMetadata:
    """Sequences with `new` tokens after `cached` ones, each given blocks 0.. of the cache (only compiled)."""
    seq_lens = [n + c for n, c in zip(new, cached)]
    cu = [0, *itertools.accumulate(new)]
    width = max(-(-s // block_size) for s in seq_lens)
    assert width <= num_blocks
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(width, dtype=torch.int32).repeat(len(new), 1),
        slot_mapping=torch.zeros(cu[-1], dtype=torch.int64),
        max_query_len=max(new),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=seq_lens,
    )


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_kernels_compile_for_sm90(fp8: bool) -> None:
    block_size, num_blocks = 16, 8
    shape = kv_cache_shape(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    runs = [(torch.bfloat16, [3, 8]), (torch.bfloat16, [24, 1]), (torch.bfloat16, [60, 2])]
    if not fp8:  # fp32 has a dense cache of its own dtype only
        runs.append((torch.float32, [60, 2]))
    attn = TritonPagedAttention()
    with compile_only_for_sm90() as compiled:
        for dtype, new in runs:
            cache = FP8KVCache.zeros(shape, "cpu") if fp8 else torch.zeros(shape, dtype=dtype)
            md = _prefill_metadata(new, [5, 0], block_size, num_blocks)
            t = sum(new)
            q = torch.zeros(t, NUM_HEADS, HEAD_DIM, dtype=dtype)
            k = torch.zeros(t, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
            attn.forward(q, k, k.clone(), cache, md, HEAD_DIM**-0.5)
    prefills = [kw for name, kw in compiled if name == "paged_prefill_kernel"]
    assert [kw["BLOCK_M"] for kw in prefills] == [16, 32, 64] + ([] if fp8 else [64]), compiled
    assert all(kw["FP8"] == fp8 for kw in prefills)
    assert [kw["IEEE"] for kw in prefills][-1] == (not fp8)
    writes = [name for name, _ in compiled if name == "reshape_and_cache_kernel"]
    assert len(writes) == (3 if fp8 else 0), compiled  # an fp8 cache is written once, before the kernel reads it


@pytest.mark.parametrize("fp8", [False, True])
def test_tiled_prefill_compiles_for_sm90(fp8: bool) -> None:
    """The tile-table launch the full prefill graphs capture, at each bucket's BLOCK_M, with padding rows."""
    block_size, num_blocks = 16, 8
    shape = kv_cache_shape(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    cache = FP8KVCache.zeros(shape, "cpu") if fp8 else torch.zeros(shape, dtype=torch.bfloat16)
    md = _prefill_metadata([24, 1], [5, 0], block_size, num_blocks)
    t = 32  # the bucket: 25 tokens and 7 padding rows
    md.slot_mapping = torch.full((t,), -1, dtype=torch.int64)
    q = torch.zeros(t, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    k = torch.zeros(t, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    attn = TritonPagedAttention()
    with compile_only_for_sm90() as compiled:
        for block_m in (16, 32, 64):
            tiles = torch.from_numpy(prefill_tiles(np.array([24, 1]), block_m, max_prefill_tiles(t, 2, block_m)))
            attn.prefill_tiled(torch.empty_like(q), q, k, k.clone(), cache, md, HEAD_DIM**-0.5, tiles, block_m)
    prefills = [kw for name, kw in compiled if name == "paged_prefill_kernel"]
    assert [kw["BLOCK_M"] for kw in prefills] == [16, 32, 64], compiled
    assert all(kw["TILED"] and kw["FP8"] == fp8 for kw in prefills)
