"""Benchmark reports: report.json (machine, versions, git commit, command line, config, every figure and every
request), report.md (tables), and PNG plots (throughput vs load, latency percentiles vs load, TTFA CDF)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

from ttsserve.bench.results import RunResult

# a load-generator event-loop stall the serve report points out: TTFA targets are 0.15-0.35 s, and at 512 H100
# streams every client process's loop stalled 0.07-0.15 s at once (the waves of 64 new requests a process)
CLIENT_STALL_WARN_S = 0.1

REPORT_VERSION = 1


def default_out_dir(kind: str) -> Path:
    from ttsserve.bench.sysinfo import REPO_ROOT

    return REPO_ROOT / "benchmarks" / "results" / f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}"


def ratios(results: Sequence[RunResult], base: str = "hf", other: str = "ttsserve") -> list[dict]:
    """Per load point present for both backends: other / base for throughput, base / other for latency
    (so > 1 always means `other` is better)."""
    by = {(r.backend, r.load): r.summary() for r in results}
    out = []
    for (backend, load), s_base in sorted(by.items(), key=lambda kv: kv[0][1]):
        s_other = by.get((other, load))
        if backend != base or s_other is None:
            continue

        def div(a, b):
            return a / b if a is not None and b else None

        out.append(
            {
                "load": load,
                "throughput_ratio": div(s_other["audio_seconds_per_s"], s_base["audio_seconds_per_s"]),
                "frames_per_s_ratio": div(s_other["frames_per_s"], s_base["frames_per_s"]),
                "latency_p50_speedup": div(s_base["latency_s"]["p50"], s_other["latency_s"]["p50"]),
                "ttfa_p50_speedup": div(s_base["ttfa_s"]["p50"], s_other["ttfa_s"]["p50"]),
                "peak_memory_ratio": div(s_other["peak_memory_bytes"], s_base["peak_memory_bytes"]),
            }
        )
    return out


def build_report(
    kind: str, results: Sequence[RunResult], config: dict, machine: dict, backends: dict | None = None
) -> dict:
    return {
        "report_version": REPORT_VERSION,
        "kind": kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "config": config,
        "backends": backends or {},
        "ratios": ratios(results) if {r.backend for r in results} >= {"hf", "ttsserve"} else [],
        "results": [r.to_json() for r in results],
    }


def write_report(report: dict, results: Sequence[RunResult], out_dir: str | Path, plots: bool = True) -> Path:
    """Write report.json, report.md and the plots into out_dir (created); returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(_sanitize(report), indent=2, default=_json_default, allow_nan=False))
    (out / "report.md").write_text(markdown(report, results))
    if plots:
        write_plots(results, out)
    return out


def rewrite_report(out_dir: str | Path, plots: bool = True) -> Path:
    """Re-render report.md and the plots of an existing report folder from its report.json."""
    out = Path(out_dir)
    report = json.loads((out / "report.json").read_text())
    results = [RunResult.from_json(r) for r in report["results"]]
    (out / "report.md").write_text(markdown(report, results))
    if plots:
        write_plots(results, out)
    return out


def _json_default(o):
    return str(o)


def _sanitize(x):
    """NaN/inf -> None so report.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _sanitize(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_sanitize(v) for v in x]
    return x


def _f(x, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.0f}"


def _pcts(d: dict, keys=("p50", "p90", "p99")) -> str:
    return " / ".join(_f(d[k]) for k in keys)


def _client_cpu(s: dict) -> str:
    cpu, stall = s.get("client_cpu") or [], s.get("client_stall_s") or []
    text = f"{max(cpu):.2f} x {len(cpu)}" if cpu else "-"
    return text + (f", stalled {max(stall):.2f} s" if stall and max(stall) >= CLIENT_STALL_WARN_S else "")


def _pair(q: dict | None) -> str:
    return f"{_f(q.get('p50'), 3)} / {_f(q.get('p99'), 3)}" if q else "-"


def _server_side(results: Sequence[RunResult]) -> list[str]:
    """The server's own view of each point (from its /metrics): steps/s, mean batch, host ms per step phase."""
    rows = [r.summary() for r in results]
    rows = [s for s in rows if s.get("server_step_ms")]
    if not rows:
        return []
    phases = list(rows[0]["server_step_ms"])
    lines = [
        "",
        "server side (its /metrics over the run; host ms per engine step by phase)",
        "",
        "| load | steps/s | steps > 20 / 50 ms | TTFA p50 / p99, engine; API servers (s) | running | waiting | "
        + " | ".join(phases)
        + " |",
        "|---|---:|---|---|---:|---:|" + "---:|" * len(phases),
    ]
    for s in rows:
        ms, slow = s["server_step_ms"], s.get("server_steps_over_ms") or {}
        slow_cell = " / ".join(f"{slow[k]:.0f}" for k in ("20", "50")) if slow else "-"
        ttfa = s.get("server_ttfa_s") or {}
        ttfa_cell = "; ".join(_pair(ttfa.get(who)) for who in ("engine", "api")) if ttfa else "-"
        lines.append(
            f"| {s['load_kind']} {s['load']:g} | {_f(s['server_steps_per_s'], 1)} | {slow_cell} | "
            f"{ttfa_cell} | "
            f"{_f(s.get('server_running_mean'), 1)} | {_f(s.get('server_waiting_mean'), 1)} | "
            + " | ".join(_f(ms.get(p), 3) for p in phases)
            + " |"
        )
    return lines


