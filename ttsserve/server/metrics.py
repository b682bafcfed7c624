"""Prometheus metrics of one server: request outcomes and latencies recorded by the handlers, engine gauges
read from engine.stats() at scrape time. Each app has its own registry (several apps can live in a process).

With PROMETHEUS_MULTIPROC_DIR set before prometheus_client is imported (`serve --api-server-count N` sets it
for its API servers) every process writes its counters and histograms to files there, and a scrape of any
API server renders all of them summed over processes (prometheus_client's multiprocess mode), plus the
engine gauges once: the engine core is shared, so its stats are the same from every API server.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ttsserve.engine.step_stats import FIRST_AUDIO_BUCKETS_S
from ttsserve.server.vllm_metrics import CORE, VllmEngineCollector, VllmRequestMetrics, scrape_cores

# The *_created series double the output for nothing a TTS dashboard uses (process-wide setting).
disable_created_metrics()
# prometheus_client picks file-backed values when it is imported with this set; render the same way.
_MULTIPROC_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0)
# the engine's buckets, so the two histograms of time to first audio read side by side (a tail's whereabouts)
_TTFA_BUCKETS = (*FIRST_AUDIO_BUCKETS_S, 20.0, 40.0, 80.0)
_RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)

# engine.stats() key -> (metric name, help, kind)
_ENGINE_GAUGES = {
    "num_running": ("ttsserve_num_requests_running", "Requests in the engine's running batch", "gauge"),
    "num_waiting": ("ttsserve_num_requests_waiting", "Requests waiting for admission", "gauge"),
    "num_swapped": ("ttsserve_num_requests_swapped", "Requests swapped out to host memory", "gauge"),
    "kv_cache_usage": ("ttsserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1)", "gauge"),
    "step_time_ms_ema": ("ttsserve_step_time_ms", "Engine step time, exponential moving average (ms)", "gauge"),
    "num_preemptions_total": ("ttsserve_num_preemptions", "Preemptions since start", "counter"),
    "num_swaps_total": ("ttsserve_num_swaps", "Swap-outs since start", "counter"),
    "steps_total": ("ttsserve_engine_steps", "Engine steps since start", "counter"),
    "slow_steps_total": (
        "ttsserve_engine_slow_steps",
        "Engine steps over 4x the moving average (and 20 ms); the core logs one a while with what it held",
        "counter",
    ),
    "kernel_compiles_while_serving_total": (
        "ttsserve_engine_kernel_compiles_while_serving",
        "Triton kernels compiled after the engine was ready (process-wide), each one stalling the step that "
        "launched it; the core logs a warning naming it. 0 on a healthy server",
        "counter",
    ),
    "audio_collects_total": ("ttsserve_vocoder_results", "Vocoder calls whose audio was read back", "counter"),
    "audio_polled_total": (
        "ttsserve_vocoder_results_polled",
        "Of those, the ones handed out in mid-step (done by the time the next GPT step was queued)",
        "counter",
    ),
    "outstanding_frames": (
        "ttsserve_engine_outstanding_frames",
        "Frames the core's admitted requests have yet to deliver, by their estimates (what data-parallel "
        "routing weighs)",
        "gauge",
    ),
    "warm": (
        "ttsserve_engine_warm",
        "1 once the start-up work left to the background (the CPU server's compilation, the GPU server's "
        "deferred CUDA graph captures) is done: the steady speed; 0 while it runs",
        "gauge",
    ),
    "cuda_graphs_pending": (
        "ttsserve_engine_cuda_graphs_pending",
        "CUDA graph buckets still to be captured after start-up (between steps); meanwhile their batches "
        "replay the next larger captured bucket",
        "gauge",
    ),
}


class _EngineCollector:
    """Reads engine.stats() on every scrape, so gauges are never stale."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self):
        cores = scrape_cores(self._stats)
        for key, (name, help_, kind) in _ENGINE_GAUGES.items():
            values = [(core, s[key]) for core, s in cores if isinstance(s.get(key), (int, float))]
            if not values:
                continue
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(name, help_, labels=[CORE])
            for core, value in values:
                family.add_metric([core], float(value))
            yield family
        yield from self._phases(cores)
        yield from self._step_times(cores)

    @staticmethod
    def _phases(cores: list[tuple[str, dict]]):
        """Host time per engine-step phase, summed (s): rate() of it / rate() of the steps is the phase's
        share of a step under live traffic (bench serve reports it)."""
        family = CounterMetricFamily(
            "ttsserve_engine_phase_seconds",
            "Engine host time per step phase since start (s)",
            labels=[CORE, "phase"],
        )
        for core, stats in cores:
            steps = stats.get("steps_total")
            if not isinstance(steps, (int, float)):
                continue
            for group in ("step_breakdown_ms", "runner_breakdown_ms"):
                for name, per_step_ms in (stats.get(group) or {}).items():
                    prefix = "runner_" if group == "runner_breakdown_ms" else ""
                    family.add_metric([core, prefix + name.removesuffix("_ms")], per_step_ms * steps / 1000.0)
        if family.samples:
            yield family

    @staticmethod
    def _step_times(cores: list[tuple[str, dict]]):
        """The engine steps' wall times and the engine's share of time to first audio: a tail of first audio
        that is not in the engine's is the API servers' or the network's; one in it shows as long steps."""
        for key, name, help_ in (
            ("step_time_histogram", "ttsserve_engine_step_seconds", "Engine step wall time (s)"),
            (
                "first_audio_histogram",
                "ttsserve_engine_time_to_first_audio_seconds",
                "Time from a request reaching the engine to its first audio leaving it (s)",
            ),
        ):
            family = HistogramMetricFamily(name, help_, labels=[CORE])
            for core, stats in cores:
                hist = stats.get(key)
                if isinstance(hist, dict):
                    bounds = [str(b) for b in hist["le_s"]] + ["+Inf"]
                    buckets = list(zip(bounds, itertools.accumulate(hist["counts"])))
                    family.add_metric([core], buckets, sum_value=hist["sum_s"])
            if family.samples:
                yield family
        longest = GaugeMetricFamily(
            "ttsserve_engine_step_max_seconds", "Longest engine step since start (s)", labels=[CORE]
        )
        pauses = CounterMetricFamily(
            "ttsserve_engine_gc_pause_seconds",
            "The engine process's garbage collector pauses since start (s)",
            labels=[CORE, "generation"],
        )
        for core, stats in cores:
            if isinstance(hist := stats.get("step_time_histogram"), dict):
                longest.add_metric([core], hist["max_s"])
            if isinstance(gc_pauses := stats.get("gc_pause_seconds_total"), list):
                for g, seconds in enumerate(gc_pauses):
                    pauses.add_metric([core, str(g)], seconds)
        yield from (f for f in (longest, pauses) if f.samples)

    def describe(self):
        return []


