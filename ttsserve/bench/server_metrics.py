"""The server's side of a `bench serve` run, from /metrics scrapes: Prometheus text parsing, per-core
series folded into the server's totals, steps per second, phase times, time to first audio quantiles."""

from __future__ import annotations

import re


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {"name{labels}": value} (comments skipped; unparsable lines ignored)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


_CORE_LABEL = re.compile(r'core="(\d+)",?')


def fold_cores(sample: dict[str, float]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """A scrape with per-core engine series (label core="i") -> (the server's totals: summed over cores, a
    ratio such as kv_cache_usage their maximum; {core: {unlabelled key: value}})."""
    folded: dict[str, float] = {}
    cores: dict[str, dict[str, float]] = {}
    for key, value in sample.items():
        m = _CORE_LABEL.search(key)
        if m is None:
            folded[key] = value
            continue
        plain = (key[: m.start()] + key[m.end() :]).replace(",}", "}").replace("{}", "")
        cores.setdefault(m.group(1), {})[plain] = value
        if plain in folded:
            folded[plain] = max(folded[plain], value) if "usage" in plain else folded[plain] + value
        else:
            folded[plain] = value
    return folded, cores


def _per_core_figures(samples: list[dict], before: dict, after: dict, wall_s: float) -> dict:
    """Each engine core's steps per second over the run and mean waiting requests over the samples."""
    _, b = fold_cores(before)
    _, a = fold_cores(after)
    waits: dict[str, list[float]] = {}
    for s in samples:
        for core, series in fold_cores(s)[1].items():
            if "ttsserve_num_requests_waiting" in series:
                waits.setdefault(core, []).append(series["ttsserve_num_requests_waiting"])
    key = "ttsserve_engine_steps_total"
    return {
        core: {
            "steps_per_s": (series.get(key, 0.0) - b.get(core, {}).get(key, 0.0)) / max(wall_s, 1e-9),
            "waiting_mean": sum(waits.get(core, [0.0])) / max(len(waits.get(core, [])), 1),
        }
        for core, series in sorted(a.items())
    }


def server_figures(samples: list[dict[str, float]], before: dict, after: dict, wall_s: float) -> dict:
    per_core = _per_core_figures(samples, before, after, wall_s)
    samples = [fold_cores(s)[0] for s in samples]
    before, after = fold_cores(before)[0], fold_cores(after)[0]
    out = _server_totals(samples, before, after, wall_s)
    if len(per_core) > 1:
        out["server_cores"] = per_core
    return out


def _server_totals(samples: list[dict[str, float]], before: dict, after: dict, wall_s: float) -> dict:
    """Server-side figures from /metrics scrapes: the peak of every gauge named *memory* or *kv_cache_usage*,
    the preemption counter's increase, and -- where the server exports them -- its steps per second, host
    time per step of each engine phase over the run (ms, from the counters before and after), how many steps
    took over 20 and over 50 ms (server_steps_over_ms), and the mean
    running / waiting batch of the samples taken while the load ran (none for a point under 0.5 s)."""
    peaks: dict[str, float] = {}
    for s in samples + [after]:
        for k, v in s.items():
            if ("memory" in k or "kv_cache_usage" in k) and not k.endswith(("_created", "_total_created")):
                peaks[k] = max(v, peaks.get(k, v))
    pre = [k for k in after if k.startswith("ttsserve_num_preemptions") and not k.endswith("_created")]
    out: dict = {"server_metrics_peak": peaks, "preemptions": int(sum(after[k] - before.get(k, 0.0) for k in pre))}
    steps = after.get("ttsserve_engine_steps_total", 0.0) - before.get("ttsserve_engine_steps_total", 0.0)
    if steps > 0:
        phase = 'ttsserve_engine_phase_seconds_total{phase="'
        out["server_steps_per_s"] = steps / max(wall_s, 1e-9)
        out["server_step_ms"] = {
            k[len(phase) : -2]: 1000.0 * (v - before.get(k, 0.0)) / steps
            for k, v in after.items()
            if k.startswith(phase)
        }
        if 'ttsserve_engine_step_seconds_bucket{le="+Inf"}' in after:  # steps over 20 / 50 ms: a tail's cause?
            le = {ms: f'ttsserve_engine_step_seconds_bucket{{le="{ms / 1000}"}}' for ms in (20, 50)}
            out["server_steps_over_ms"] = {
                str(ms): steps - (after.get(k, 0.0) - before.get(k, 0.0)) for ms, k in le.items()
            }
    ttfa = {
        who: {f"p{q}": histogram_quantile(q / 100, buckets) for q in (50, 99)}
        for who, name in (
            ("engine", "ttsserve_engine_time_to_first_audio_seconds"),
            ("api", "ttsserve_time_to_first_audio_seconds"),
        )
        if (buckets := _bucket_increase(before, after, name))
    }
    if ttfa:  # the server's own view of time to first audio: where a tail the clients see comes from
        out["server_ttfa_s"] = ttfa
    # over the samples taken while the load ran (the scrape after it, at an idle server, would pull it down)
    for gauge, key in (
        ("ttsserve_num_requests_running", "server_running_mean"),
        ("ttsserve_num_requests_waiting", "server_waiting_mean"),
    ):
        values = [s[gauge] for s in samples if gauge in s]
        if values:
            out[key] = sum(values) / len(values)
    return out


def _bucket_increase(before: dict, after: dict, name: str) -> list[tuple[float, float]]:
    """A histogram's cumulative (le, count) buckets increase between two scrapes, summed over its labels."""
    inc: dict[float, float] = {}
    for key, value in after.items():
        if key.startswith(name + "_bucket{") and (m := re.search(r'le="([^"]+)"', key)):
            le = float(m.group(1))  # "+Inf" parses as inf
            inc[le] = inc.get(le, 0.0) + value - before.get(key, 0.0)
    return sorted(inc.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative (le, count) buckets, linear within a bucket (PromQL's histogram_quantile);
    None without observations; the last finite bound when it falls in the +Inf bucket."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (rank - below) / max(count - below, 1e-12)
        lo, below = le, count
    return lo