def markdown(report: dict, results: Sequence[RunResult]) -> str:
    m = report["machine"]
    lines = [
        f"# ttsserve bench {report['kind']}",
        "",
        f"- command: `{m.get('command')}`",
        f"- machine: {m.get('cpu_model')} ({m.get('cpu_cores')} cores), device {m.get('device')}"
        + (f" ({m['gpu_name']})" if m.get("gpu_name") else ""),
        f"- torch {m.get('torch')}, transformers {m.get('transformers', '-')}, git {m.get('git_commit')}",
        f"- created {report['created']}, load average (1 min) {_f(m.get('load_average_1m_before'))} before, "
        f"{_f(m.get('load_average_1m'))} after",
        "",
    ]
    if report["kind"] == "offline":
        lines += [
            "| backend | batch | requests | frames/s | audio-s/s | latency p50/p90/p99 (s) | "
            "TTFA p50/p90/p99 (s) | peak mem (MiB) | KV peak (MiB) | KV usage | preemptions |",
            "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
        ]
        for r in results:
            s = r.summary()
            lines.append(
                f"| {s['backend']} | {s['load']:g} | {s['num_ok']}/{s['num_requests']} | "
                f"{_f(s['frames_per_s'], 1)} | {_f(s['audio_seconds_per_s'])} | {_pcts(s['latency_s'])} | "
                f"{_pcts(s['ttfa_s'])} | {_mib(s['peak_memory_bytes'])} | {_mib(s['kv_cache_bytes_peak'])} | "
                f"{_f(s['kv_cache_usage_peak'], 4)} | {s['preemptions']} |"
            )
    else:
        lines += [
            "| load | ok/total | req/s | audio-s/s | TTFA p50/p99 (s) | latency p50/p99 (s) | "
            "RTF p50/p99 | underrun streams | errors | server mem peak (MiB) | client CPU |",
            "|---|---:|---:|---:|---|---|---|---:|---|---:|---:|",
        ]
        for r in results:
            s = r.summary()
            p = ("p50", "p99")
            lines.append(
                f"| {s['load_kind']} {s['load']:g} | {s['num_ok']}/{s['num_requests']} | "
                f"{_f(s['requests_per_s'])} | {_f(s['audio_seconds_per_s'])} | {_pcts(s['ttfa_s'], p)} | "
                f"{_pcts(s['latency_s'], p)} | {_pcts(s['rtf'], p)} | {s['underrun_streams']} | "
                f"{s['errors'] or '-'} | {_mib(s['peak_memory_bytes'])} | {_client_cpu(s)} |"
            )
    if report["ratios"]:
        lines += [
            "",
            "ttsserve vs hf (> 1: ttsserve better)",
            "",
            "| batch | throughput x | latency p50 x | TTFA p50 x | peak memory (ttsserve/hf) |",
            "|---:|---:|---:|---:|---:|",
        ]
        for q in report["ratios"]:
            lines.append(
                f"| {q['load']:g} | {_f(q['throughput_ratio'])} | {_f(q['latency_p50_speedup'])} | "
                f"{_f(q['ttfa_p50_speedup'])} | {_f(q['peak_memory_ratio'])} |"
            )
    if report["kind"] == "serve":
        lines += _after_warmup(results)
        lines += _server_side(results)
        lines += [
            "",
            "client CPU = cores busy per load-generator process (its most loaded one, x the number "
            "of processes); near 1.0 the client, not the server, limits the figures: raise --client-procs. "
            f"'stalled X s': a process's event loop was held X s at once (>= {CLIENT_STALL_WARN_S} s shown), "
            "and its requests' TTFA and latency include that delay: raise --client-procs or free cores.",
        ]
    lines += [
        "",
        "Units: audio-s/s = seconds of returned 24-kHz audio per wall second (all requests); "
        "frames/s = code frames per wall second (1 frame = 512 samples = 21.3 ms); latency = submission "
        "to last audio; TTFA = submission to first audio; RTF = latency / audio duration.",
        "",
    ]
    return "\n".join(lines)


