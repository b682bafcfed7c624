"""The one-row fused GEMV kernels (layers/triton_gemv.py) against the torch functions of the path they replace
(runner/decode_ops.py's norms and SiLU-and-mul, F.linear), and the one-row GPT forward built on them against
fused_gpt_forward.

Runs on CUDA in bf16 (the engine's dtype) and fp32. Without CUDA it is skipped, unless TRITON_INTERPRET=1 and
triton is installed: then the kernels run in fp32 through Triton's CPU interpreter (a development aid, not CI).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

from triton_env import DEVICE, DTYPES, assert_rel_close, require_cuda_or_interpreter, seeded_randn  # noqa: E402

require_cuda_or_interpreter()

from ttsserve.config import GPTConfig  # noqa: E402
from ttsserve.layers import triton_gemv  # noqa: E402
from ttsserve.model.gpt import GPT  # noqa: E402
from ttsserve.runner import decode_ops  # noqa: E402

# fp32: summation order only; bf16: a value may round the other way where the kernel keeps an fp32 intermediate
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}


def _close(got: torch.Tensor, want: torch.Tensor, tol: float | None = None) -> None:
    assert_rel_close(got, want, tol or REL_TOL[want.dtype])


SHAPES = [(768, 2304), (768, 6144), (3072, 768)] if DEVICE.type == "cuda" else [(96, 46), (48, 200), (200, 30)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", SHAPES)
def test_linear_matches_f_linear(dtype: torch.dtype, k: int, n: int) -> None:
    x, w = seeded_randn(1, k, dtype=dtype, seed=1), seeded_randn(n, k, dtype=dtype, seed=2) / k**0.5
    _close(triton_gemv.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_norm_linear_matches_the_norm_then_the_linear(dtype: torch.dtype, with_residual: bool, gated: bool) -> None:
    k, n = (768, 2 * 3072 if gated else 2304) if DEVICE.type == "cuda" else (96, 2 * 37 if gated else 46)
    x, res = seeded_randn(1, k, dtype=dtype, seed=3) * 3, seeded_randn(1, k, dtype=dtype, seed=4)
    nw, w = seeded_randn(k, dtype=dtype, seed=5), seeded_randn(n, k, dtype=dtype, seed=6) / k**0.5
    residual = res if with_residual else None
    got, got_sum = triton_gemv.norm_linear(x, residual, nw, 1e-6, w, gated=gated)
    if with_residual:
        normed, want_sum = decode_ops._add_rmsnorm(x, res, nw, 1e-6)
        assert torch.equal(got_sum, want_sum)  # the residual stream: one rounding of residual + x, as torch
        assert got_sum.data_ptr() != res.data_ptr()
    else:
        normed = decode_ops._rmsnorm(x, nw, 1e-6)
        assert got_sum is x or torch.equal(got_sum, x)
    want = F.linear(normed, w)
    _close(got, decode_ops._silu_mul(want) if gated else want)


class _EchoAttention:
    """q back as the attention output: the two forwards see the same q / k / v, and q depends on every layer."""

    def attend(self, layer_idx, q, k, v, rope=None):
        return q.contiguous() * 0.5


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_row_gpt_forward_matches_fused_gpt_forward(dtype: torch.dtype) -> None:
    cfg = GPTConfig(
        hidden_size=96,
        intermediate_size=200,
        num_layers=3,
        num_heads=4,
        num_kv_heads=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    gpt = GPT(cfg).to(DEVICE, dtype)
    for p in gpt.parameters():
        p.data.normal_(0.0, 0.2)
    ops = decode_ops.DecodeOps(compile=False)
    x, positions = seeded_randn(1, 96, dtype=torch.float32, seed=7), torch.tensor([5], device=DEVICE)
    with torch.no_grad():
        want = decode_ops.fused_gpt_forward(gpt, ops, x, positions, _EchoAttention())
        got = decode_ops.gemv_gpt_forward(gpt, ops, x, positions, _EchoAttention())
    _close(got, want, tol=1e-4 if dtype == torch.float32 else 2**-5)
