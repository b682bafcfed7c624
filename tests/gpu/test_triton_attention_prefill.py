"""TritonPagedAttention's prefill kernel against a plain fp32 torch reference (tests/gpu/triton_attention_util.py):
fresh prompts and later chunks of long prompts, decode rows interleaved with prefill rows, grouped-query heads,
and all of those on an fp8 cache.

Runs on CUDA. Without CUDA it is skipped, unless TRITON_INTERPRET=1 and triton is installed: then the
same tests run small shapes through Triton's CPU interpreter (slow; a development aid, not CI).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

from triton_env import require_cuda_or_interpreter  # noqa: E402

require_cuda_or_interpreter()

from triton_attention_util import (  # noqa: E402
    DEVICE,
    INTERPRET,
    MAX_CTX,
    ON_GPU,
    REL_TOL,
    bits,
    cache_bits,
    check,
    clone_cache,
    make_case,
    rand_lens,
    skip_bf16_dot_in_interpreter,
    to_fp8_cache,
)

from ttsserve.attention.dense import causal_sdpa  # noqa: E402
from ttsserve.attention.prefill_tiles import max_prefill_tiles, prefill_tiles  # noqa: E402
from ttsserve.attention.triton_paged import TritonPagedAttention, paged_prefill, write_kv_cache  # noqa: E402
from ttsserve.attention.triton_tuning import TritonTuning  # noqa: E402
from ttsserve.layers.quant.kv_fp8 import write_kv_fp8  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_chunked_prefill_matches_reference(dtype: torch.dtype, block_size: int) -> None:
    """Fresh prompts (no context) and later chunks of long prompts (context already cached)."""
    skip_bf16_dot_in_interpreter(dtype)
    gen = torch.Generator().manual_seed(block_size + 7)
    big = 400 if ON_GPU else 40
    ctx = [0, 0, 17, big, 3 * big] + rand_lens(3, 1, MAX_CTX // 2, gen)
    q_lens = [1 + big // 2, 5, 64, big, 33] + rand_lens(3, 1, big, gen)
    check(make_case(ctx, q_lens, block_size, dtype, gen))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_decode_and_prefill(dtype: torch.dtype) -> None:
    skip_bf16_dot_in_interpreter(dtype)
    gen = torch.Generator().manual_seed(3)
    n_dec = 40 if ON_GPU else 3
    ctx = rand_lens(n_dec, 1, MAX_CTX - 1, gen) + [0, 50, 130]
    q_lens = [1] * n_dec + ([300, 17, 200] if ON_GPU else [30, 17, 20])
    order = torch.randperm(len(ctx), generator=gen).tolist()  # decode rows interleaved with prefill rows
    check(make_case([ctx[i] for i in order], [q_lens[i] for i in order], 32, dtype, gen))


def test_gqa_decode_and_prefill() -> None:
    dtype = torch.float16 if INTERPRET and not ON_GPU else torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    backend = TritonPagedAttention()
    check(make_case(rand_lens(5, 0, MAX_CTX - 1, gen), [1] * 5, 16, dtype, gen, num_kv_heads=4), backend)
    check(make_case([0, 70], [20, 9], 16, dtype, gen, num_kv_heads=4), backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_prefill_matches_dequantized_reference(dtype: torch.dtype) -> None:
    """Fresh prompts, a later chunk and decode rows in one prefill launch on an fp8 cache: the new rows stored
    as kv_fp8.py's torch rule stores them, byte for byte, every other byte untouched, and the output equal to
    fp32 attention over the dequantized cache (the new tokens enter their own attention fp8-rounded). Triton's
    interpreter rounds some values to fp8 a binade off torch's, so there the bytes are the stand-alone
    write's (write_kv_cache: the same Triton rule); tests/gpu/test_quant_gpu.py ties that write to torch's."""
    skip_bf16_dot_in_interpreter(dtype)
    gen = torch.Generator().manual_seed(21)
    big = 300 if ON_GPU else 30
    case = make_case([0, 0, 17, big, 5], [big, 9, 1, 20, 1], 16, dtype, gen)
    cache = to_fp8_cache(case.kv_cache)
    expected = clone_cache(cache)
    real = case.md.slot_mapping >= 0
    if ON_GPU:
        write_kv_fp8(expected, case.k[real].float(), case.v[real].float(), case.md.slot_mapping[real])
    else:
        write_kv_cache(case.k[real], case.v[real], expected, case.md.slot_mapping[real])
    out = TritonPagedAttention().forward(case.q, case.k, case.v, cache, case.md, case.scale)
    assert all(torch.equal(a, b) for a, b in zip(cache_bits(cache), cache_bits(expected)))
    deq = cache.dequantize(torch.float32)
    bs, cu = case.md.block_size, case.md.cu_seqlens_q_cpu
    ref = torch.empty(case.q.shape, dtype=torch.float32, device=DEVICE)
    for b, seq_len in enumerate(case.md.seq_lens_cpu):
        pos = torch.arange(seq_len, device=DEVICE)
        flat = case.md.block_tables[b].long()[pos // bs] * bs + pos % bs
        keys, vals = (deq[i].reshape(-1, *deq.shape[3:])[flat] for i in (0, 1))
        lo, hi = cu[b], cu[b + 1]
        ref[lo:hi] = causal_sdpa(case.q[lo:hi].float(), keys, vals, case.scale)
    assert torch.isfinite(out).all()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < REL_TOL[dtype], f"relative error {rel:.2e}"


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_m", [16, 64])
def test_tiled_launch_matches_the_sequence_grid(fp8: bool, block_m: int) -> None:
    """The launch a CUDA graph captures (a tile table with unused tiles, padding token rows with slot -1 after the
    step's tokens) writes the same cache bytes and the same output rows as the launch over the sequences, at
    the same BLOCK_M: the same programs' arithmetic, listed instead of gridded."""
    dtype = torch.float32 if INTERPRET and not ON_GPU else torch.bfloat16
    gen = torch.Generator().manual_seed(31 + block_m)
    big = 200 if ON_GPU else 20
    case = make_case([0, 17, big, 3], [big, 1, 40, 5], 16, dtype, gen)
    md, t = case.md, case.q.shape[0]
    pad = 7  # the bucket's rows past the step's tokens
    q, k, v = (torch.cat([x, torch.randn(pad, *x.shape[1:], generator=gen).to(x)]) for x in (case.q, case.k, case.v))
    slots = torch.cat([md.slot_mapping, torch.full((pad,), -1, dtype=md.slot_mapping.dtype, device=DEVICE)])
    padded = dataclasses.replace(md, slot_mapping=slots)
    cache = to_fp8_cache(case.kv_cache) if fp8 else case.kv_cache
    want_cache = clone_cache(cache) if fp8 else cache.clone()
    tuning = TritonTuning(prefill_block_m=block_m)
    want = torch.empty_like(case.q)
    paged_prefill(want, case.q, case.k, case.v, want_cache, md, case.scale, tuning)
    num_new = np.diff(np.array(md.cu_seqlens_q_cpu))
    capacity = max_prefill_tiles(t + pad, len(num_new) + 2, block_m)
    tiles = torch.from_numpy(prefill_tiles(num_new, block_m, capacity)).to(DEVICE)
    got = torch.empty_like(q)
    paged_prefill(got, q, k, v, cache, padded, case.scale, TritonTuning(), tiles=tiles, block_m=block_m)
    assert torch.equal(got[:t], want)
    if fp8:
        assert all(torch.equal(a, b) for a, b in zip(cache_bits(cache), cache_bits(want_cache)))
    else:
        assert torch.equal(bits(cache), bits(want_cache))  # bitwise: the unused slots hold NaN