def _after_warmup(results: Sequence[RunResult]) -> list[str]:
    """One line per point run with --warmup-s: the TTFA of the requests sent after the warm-up."""
    rows = []
    for r in results:
        s = r.summary()
        if "ttfa_s_after_warmup" in s:
            rows.append(
                f"- {s['load_kind']} {s['load']:g}: TTFA p50/p99 {_pcts(s['ttfa_s_after_warmup'], ('p50', 'p99'))} s "
                f"over the {s['num_after_warmup']} requests sent after the first {s['warmup_s']:g} s"
            )
    if not rows:
        return []
    head = "after the warm-up (a closed loop starts every stream at once, and their ends the next wave):"
    return ["", head, "", *rows]


def write_plots(results: Sequence[RunResult], out: Path) -> list[Path]:
    """throughput.png, latency.png and ttfa_cdf.png (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[RunResult]] = {}
    for r in results:
        groups.setdefault(r.backend, []).append(r)
    xlabel = {
        "batch_size": "batch size (requests submitted at once)",
        "concurrency": "concurrent clients",
        "qps": "offered load (requests/s)",
    }
    paths = []

    colors = {name: f"C{i}" for i, name in enumerate(groups)}
    xlab = " / ".join(xlabel[k] for k in dict.fromkeys(r.load_kind for r in results))

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rs in groups.items():
        for kind, marker in zip(dict.fromkeys(r.load_kind for r in rs), "os^"):
            pts = sorted((r.load, r.summary()["audio_seconds_per_s"]) for r in rs if r.load_kind == kind)
            ax.plot(*zip(*pts), marker=marker, color=colors[name], label=f"{name} ({kind})")
    ax.set(xlabel=xlab, ylabel="audio seconds per second", title="Throughput")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    _finish_axes(ax, results)
    paths.append(_save(fig, out / "throughput.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: r.load)
        for key, q, style in (
            ("latency_s", "p50", "-"),
            ("latency_s", "p90", "--"),
            ("latency_s", "p99", ":"),
            ("ttfa_s", "p50", "-."),
        ):
            pts = [(r.load, r.summary()[key][q]) for r in rs]
            pts = [p for p in pts if p[1] is not None]
            if pts:
                ax.plot(
                    *zip(*pts),
                    ls=style,
                    marker="x" if key == "ttfa_s" else "o",
                    color=colors[name],
                    label=f"{name} {'TTFA' if key == 'ttfa_s' else 'latency'} {q}",
                )
    ax.set(xlabel=xlab, ylabel="seconds", title="Latency percentiles vs load")
    _finish_axes(ax, results)
    paths.append(_save(fig, out / "latency.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ttfa = sorted(x.ttfa_s for x in r.requests if x.status == "ok" and x.ttfa_s is not None)
        if ttfa:
            ax.step(
                ttfa,
                [(i + 1) / len(ttfa) for i in range(len(ttfa))],
                where="post",
                label=f"{r.backend} {r.load_kind} {r.load:g}",
            )
    ax.set(xlabel="time to first audio (s)", ylabel="fraction of requests", title="TTFA CDF", ylim=(0, 1.02))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "ttfa_cdf.png"))
    return paths


def _finish_axes(ax, results: Sequence[RunResult]) -> None:
    loads = [r.load for r in results if r.load > 0]
    if loads and max(loads) / min(loads) >= 8:  # 1, 8, 32...: a log axis keeps the small loads readable
        ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
