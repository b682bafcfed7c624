"""TritonPagedAttention against a plain fp32 torch reference (gather the context, causal softmax).

Runs on CUDA. Without CUDA it is skipped, unless TRITON_INTERPRET=1 and triton is installed: then the
same tests run small shapes through Triton's CPU interpreter (slow; a development aid, not CI).
Unused cache slots are filled with NaN, so any read outside a sequence's context shows up as NaN.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

from ttsserve.attention.backend import AttentionMetadata, kv_cache_shape
from ttsserve.layers.quant.kv_fp8 import FP8KVCache, write_kv_fp8
from ttsserve.model.layers import RotaryEmbedding

pytestmark = pytest.mark.gpu

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HEAD_DIM = 64
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1 with triton installed)", allow_module_level=True)
pytest.importorskip("triton")

from ttsserve.attention.triton_paged import (  # noqa: E402
    TritonPagedAttention,
    TritonTuning,
    choose_num_splits,
    write_kv_cache,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# relative Frobenius error ‖out - ref‖ / ‖ref‖ allowed per dtype (bf16 keeps 8 mantissa bits)
REL_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@dataclass
class Case:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    kv_cache: torch.Tensor
    md: AttentionMetadata
    ctx_k: list[torch.Tensor]  # per sequence, the K of its already cached tokens [ctx_len, Hkv, D]
    ctx_v: list[torch.Tensor]
    scale: float


def make_case(
    ctx_lens: list[int],
    q_lens: list[int],
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    num_heads: int = 12,
    num_kv_heads: int = 12,
    spare_blocks: int = 5,
) -> Case:
    """Random sequences with `ctx_lens[b]` cached tokens and `q_lens[b]` new ones, scattered over random pages."""
    num_seqs = len(ctx_lens)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros((num_seqs, max(blocks_per_seq)), dtype=torch.int32)
    taken = 0
    for b, nb in enumerate(blocks_per_seq):
        block_tables[b, :nb] = torch.tensor(perm[taken : taken + nb])
        taken += nb

    def slots(b: int, start: int, stop: int) -> torch.Tensor:
        pos = torch.arange(start, stop)
        return block_tables[b, pos // block_size].long() * block_size + pos % block_size

    # tensors are drawn on the device (a device generator seeded from `gen`): large cases stay fast
    dgen = torch.Generator(device=DEVICE).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=dgen, device=DEVICE).to(dtype)

    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, HEAD_DIM)
    kv_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    all_ctx = randn(2, sum(ctx_lens), num_kv_heads, HEAD_DIM)
    ctx_slots = torch.cat([slots(b, 0, c) for b, c in enumerate(ctx_lens)]).to(DEVICE)
    kv_cache.view(2, -1, num_kv_heads, HEAD_DIM)[:, ctx_slots] = all_ctx
    ctx_k = list(all_ctx[0].split(ctx_lens))
    ctx_v = list(all_ctx[1].split(ctx_lens))

    # q / k / v as views of one fused projection, as the GPT produces them (token stride != H * D)
    num_tokens = sum(q_lens)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * HEAD_DIM) * 2
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    slot_mapping = torch.cat([slots(b, c, s) for b, (c, s) in enumerate(zip(ctx_lens, seq_lens))])
    md = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        slot_mapping=slot_mapping.to(DEVICE),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=seq_lens,
    )
    q = qkv[:, : num_heads * HEAD_DIM].view(num_tokens, num_heads, HEAD_DIM)
    k = qkv[:, num_heads * HEAD_DIM : (num_heads + num_kv_heads) * HEAD_DIM].view(num_tokens, num_kv_heads, HEAD_DIM)
    v = qkv[:, (num_heads + num_kv_heads) * HEAD_DIM :].view(num_tokens, num_kv_heads, HEAD_DIM)
    return Case(q, k, v, kv_cache, md, ctx_k, ctx_v, 1.0 / math.sqrt(HEAD_DIM))


def reference(case: Case) -> torch.Tensor:
    """fp32 causal attention, from the test's own copy of each context (never from the cache)."""
    cu, group = case.md.cu_seqlens_q_cpu, case.q.shape[1] // case.k.shape[1]
    out = torch.empty(case.q.shape, dtype=torch.float32, device=DEVICE)
    for b in range(case.md.num_seqs):
        lo, hi = cu[b], cu[b + 1]
        keys = torch.cat([case.ctx_k[b], case.k[lo:hi]]).float().repeat_interleave(group, dim=1)
        vals = torch.cat([case.ctx_v[b], case.v[lo:hi]]).float().repeat_interleave(group, dim=1)
        q = case.q[lo:hi].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * case.scale
        q_pos = torch.arange(keys.shape[0] - (hi - lo), keys.shape[0], device=DEVICE)
        allowed = torch.arange(keys.shape[0], device=DEVICE)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, vals)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view, so that NaN poison compares equal to itself."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def check(case: Case, backend: TritonPagedAttention | None = None) -> None:
    """Output close to the fp32 reference, and the cache changed exactly at the new tokens' slots."""
    backend = backend or TritonPagedAttention()
    expected_cache = case.kv_cache.clone()
    slots = case.md.slot_mapping
    real = slots >= 0
    expected_cache.view(2, -1, *case.k.shape[1:])[:, slots[real]] = torch.stack([case.k[real], case.v[real]])
    out = backend.forward(case.q, case.k, case.v, case.kv_cache, case.md, case.scale)
    assert torch.equal(bits(case.kv_cache), bits(expected_cache)), "KV cache write wrong"
    ref = reference(case)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert torch.isfinite(out).all(), "NaN/inf in output: read outside the context?"
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < REL_TOL[case.q.dtype], f"relative error {rel:.2e}"


