"""What an interleaved A/B of two server configurations measured (benchmarks/gpu_ab.sh OUT ...): one line per run
and point, then each B run against the mean of the A runs on either side of it (the host's speed drifts over a
lease, so only neighbours compare); writes OUT/ab.json. Served points (serve_*) and bench offline's (offline_b*,
gpu_ab.sh with PARTS=offline: audio-s/s, latency and first audio p50, the engine's host phases a step) alike.

Each pair also compares the engine core's pure-Python phases (schedule + update + outputs, ms a step: no device
work, and the same code in A and B unless the change is to them): a B run whose host ran slower than its
neighbours' by more than the figure moved says little about the change. A change to the step itself (its rows, its
decode burst: --num-scheduler-steps) changes these phases too, so there the ratio is not the host's drift.

    python3 benchmarks/ab_summary.py OUT
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PYTHON_PHASES = ("schedule", "update", "outputs")


def run_points(run: Path) -> dict[str, dict]:
    """point name (serve_pcm_512, offline_b1, ...) -> the figures of that run's report there."""
    points = {report.parent.name: offline_point(report) for report in sorted(run.glob("offline_b*/report.json"))}
    for report in sorted(run.glob("serve_*/report.json")):
        s = json.loads(report.read_text())["results"][0]["summary"]
        step = s.get("server_step_ms", {})
        points[report.parent.name] = {
            "audio_s_per_s": round(s["audio_seconds_per_s"], 1),
            "ttfa_p50_s": round(s["ttfa_s"]["p50"], 3),
            "ttfa_p99_s": round(s["ttfa_s"]["p99"], 3),
            "underrun_streams": s["underrun_streams"],
            "ok": f"{s['num_ok']}/{s['num_requests']}",
            "steps_per_s": round(s.get("server_steps_per_s", 0.0), 1),
            "device_wait_ms": round(step.get("runner_forward", float("nan")), 2),
            "python_ms": round(sum(step.get(k, float("nan")) for k in PYTHON_PHASES), 2),
        }
    return points


def offline_point(report: Path) -> dict:
    """A bench offline report's figures, named as a served point's (its TTFA p99 is the rounds' first audio p99;
    steps_per_s over the rounds' wall, admission included)."""
    result = json.loads(report.read_text())["results"][0]
    s, run = result["summary"], result["run"]
    ms = run["extra"]["host_ms"]
    return {
        "audio_s_per_s": round(s["audio_seconds_per_s"], 1),
        "latency_p50_s": round(s["latency_s"]["p50"], 3),
        "ttfa_p50_s": round(s["ttfa_s"]["p50"], 3),
        "ttfa_p99_s": round(s["ttfa_s"]["p99"], 3),
        "underrun_streams": 0,
        "ok": f"{s['num_ok']}/{s['num_requests']}",
        "steps_per_s": round(run["steps"] / s["wall_s"], 1),
        "device_wait_ms": round(ms["runner_wait_ms"], 2),
        "python_ms": round(sum(ms[f"{k}_ms"] for k in PYTHON_PHASES), 2),
    }


def summarize(out: Path) -> dict:
    runs = sorted(
        (p for p in out.iterdir() if p.is_dir() and re.fullmatch(r"[ab]\d+", p.name)),
        key=lambda p: (int(p.name[1:]), p.name[0]),
    )  # a1, b1, a2, b2, ...: the order they ran in
    table = {p.name: run_points(p) for p in runs}
    pairs = []
    for name, points in table.items():
        if name[0] != "b":
            continue
        k = int(name[1:])
        for point, fig in points.items():
            around = [table.get(f"a{j}", {}).get(point) for j in (k, k + 1)]
            around = [f for f in around if f]
            if around:
                base = sum(f["audio_s_per_s"] for f in around) / len(around)
                python = sum(f["python_ms"] for f in around) / len(around)
                pairs.append(
                    {
                        "run": name,
                        "point": point,
                        "b_over_a": round(fig["audio_s_per_s"] / base, 3),
                        "python_ms_b_over_a": round(fig["python_ms"] / python, 3),
                    }
                )
    return {"runs": table, "b_against_neighbouring_a": pairs}


def main() -> int:
    out = Path(sys.argv[1])
    result = summarize(out)
    (out / "ab.json").write_text(json.dumps(result, indent=1))
    for name, points in result["runs"].items():
        for point, f in points.items():
            print(
                f"{name:4s} {point:16s} {f['audio_s_per_s']:8.1f} audio-s/s  TTFA {f['ttfa_p50_s']:.2f} / "
                f"{f['ttfa_p99_s']:.2f} s  {f['steps_per_s']:5.1f} steps/s  waits {f['device_wait_ms']:.2f} ms  "
                f"python {f['python_ms']:.2f} ms  underruns {f['underrun_streams']}  ok {f['ok']}"
                + (f"  latency p50 {f['latency_p50_s']:.3f} s" if "latency_p50_s" in f else "")
            )
    for p in result["b_against_neighbouring_a"]:
        print(
            f"{p['run']} {p['point']}: B / A = {p['b_over_a']:.3f}  "
            f"(its host's pure-Python phases: {p['python_ms_b_over_a']:.3f} of the A runs')"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