class ServerMetrics:
    """The metrics of one app.

    requests_total{endpoint, status}; time_to_first_audio_seconds and request_latency_seconds histograms
    {endpoint}; audio_seconds_total; real_time_factor histogram (wall seconds / audio seconds, < 1 is faster
    than real time); plus the engine gauges/counters above, and vLLM's names for the same (vllm_metrics.py)
    with model_name: the served model's name.
    """

    def __init__(self, engine_stats: Callable[[], dict], model_name: str = "chattts") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "ttsserve_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.ttfa = Histogram(
            "ttsserve_time_to_first_audio_seconds",
            "Time from request to first audio bytes",
            ["endpoint"],
            buckets=_TTFA_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "ttsserve_request_latency_seconds",
            "Time from request to the last audio byte",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.audio_seconds = Counter("ttsserve_audio_seconds", "Seconds of audio produced", registry=r)
        self.rtf = Histogram(
            "ttsserve_real_time_factor",
            "Wall time / audio duration of finished syntheses",
            buckets=_RTF_BUCKETS,
            registry=r,
        )
        self.aborted = Counter(
            "ttsserve_requests_aborted", "Syntheses aborted because the client went away", registry=r
        )
        self.vllm = VllmRequestMetrics(r, model_name)
        self._engine = _EngineCollector(engine_stats)
        self._vllm_engine = VllmEngineCollector(engine_stats, model_name)
        r.register(self._engine)
        r.register(self._vllm_engine)

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_synthesis(
        self, endpoint: str, ttfa_s: float | None, total_s: float, audio_s: float, finish_reason: str | None
    ) -> None:
        if ttfa_s is not None:
            self.ttfa.labels(endpoint=endpoint).observe(ttfa_s)
        self.vllm.observe(ttfa_s, total_s, finish_reason)
        if finish_reason == "abort":
            self.aborted.inc()
        self.audio_seconds.inc(max(0.0, audio_s))
        if finish_reason in ("stop", "length"):
            self.latency.labels(endpoint=endpoint).observe(total_s)
            if audio_s > 0:
                self.rtf.observe(total_s / audio_s)

    def render(self) -> bytes:
        if _MULTIPROC_DIR:  # every API server's files, summed; this process's own objects would repeat them
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry, _MULTIPROC_DIR)
            registry.register(self._engine)
            registry.register(self._vllm_engine)
            return generate_latest(registry)
        return generate_latest(self.registry)
