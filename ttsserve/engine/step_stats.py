"""The engine's own counters and host time per step phase (Engine.stats() reports them)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Upper bounds (ms) of the step-time histogram: a served H200 step is ~10 ms; a tail of first audio comes from
# steps far beyond it (a large prefill, many final vocoder calls, a stalled host), which the mean hides.
STEP_TIME_BUCKETS_MS = (5.0, 10.0, 15.0, 20.0, 30.0, 50.0, 100.0, 250.0, 1000.0)


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
class EngineCounters:
    steps: int = 0
    frames: int = 0
    tokens_scheduled: int = 0
    preemptions: int = 0
    swaps: int = 0
    step_time_ms_ema: float = 0.0
    last_batch_size: int = 0
    step_time_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_TIME_BUCKETS_MS) + 1))
    step_time_ms_sum: float = 0.0
    step_time_ms_max: float = 0.0

    def observe_step(self, ms: float) -> None:
        self.step_time_counts[bisect.bisect_left(STEP_TIME_BUCKETS_MS, ms)] += 1
        self.step_time_ms_sum += ms
        self.step_time_ms_max = max(self.step_time_ms_max, ms)

    def step_time_histogram(self) -> dict:
        """{"le_ms": the finite upper bounds, "counts": steps per bucket, not cumulative (one more than le_ms:
        the last counts the steps above every bound), "sum_ms", "max_ms"}."""
        return {"le_ms": list(STEP_TIME_BUCKETS_MS), "counts": list(self.step_time_counts),
                "sum_ms": self.step_time_ms_sum, "max_ms": self.step_time_ms_max}
