"""GPU checks of the quantization kernels (run with `-m gpu` on a CUDA machine):
- the Triton dequantize-and-multiply kernels against the torch reference (fp64 product with the
  dequantized weight), for int8 / int4, bf16 / fp32, decode (split-K) and prefill shapes of the real GPT;
- the fp8 KV cache: the fused write equals kv_fp8.py's torch rule bit for bit, and the decode / prefill
  attention on an FP8KVCache matches fp32 attention over a dequantized copy of that cache;
- a whole quantized GPT step (int8 / int4 linears, fp8 KV) against the dense bf16 GPT.
Without CUDA: skipped, unless TRITON_INTERPRET=1 (the fp32 matmul tests then run through Triton's CPU
interpreter; the fp8 tests stay skipped: the interpreter mis-rounds fp8 conversions that carry into the
exponent, e.g. 31.2 -> 16 instead of 32).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

from triton_env import require_cuda_or_interpreter  # noqa: E402

require_cuda_or_interpreter()

from ttsserve.attention.backend import AttentionMetadata, PagedAttention, kv_cache_shape  # noqa: E402
from ttsserve.attention.dense import causal_sdpa  # noqa: E402
from ttsserve.attention.triton_paged import TritonPagedAttention, write_kv_cache  # noqa: E402
from ttsserve.layers.quant.kv_fp8 import FP8KVCache, quantize_fp8_rows, write_kv_fp8  # noqa: E402
from ttsserve.layers.quant.quantize import QuantConfig, dequantize_weight, quantize_weight  # noqa: E402
from ttsserve.layers.quant.triton_quant import (  # noqa: E402
    QuantMMConfig,
    choose_config,
    first_rows_per_config,
    quant_matmul,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="fp8 / bf16 paths need a real GPU")
SHAPES = [(2304, 768), (768, 768), (6144, 768), (768, 3072)] if ON_GPU else [(96, 256), (64, 512)]
MS = [1, 7, 64, 200, 1024] if ON_GPU else [1, 5, 70]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


@pytest.mark.parametrize("method", ["int8", "awq-int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32] if ON_GPU else [torch.float32])
@pytest.mark.parametrize("m", MS)
def test_quant_matmul_matches_reference(method: str, dtype: torch.dtype, m: int) -> None:
    qc = QuantConfig.for_method(method, 128 if ON_GPU else 64)
    for i, (n, k) in enumerate(SHAPES):
        g = gen(1000 * m + i)
        w = torch.randn(n, k, generator=g, device=DEVICE) * 0.02
        t = quantize_weight(w, qc)
        x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
        y = quant_matmul(x, t["qweight"], t["scales"], t.get("qzeros"), qc.bits, qc.group_size, 132)
        ref = x.double() @ dequantize_weight(t, qc).double().T
        assert y.shape == (m, n) and y.dtype == dtype and torch.isfinite(y).all()
        assert rel(y, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5), (n, k)


@pytest.mark.parametrize("method", ["int8", "awq-int4"])
@pytest.mark.parametrize("split_k", [1, 2, 3, 8])
def test_quant_matmul_split_k_and_ragged_tiles(method: str, split_k: int) -> None:
    """Pinned launch shapes, N and M not multiples of the tiles, K splits of unequal length."""
    qc = QuantConfig.for_method(method, 64)
    g = gen(split_k)
    w = torch.randn(200, 640, generator=g, device=DEVICE)
    t = quantize_weight(w, qc)
    x = torch.randn(19, 640, generator=g, device=DEVICE)
    cfg = QuantMMConfig(16, 64, 64, split_k, 4, 2)
    y = quant_matmul(x, t["qweight"], t["scales"], t.get("qzeros"), qc.bits, qc.group_size, 132, cfg)
    assert rel(y, x.double() @ dequantize_weight(t, qc).double().T) < 1e-5


def test_choose_config_regimes() -> None:
    """The shapes the H200 sweep (bench/decode_kernels.py --sweep) found best or near-best."""
    assert choose_config(1, 2304, 768, 8, None, 132) == QuantMMConfig(16, 32, 128, 1, 4, 3)  # no split
    assert choose_config(1, 768, 3072, 8, None, 132) == QuantMMConfig(16, 64, 128, 8, 4, 3)  # long K: split
    assert choose_config(256, 768, 3072, 4, 128, 132) == QuantMMConfig(64, 64, 128, 4, 4, 3)
    assert choose_config(256, 6144, 768, 8, None, 132) == QuantMMConfig(64, 128, 128, 1, 4, 3)
    assert choose_config(4096, 2304, 768, 4, 128, 132) == QuantMMConfig(128, 128, 128, 1, 8, 3)


def test_first_rows_per_config_covers_every_row_count() -> None:
    """What TritonQuantKernels.precompile launches: each launch shape of 1..max_rows rows once, at its fewest rows."""
    for n, k, bits, group in [(2304, 768, 8, None), (768, 3072, 8, None), (6144, 768, 4, 128)]:
        firsts = first_rows_per_config(n, k, bits, group, 4096, 132)
        configs = [choose_config(m, n, k, bits, group, 132) for m in firsts]
        assert firsts[0] == 1 and len(set(configs)) == len(firsts) >= 4
        for m in range(1, 4097):
            cfg = choose_config(m, n, k, bits, group, 132)
            assert cfg in configs and firsts[configs.index(cfg)] <= m


# ---------------------------------------------------------------------------------------------- fp8 KV


def paged_case(ctx_lens: list[int], q_lens: list[int], block_size: int, heads: int, g: torch.Generator):
    """Random contexts written into an FP8KVCache (torch rule) over shuffled blocks, plus new q / k / v."""
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    nbs = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(nbs) + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(len(ctx_lens))).tolist()
    tables, taken = [], 0
    for nb in nbs:
        tables.append(perm[taken : taken + nb])
        taken += nb
    width = max(nbs)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)

    def slots(b: int, lo: int, hi: int) -> list[int]:
        return [tables[b][p // block_size] * block_size + p % block_size for p in range(lo, hi)]

    cache = FP8KVCache.zeros(kv_cache_shape(num_blocks, block_size, heads, 64), DEVICE)
    cache.data.view(torch.uint8).fill_(0x7F)  # NaN in e4m3: any read outside a context shows up
    ctx_slots = torch.tensor(
        [x for b, c in enumerate(ctx_lens) for x in slots(b, 0, c)], device=DEVICE, dtype=torch.int64
    )
    total = sum(ctx_lens)
    ck = torch.randn(total, heads, 64, generator=g, device=DEVICE) * 3
    cv = torch.randn(total, heads, 64, generator=g, device=DEVICE)
    write_kv_fp8(cache, ck, cv, ctx_slots)
    t = sum(q_lens)
    q, k, v = (torch.randn(t, heads, 64, generator=g, device=DEVICE).to(torch.bfloat16) for _ in range(3))
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    new_slots = [x for b, (c, s) in enumerate(zip(ctx_lens, seq_lens)) for x in slots(b, c, s)]
    md = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=table,
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device=DEVICE),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=seq_lens,
    )
    return q, k, v, cache, md


def dequantized_reference(q: torch.Tensor, cache: FP8KVCache, md: AttentionMetadata) -> torch.Tensor:
    """fp32 causal attention over the dequantized cache (which by now holds the new tokens too)."""
    deq = cache.dequantize(torch.float32)
    bs = md.block_size
    out = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    for b, ctx_len in enumerate(md.seq_lens_cpu):
        lo, hi = md.cu_seqlens_q_cpu[b], md.cu_seqlens_q_cpu[b + 1]
        pos = torch.arange(ctx_len, device=DEVICE)
        flat = md.block_tables[b].long()[pos // bs] * bs + pos % bs
        keys = deq[0].reshape(-1, *deq.shape[3:])[flat]
        vals = deq[1].reshape(-1, *deq.shape[3:])[flat]
        out[lo:hi] = causal_sdpa(q[lo:hi].float(), keys, vals, 1 / 8)
    return out


@needs_gpu
@pytest.mark.parametrize(
    "ctx_lens,q_lens,splits",
    [
        ([0, 5, 300, 1500, 33], [1] * 5, None),  # decode, split count chosen per call
        ([7, 2000, 64], [1] * 3, 1),
        ([7, 2000, 64], [1] * 3, 8),
        ([0, 0, 100, 900], [40, 1, 17, 130], None),  # prefill / chunked prefill / decode mixed
    ],
)
def test_fp8_attention_matches_dequantized_reference(ctx_lens, q_lens, splits) -> None:
    g = gen(sum(ctx_lens) + len(q_lens))
    q, k, v, cache, md = paged_case(ctx_lens, q_lens, 16, 12, g)
    out = TritonPagedAttention(num_splits=splits).forward(q, k, v, cache, md, 1 / 8)
    # the fused write stored exactly the torch rule's bytes and scales at the new slots
    kq, ks = quantize_fp8_rows(k)
    vq, vs = quantize_fp8_rows(v)
    data = cache.data.view(2, -1, 12, 64)
    sl = md.slot_mapping
    blk, off = sl // md.block_size, sl % md.block_size
    assert torch.equal(cache.scales[0, blk, :, off], ks) and torch.equal(cache.scales[1, blk, :, off], vs)
    assert torch.equal(data[0, sl].view(torch.uint8), kq.view(torch.uint8))
    assert torch.equal(data[1, sl].view(torch.uint8), vq.view(torch.uint8))
    assert torch.isfinite(out).all()
    assert rel(out, dequantized_reference(q, cache, md)) < 1.5e-2


@needs_gpu
def test_fp8_stand_alone_write_and_swap() -> None:
    from ttsserve.config import GPTConfig
    from ttsserve.runner.kv_cache import KVCache, plan_kv_cache

    g = gen(5)
    k, v = (torch.randn(9, 12, 64, generator=g, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([0, 3, -1, 17, 18, 40, 41, 60, 5], device=DEVICE)
    a = FP8KVCache.zeros(kv_cache_shape(4, 16, 12, 64), DEVICE)
    b = FP8KVCache.zeros(kv_cache_shape(4, 16, 12, 64), DEVICE)
    write_kv_cache(k, v, a, slots)
    write_kv_fp8(b, k, v, slots)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scales, b.scales)
    cfg = GPTConfig(hidden_size=768, intermediate_size=64, num_layers=2, num_heads=12, num_kv_heads=12)
    spec = plan_kv_cache(cfg, torch.bfloat16, 16, 8 * 16 * 2 * 2 * 12 * 68, 4 * 16 * 2 * 2 * 12 * 68, "fp8")
    kv = KVCache(cfg, spec, DEVICE, torch.bfloat16)
    write_kv_cache(k, v, kv.layers[1], slots)
    before = kv.layers[1].dequantize()
    kv.swap_out([(0, 2), (1, 0)])
    kv.layers[1].data.zero_()
    kv.layers[1].scales.zero_()
    kv.swap_in([(2, 0), (0, 1)])
    assert torch.equal(kv.layers[1].dequantize()[:, :2], before[:, :2])


@needs_gpu
@pytest.mark.parametrize("method,kv_fp8", [("int8", False), ("awq-int4", False), (None, True), ("int8", True)])
@torch.no_grad()
def test_quantized_gpt_step_close_to_dense(method: str | None, kv_fp8: bool) -> None:
    """Prefill 3 sequences then decode one step each, quantized vs dense bf16 (real-size layers, 2 of them)."""
    from ttsserve.attention.torch_ref import make_metadata
    from ttsserve.config import GPTConfig
    from ttsserve.layers.quant.linear import quantize_gpt_
    from ttsserve.model.dummy import SIZES, _gpt
    from ttsserve.model.gpt import GPT

    s = SIZES["real"]
    cfg = GPTConfig(
        hidden_size=s.hidden, intermediate_size=s.intermediate, num_layers=2, num_heads=s.heads, num_kv_heads=s.heads
    )
    sd = _gpt(torch.Generator().manual_seed(3), type(s)(**{**s.__dict__, "layers": 2}))
    dense = GPT.from_state_dict(sd, cfg, dtype=torch.bfloat16, device=DEVICE)
    cand = GPT.from_state_dict(sd, cfg, dtype=torch.float32, device=DEVICE)
    if method:
        quantize_gpt_(cand, QuantConfig.for_method(method))
    from ttsserve.layers.quant.linear import cast_except_quant

    cand = cast_except_quant(cand, DEVICE, torch.bfloat16)
    backend = TritonPagedAttention()
    shape = kv_cache_shape(16, 16, cfg.num_kv_heads, cfg.head_dim)
    caches = {
        "dense": [torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)],
        "cand": [
            FP8KVCache.zeros(shape, DEVICE) if kv_fp8 else torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
            for _ in range(2)
        ],
    }
    tables, prompt = [[0, 1, 2], [3, 4], [5]], [40, 20, 9]
    g = gen(7)
    for step, (computed, new) in enumerate([([0, 0, 0], prompt), (prompt, [1, 1, 1])]):
        md = make_metadata(tables, computed, new, 16, DEVICE)
        x = torch.randn(sum(new), cfg.hidden_size, generator=g, device=DEVICE) * 0.5
        pos = torch.cat([torch.arange(c, c + n, device=DEVICE) for c, n in zip(computed, new)])
        ref = dense(x, pos, PagedAttention(backend, caches["dense"], md, 1 / 8)).float()
        got = cand(x, pos, PagedAttention(backend, caches["cand"], md, 1 / 8)).float()
        assert torch.isfinite(got).all()
        tol = {"int8": 0.03, "awq-int4": 0.2, None: 0.03}[method] + (0.02 if kv_fp8 and method else 0)
        assert rel(got, ref) < tol, (step, rel(got, ref))
