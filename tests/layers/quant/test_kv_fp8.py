"""The fp8 KV cache on the CPU side: the quantization rule, the reference write, sizing, and the CPU refusal."""

from __future__ import annotations

import pytest
import torch

from ttsserve.attention.backend import kv_cache_shape
from ttsserve.attention.dense import DenseAttention, FP8DenseAttention
from ttsserve.config import GPTConfig
from ttsserve.layers.quant.kv_fp8 import (
    FP8_DTYPE,
    FP8KVCache,
    fake_quantize_fp8,
    quantize_fp8_rows,
    write_kv_fp8,
)
from ttsserve.runner.kv_cache import KVCache, kv_bytes_per_token, plan_kv_cache

REAL = GPTConfig(hidden_size=768, intermediate_size=3072, num_layers=20, num_heads=12, num_kv_heads=12)


def test_fp8_rule_scale_range_and_error() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(50, 12, 64, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]  # 5 decades of range
    x[3, 4] = 0.0
    q, s = quantize_fp8_rows(x)
    assert q.dtype == FP8_DTYPE and s.shape == (50, 12) and s.dtype == torch.float32
    assert float(s[3, 4]) == 1.0 and bool((q[3, 4].float() == 0).all())
    # the largest value of every row maps onto 448 exactly
    amax = q.float().abs().amax(-1)
    assert bool((amax[x.abs().amax(-1) > 0] == 448.0).all())
    # e4m3 keeps 3 mantissa bits: elements within the normal range err by at most 2^-4 relative
    deq = fake_quantize_fp8(x)
    normal = x.abs() >= s[..., None] * 2.0**-6
    assert bool(((deq - x).abs()[normal] <= x.abs()[normal] * 2.0**-4 + 1e-12).all())
    assert float((deq - x).norm() / x.norm()) < 0.03


def test_write_kv_fp8_reference_and_dequantize() -> None:
    g = torch.Generator().manual_seed(8)
    cache = FP8KVCache.zeros(kv_cache_shape(4, 8, 2, 64), "cpu")
    k, v = torch.randn(5, 2, 64, generator=g), torch.randn(5, 2, 64, generator=g) * 10
    slots = torch.tensor([3, 9, -1, 31, 0])
    write_kv_fp8(cache, k, v, slots)
    deq = cache.dequantize().view(2, 32, 2, 64)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(deq[0, slot], fake_quantize_fp8(k[t]))
        assert torch.equal(deq[1, slot], fake_quantize_fp8(v[t]))
    assert bool((deq[:, 1] == 0).all())  # untouched slots stay zero
    assert cache.shape == (2, 4, 8, 2, 64) and cache.dtype == FP8_DTYPE
    assert cache.nbytes() == 2 * 4 * 8 * 2 * (64 + 4)


def test_fp8_dense_attention_stores_rounded_kv() -> None:
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(6, 2, 64, generator=g) for _ in range(3))
    sim = FP8DenseAttention(1)
    out = sim.attend(0, q, k, v)
    ref = DenseAttention(1).attend(0, q, fake_quantize_fp8(k), fake_quantize_fp8(v))
    assert torch.equal(out, ref)
    assert torch.equal(sim.k_cache[0], fake_quantize_fp8(k))
    exact = DenseAttention(1).attend(0, q, k, v)
    assert 0 < float((out - exact).norm() / exact.norm()) < 0.05


def test_fp8_sizing_and_cpu_refusal() -> None:
    dense = kv_bytes_per_token(REAL, torch.bfloat16)
    fp8 = kv_bytes_per_token(REAL, torch.bfloat16, "fp8")
    assert dense == 2 * 20 * 12 * 64 * 2 and fp8 == 2 * 20 * 12 * (64 + 4)
    a = plan_kv_cache(REAL, torch.bfloat16, 16, 4 << 30, 0)
    b = plan_kv_cache(REAL, torch.bfloat16, 16, 4 << 30, 0, kv_cache_dtype="fp8")
    assert b.kv_cache_dtype == "fp8" and 1.85 < b.num_blocks / a.num_blocks < 1.9
    assert "KV cache fp8" in b.report()
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 needs a CUDA device"):
        KVCache(REAL, b, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        plan_kv_cache(REAL, torch.bfloat16, 16, 4 << 30, 0, kv_cache_dtype="int4")
