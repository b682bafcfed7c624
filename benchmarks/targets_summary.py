"""The performance targets of the GPU headline table, checked against one `benchmarks/gpu_targets.sh OUT` run:
one JSON object with each target's figures, its threshold and whether it was met, read from the run's reports
(bench coldstart's JSON, bench serve's and bench offline's report.json).

    python3 benchmarks/targets_summary.py OUT > targets.json

A target whose run is missing from OUT is reported with "measured": false, never as met. The variant server's
points (OUT/variant, `PARTS=... variant`) are listed with their serve flags, not judged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _summary(path: Path) -> dict | None:
    """The summary of the first result of a bench report, None if the run is missing."""
    report = path / "report.json"
    if not report.exists():
        return None
    return json.loads(report.read_text())["results"][0]["summary"]


def _served(out: Path, name: str) -> dict | None:
    """The point `name`, or the same point run with its own client-process count (name_pN), if only that ran."""
    runs = [out / name] if (out / name).is_dir() else sorted(out.glob(f"{name}_p*"))
    s = _summary(runs[0]) if runs else None
    if s is None:
        return None
    return {
        "audio_s_per_s": round(s["audio_seconds_per_s"], 1),
        "requests_per_s": round(s["requests_per_s"], 2),
        "ok": f"{s['num_ok']}/{s['num_requests']}",
        "ttfa_p50_s": round(s["ttfa_s"]["p50"], 3),
        "ttfa_p99_s": round(s["ttfa_s"]["p99"], 3),
        "latency_p99_s": round(s["latency_s"]["p99"], 3),
        "underrun_streams": s["underrun_streams"],
        **({"ttfa_p99_after_warmup_s": round(s["ttfa_s_after_warmup"]["p99"], 3)} if s.get("warmup_s") else {}),
        "engine_ttfa_p99_s": round(s.get("server_ttfa_s", {}).get("engine", {}).get("p99", float("nan")), 3),
        "api_ttfa_p99_s": round(s.get("server_ttfa_s", {}).get("api", {}).get("p99", float("nan")), 3),
        "server_steps_per_s": round(s.get("server_steps_per_s") or 0.0, 1),
    }


def _offline(out: Path, batch: int) -> dict | None:
    s = _summary(out / f"offline_b{batch}")
    if s is None:
        return None
    run = json.loads((out / f"offline_b{batch}" / "report.json").read_text())["results"][0].get("run", {})
    extra = run.get("extra", {})
    return {
        "audio_s_per_s": round(s["audio_seconds_per_s"], 1),
        "latency_p50_s": round(s["latency_s"]["p50"], 3),
        "ttfa_p50_s": round(s["ttfa_s"]["p50"], 3),
        # where the rounds went: the requests' admission and the engine's host ms a step by phase (reports since
        # bench offline kept them)
        **({"admit_s": extra["admit_s"], "steps": run["steps"]} if "admit_s" in extra else {}),
        **({"host_ms_a_step": {k: round(v, 2) for k, v in extra["host_ms"].items()}} if "host_ms" in extra else {}),
    }


def _target(name: str, figures: dict | None, checks: dict[str, bool] | None) -> dict:
    if figures is None:
        return {"target": name, "measured": False, "met": False}
    return {"target": name, "measured": True, "met": all(checks.values()), "checks": checks, **figures}


def _server_log(d: Path) -> dict | None:
    """What a served part's server.log says about stalls: the slow steps the core logged (one per 10 s at most)
    and the Triton kernels compiled after /ready (every one logged; each a stalled step)."""
    log = d / "server.log"
    if not log.exists():
        return None
    text = log.read_text(errors="replace")
    return {
        "slow_step_lines": text.count("slow engine step:"),
        "kernel_compiles_while_serving": text.count("compiled a kernel while serving"),
    }


def summarize(out: Path) -> dict:
    targets = []
    p512, p256, p128 = (_served(out, f"serve_pcm_{c}") for c in (512, 256, 128))
    m256, q400 = _served(out, "serve_mp3_256"), _served(out, "serve_pcm_qps400")
    targets.append(
        _target(
            "pcm @ 512: >= 2,500 audio-s/s, TTFA p99 <= 0.35 s, 0 underrun streams",
            p512,
            p512
            and {
                "audio": p512["audio_s_per_s"] >= 2500,
                "ttfa": p512["ttfa_p99_s"] <= 0.35,
                "underruns": p512["underrun_streams"] == 0,
            },
        )
    )
    targets.append(_target("pcm @ 256: >= 2,000 audio-s/s", p256, p256 and {"audio": p256["audio_s_per_s"] >= 2000}))
    targets.append(_target("pcm @ 128: TTFA p99 <= 0.15 s", p128, p128 and {"ttfa": p128["ttfa_p99_s"] <= 0.15}))
    targets.append(
        _target("Poisson 400 req/s: latency p99 <= 1.0 s", q400, q400 and {"latency": q400["latency_p99_s"] <= 1.0})
    )
    ratio = m256 and p256 and {"mp3_over_pcm": round(m256["audio_s_per_s"] / p256["audio_s_per_s"], 3), **m256}
    targets.append(_target("mp3 @ 256 >= 0.8 of pcm @ 256", ratio, ratio and {"ratio": ratio["mp3_over_pcm"] >= 0.8}))
    o1, o512 = _offline(out, 1), _offline(out, 512)
    targets.append(
        _target(
            "bench offline 1 x 10 s: <= 0.20 s, first audio <= 40 ms",
            o1,
            o1 and {"latency": o1["latency_p50_s"] <= 0.20, "first_audio": o1["ttfa_p50_s"] <= 0.040},
        )
    )
    targets.append(
        _target("bench offline 512 x 10 s: >= 3,000 audio-s/s", o512, o512 and {"audio": o512["audio_s_per_s"] >= 3000})
    )
    cold_path = out / "coldstart.json"
    cold = json.loads(cold_path.read_text()) if cold_path.exists() else None
    cold_figs = cold and {"median_s": cold["median_s"], "min_s": cold["min_s"], "runs": len(cold["runs"])}
    targets.append(
        _target("serve to /ready, caches warm: <= 15 s", cold_figs, cold_figs and {"ready": cold["median_s"] <= 15})
    )
    machine = (out / "machine.txt").read_text().splitlines() if (out / "machine.txt").exists() else []
    summary = {"machine": machine, "targets": targets}
    if (log := _server_log(out)) is not None:
        summary["server_log"] = log
    variant = out / "variant"
    if variant.is_dir():  # the same points with other serve flags: figures only, no target is judged on them
        points = sorted(p.name for p in variant.iterdir() if (p / "report.json").exists())
        summary["variant"] = {
            "serve_args": (variant / "serve_args.txt").read_text().strip(),
            "points": {
                name: _offline(variant, int(name[len("offline_b") :]))
                if name.startswith("offline_b")
                else _served(variant, name)
                for name in points
            },
        }
        if (log := _server_log(variant)) is not None:
            summary["variant"]["server_log"] = log
    return summary


if __name__ == "__main__":
    print(json.dumps(summarize(Path(sys.argv[1])), indent=1))
