"""The engine's own counters and host time per step phase (Engine.stats() reports them)."""

from __future__ import annotations

import bisect
import gc
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("ttsserve.engine.engine")

# Upper bounds (s) of the step-time histogram: a served H200 step is ~10 ms; a tail of first audio comes from
# steps far beyond it (a large prefill, many final vocoder calls, a stalled host), which the mean hides.
STEP_TIME_BUCKETS_S = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)
# vLLM's request-latency layout (its e2e and queue-time histograms), so its dashboards' quantiles read the same.
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
# ... and of the engine's time to first audio (add_synthesis -> the first output with samples): 25-ms steps
# around the H200's ~0.2 s, so its p99 can be told from the API servers' and the clients'.
FIRST_AUDIO_BUCKETS_S = (
    0.05,
    0.1,
    0.125,
    0.15,
    0.175,
    0.2,
    0.225,
    0.25,
    0.275,
    0.3,
    0.35,
    0.4,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
    10.0,
)
# A slow step: over SLOW_STEP_FACTOR x the moving average and SLOW_STEP_MIN_MS; one in SLOW_STEP_LOG_INTERVAL_S
# is logged with what it held (a stalled step delays the first audio of every stream in flight).
SLOW_STEP_FACTOR, SLOW_STEP_MIN_MS, SLOW_STEP_LOG_INTERVAL_S = 4.0, 20.0, 10.0
# The log names the objects a full GC pass walks only after a pause this long: counting them walks them too
# (~50 ms a count under py-spy for 215,000 objects on an H100 host, inside the step being logged), and a
# young-generation pass of ~1 ms is not the pause that grows with uptime.
GC_WALK_MIN_MS = 10.0


@dataclass
class StepTimings:
    """Host wall time per phase of step(), summed over steps (ms): where the Python time goes."""

    schedule_ms: float = 0.0
    runner_ms: float = 0.0  # ModelRunner.execute: input prep + graph replay / forward + the token sync
    update_ms: float = 0.0  # Scheduler.update_from_output
    audio_append_ms: float = 0.0  # hidden states into the audio stage + per-synthesis frame counts
    finish_ms: float = 0.0  # finished sequences (refine -> code hand-off, audio finish)
    audio_step_ms: float = 0.0  # plan + queue the vocoder, collect the previous step's audio
    outputs_ms: float = 0.0  # per-synthesis trackers -> AudioOutputs

    def as_dict(self, steps: int) -> dict[str, float]:
        n = max(steps, 1)
        return {k: v / n for k, v in self.__dict__.items()}


