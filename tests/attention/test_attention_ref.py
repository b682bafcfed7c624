"""DenseAttention vs float64 math, and TorchPagedAttention vs DenseAttention on random paged layouts."""

from __future__ import annotations

import random

import pytest
import torch

from ttsserve.attention.backend import PagedAttention, kv_cache_shape
from ttsserve.attention.dense import DenseAttention
from ttsserve.attention.torch_ref import TorchPagedAttention, make_metadata


def naive_attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last len(q) positions, in float64 with an explicit softmax."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    t, n = q.shape[0], k.shape[0]
    scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
    qpos = torch.arange(n - t, n)[:, None]
    scores = scores.masked_fill(torch.arange(n)[None, :] > qpos, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_dense_matches_float64_with_chunked_appends(heads: tuple[int, int]) -> None:
    hq, hkv = heads
    g = torch.Generator().manual_seed(0)
    n, d = 37, 16
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
    ref = naive_attention_f64(q, k, v)
    whole = DenseAttention(1).attend(0, q, k, v)
    assert (whole.double() - ref).abs().max() < 1e-6
    ctx, outs, s = DenseAttention(1), [], 0
    for e in (5, 6, 20, 21, 22, 37):  # prompt chunks, then single tokens, then a chunk
        outs.append(ctx.attend(0, q[s:e], k[s:e], v[s:e]))
        s = e
    assert ctx.k_cache[0].shape[0] == n
    assert (torch.cat(outs).double() - ref).abs().max() < 1e-6


def _random_block_tables(num_seqs: int, blocks_each: int, num_blocks: int, rng: random.Random) -> list[list[int]]:
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    return [pool[i * blocks_each : (i + 1) * blocks_each] for i in range(num_seqs)]


@pytest.mark.parametrize("heads,block_size", [((4, 4), 4), ((4, 2), 3), ((2, 1), 16)])
def test_paged_matches_dense_random_schedule(heads: tuple[int, int], block_size: int) -> None:
    """Several sequences, random block tables, steps mixing prefill chunks and decodes (and decode-only)."""
    hq, hkv = heads
    d, num_seqs, max_len = 8, 5, 29
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    blocks_each = -(-max_len // block_size)
    num_blocks = num_seqs * blocks_each + 3
    tables = _random_block_tables(num_seqs, blocks_each, num_blocks, rng)
    lens = [rng.randint(8, max_len) for _ in range(num_seqs)]
    qkv = [
        (torch.randn(n, hq, d, generator=g), torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g))
        for n in lens
    ]
    dense_out = [DenseAttention(1).attend(0, *x) for x in qkv]
    cache = torch.zeros(kv_cache_shape(num_blocks, block_size, hkv, d))
    done, paged_out = [0] * num_seqs, [[] for _ in range(num_seqs)]
    backend, step, decode_only_steps = TorchPagedAttention(), 0, 0
    while any(c < n for c, n in zip(done, lens)):
        active = [i for i in range(num_seqs) if done[i] < lens[i]]
        rng.shuffle(active)  # batch order differs from sequence order
        # Every third step is decode-only (one token each), others mix chunks of random sizes.
        news = [
            1 if step % 3 == 2 or done[i] >= 6 and rng.random() < 0.5 else rng.randint(1, lens[i] - done[i])
            for i in active
        ]
        news = [min(x, lens[i] - done[i]) for x, i in zip(news, active)]
        md = make_metadata([tables[i] for i in active], [done[i] for i in active], news, block_size)
        decode_only_steps += md.is_decode_only
        q = torch.cat([qkv[i][0][done[i] : done[i] + x] for i, x in zip(active, news)])
        k = torch.cat([qkv[i][1][done[i] : done[i] + x] for i, x in zip(active, news)])
        v = torch.cat([qkv[i][2][done[i] : done[i] + x] for i, x in zip(active, news)])
        out = PagedAttention(backend, [cache], md, d**-0.5).attend(0, q, k, v)
        for j, (i, x) in enumerate(zip(active, news)):
            paged_out[i].append(out[md.cu_seqlens_q_cpu[j] : md.cu_seqlens_q_cpu[j + 1]])
            done[i] += x
        step += 1
    assert decode_only_steps > 0
    for i in range(num_seqs):
        assert (torch.cat(paged_out[i]) - dense_out[i]).abs().max() < 1e-6


def test_paged_skips_negative_slots_and_checks_block_capacity() -> None:
    backend, block_size = TorchPagedAttention(), 4
    cache = torch.zeros(kv_cache_shape(4, block_size, 1, 2))
    md = make_metadata([[2]], [0], [2], block_size)
    md.slot_mapping = torch.tensor([8, -1])  # second token is padding (e.g. a CUDA-graph bucket)
    q = k = v = torch.ones(2, 1, 2)
    backend.forward(q, k, v, cache, md, 1.0)
    assert cache[:, 2, 0].eq(1).all() and cache[:, 2, 1:].eq(0).all()
    assert cache[:, [0, 1, 3]].eq(0).all()
    with pytest.raises(ValueError, match="cannot hold"):
        make_metadata([[0]], [3], [2], block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_argument_rotates_q_and_k_before_attending(dtype: torch.dtype) -> None:
    """attend(..., rope=(cos, sin)) == attend on q / k rotated by the model's apply_rotary, bit for bit
    (output and the stored, rotated k), for the paged torch backend (decode and prefill) and DenseAttention."""
    from ttsserve.model.layers import RotaryEmbedding, apply_rotary

    g = torch.Generator().manual_seed(5)
    hq, hkv, d, block_size = 4, 2, 16, 4
    rotary = RotaryEmbedding(d, 10000.0, 64)
    for lens, news in (([3, 9], [1, 1]), ([0, 5], [6, 2])):  # decode-only, then prefill chunks
        md = make_metadata([[0, 1, 2], [3, 4, 5]], lens, news, block_size)
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(lens, news)])
        cos, sin = rotary(positions, dtype)
        t = len(positions)
        q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
        caches = [torch.zeros(kv_cache_shape(6, block_size, hkv, d), dtype=dtype) for _ in range(2)]
        backend = TorchPagedAttention()
        want = PagedAttention(backend, caches[:1], md, d**-0.5).attend(
            0, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v
        )
        got = PagedAttention(backend, caches[1:], md, d**-0.5).attend(0, q, k, v, rope=(cos, sin))
        assert torch.equal(got, want) and torch.equal(caches[1], caches[0])
        assert not torch.equal(apply_rotary(k, cos, sin), k)  # the positions rotate something
    cos, sin = rotary(torch.arange(7), dtype)
    q, k, v = (torch.randn(7, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    want = DenseAttention(1).attend(0, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
    assert torch.equal(DenseAttention(1).attend(0, q, k, v, rope=(cos, sin)), want)