def skip_bf16_dot_in_interpreter(dtype: torch.dtype) -> None:
    """The prefill kernel uses tl.dot, which Triton 3.9's CPU interpreter gets wrong for bf16."""
    if INTERPRET and not ON_GPU and dtype == torch.bfloat16:
        pytest.skip("Triton's CPU interpreter mis-computes bf16 tl.dot")


def rand_lens(n: int, lo: int, hi: int, gen: torch.Generator) -> list[int]:
    return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()


MAX_CTX = 4096 if ON_GPU else 80
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


# ---------------------------------------------------------------------------------------------- fused RoPE


def new_token_rope(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, 1, D] of each sequence's new token (position seq_len - 1), as the GPT builds them."""
    positions = case.md.seq_lens.long() - 1
    rotary = RotaryEmbedding(HEAD_DIM, 10000.0, int(positions.max()) + 1).to(DEVICE)
    return rotary(positions, case.q.dtype)


def rope_fp32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The fused kernel's rounding: x * cos + rotate_half(x) * sin in fp32, rounded once to x's dtype."""
    xf, half = x.float(), x.shape[-1] // 2
    return (xf * cos.float() + torch.cat((-xf[..., half:], xf[..., :half]), -1) * sin.float()).to(x.dtype)


def to_fp8_cache(kv_cache: torch.Tensor) -> FP8KVCache:
    """The dense case cache quantized slot by slot (torch rule); NaN poison stays NaN."""
    _, num_blocks, block_size, heads, d = kv_cache.shape
    cache = FP8KVCache.zeros(kv_cache.shape, DEVICE)
    flat = kv_cache.view(2, -1, heads, d).float()
    write_kv_fp8(cache, flat[0], flat[1], torch.arange(num_blocks * block_size, device=DEVICE))
    return cache


def clone_cache(cache: torch.Tensor | FP8KVCache) -> torch.Tensor | FP8KVCache:
    if isinstance(cache, FP8KVCache):
        return FP8KVCache(cache.data.clone(), cache.scales.clone())
    return cache.clone()


def cache_bits(cache: torch.Tensor | FP8KVCache) -> list[torch.Tensor]:
    if isinstance(cache, FP8KVCache):
        return [cache.data.view(torch.uint8), bits(cache.scales)]
    return [bits(cache)]


def within_one_ulp(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every element of a equals b's or a neighbour (FMA contraction on the GPU may move a rounding; the 1e-5
    floor covers x * cos + partner * sin cancelling to 0 in one rounding and not in the other)."""
    eps, a, b = torch.finfo(b.dtype).eps, a.float(), b.float()
    return bool(((a - b).abs() <= eps * torch.maximum(a.abs(), b.abs()) + 1e-5).all())


