"""The decode and prefill attention kernels compile for sm_90 through the code that launches them, on a machine
without a GPU (tests/sm90_compile.py): every decode variant `precompile_decode` launches (one split and two, RoPE
before and in the kernel, each lanes head count), with the bf16 and the fp8 KV cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sm90_compile import compile_only_for_sm90  # noqa: E402

from ttsserve.attention.backend import kv_cache_shape  # noqa: E402
from ttsserve.attention.triton_paged import TritonPagedAttention  # noqa: E402
from ttsserve.layers.quant.kv_fp8 import FP8KVCache  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 12, 64  # the ChatTTS GPT's


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_kernels_compile_for_sm90(fp8: bool) -> None:
    shape = kv_cache_shape(4, 16, NUM_KV_HEADS, HEAD_DIM)
    cache = FP8KVCache.zeros(shape, "cpu") if fp8 else torch.zeros(shape, dtype=torch.bfloat16)
    with compile_only_for_sm90() as compiled:
        TritonPagedAttention().precompile_decode(cache, NUM_HEADS, torch.bfloat16)
    names = [name for name, _ in compiled]
    assert names and all("decode" in n or "reduce" in n for n in names), names
    if fp8:
        assert any("lanes" in n for n in names), names
