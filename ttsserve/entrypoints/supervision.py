"""The launcher's bookkeeping for the processes it supervises: restart backoff and the core-death budget."""

from __future__ import annotations

from collections import deque


class RestartBackoff:
    """The delay before restarting a process that died: `first` s, doubling to `cap` s over crashes in a row,
    and back to `first` once the process had run `healthy_s` s (a crash after a long healthy run is not part
    of a crash loop)."""

    def __init__(self, first: float = 1.0, cap: float = 30.0, healthy_s: float = 60.0) -> None:
        self.first, self.cap, self.healthy_s = first, cap, healthy_s
        self.delay = first
        self.started_at: float | None = None

    def started(self, now: float) -> None:
        self.started_at = now

    def next_delay(self, now: float) -> float:
        """The delay for a restart now (the process just died); the one after it doubles."""
        if self.started_at is not None and now - self.started_at >= self.healthy_s:
            self.delay = self.first
        delay, self.delay = self.delay, min(self.delay * 2, self.cap)
        return delay


class DeathBudget:
    """At most `limit` deaths within `window_s` seconds; the one more says stop (the launcher exits non-zero
    so an orchestrator sees a core that cannot stay up)."""

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit, self.window_s = limit, window_s
        self.deaths: deque[float] = deque()

    def record(self, now: float) -> bool:
        """Count a death at `now`; True while within the budget."""
        self.deaths.append(now)
        while self.deaths and self.deaths[0] < now - self.window_s:
            self.deaths.popleft()
        return len(self.deaths) <= self.limit
