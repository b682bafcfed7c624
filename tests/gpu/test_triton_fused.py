"""The decode step's Triton kernels (layers/triton_fused.py) against the plain torch functions they replace
(runner/decode_ops.py), and the engine's decode ops mode ($TTSSERVE_DECODE_OPS).

Runs on CUDA in bf16 (the engine's dtype) and fp32. Without CUDA it is skipped, unless TRITON_INTERPRET=1 and
triton is installed: then the kernels run in fp32 through Triton's CPU interpreter (a development aid, not CI).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from triton_env import DEVICE, DTYPES, assert_rel_close, require_cuda_or_interpreter, seeded_randn  # noqa: E402

require_cuda_or_interpreter()

from ttsserve.layers import triton_fused  # noqa: E402
from ttsserve.runner import decode_ops  # noqa: E402
from ttsserve.sample import sampler, triton_sampler  # noqa: E402

# Largest difference allowed, relative to the largest value: fp32 differs by summation order only; bf16 (8 bits of
# mantissa) may round a value the other way where torch rounds an intermediate the kernel keeps in fp32
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert_rel_close(got, want, REL_TOL[want.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 130])
def test_norms_match_torch(dtype: torch.dtype, rows: int) -> None:
    hidden = 768 if DEVICE.type == "cuda" else 96  # not a power of two: the masked tail of the row
    x = seeded_randn(rows, hidden, dtype=dtype, seed=1) * 3
    res = seeded_randn(rows, hidden, dtype=dtype, seed=2)
    w = seeded_randn(hidden, dtype=dtype, seed=3)
    _close(triton_fused.rmsnorm(x, w, 1e-6), decode_ops._rmsnorm(x, w, 1e-6))
    got, got_sum = triton_fused.add_rmsnorm(x, res, w, 1e-6)
    want, want_sum = decode_ops._add_rmsnorm(x, res, w, 1e-6)
    assert torch.equal(got_sum, want_sum)  # the residual stream: one rounding of residual + x, as torch
    _close(got, want)
    strided = torch.cat([x, x], dim=1)[:, :hidden]  # a row stride other than the width
    _close(triton_fused.rmsnorm(strided, w, 1e-6), decode_ops._rmsnorm(strided, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype: torch.dtype) -> None:
    n = 3072 if DEVICE.type == "cuda" else 200  # several column tiles, a masked last one on the CPU
    gate_up = seeded_randn(9, 2 * n, dtype=dtype, seed=4) * 4
    _close(triton_fused.silu_mul(gate_up), decode_ops._silu_mul(gate_up))
    assert triton_fused.silu_mul(gate_up[:0]).shape == (0, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_rotary_matches_torch(dtype: torch.dtype) -> None:
    hq, hkv, d, t = 4, 2, 64, 11
    qkv = seeded_randn(t, (hq + 2 * hkv) * d, dtype=dtype, seed=5)
    pos = torch.randint(0, 4000, (t,), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
    ang = pos.float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)[:, None, :]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got = triton_fused.qkv_rotary(qkv, cos, sin, hq, hkv, d)
    # the reference in fp32, rounded once: what the kernel computes (torch's bf16 op-by-op rounds three times)
    want = decode_ops._qkv_rotary(qkv.float(), cos.float(), sin.float(), hq, hkv, d)
    for g, w in zip(got, want):
        _close(g, w.to(dtype))
    assert got[2].data_ptr() == qkv[:, (hq + hkv) * d :].data_ptr()  # v is a view of qkv


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_rows_matches_torch(dtype: torch.dtype) -> None:
    """The decode input of rows out of order (and a repeated padding row) from the last-token table: fp32 sums of
    the four codebooks' rows, rounded once to the GPT dtype, as Embed.embed_codes(...).to(dtype)."""
    q, v, h = 4, 626, 768 if DEVICE.type == "cuda" else 96
    emb = seeded_randn(q, v, h, dtype=torch.float32, seed=8)
    last = torch.randint(0, v, (12, q), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    rows = torch.tensor([7, 2, 11, 11, 0], device=DEVICE)
    got = triton_fused.embed_rows(emb, last, rows, dtype)
    want = decode_ops._embed_rows(emb, last, rows, dtype)
    assert got.dtype == dtype and got.shape == (5, h)
    _close(got, want)
    assert torch.equal(got[2], got[3])
    assert triton_fused.embed_rows(emb, last, rows[:0], dtype).shape == (0, h)


def test_decode_ops_mode(monkeypatch) -> None:
    monkeypatch.delenv(decode_ops.DECODE_OPS_ENV, raising=False)
    cuda = torch.device("cuda")
    ops = decode_ops.DecodeOps.for_device(cuda)  # the default: every op a Triton kernel, nothing traced
    assert ops.rmsnorm is triton_fused.rmsnorm and ops.sample is triton_sampler.sample_or_reference
    assert ops.compiled and not ops.traced
    monkeypatch.setenv(decode_ops.DECODE_OPS_ENV, "triton-compiled-sampler")
    ops = decode_ops.DecodeOps.for_device(cuda)
    assert ops.rmsnorm is triton_fused.rmsnorm and ops.compiled and ops.traced
    monkeypatch.setenv(decode_ops.DECODE_OPS_ENV, "triton-eager-sampler")
    ops = decode_ops.DecodeOps.for_device(cuda)
    assert ops.silu_mul is triton_fused.silu_mul and ops.sample is sampler.sample and not ops.traced
    monkeypatch.setenv(decode_ops.DECODE_OPS_ENV, "compile")
    ops = decode_ops.DecodeOps.for_device(cuda)
    assert ops.rmsnorm is not triton_fused.rmsnorm and ops.traced
    assert not decode_ops.DecodeOps.for_device(torch.device("cpu")).compiled
    monkeypatch.setenv(decode_ops.DECODE_OPS_ENV, "fast")
    modes = "triton, triton-compiled-sampler, triton-eager-sampler, compile"
    with pytest.raises(ValueError, match=f"must be one of {modes}"):
        decode_ops.DecodeOps.for_device(cuda)
