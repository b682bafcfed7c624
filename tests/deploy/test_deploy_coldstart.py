"""Cold-start harness (ttsserve/bench/coldstart.py): phase parsing, the cached dummy checkpoint, and one real
measurement of a tiny CPU server from process start to /ready 200."""

from __future__ import annotations

import os
import time
from datetime import datetime

import torch
from deploy_helpers import ROOT, TINY_SERVE_ARGS

from ttsserve.bench.coldstart import measure_cold_start, parse_phases
from ttsserve.model.dummy_cache import cached_dummy_checkpoint


def test_parse_phases_reads_the_first_matching_line_of_each_phase() -> None:
    t0 = datetime(2026, 1, 2, 3, 4, 5).timestamp()
    log = "\n".join(
        [
            "2026-01-02 03:04:07,500 INFO ttsserve.server: loading model (dummy)",
            "noise without a timestamp: loaded 1 MB of weights",
            "2026-01-02 03:04:09,000 INFO ttsserve.model.chattts: loaded dummy (tiny) on cpu: 3.8 MB of weights",
            "2026-01-02 03:04:09,250 INFO ttsserve.engine.engine: KV cache: 4 blocks",
            "2026-01-02 03:04:10,000 INFO ttsserve.server: memory: KV cache: 4 blocks",  # not the first: ignored
            "2026-01-02 03:04:10,125 INFO ttsserve.server: ttsserve ready: KV cache: 4 blocks",
        ]
    )
    assert parse_phases(log, t0) == {"imports": 2.5, "model_loaded": 4.0, "engine_built": 4.25, "app_started": 5.125}


def test_parse_phases_reads_the_gpu_start_up_lines() -> None:
    t0 = datetime(2026, 1, 2, 3, 4, 5).timestamp()
    lines = [
        "memory: 139.80 GiB total x 0.90 utilization; ... -> 122.15 GiB for the KV cache",
        "runner set-up: KV pool 1.0 s, host swap pool 2.0 s (on a helper thread) beside 2.5 s of torch.compile",
        "captured 1 decode CUDA graph (batch sizes 512..512) in 3.1 s; 38 more after start-up, between steps",
        "captured 1 vocoder CUDA graph (rows 128..128, frames 116..116) in 0.3 s",
        "warmed up in 0.8 s",
        "KV cache: 4 blocks",
        "ttsserve ready: KV cache: 4 blocks",
        "captured 97 deferred CUDA graph buckets in 11.0 s of engine time, done 12.0 s after start-up",
    ]
    log = "\n".join(f"2026-01-02 03:04:{6 + i:02d},000 INFO x: {line}" for i, line in enumerate(lines))
    names = [
        "memory_profiled",
        "runner_set_up",
        "graphs_captured",
        "vocoder_graphs_captured",
        "warmed_up",
        "engine_built",
        "app_started",
        "deferred_graphs_captured",
    ]
    assert parse_phases(log, t0) == {name: 1.0 + i for i, name in enumerate(names)}


def test_cached_dummy_checkpoint_is_written_once_and_loads(tmp_path) -> None:
    from ttsserve.model.dummy import make_dummy_checkpoint
    from ttsserve.model.loader import load_checkpoint

    path = cached_dummy_checkpoint("tiny", seed=3, cache_dir=tmp_path)
    weights = path / "asset" / "gpt" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert cached_dummy_checkpoint("tiny", seed=3, cache_dir=tmp_path) == path
    assert weights.stat().st_mtime_ns == stamp, "the second call must reuse the saved checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "no temporary folder is left behind"
    loaded, fresh = load_checkpoint(path), make_dummy_checkpoint("tiny", seed=3)
    for name, sd in fresh.state_dicts().items():
        got = loaded.state_dicts()[name]
        assert got.keys() == sd.keys(), name
        assert all(torch.equal(got[k], sd[k]) for k in sd), name


def test_measure_cold_start_of_a_tiny_server(tmp_path) -> None:
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    args = TINY_SERVE_ARGS + ["--log-level", "info"]
    r = measure_cold_start(args, timeout_s=120, env=env, until_warm=True, log_path=str(tmp_path / "serve.log"))
    wall = time.perf_counter() - start
    assert 0 < r.listen_s <= r.total_s <= r.warm_s < wall  # a CPU server that compiles nothing: warm at once
    # The phases come in order and all before /ready answered.
    phases = [r.phases[k] for k in ("imports", "model_loaded", "engine_built", "app_started")]
    assert phases == sorted(phases) and phases[-1] <= r.total_s + 0.5, r
    assert "model_loaded" in r.phases and "loaded dummy" in (tmp_path / "serve.log").read_text()  # the log is kept
