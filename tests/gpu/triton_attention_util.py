"""Shared by the Triton attention tests: random paged cases (contexts scattered over random pages, q / k / v as
views of one fused projection, NaN in every unused cache slot so that any read outside a sequence's context
shows up as NaN), the plain fp32 torch reference, the check of a backend's output and cache write, and the
fp8 cache helpers (a case's cache quantized by the torch rule, copies, bit views).

Import it only after the test module's skip guard: it imports the Triton kernels. DEVICE is CUDA when there is
one, else the CPU, where TRITON_INTERPRET=1 runs the kernels in Triton's interpreter (small shapes: MAX_CTX).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from triton_env import INTERPRET as INTERPRET  # re-exported: the attention tests import it from here

from ttsserve.attention.backend import AttentionMetadata, kv_cache_shape
from ttsserve.attention.triton_paged import TritonPagedAttention
from ttsserve.layers.quant.kv_fp8 import FP8KVCache, write_kv_fp8

HEAD_DIM = 64
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
