"""The fused CPU decode kernels (layers/cpu) and the decode step built on them (runner/cpu_decode.py): each kernel
against the torch ops it replaces, the whole step against GPT.forward over several steps of a paged cache, and the
torch path whenever the kernels are off or cannot be built."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from engine.engine_testutil import TINY
from runner.test_cpu_fast_path import _decode_case, attention_f64

from ttsserve.attention.backend import PagedAttention, kv_cache_shape
from ttsserve.attention.torch_ref import TorchPagedAttention, make_metadata, write_kv
from ttsserve.config import EngineConfig
from ttsserve.layers.cpu import kernels
from ttsserve.model.chattts import load_model
from ttsserve.model.cpu_linear import pack_linears_
from ttsserve.model.layers import RMSNorm, silu_and_mul
from ttsserve.runner.cpu_decode import CpuFusedDecode

K = kernels.load()
needs_kernels = pytest.mark.skipif(K is None, reason="no C compiler: the kernels cannot be built")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_and_silu_mul_match_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    h, delta = torch.randn(3, 96, generator=g).to(dtype), torch.randn(3, 96, generator=g)
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    want_h = h + delta.to(dtype)
    want = norm(want_h)
    out = torch.empty(3, 96)  # fp32: what a W8A8 GEMM takes
    K.add_rms_norm(h, delta, norm.weight.detach(), 1e-6, out)
    assert torch.equal(h, want_h)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # a bf16 rounding flip is 1 bf16 ulp
    assert (out - want.float()).abs().max() <= tol * want.float().abs().max()
    gate_up = torch.randn(3, 256, generator=g) * 4
    act = torch.empty(3, 128, dtype=dtype)
    K.silu_mul(gate_up, act, dtype == torch.bfloat16)
    ref = silu_and_mul(gate_up.to(dtype))
    assert (act.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


@needs_kernels
@pytest.mark.parametrize("d16", [16, 64])  # 64: a bf16 model's query-key products by bf16 pairs (AVX512_BF16)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lens,heads,block_size", [([37], (4, 4), 16), ([5, 33, 17, 1], (4, 2), 8), ([70, 3], (2, 1), 32)]
)
def test_decode_attention_matches_float64(lens, heads, block_size, dtype, d16) -> None:
    """RoPE with cos = 1, sin = 0 (the identity) isolates the KV write and the attention. The kernel works in
    16-float vectors: the shared case's head dim (8) is padded with zeros to d16."""
    cache, md, q, k, v, contexts = _decode_case(lens, *heads, block_size, dtype, seed=len(lens))
    b, hq, d = q.shape
    cache16 = torch.zeros(*cache.shape[:-1], d16, dtype=dtype)
    cache16[..., :d] = cache
    qkv = torch.zeros(b, hq + 2 * heads[1], d16, dtype=dtype)
    qkv[:, :hq, :d], qkv[:, hq : hq + heads[1], :d], qkv[:, hq + heads[1] :, :d] = q, k, v
    ones, zeros = torch.ones(b, d16), torch.zeros(b, d16)
    out = torch.empty(b, hq * d16, dtype=dtype)
    K.decode_attention(
        qkv.reshape(b, -1), ones, zeros, cache16, md.slot_mapping, md.block_tables, md.seq_lens,
        hq, d**-0.5, out, dtype == torch.bfloat16, kernels.attention_scratch(None, hq, md.max_seq_len),
    )  # fmt: skip
    write_kv(cache, k, v, md.slot_mapping)  # what the torch path stores
    assert torch.equal(cache16[..., :d], cache)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (kc, vc) in enumerate(contexts):
        got = out[i].view(hq, d16)[:, :d].double()
        assert (got - attention_f64(q[i], kc, vc)).abs().max() < tol


def _models(dtype: str):
    torch.manual_seed(0)
    m = load_model(EngineConfig(model=str(TINY), device="cpu", dtype=dtype))
    pack_linears_(m.gpt)
    return m.gpt


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_fused_step_matches_gpt_forward(dtype: str, tol: float) -> None:
    """Ragged sequences in shuffled blocks, a torch prefill, then decode steps by both paths on twin caches."""
    gpt = _models(dtype)
    cfg, bs, rng = gpt.cfg, 8, random.Random(0)
    caches = [
        [torch.zeros(kv_cache_shape(40, bs, cfg.num_kv_heads, cfg.head_dim), dtype=gpt.dtype) for _ in gpt.layers]
        for _ in range(2)
    ]
    fused = CpuFusedDecode.create(gpt, caches[1], cfg.head_dim**-0.5)
    assert fused is not None
    lens, pool = [3, 17, 9], list(range(40))
    rng.shuffle(pool)
    tables = [pool[i * 6 : (i + 1) * 6] for i in range(3)]
    backend, scale = TorchPagedAttention(compile_decode=False), cfg.head_dim**-0.5
    with torch.inference_mode():
        x, md = torch.randn(sum(lens), cfg.hidden_size), make_metadata(tables, [0] * 3, lens, bs)
        pos = torch.cat([torch.arange(n) for n in lens])
        for c in caches:
            gpt(x, pos, PagedAttention(backend, c, md, scale))
        for step in range(10):
            x, md = torch.randn(3, cfg.hidden_size), make_metadata(tables, [n + step for n in lens], [1] * 3, bs)
            pos = torch.tensor([n + step for n in lens])
            want = gpt(x, pos, PagedAttention(backend, caches[0], md, scale)).float()
            got = fused.run(x, pos, md)
            assert got.dtype == gpt.dtype
            assert (got.float() - want).abs().max() <= tol * want.abs().max(), step
    for a, b in zip(*caches):
        assert (a.float() - b.float()).abs().max() <= tol * a.float().abs().max()


def test_off_or_unbuildable_keeps_the_torch_path(monkeypatch) -> None:
    gpt = _models("float32")
    caches = [torch.zeros(kv_cache_shape(4, 8, gpt.cfg.num_kv_heads, gpt.cfg.head_dim)) for _ in gpt.layers]
    try:
        for env, value in ((kernels.ENV, "0"), ("CC", "/nonexistent/cc")):
            with monkeypatch.context() as mp:
                mp.setenv(env, value)
                kernels.load.cache_clear()
                assert kernels.load() is None
                assert CpuFusedDecode.create(gpt, caches, 0.25) is None
        kernels.load.cache_clear()
        half = [c.half() for c in caches]  # a KV dtype the kernels do not take
        assert CpuFusedDecode.create(gpt, half, 0.25) is None
    finally:
        kernels.load.cache_clear()


def test_silu_matches_torch_bitwise_mostly() -> None:
    """The kernels' exp is a polynomial: SiLU in fp32 within 4 ulp of torch's, equal for most inputs."""
    if K is None:
        pytest.skip("no C compiler")
    g = torch.linspace(-90, 90, 20001)
    act = torch.empty(1, g.numel())
    K.silu_mul(torch.cat([g, torch.ones_like(g)])[None], act, False)
    ref = F.silu(g)
    assert ((act[0] - ref).abs() <= 4 * torch.finfo(torch.float32).eps * ref.abs()).all()
    assert (act[0] == ref).float().mean() > 0.9