@dataclass
class Histogram:
    """Fixed-bucket histogram of seconds; counts per bucket, not cumulative (one more than bounds: the last
    counts what is above every bound)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum_s: float = 0.0
    max_s: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1  # a bound is inclusive, as Prometheus' le
        self.sum_s += seconds
        self.max_s = max(self.max_s, seconds)

    def as_dict(self) -> dict:
        return {"le_s": list(self.bounds), "counts": list(self.counts), "sum_s": self.sum_s, "max_s": self.max_s}


@dataclass
class EngineCounters:
    steps: int = 0
    frames: int = 0
    tokens_scheduled: int = 0
    preemptions: int = 0
    swaps: int = 0
    step_time_ms_ema: float = 0.0
    last_batch_size: int = 0
    step_times: Histogram = field(default_factory=lambda: Histogram(STEP_TIME_BUCKETS_S))
    first_audio: Histogram = field(default_factory=lambda: Histogram(FIRST_AUDIO_BUCKETS_S))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS_S))
    slow_steps: int = 0
    slow_step_logged_at: float = float("-inf")

    def observe_step(
        self,
        ms: float,
        phases_s: dict[str, float],
        rows: int,
        tokens: int,
        gc_ms: float,
        vocoder: tuple[int, int] = (0, 0),
        compile_ms: float = 0.0,
    ) -> None:
        """One step's wall time (ms) with its phases (s), rows, scheduled tokens, the GC pause inside it (ms),
        its vocoder work (calls queued, frames they decode) and the Triton compiles inside it (ms)."""
        self.steps += 1
        self.tokens_scheduled += tokens
        self.last_batch_size = rows
        ema = self.step_time_ms_ema
        self.step_time_ms_ema = ms if self.steps == 1 else 0.9 * ema + 0.1 * ms
        self.step_times.observe(ms / 1e3)
        if self.steps > 20 and ms > max(SLOW_STEP_MIN_MS, SLOW_STEP_FACTOR * ema):
            self.slow_steps += 1
            now = time.monotonic()
            # a step that waited for a Triton compile is always named (compiles while serving are rare and each
            # is actionable); other slow steps once per interval at most
            if compile_ms > 0 or now - self.slow_step_logged_at >= SLOW_STEP_LOG_INTERVAL_S:
                self.slow_step_logged_at = now
                where = ", ".join(f"{k.removesuffix('_ms')} {v * 1e3:.1f}" for k, v in phases_s.items())
                # what a full pass walks (O(objects), once per interval at most): long-lived tracked objects
                # the start-up freeze did not cover are what makes such a pause grow with uptime
                gen2 = f", {len(gc.get_objects(2))} objects in generation 2" if gc_ms >= GC_WALK_MIN_MS else ""
                logger.info(
                    "slow engine step: %.1f ms against %.1f on average (%s ms; %d rows, %d tokens; "
                    "vocoder %d calls, %d frames; GC %.1f ms%s%s; %d slow steps so far)",
                    ms,
                    ema,
                    where,
                    rows,
                    tokens,
                    *vocoder,
                    gc_ms,
                    gen2,
                    f"; Triton compiles {compile_ms:.1f} ms" if compile_ms > 0 else "",
                    self.slow_steps,
                )


class GcPauses:
    """This process's garbage-collector pauses per generation (seconds and passes), from gc.callbacks. One per
    process (`gc_pauses()`): the collector is process-wide, so every engine of the process reads the same."""

    def __init__(self) -> None:
        self.seconds, self.counts = [0.0, 0.0, 0.0], [0, 0, 0]
        self._started = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        g = info["generation"]
        self.seconds[g] += time.perf_counter() - self._started
        self.counts[g] += 1

    def total_s(self) -> float:
        return self.seconds[0] + self.seconds[1] + self.seconds[2]


_GC_PAUSES: GcPauses | None = None


def gc_pauses() -> GcPauses:
    global _GC_PAUSES
    if _GC_PAUSES is None:
        _GC_PAUSES = GcPauses()
        gc.callbacks.append(_GC_PAUSES._on_gc)
    return _GC_PAUSES


def engine_stats(engine) -> dict:
    """The Engine's counters and gauges as one dict (Engine.stats(): the API servers' /metrics and the logs)."""
    s, c, rt = engine.scheduler, engine.counters, engine.runner.timings
    return {
        "num_running": s.num_running,
        "num_waiting": s.num_waiting,
        "num_swapped": s.num_swapped,
        "num_syntheses": engine.num_syntheses,
        "kv_cache_usage": engine.kv_manager.usage,
        "num_free_blocks": engine.kv_manager.num_free_blocks,
        "num_blocks": engine.kv_spec.num_blocks,
        "num_preemptions_total": c.preemptions,
        "num_swaps_total": c.swaps,
        "steps_total": c.steps,
        "frames_total": c.frames,
        "step_time_ms_ema": c.step_time_ms_ema,
        "step_time_histogram": c.step_times.as_dict(),
        "first_audio_histogram": c.first_audio.as_dict(),
        "queue_time_histogram": c.queue_time.as_dict(),
        "audio_collects_total": engine.audio.collects_total,
        "audio_polled_total": engine.audio.polled_total,
        "slow_steps_total": c.slow_steps,
        "gc_pause_seconds_total": list(engine._gc.seconds),
        "gc_collections_total": list(engine._gc.counts),
        "kernel_compiles_while_serving_total": engine._compiles.while_serving,
        "batch_size_limit": engine.controller.limit,
        "last_batch_size": c.last_batch_size,
        "cuda_graphs": engine.runner.graphs is not None,
        "graph_steps_total": rt.graph_steps,
        "mixed_graph_steps_total": rt.mixed_graph_steps,
        "prefill_graph_steps_total": rt.prefill_graph_steps,
        "sampler_graph_steps_total": rt.sampler_graph_steps,
        "step_breakdown_ms": engine.timings.as_dict(c.steps),
        "runner_breakdown_ms": rt.per_step(),
        "async_scheduling": engine.pipelined,
        "cuda_graphs_pending": engine.graphs_pending,
        "warm": engine.wait_warm(0),
    }