def check_rope_decode(case: Case, backend: TritonPagedAttention, fp8: bool = False) -> None:
    """backend.forward with rope=(cos, sin) on unrotated q / k == rope_fp32 in torch, then the plain kernel:
    the output and the whole cache afterwards (the rotated k stored, fp8-quantized for an FP8KVCache)."""
    cache = to_fp8_cache(case.kv_cache) if fp8 else case.kv_cache
    ref_cache = clone_cache(cache)
    cos, sin = new_token_rope(case)
    q_rot, k_rot = rope_fp32(case.q, cos, sin), rope_fp32(case.k, cos, sin)
    ref = backend.forward(q_rot, k_rot, case.v, ref_cache, case.md, case.scale)
    out = backend.forward(case.q, case.k, case.v, cache, case.md, case.scale, rope=(cos, sin))
    assert torch.isfinite(out).all()
    if not ON_GPU:  # the interpreter computes in numpy fp32: no FMA, the same roundings exactly
        assert torch.equal(bits(out), bits(ref))
        assert all(torch.equal(a, b) for a, b in zip(cache_bits(cache), cache_bits(ref_cache)))
        return
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < REL_TOL[case.q.dtype] / 4
    slots = case.md.slot_mapping
    if fp8:
        stored = cache.dequantize(torch.float32).view(2, -1, *case.k.shape[1:])[0, slots]
        ref_stored = ref_cache.dequantize(torch.float32).view(2, -1, *case.k.shape[1:])[0, slots]
        assert ((stored - ref_stored).norm() / ref_stored.norm()).item() < 1e-2
    else:
        assert within_one_ulp(cache.view(2, -1, *case.k.shape[1:])[0, slots], k_rot)
        assert torch.equal(bits(cache[1]), bits(ref_cache[1]))  # V untouched by RoPE


ROPE_BATCHES = [(1, 12), (7, 12), (63, 4)] if ON_GPU else [(1, 4), (3, 2)]
ROPE_DTYPES = [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", ROPE_DTYPES)
@pytest.mark.parametrize("batch,num_kv_heads", ROPE_BATCHES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_rope_decode_equals_rotate_then_decode(dtype: torch.dtype, batch: int, num_kv_heads: int, num_splits) -> None:
    gen = torch.Generator().manual_seed(100 * batch + num_splits)
    ctx = rand_lens(batch, 1, MAX_CTX - 1, gen)
    if batch > 1:
        ctx[0] = 0  # position 0: cos 1, sin 0
    case = make_case(ctx, [1] * batch, 16, dtype, gen, num_heads=12, num_kv_heads=num_kv_heads)
    check_rope_decode(case, TritonPagedAttention(num_splits=num_splits))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_rope_decode_fp8_cache_equals_rotate_then_decode(num_splits: int) -> None:
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    gen = torch.Generator().manual_seed(7 + num_splits)
    ctx = [0, 37] + rand_lens(3, 1, MAX_CTX - 1, gen)
    case = make_case(ctx, [1] * len(ctx), 16, dtype, gen, num_kv_heads=4)
    check_rope_decode(case, TritonPagedAttention(num_splits=num_splits), fp8=True)


def test_rope_on_a_prefill_batch_rotates_in_torch() -> None:
    """Batches with prefill rows take the prefill kernel: rope there is backend.rope_qk, then the same call."""
    from ttsserve.attention.backend import rope_qk

    gen = torch.Generator().manual_seed(17)
    case = make_case([0, 20, 5], [6, 1, 9], 16, torch.float32, gen, num_kv_heads=4)
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(case.md.seq_lens_cpu, [6, 1, 9])]).to(DEVICE)
    cos, sin = RotaryEmbedding(HEAD_DIM, 10000.0, 64).to(DEVICE)(positions, torch.float32)
    ref_cache = case.kv_cache.clone()
    q_rot, k_rot = rope_qk(case.q, case.k, (cos, sin))
    backend = TritonPagedAttention()
    ref = backend.forward(q_rot, k_rot, case.v, ref_cache, case.md, case.scale)
    out = backend.forward(case.q, case.k, case.v, case.kv_cache, case.md, case.scale, rope=(cos, sin))
    assert torch.equal(out, ref) and torch.equal(bits(case.kv_cache), bits(ref_cache))


def test_rope_rejects_mis_shaped_tables() -> None:
    gen = torch.Generator().manual_seed(4)
    case = make_case([5, 9], [1, 1], 16, torch.float16, gen)
    cos, sin = new_token_rope(case)
    backend = TritonPagedAttention()
    with pytest.raises(ValueError, match="rope"):
        backend.forward(case.q, case.k, case.v, case.kv_cache, case.md, case.scale, rope=(cos[:1], sin[:1]))
    with pytest.raises(ValueError, match="rope"):
        backend.forward(case.q, case.k, case.v, case.kv_cache, case.md, case.scale, rope=(cos[..., :32], sin))
