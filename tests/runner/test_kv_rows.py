"""max_num_seqs when not given: the device's default, lowered on CUDA to what the KV pool holds."""

from types import SimpleNamespace

import torch

from ttsserve.config import EngineConfig
from ttsserve.runner import kv_cache
from ttsserve.runner.kv_cache import KVCacheSpec, plan_engine_batch


def test_rows_that_fit_caps_by_ten_second_utterances():
    spec = KVCacheSpec(
        num_blocks=34 * 100, num_cpu_blocks=0, block_size=16, bytes_per_token=1
    )  # 100 x (64 + 468 frames)
    assert spec.concurrent_utterances(10.0) == 100
    assert spec.rows_that_fit(512) == 96  # rounded down to 16
    assert spec.rows_that_fit(64) == 64
    tiny = KVCacheSpec(num_blocks=34 * 3, num_cpu_blocks=0, block_size=16, bytes_per_token=1)
    assert tiny.rows_that_fit(512) == 16 and tiny.rows_that_fit(8) == 8  # never below min(cap, 16)


def _plan(monkeypatch, device: str, blocks: int, **cfg):
    seen = {}

    def fake_plan(c, model):
        seen["rows"] = c.max_num_seqs  # the memory profile and the CPU pool size see the resolved rows
        return KVCacheSpec(num_blocks=blocks, num_cpu_blocks=0, block_size=16, bytes_per_token=1)

    monkeypatch.setattr(kv_cache, "plan_engine_kv_cache", fake_plan)
    model = SimpleNamespace(device=torch.device(device))
    out, _ = plan_engine_batch(EngineConfig(device=device, **cfg), model)
    return out.max_num_seqs, seen["rows"]


def test_default_rows_per_device(monkeypatch):
    assert EngineConfig().max_num_seqs is None
    assert _plan(monkeypatch, "cuda", 34 * 10_000) == (512, 512)
    assert _plan(monkeypatch, "cuda", 34 * 300) == (288, 512)  # the pool holds 300 10-s utterances
    assert _plan(monkeypatch, "cpu", 34 * 10) == (256, 256)  # the CPU pool is sized from the rows, not capped


def test_given_rows_are_kept(monkeypatch):
    assert _plan(monkeypatch, "cuda", 34 * 10, max_num_seqs=200) == (200, 200)
    assert _plan(monkeypatch, "cuda", 34 * 10, max_num_seqs=None, kv_cache_memory=1 << 20) == (512, 512)
