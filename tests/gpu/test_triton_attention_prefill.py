"""TritonPagedAttention's prefill kernel against a plain fp32 torch reference (tests/gpu/triton_attention_util.py):
fresh prompts and later chunks of long prompts, decode rows interleaved with prefill rows, grouped-query heads.

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
    INTERPRET,
    MAX_CTX,
    ON_GPU,
    check,
    make_case,
    rand_lens,
    skip_bf16_dot_in_interpreter,
)

from ttsserve.attention.triton_paged import TritonPagedAttention  # noqa: E402


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
