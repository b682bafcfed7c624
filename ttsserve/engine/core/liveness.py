"""Liveness: whether an engine front can reach a serving engine now, the rule both EngineClients share.

An engine is dead while it is gone (`lost`: a dead thread or core process, until a new one answers) or stalled:
no sign of its loop (`sign()`: a loop turn, a message from the core) for `stall_timeout_s`, once watching
started. The loop turns every 50 ms idle and once per step busy, so silence means it is stuck (a hung step, a
SIGSTOP), whether or not work is pending.
"""

from __future__ import annotations

import time


class Liveness:
    def __init__(self, stall_timeout_s: float, silence: str) -> None:
        """silence: how a stall reads, e.g. "its step loop has not turned"; " in N s" is appended."""
        self.stall_timeout_s = stall_timeout_s
        self.silence = silence
        self.lost: str | None = None
        self.watching = False  # set once the engine is started (a front not yet started is not stalled)
        self.last_sign = time.monotonic()

    def sign(self) -> None:
        self.last_sign = time.monotonic()

    @property
    def dead_reason(self) -> str | None:
        if self.lost is not None:
            return self.lost
        silent = time.monotonic() - self.last_sign
        if self.watching and silent > self.stall_timeout_s:
            return f"{self.silence} in {silent:.0f} s"
        return None

    @property
    def stalled(self) -> bool:
        return self.lost is None and self.dead_reason is not None


class LivenessReport:
    """The EngineClient's dead / dead_reason / stalled, read from the client's `liveness`."""

    liveness: Liveness

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve now (gone, or stalled); None while it can."""
        return self.liveness.dead_reason

    @property
    def dead(self) -> bool:
        return self.liveness.dead_reason is not None

    @property
    def stalled(self) -> bool:
        return self.liveness.stalled
