"""The engine's own counters and host time per step phase (Engine.stats() reports them)."""

from __future__ import annotations

from dataclasses import dataclass


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
