"""`ttsserve bench offline` end to end on the tiny dummy model: both backends, the report's fields, plots and
the consistency of its figures."""

from __future__ import annotations

import json

import pytest

from tests.tiny_args import TINY_CLI_ARGS
from ttsserve.bench.results import FRAME_SECONDS, SAMPLE_RATE

pytest.importorskip("transformers")


def run_cli(*argv: str) -> int:
    from ttsserve.entrypoints.cli import main

    return main(["bench", "offline", *argv])


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, object]:
    out = tmp_path_factory.mktemp("offline")
    rc = run_cli(
        "--backend",
        "both",
        *TINY_CLI_ARGS,
        "--batch-sizes",
        "1,2",
        "--frames",
        "16",
        "--rounds",
        "2",
        "--swap-space",
        "0",
        "--kv-cache-memory",
        "64M",
        "--no-progress",
        "--out",
        str(out),
    )
    assert rc == 0
    return json.loads((out / "report.json").read_text()), out


def test_report_has_machine_config_and_files(report) -> None:
    data, out = report
    m = data["machine"]
    for key in ("cpu_model", "cpu_cores", "torch", "git_commit", "command", "device"):
        assert m.get(key) is not None, key
    assert data["config"]["args"]["backend"] == "both" and data["config"]["args"]["batch_sizes"] == [1, 2]
    assert data["config"]["spec"]["frames"] == 16 and data["config"]["engine"]["dummy_size"] == "tiny"
    assert set(data["backends"]) == {"hf", "ttsserve"}
    for name in ("report.md", "throughput.png", "latency.png", "ttfa_cdf.png"):
        assert (out / name).stat().st_size > 0, name
    md = (out / "report.md").read_text()
    assert "| ttsserve | 2 |" in md and "| hf | 1 |" in md


def test_figures_are_consistent(report) -> None:
    data, _ = report
    points = {(r["summary"]["backend"], r["summary"]["load"]): r for r in data["results"]}
    assert set(points) == {("hf", 1), ("hf", 2), ("ttsserve", 1), ("ttsserve", 2)}
    for (backend, b), r in points.items():
        s, reqs = r["summary"], r["requests"]
        assert len(reqs) == 2 * b and s["num_ok"] == 2 * b and s["errors"] == {}  # 2 rounds
        # fixed lengths: every request generated exactly --frames frames, and its audio is 512 n - 256 samples
        assert all(q["num_frames"] == 16 and q["num_samples"] == 512 * 16 - 256 for q in reqs), backend
        assert s["audio_seconds"] == pytest.approx(sum(q["num_samples"] for q in reqs) / SAMPLE_RATE)
        assert s["frames_per_s"] * s["wall_s"] == pytest.approx(s["total_frames"])
        edge = 1 - 256 / (512 * 16)  # the decoder's one-shot edge: n frames -> 512 n - 256 samples
        assert s["audio_seconds_per_s"] == pytest.approx(s["frames_per_s"] * FRAME_SECONDS * edge)
        for q in reqs:
            assert 0 < q["ttfa_s"] <= q["latency_s"] <= s["wall_s"] + 1e-6
        assert s["latency_s"]["p50"] <= s["latency_s"]["p90"] <= s["latency_s"]["p99"] <= s["latency_s"]["max"]
        assert s["peak_memory_bytes"] > 0 and s["memory_kind"] == "rss_peak_sampled"
        assert s["kv_cache_bytes_peak"] > 0
    # the engine streams: its first audio comes before its last; the baseline returns everything at the end
    assert all(q["ttfa_s"] == q["latency_s"] for q in points[("hf", 2)]["requests"])
    assert 0 < points[("ttsserve", 2)]["summary"]["kv_cache_usage_peak"] <= 1
    assert [q["load"] for q in data["ratios"]] == [1, 2]


def test_admission_and_host_phases_are_reported(report) -> None:
    """The engine's rounds report the time to admit their requests and the host ms a step by phase: the phases
    of a step add up to no more than the stepping time of the rounds; the device wait is part of runner_ms, the
    GC pauses part of the phases."""
    data, _ = report
    for r in (r for r in data["results"] if r["summary"]["backend"] == "ttsserve"):
        extra, wall, steps = r["run"]["extra"], r["summary"]["wall_s"], r["run"]["steps"]
        assert len(extra["admit_s"]) == 2 and all(a > 0 for a in extra["admit_s"])
        ms = extra["host_ms"]
        assert {"schedule_ms", "runner_ms", "runner_wait_ms", "audio_step_ms", "outputs_ms", "gc_ms"} <= set(ms)
        assert 0 <= ms["runner_wait_ms"] <= ms["runner_ms"]
        stepping_ms = (wall - sum(extra["admit_s"])) * 1e3
        host_ms = sum(v for k, v in ms.items() if k not in ("runner_wait_ms", "gc_ms")) * steps
        assert 0 < host_ms <= stepping_ms
        assert 0 <= ms["gc_ms"] * steps <= stepping_ms


