"""benchmarks/ab_summary.py, the reader of an interleaved A/B (benchmarks/gpu_ab.sh): runs in the order they ran,
and each B run judged against the A runs on either side of it only."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ab_summary", ROOT / "benchmarks" / "ab_summary.py")
ab_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_summary)


def _report(path: Path, audio: float, wait_ms: float = 1.0, python_ms: float = 3.0) -> None:
    summary = {
        "audio_seconds_per_s": audio,
        "num_ok": 10,
        "num_requests": 10,
        "ttfa_s": {"p50": 0.2, "p99": 0.4},
        "underrun_streams": 0,
        "server_steps_per_s": 50.0,
        "server_step_ms": {
            "runner_forward": wait_ms,
            "schedule": python_ms / 2,
            "update": python_ms / 4,
            "outputs": python_ms / 4,
        },
    }
    path.mkdir(parents=True)
    (path / "report.json").write_text(json.dumps({"results": [{"summary": summary}]}))


def test_each_b_run_is_judged_against_its_neighbouring_a_runs(tmp_path: Path) -> None:
    # the host sped up over the lease: A went 1,000 -> 1,200 -> 1,400; B ran between them
    runs = (("a1", 1000, 4.0), ("b1", 1210, 3.3), ("a2", 1200, 3.0), ("b2", 1300, 3.3), ("a3", 1400, 3.0))
    for name, audio, python_ms in runs:
        _report(tmp_path / name / "serve_pcm_512", audio, wait_ms=2.5, python_ms=python_ms)
    got = ab_summary.summarize(tmp_path)
    assert list(got["runs"]) == ["a1", "b1", "a2", "b2", "a3"]  # the order they ran in: by round, A first
    assert got["runs"]["b1"]["serve_pcm_512"]["device_wait_ms"] == 2.5
    pairs = {p["run"]: p["b_over_a"] for p in got["b_against_neighbouring_a"]}
    assert pairs == {"b1": 1.1, "b2": 1.0}  # 1,210 / mean(1,000, 1,200); 1,300 / mean(1,200, 1,400)
    python = {p["run"]: p["python_ms_b_over_a"] for p in got["b_against_neighbouring_a"]}
    assert python == {"b1": 0.943, "b2": 1.1}  # 3.3 / mean(4.0, 3.0); 3.3 / mean(3.0, 3.0)
    (tmp_path / "b3").mkdir()  # a run cut off before its report: no line, no pair
    assert "b3" not in {p["run"] for p in ab_summary.summarize(tmp_path)["b_against_neighbouring_a"]}


def test_offline_points_are_read_from_bench_offline_reports(tmp_path: Path) -> None:
    """gpu_ab.sh with PARTS=offline: each run's offline_b* reports, judged as the served points are."""
    for name, audio in (("a1", 2500.0), ("b1", 2600.0), ("a2", 2700.0)):
        summary = {
            "audio_seconds_per_s": audio,
            "latency_s": {"p50": 2.0},
            "ttfa_s": {"p50": 0.39, "p99": 0.4},
            "num_ok": 1024,
            "num_requests": 1024,
            "wall_s": 4.0,
        }
        host = {"schedule_ms": 1.0, "update_ms": 0.5, "outputs_ms": 1.5, "runner_ms": 20.0, "runner_wait_ms": 6.0}
        run = {"steps": 126, "extra": {"admit_s": [0.1, 0.1], "host_ms": host}}
        (tmp_path / name / "offline_b512").mkdir(parents=True)
        report = {"results": [{"summary": summary, "run": run}]}
        (tmp_path / name / "offline_b512" / "report.json").write_text(json.dumps(report))
    got = ab_summary.summarize(tmp_path)
    point = got["runs"]["b1"]["offline_b512"]
    assert point["python_ms"] == 3.0 and point["device_wait_ms"] == 6.0 and point["steps_per_s"] == 31.5
    assert point["latency_p50_s"] == 2.0 and point["ok"] == "1024/1024"
    assert got["b_against_neighbouring_a"] == [
        {"run": "b1", "point": "offline_b512", "b_over_a": 1.0, "python_ms_b_over_a": 1.0}
    ]
