"""`ttsserve bench serve` against the real app (ttsserve.server.app + AsyncEngine on the tiny dummy model),
served by uvicorn on loopback: every request streams audio, the figures add up, the CLI writes a report."""

from __future__ import annotations

import json

import pytest

from tests.bench.live_server import LiveServer
from ttsserve.bench.serving import ServeSpec, run_serving
from ttsserve.config import EngineConfig


@pytest.fixture(scope="module")
def server():
    from ttsserve.engine.core.async_engine import AsyncEngine
    from ttsserve.server.app import create_app

    engine = AsyncEngine.from_config(
        EngineConfig(
            load_format="dummy",
            dummy_size="tiny",
            dtype="float32",
            device="cpu",
            swap_space=0,
            kv_cache_memory=32 << 20,
        )
    )
    with LiveServer(create_app(engine)) as srv:
        yield srv


def test_streaming_concurrency_sweep(server) -> None:
    spec = ServeSpec(
        url=server.url, concurrency=[1, 3], num_requests=6, duration=60, max_new_tokens=24, text_lengths=("short",)
    )
    results = run_serving(spec, progress=False)
    assert [r.load for r in results] == [1, 3]
    for res in results:
        s = res.summary()
        assert s["num_ok"] == 6 and s["errors"] == {}, s["errors"]
        for r in res.requests:
            assert r.num_samples > 0 and 0 < r.ttfa_s <= r.latency_s
        assert s["audio_seconds"] == pytest.approx(sum(r.num_samples for r in res.requests) / 24000)
        assert s["requests_per_s"] == pytest.approx(6 / s["wall_s"])
        assert s["rtf"]["p50"] > 0 and s["underrun_streams"] <= 6
        # the cap: at most 24 frames (512 samples each) per segment of these one-sentence texts
        assert max(r.num_samples for r in res.requests) <= 24 * 512
        # the server's own view from its /metrics: it stepped, and its phases are host time per step
        assert s["server_steps_per_s"] > 0
        assert s.get("server_running_mean", 0) <= 3  # sampled every 0.5 s: absent from a shorter point
        ms = s["server_step_ms"]
        assert {"schedule", "runner_prepare", "audio_step"} <= set(ms) and all(v >= 0 for v in ms.values())
        assert 0 < ms["runner"] < 1000.0 / s["server_steps_per_s"]  # a phase fits in the time between steps
        ttfa = s["server_ttfa_s"]  # the server's own histograms: the engine's share within the API servers'
        eps = 1e-9  # both are interpolated in the same histogram buckets: equal up to float rounding
        assert (
            0 < ttfa["engine"]["p50"] <= ttfa["api"]["p50"] + eps and ttfa["engine"]["p99"] <= ttfa["api"]["p99"] + eps
        )
        slow = s["server_steps_over_ms"]
        assert set(slow) == {"20", "50"} and 0 <= slow["50"] <= slow["20"] <= s["server_steps_per_s"] * s["wall_s"] + 1


def test_cli_serve_non_streaming_synthesize(server, tmp_path) -> None:
    from ttsserve.entrypoints.cli import main

    rc = main(
        [
            "bench",
            "serve",
            "--url",
            server.url,
            "--endpoint",
            "synthesize",
            "--no-stream",
            "--qps",
            "4",
            "--num-requests",
            "4",
            "--duration",
            "30",
            "--max-new-tokens",
            "16",
            "--text-lengths",
            "short",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "report.json").read_text())
    (res,) = data["results"]
    assert res["summary"]["num_ok"] == 4 and res["summary"]["load_kind"] == "qps"
    assert all(q["ttfa_s"] == q["latency_s"] for q in res["requests"])  # whole files: nothing plays early
    assert (tmp_path / "throughput.png").exists()
    assert "server side" in (tmp_path / "report.md").read_text()


def test_client_records_join_the_access_log_on_their_request_id(server, tmp_path, caplog) -> None:
    """The bench sends each record's id as X-Request-ID, so benchmarks/ttfa_split.py can set the client's TTFA
    beside the app's (access ms) and the admission's (ttfa_ms): each later in the chain, each no longer."""
    import importlib.util
    import logging
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "ttfa_split.py"
    spec_ = importlib.util.spec_from_file_location("ttfa_split", path)
    ttfa_split = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(ttfa_split)
    spec = ServeSpec(
        url=server.url, concurrency=[2], num_requests=4, duration=60, max_new_tokens=24, text_lengths=("short",)
    )
    with caplog.at_level(logging.INFO, logger="ttsserve.access"):
        (res,) = run_serving(spec, progress=False)
    log = tmp_path / "server.log"
    log.write_text("\n".join(f"INFO [api0] ttsserve.access: {r.getMessage()}" for r in caplog.records))
    times = ttfa_split.server_times(log)
    assert {r.request_id for r in res.requests} <= set(times)
    rows = ttfa_split.split({"results": [res.to_json()]}, times, bin_s=60.0)
    assert sum(r["n"] for r in rows) == 4
    for r in rows:
        assert 0 < r["admitted"][0] <= r["app"][0] <= r["client"][0]
        assert r["outside_app"][0] >= 0 and r["before_admission"][0] >= 0
