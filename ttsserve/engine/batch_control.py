"""Dynamic batching: the user sets a step-latency goal, the engine picks how many sequences run per step.

Rule (additive increase, multiplicative decrease on a smoothed latency): every step reports (batch size,
step time). While the smoothed step time is below the target the limit grows by 1 per step that used the
whole limit; when it exceeds the target, the limit shrinks to the batch size that the measured cost per
sequence predicts for the target (at least 1). Streams then stay above real time (a step at the target
latency produces one frame of 21.3 ms per stream) instead of all slowing down together.
"""

from __future__ import annotations


class BatchSizeController:
    def __init__(self, target_step_latency_ms: float, max_num_seqs: int) -> None:
        self.target = target_step_latency_ms
        self.max_num_seqs = max_num_seqs
        self.limit = max_num_seqs
        self.ema_ms: float | None = None

    def observe(self, batch_size: int, step_ms: float) -> None:
        if self.target <= 0 or batch_size <= 0:
            return
        self.ema_ms = step_ms if self.ema_ms is None else 0.8 * self.ema_ms + 0.2 * step_ms
        if self.ema_ms > self.target:
            per_seq = self.ema_ms / batch_size
            self.limit = max(1, min(self.limit - 1, int(self.target / per_seq)))
            self.ema_ms = None  # re-measure at the new size
        elif batch_size >= self.limit:
            self.limit = min(self.max_num_seqs, self.limit + 1)
