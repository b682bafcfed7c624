"""TritonPagedAttention's fused RoPE (rope=(cos, sin): q and k rotated inside the decode kernel, the rotated k
stored) against rotating in torch and then running the plain kernel, with the dense and the fp8 KV cache; prefill
batches rotate in torch. Cases and reference: tests/gpu/triton_attention_util.py.

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
    bits,
    cache_bits,
    clone_cache,
    make_case,
    rand_lens,
    to_fp8_cache,
)

from ttsserve.attention.triton_paged import TritonPagedAttention, TritonTuning  # noqa: E402
from ttsserve.model.layers import RotaryEmbedding  # noqa: E402


def new_token_rope(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, 1, D] of each sequence's new token (position seq_len - 1), as the GPT builds them."""
    positions = case.md.seq_lens.long() - 1
    rotary = RotaryEmbedding(HEAD_DIM, 10000.0, int(positions.max()) + 1).to(DEVICE)
    return rotary(positions, case.q.dtype)


def rope_fp32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The fused kernel's rounding: x * cos + rotate_half(x) * sin in fp32, rounded once to x's dtype."""
    xf, half = x.float(), x.shape[-1] // 2
    return (xf * cos.float() + torch.cat((-xf[..., half:], xf[..., :half]), -1) * sin.float()).to(x.dtype)


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
@pytest.mark.parametrize("num_kv_heads, lanes, heads", [(4, "fp8", 1), (12, "none", 1), (12, "fp8", 1), (12, "fp8", 4)])
def test_rope_decode_fp8_cache_equals_rotate_then_decode(
    num_splits: int, num_kv_heads: int, lanes: str, heads: int
) -> None:
    """The fp8 cache through both decode paths: tensor-core dots (several query heads per KV head, or lanes
    off) and the CUDA-core lanes (one query head per KV head; a program taking one KV head or four)."""
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    gen = torch.Generator().manual_seed(7 + num_splits)
    ctx = [0, 37] + rand_lens(3, 1, MAX_CTX - 1, gen)
    case = make_case(ctx, [1] * len(ctx), 16, dtype, gen, num_kv_heads=num_kv_heads)
    tuning = TritonTuning(decode_lanes=lanes, decode_lanes_heads=heads, decode_lanes_programs_per_sm=0)
    check_rope_decode(case, TritonPagedAttention(num_splits=num_splits, tuning=tuning), fp8=True)


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
