"""Dynamic batching: the user sets a step-latency goal, the engine picks how many sequences it admits.

Rule. Each step reports (batch size b, step time t). The controller keeps an exponentially weighted
least-squares fit t ~ fixed + per_seq * b over recent steps (old steps fade with factor 0.95), and sets
the admission limit to the largest b whose predicted step time meets the target:
    limit = floor((target - fixed) / per_seq), clamped to [1, max_num_seqs].
Until the fit has seen two different batch sizes it grows the limit multiplicatively from a small start
(doubling while under the target), so a burst of arrivals does not all enter at once. The limit only
gates admission: running streams are never preempted for it, so a stream that started keeps its pace and
new requests wait in the queue instead of slowing everyone down. A step at the target latency produces one
frame (21.3 ms of audio) per running stream, so a target below ~21 ms keeps every stream above real time.
"""

from __future__ import annotations

INITIAL_LIMIT = 8
DECAY = 0.95


class BatchSizeController:
    def __init__(self, target_step_latency_ms: float, max_num_seqs: int) -> None:
        self.target = target_step_latency_ms
        self.max_num_seqs = max_num_seqs
        self.reset()

    def reset(self) -> None:
        """Forget every observed step: the limit starts over from INITIAL_LIMIT."""
        self.limit = min(INITIAL_LIMIT, self.max_num_seqs) if self.enabled else self.max_num_seqs
        # Weighted sums for the least-squares fit of t = fixed + per_seq * b.
        self._w = self._sb = self._st = self._sbb = self._sbt = 0.0

    @property
    def enabled(self) -> bool:
        return self.target > 0

    def observe(self, batch_size: int, step_ms: float) -> None:
        if not self.enabled or batch_size <= 0:
            return
        d = DECAY
        self._w = d * self._w + 1.0
        self._sb = d * self._sb + batch_size
        self._st = d * self._st + step_ms
        self._sbb = d * self._sbb + batch_size * batch_size
        self._sbt = d * self._sbt + batch_size * step_ms
        fit = self.fit()
        if fit is None:  # one batch size seen so far: probe upwards while under the target
            if step_ms < self.target and batch_size >= self.limit:
                self.limit = min(self.max_num_seqs, self.limit * 2)
            elif step_ms > self.target:
                self.limit = max(1, self.limit // 2)
            return
        fixed, per_seq = fit
        best = int((self.target - fixed) / per_seq) if per_seq > 1e-9 else self.max_num_seqs
        # Grow at most by doubling per step, so an optimistic fit is re-checked before it is trusted.
        self.limit = max(1, min(self.max_num_seqs, best, 2 * max(self.limit, batch_size)))

    def fit(self) -> tuple[float, float] | None:
        """(fixed ms, ms per sequence), or None until two different batch sizes were observed."""
        var = self._w * self._sbb - self._sb * self._sb
        if var <= 1e-6 * max(1.0, self._w * self._sbb):
            return None
        per_seq = (self._w * self._sbt - self._sb * self._st) / var
        fixed = (self._st - per_seq * self._sb) / self._w
        return fixed, max(per_seq, 0.0)
