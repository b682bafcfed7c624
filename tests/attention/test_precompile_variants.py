"""TritonPagedAttention.precompile_decode launches every decode kernel variant a served step can reach: the
eager path's (RoPE before the kernel) and the decode graphs' (RoPE in the kernel) for every number of KV heads a
lanes program may take, split or not. The graphs of the middle buckets are captured after start-up, between
served steps: a variant missed here compiles there (1.0-1.1 s a kernel on an empty cache, seen on an H100).
The launches are recorded, not run (tests/gpu/test_kernel_compiles_gpu.py counts the real compiles on CUDA)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import ttsserve.attention.triton_paged as triton_paged  # noqa: E402
from ttsserve.attention.backend import kv_cache_shape  # noqa: E402
from ttsserve.attention.triton_tuning import choose_num_splits  # noqa: E402
from ttsserve.layers.quant.kv_fp8 import FP8KVCache  # noqa: E402
from ttsserve.runner.cuda_graphs import default_capture_sizes  # noqa: E402

NUM_HEADS, HEAD_DIM, MAX_MODEL_LEN = 12, 64, 2048


def _precompiled(monkeypatch, cache) -> set[tuple[int, bool, bool]]:
    """(lanes heads, split, RoPE in the kernel) of every launch precompile_decode makes."""
    seen = set()

    def record(out, q, k, v, kv_cache, md, scale, num_splits, tuning, rope=None, lanes_heads=1):
        seen.add((lanes_heads, num_splits > 1, rope is not None))

    monkeypatch.setattr(triton_paged, "paged_decode", record)
    triton_paged.TritonPagedAttention().precompile_decode(cache, NUM_HEADS, torch.bfloat16)
    return seen


def _graph_variants(fp8: bool, num_sms: int) -> set[tuple[int, bool, bool]]:
    """What the decode graphs launch at each capture bucket (TritonPagedAttention.forward's choices; a graph is
    captured with max_seq_len = max_model_len)."""
    tuning, variants = triton_paged.TritonTuning(), set()
    for bs in default_capture_sizes(512):
        heads = tuning.lanes_heads(bs, NUM_HEADS, num_sms) if tuning.uses_lanes(1, fp8) else 1
        splits = choose_num_splits(bs * NUM_HEADS // heads, MAX_MODEL_LEN, num_sms, tuning)
        variants.add((heads, splits > 1, True))
    return variants


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("num_sms", [78, 132])
def test_precompile_covers_the_decode_graphs_launches(monkeypatch, fp8: bool, num_sms: int) -> None:
    shape = kv_cache_shape(1, 16, NUM_HEADS, HEAD_DIM)
    cache = FP8KVCache.zeros(shape, "cpu") if fp8 else torch.zeros(shape, dtype=torch.bfloat16)
    seen = _precompiled(monkeypatch, cache)
    graphs = _graph_variants(fp8, num_sms)
    if fp8:
        assert {h for h, _, _ in graphs} == {1, 2, 4}  # the middle buckets take one and two heads a program
    assert graphs <= seen, f"launched by the decode graphs, not precompiled: {sorted(graphs - seen)}"
    assert {(h, s, False) for h, s, _ in seen} <= seen  # and the eager path's, RoPE applied before the kernel
