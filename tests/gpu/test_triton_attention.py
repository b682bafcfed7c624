"""TritonPagedAttention's decode kernel against a plain fp32 torch reference (tests/gpu/triton_attention_util.py):
split counts and their heuristic, padded CUDA-graph rows, graph replay with new lengths; the standalone KV write
and the inputs the backend rejects. Prefill: test_triton_attention_prefill.py; fused RoPE and the fp8 cache:
test_triton_attention_rope.py.

Runs on CUDA. Without CUDA it is skipped, unless TRITON_INTERPRET=1 and triton is installed: then the
same tests run small shapes through Triton's CPU interpreter (slow; a development aid, not CI).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from triton_env import require_cuda_or_interpreter  # noqa: E402

require_cuda_or_interpreter()

from triton_attention_util import (  # noqa: E402
    DEVICE,
    HEAD_DIM,
    MAX_CTX,
    ON_GPU,
    REL_TOL,
    Case,
    check,
    make_case,
    rand_lens,
    reference,
    skip_bf16_dot_in_interpreter,
)

from ttsserve.attention.backend import AttentionMetadata, kv_cache_shape  # noqa: E402
from ttsserve.attention.triton_paged import (  # noqa: E402
    TritonPagedAttention,
    TritonTuning,
    choose_num_splits,
    write_kv_cache,
)

DECODE_BATCHES = [1, 7, 64, 256] if ON_GPU else [1, 3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("batch", DECODE_BATCHES)
def test_decode_matches_reference(dtype: torch.dtype, block_size: int, batch: int) -> None:
    skip_bf16_dot_in_interpreter(dtype)
    gen = torch.Generator().manual_seed(1000 * batch + block_size)
    ctx = rand_lens(batch, 0, MAX_CTX - 1, gen)
    check(make_case(ctx, [1] * batch, block_size, dtype, gen))


@pytest.mark.parametrize("block_n", [16, 64, 128])
@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
def test_decode_forced_splits_fp32(block_n: int, num_splits: int) -> None:
    """Every split count gives the same answer, including splits left empty by short contexts."""
    gen = torch.Generator().manual_seed(num_splits)
    ctx = [0, 1, 3, 40, 77] + rand_lens(4, MAX_CTX // 2, MAX_CTX - 1, gen)
    case = make_case(ctx, [1] * len(ctx), 16, torch.float32, gen, num_heads=4, num_kv_heads=4)
    check(case, TritonPagedAttention(num_splits=num_splits, tuning=TritonTuning(decode_block_n=block_n)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_n", [16, 64, 128])
@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("path", ["dots", "lanes", "lanes-unpipelined", "lanes-2-heads", "lanes-4-heads"])
def test_decode_paths_match_reference(dtype: torch.dtype, block_n: int, num_splits: int, path: str) -> None:
    """Both decode paths for one query row per KV head (tensor-core dots; CUDA-core lanes with and without their
    loop's software pipeline, a program taking 1, 2 or 4 KV heads in tiles of block_n rows), every tile and
    split count, contexts from empty to long, against the fp32 reference."""
    lanes = path != "dots"
    if not lanes:
        skip_bf16_dot_in_interpreter(dtype)
    heads = int(path.split("-")[1]) if path.endswith("-heads") else 1
    gen = torch.Generator().manual_seed(block_n + num_splits)
    ctx = [0, 1, 2, 17, 64, 65] + rand_lens(3, MAX_CTX // 2, MAX_CTX - 1, gen)
    case = make_case(ctx, [1] * len(ctx), 16, dtype, gen)
    tuning = TritonTuning(
        decode_block_n=block_n,
        decode_lanes="all" if lanes else "none",
        decode_lanes_rows=block_n,
        decode_lanes_num_stages=None if path == "lanes-unpipelined" else 3,
        decode_lanes_heads=heads,
        decode_lanes_programs_per_sm=0,  # every batch takes `heads` a program
    )
    check(case, TritonPagedAttention(num_splits=num_splits, tuning=tuning))


@pytest.mark.parametrize("num_kv_heads, heads", [(6, 2), (3, 1), (12, 4)])
def test_lanes_heads_divide_the_kv_heads(num_kv_heads: int, heads: int) -> None:
    """decode_lanes_heads = 4 on a model whose KV heads it does not divide: the largest power of two that does."""
    tuning = TritonTuning(decode_lanes="all", decode_lanes_rows=16, decode_lanes_programs_per_sm=0)
    assert tuning.lanes_heads(1, num_kv_heads, 132) == heads
    gen = torch.Generator().manual_seed(num_kv_heads)
    case = make_case([0, 5, 40], [1, 1, 1], 16, torch.float32, gen, num_heads=num_kv_heads, num_kv_heads=num_kv_heads)
    check(case, TritonPagedAttention(num_splits=2, tuning=tuning))


def test_lanes_heads_keep_the_device_filled() -> None:
    """Four heads a program while that leaves four programs a multiprocessor (132 of them), fewer below."""
    tuning = TritonTuning()
    assert [tuning.lanes_heads(rows, 12, 132) for rows in (512, 176, 175, 88, 87, 1)] == [4, 4, 2, 2, 1, 1]
    assert TritonTuning(decode_lanes_heads=2).lanes_heads(512, 12, 132) == 2
    assert tuning.lanes_heads_choices(12) == [1, 2, 4] and tuning.lanes_heads_choices(6) == [1, 2]


def test_tuning_rejects_an_unknown_lanes_choice() -> None:
    with pytest.raises(ValueError, match="decode_lanes"):
        TritonTuning(decode_lanes="bf16")
    with pytest.raises(ValueError, match="decode_lanes_num_stages"):
        TritonTuning(decode_lanes_num_stages=0)
    for heads in (0, 3, 6):
        with pytest.raises(ValueError, match="decode_lanes_heads"):
            TritonTuning(decode_lanes_heads=heads)
        with pytest.raises(ValueError, match="decode_lanes_rows"):
            TritonTuning(decode_lanes_rows=heads)
    with pytest.raises(ValueError, match="must not exceed decode_lanes_rows"):
        TritonTuning(decode_lanes_rows=2, decode_lanes_heads=4)  # a tile narrower than a token's heads
    with pytest.raises(ValueError, match="decode_lanes_programs_per_sm"):
        TritonTuning(decode_lanes_programs_per_sm=-1)


def test_split_heuristic() -> None:
    tuning, sms = TritonTuning(), 132
    assert choose_num_splits(44 * 12, 4096, sms, tuning) == 1  # enough (sequence, head) programs already
    assert choose_num_splits(12, 1500, sms, tuning) == 32  # one long sequence: as many splits as allowed
    assert choose_num_splits(12, 40, sms, tuning) == 1  # short context: splits would be too short
    for programs in (1, 12, 96, 300):
        for max_len in (1, 100, 1000, 8000):
            n = choose_num_splits(programs, max_len, sms, tuning)
            assert 1 <= n <= tuning.max_splits and (n == 1 or max_len // n >= tuning.min_tokens_per_split)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_standalone_kv_write_is_exact_and_touches_only_its_slots(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, heads, tokens = 9, 16, 12, 40
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, heads, HEAD_DIM), generator=gen).to(dtype)
    cache = cache.to(DEVICE)
    kv = torch.randn(tokens, 2 * heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    k, v = kv[:, :heads], kv[:, heads:]  # strided views
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::7] = -1  # padding tokens: no write
    slots = slots.to(DEVICE)
    expected = cache.clone()
    real = slots >= 0
    expected[0].view(-1, heads, HEAD_DIM)[slots[real]] = k[real]
    expected[1].view(-1, heads, HEAD_DIM)[slots[real]] = v[real]
    write_kv_cache(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_padded_decode_rows_give_zeros_not_nan() -> None:
    """A CUDA-graph batch padded with empty sequences (seq_len 0, slot -1) leaves the real rows intact."""
    gen = torch.Generator().manual_seed(9)
    case = make_case([30, 50], [1, 1], 16, torch.float16, gen)
    ref = reference(case)
    md = case.md
    pad = 2
    md.seq_lens = torch.cat([md.seq_lens, torch.zeros(pad, dtype=torch.int32, device=DEVICE)])
    md.block_tables = torch.cat([md.block_tables, torch.zeros_like(md.block_tables[:pad])])
    md.slot_mapping = torch.cat([md.slot_mapping, torch.full((pad,), -1, dtype=torch.int64, device=DEVICE)])
    md.cu_seqlens_q = torch.arange(len(md.seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    q = torch.cat([case.q, torch.randn_like(case.q[:pad])])
    k, v = torch.cat([case.k, case.k[:pad]]), torch.cat([case.v, case.v[:pad]])
    for splits in (1, 4):
        out = TritonPagedAttention(num_splits=splits).forward(q, k, v, case.kv_cache, md, case.scale)
        assert torch.equal(out[2:], torch.zeros_like(out[2:]))
        assert ((out[:2].float() - ref).norm() / ref.norm()).item() < REL_TOL[torch.float16]


def test_rejects_unsupported_inputs() -> None:
    gen = torch.Generator().manual_seed(2)
    case = make_case([5], [1], 16, torch.float16, gen)
    backend = TritonPagedAttention()
    with pytest.raises(ValueError, match="head_dim"):
        backend.forward(case.q[..., :32], case.k[..., :32], case.v[..., :32], case.kv_cache, case.md, case.scale)
    with pytest.raises(ValueError, match="dtype"):
        backend.forward(case.q.float(), case.k, case.v, case.kv_cache, case.md, case.scale)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need CUDA")
def test_decode_cuda_graph_replays_new_lengths() -> None:
    """Capture decode once; replay with other contexts / block tables / queries copied into its buffers."""
    batch, block_size, max_blocks = 8, 16, 64
    num_blocks = batch * max_blocks + 8  # >= any case below: sum of blocks + 5 spare
    cases = []
    for seed in (21, 22, 23):
        gen = torch.Generator().manual_seed(seed)
        lo = 0 if seed > 21 else 500
        cases.append(
            make_case(
                rand_lens(batch, lo, max_blocks * block_size - 1, gen), [1] * batch, block_size, torch.bfloat16, gen
            )
        )
    first = cases[0]
    cache = torch.empty(kv_cache_shape(num_blocks, block_size, 12, HEAD_DIM), dtype=torch.bfloat16, device=DEVICE)
    q, k, v = first.q.clone(), first.k.clone(), first.v.clone()
    md = AttentionMetadata(
        first.md.cu_seqlens_q.clone(),
        first.md.seq_lens.clone(),
        torch.zeros((batch, max_blocks), dtype=torch.int32, device=DEVICE),
        first.md.slot_mapping.clone(),
        1,
        max_blocks * block_size,
        block_size,
        first.md.cu_seqlens_q_cpu,
        first.md.seq_lens_cpu,
    )

    def load(case: Case) -> None:
        cache.fill_(float("nan"))
        cache[:, : case.kv_cache.shape[1]].copy_(case.kv_cache)
        md.block_tables.zero_()
        md.block_tables[:, : case.md.block_tables.shape[1]].copy_(case.md.block_tables)
        for dst, src in (
            (md.seq_lens, case.md.seq_lens),
            (md.slot_mapping, case.md.slot_mapping),
            (q, case.q),
            (k, case.k),
            (v, case.v),
        ):
            dst.copy_(src)

    backend = TritonPagedAttention()  # split count chosen at capture from max_seq_len, then frozen
    load(first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, cache, md, first.scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, md, first.scale)
    for case in cases:
        load(case)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(case)
        assert ((out.float() - ref).norm() / ref.norm()).item() < REL_TOL[torch.bfloat16]