def test_bad_flags_exit_2(capsys) -> None:
    assert (
        run_cli(
            *TINY_CLI_ARGS,
            "--frames",
            "0",
            "--no-progress",
        )
        == 2
    )
    assert "frames must be >= 1" in capsys.readouterr().err


def test_preemptions_are_counted_under_a_small_kv_pool(tmp_path) -> None:
    """8 blocks of 16 frames cannot hold 3 prompts plus 40 frames each at once: the engine must preempt, every
    request must still finish with all its frames, and the report must say how often it preempted."""
    rc = run_cli(
        "--backend",
        "ttsserve",
        *TINY_CLI_ARGS,
        "--batch-sizes",
        "3",
        "--frames",
        "40",
        "--swap-space",
        "0",
        "--kv-cache-memory",
        "128K",
        "--text-lengths",
        "short",
        "--warmup-frames",
        "0",
        "--no-progress",
        "--no-plots",
        "--out",
        str(tmp_path),
    )
    assert rc == 0
    (res,) = json.loads((tmp_path / "report.json").read_text())["results"]
    s = res["summary"]
    assert s["num_ok"] == 3 and all(q["num_frames"] == 40 for q in res["requests"])
    assert s["preemptions"] > 0 and s["kv_cache_usage_peak"] > 0.5


def test_bench_parser_has_every_subcommand() -> None:
    from ttsserve.entrypoints.cli import build_parser

    ap = build_parser()
    a = ap.parse_args(["bench", "offline", "--batch-sizes", "2,4", "--kv-cache-memory", "1.5G"])
    assert a.batch_sizes == [2, 4] and a.kv_cache_memory == int(1.5 * 2**30) and a.func.__name__ == "cmd_offline"
    a = ap.parse_args(["bench", "serve", "--concurrency", "1,4", "--qps", "0.5"])
    assert a.concurrency == [1, 4] and a.qps == [0.5] and a.func.__name__ == "cmd_serve"
    assert ap.parse_args(["bench", "report", "d"]).func.__name__ == "cmd_report"
    assert callable(ap.parse_args(["bench", "quality"]).func)


def test_engine_overrides_are_typed_and_checked() -> None:
    from ttsserve.bench.cli_bench import engine_overrides

    got = engine_overrides(
        ["first_chunk_frames=4", "enable-prefix-caching=false", "kv_cache_memory=none", "gpu_memory_utilization=0.5"]
    )
    assert got == {
        "first_chunk_frames": 4,
        "enable_prefix_caching": False,
        "kv_cache_memory": None,
        "gpu_memory_utilization": 0.5,
    }
    with pytest.raises(ValueError, match="no_such_field"):
        engine_overrides(["no_such_field=1"])
    with pytest.raises(ValueError, match="'x' is not a valid"):
        engine_overrides(["max_num_seqs=x"])


def test_each_batch_size_is_warmed_at_its_own_size_and_not_timed() -> None:
    from ttsserve.bench.offline import BatchRun, OfflineSpec, run_offline
    from ttsserve.bench.results import RequestRecord

    class Recorder:  # a backend that records what it was asked to run
        name = "recorder"

        def __init__(self) -> None:
            self.calls: list[tuple[int, int]] = []  # (batch size, max_new_tokens)

        def run_batch(self, sentences, params, split, bar=None) -> BatchRun:
            self.calls.append((len(sentences), params[0].max_new_tokens))
            return BatchRun(1.0, [RequestRecord(f"r{i}", s.id) for i, s in enumerate(sentences)])

    rec = Recorder()
    results = run_offline(OfflineSpec(batch_sizes=(1, 3), frames=20, warmup_frames=5), rec, progress=False)
    assert rec.calls == [(1, 5), (1, 20), (3, 5), (3, 20)]
    assert [len(r.requests) for r in results] == [1, 3]  # the warm-up batches are not in the results
    rec.calls.clear()
    run_offline(OfflineSpec(batch_sizes=(2,), frames=20, warmup_frames=0), rec, progress=False)
    assert rec.calls == [(2, 20)]
