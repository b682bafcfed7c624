"""The CUDA engine's fallbacks and memory profile: prefill graphs captured again uncompiled when the compiled
capture fails (still the CPU reference's greedy codes), enforce_eager without graphs, and the KV budget profiled
under gpu_memory_utilization."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import sys

from engine_gpu_util import _engine, _requests, _run
from engine_gpu_util import free_engines as free_engines  # autouse fixtures: active where imported
from engine_gpu_util import no_tf32 as no_tf32
from engine_gpu_util import real_bf16 as real_bf16  # a fixture, used by name
from engine_gpu_util import real_fp32 as real_fp32  # a fixture, used by name
from engine_gpu_util import real_fp32_cpu as real_fp32_cpu  # a fixture, used by name


def test_piecewise_capture_falls_back_to_uncompiled_ops(real_fp32, real_fp32_cpu):
    """If capturing the prefill graphs with the compiled ops fails, they are captured again uncompiled and
    the engine still computes the CPU reference's greedy codes (fp32, TF32 off)."""
    from ttsserve.runner.decode_ops import DecodeOps

    e = _engine(real_fp32, kv_cache_memory=1 << 30)
    pg = e.runner.prefill_graphs
    assert pg is not None
    pg.ops = DecodeOps(compile=True)
    capture_all, calls = pg._capture_all, []

    def failing_once():
        calls.append(pg.ops.compiled)
        if len(calls) == 1:
            raise RuntimeError("injected: compiled capture failed")
        capture_all()

    pg._capture_all = failing_once
    pg.capture()
    assert calls == [True, False] and not pg.ops.compiled and pg.graphs and pg.capture_s > 0
    reqs = _requests(4, 16, greedy=True)
    rec_gpu, _ = _run(e, reqs)
    assert e.runner.timings.prefill_graph_steps > 0
    rec_cpu, _ = _run(_engine(real_fp32_cpu, kv_cache_memory=1 << 30), reqs)
    for r in reqs:
        seq = f"{r.request_id}/0/code"
        assert rec_gpu.frames[seq] == rec_cpu.frames[seq], seq


def test_enforce_eager_has_no_graphs(real_bf16):
    e = _engine(real_bf16, kv_cache_memory=1 << 30, enforce_eager=True)
    assert e.runner.graphs is None
    _run(e, _requests(2, 8, greedy=True))
    assert e.runner.timings.graph_steps == 0


_KV_BUDGET_PROBE = """
import json, torch
from ttsserve.config import EngineConfig
from ttsserve.model.chattts import load_model
from ttsserve.runner.profile import kv_budget_after_profiling
cfg = EngineConfig(load_format="dummy", dummy_size="real", device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
budget = kv_budget_after_profiling(load_model(cfg), cfg)
free, total = torch.cuda.mem_get_info()
print(json.dumps([budget, free, total]))
"""


def test_profiled_kv_budget_honours_utilization():
    """In a process of its own: what this test process's earlier engines still hold would count against it."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", _KV_BUDGET_PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    budget, free, total = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0 < budget < 0.3 * total
    assert budget + (total - free) <= 0.3 * total + (1 << 30)  # what the process already holds counts
