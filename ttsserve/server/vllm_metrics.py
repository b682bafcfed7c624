"""vLLM's metric names, types, `model_name` label and bucket layouts, beside the ttsserve_* ones, so dashboards
and alerts written for vLLM read a TTS server. Mapping (docs/DEPLOY.md, "Metrics"):

    vllm:num_requests_running        gauge      sequences in the running batch (= ttsserve_num_requests_running)
    vllm:num_requests_waiting        gauge      sequences waiting for admission
    vllm:kv_cache_usage_perc         gauge      fraction of KV blocks in use, 0..1 (as vLLM's, despite the name)
    vllm:request_queue_time_seconds  histogram  a synthesis' arrival at the engine -> its first scheduled step
    vllm:time_to_first_token_seconds histogram  request -> first audio bytes (the first "token" a listener gets)
    vllm:e2e_request_latency_seconds histogram  request -> its last audio byte, every finished synthesis
    vllm:request_success_total       counter    syntheses by finished_reason (stop, length, abort, timeout, ...)

The engine gauges and the queue-time histogram are read from engine.stats() at scrape time (once, even with N
API servers: the engine core is shared); the others are prometheus_client objects, file-backed and summed over
API servers in multiprocess mode like the ttsserve_* ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from ttsserve.engine.step_stats import REQUEST_LATENCY_BUCKETS_S

# vLLM's time-to-first-token layout.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
LABEL = "model_name"
CORE = "core"  # the engine-core label: "0".."N-1" with data-parallel cores, "0" otherwise


def scrape_cores(stats: Callable[[], dict]) -> list[tuple[str, dict]]:
    """(core label, that core's stats) from engine.stats(): a data-parallel client's stats["cores"], else the
    one core "0"; nothing while the engine cannot say (a scrape must not fail while it starts or stops)."""
    try:
        snapshot = stats() or {}
    except Exception:
        return []
    cores = snapshot.get("cores")
    return list(cores.items()) if isinstance(cores, dict) else [("0", snapshot)]


_GAUGES = {
    "num_running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
    "num_waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
}


class VllmEngineCollector:
    """The engine's side of vLLM's metrics, read from engine.stats() on every scrape."""

    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self):
        cores = scrape_cores(self._stats)
        for key, (name, help_) in _GAUGES.items():
            family = GaugeMetricFamily(name, help_, labels=[LABEL, CORE])
            for core, s in cores:
                if isinstance(s.get(key), (int, float)):
                    family.add_metric([self._model, core], float(s[key]))
            if family.samples:
                yield family
        family = HistogramMetricFamily(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels=[LABEL, CORE],
        )
        for core, s in cores:
            hist = s.get("queue_time_histogram")
            if isinstance(hist, dict):
                bounds = [str(b) for b in hist["le_s"]] + ["+Inf"]
                buckets = list(zip(bounds, itertools.accumulate(hist["counts"])))
                family.add_metric([self._model, core], buckets, sum_value=hist["sum_s"])
        if family.samples:
            yield family

    def describe(self):
        return []


class VllmRequestMetrics:
    """The API servers' side: per-request latencies and outcomes."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._model = model_name
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (here: to the first audio bytes).",
            [LABEL],
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            [LABEL],
            buckets=REQUEST_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of finished requests by finished_reason.",
            [LABEL, "finished_reason"],
            registry=registry,
        )

    def observe(self, ttfa_s: float | None, total_s: float, finish_reason: str | None) -> None:
        if ttfa_s is not None:
            self.ttft.labels(self._model).observe(ttfa_s)
        self.e2e.labels(self._model).observe(total_s)
        self.success.labels(self._model, finish_reason or "error").inc()
