"""CUDA graphs captured after the engine is ready, one bucket at a time, between served steps.

Capturing every bucket up front (39 decode batch sizes, 15 prefill token buckets x 21 pieces, 7 sampler row
buckets, 40 vocoder buckets) took 18 s of a 40-s start on an H200 (the vocoder's 40 alone 9.3 s: each bucket
runs its call eagerly once before its capture). With `background_graph_capture` the runner and the audio
stage capture only each family's largest bucket (the runner's: and smallest) before the engine is ready, so
every batch already has a graph (the smallest captured bucket that holds it: more padding rows, the same rows'
math), and this driver takes the others afterwards, largest first, on the engine's own thread: the engine-core
loop calls run_one() between steps (engine/core/engine_core.py), never beside a step.

Each capture synchronizes the device first (a pipelined step in flight finishes; its results stay where the
next step reads them) and writes only the graphs' static buffers and scratch rows / slots, which no request
owns. Idle, a unit runs on every turn of the loop; busy, the units take at most BUSY_SHARE of the loop's
time, so a loaded server finishes later rather than stalling its streams.

Pure Python: the families are any objects with `num_pending` and `capture_next()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

logger = logging.getLogger("ttsserve.engine.engine")

BUSY_SHARE = 0.1  # at most this share of a busy engine's time goes to deferred captures


class GraphFamily(Protocol):
    num_pending: int

    def capture_next(self) -> None: ...


class DeferredCapture:
    """The graph families' pending buckets, captured one per run_one() (see the module docstring)."""

    def __init__(
        self,
        families: Sequence[GraphFamily],
        sync: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.perf_counter,
        busy_share: float = BUSY_SHARE,
    ) -> None:
        """sync: waits for the device's queued work (torch.cuda.synchronize) before each capture."""
        self.families = list(families)
        self.sync, self.clock, self.busy_share = sync, clock, busy_share
        self.captured = 0  # buckets captured here
        self.capture_s = 0.0  # the engine thread's time in those captures
        self.failed: list[str] = []  # families given up after a failed capture (their buckets stay uncaptured)
        self._started = clock()
        self._busy_after = 0.0  # busy, the next unit waits until then
        self._done_logged = False

    @property
    def num_pending(self) -> int:
        return sum(f.num_pending for f in self.families)

    def due(self, busy: bool) -> bool:
        """A unit may run now: one is pending and, if the engine is busy, the last one's share of time has passed."""
        return self.num_pending > 0 and (not busy or self.clock() >= self._busy_after)

    def run_one(self, busy: bool = False) -> bool:
        """Capture the next pending bucket if due (busy: the engine has requests) -> whether one was captured.
        A family whose capture raises is logged and given up: its uncaptured buckets keep replaying larger ones."""
        if not self.due(busy):
            return False
        family = next(f for f in self.families if f.num_pending > 0)
        t0 = self.clock()
        try:
            self.sync()
            family.capture_next()
        except Exception:  # noqa: BLE001 - serving goes on with the graphs already captured
            name = type(family).__name__
            logger.exception("capturing a deferred %s bucket failed: its other buckets stay uncaptured", name)
            self.families.remove(family)
            self.failed.append(name)
            return False
        dt = self.clock() - t0
        logger.debug("deferred capture of a %s bucket: %.3f s", type(family).__name__, dt)
        self.captured += 1
        self.capture_s += dt
        self._busy_after = self.clock() + dt * (1 - self.busy_share) / self.busy_share
        if not self.num_pending and not self._done_logged:
            self._done_logged = True
            logger.info(
                "captured %d deferred CUDA graph buckets in %.1f s of engine time, done %.1f s after the engine "
                "was built",
                self.captured,
                self.capture_s,
                self.clock() - self._started,
            )
        return True

    def run_all(self, timeout: float | None = None) -> bool:
        """Capture every pending bucket now (the caller owns the engine's thread and has no step to run) ->
        whether none is left. timeout: seconds at most (None: no limit)."""
        deadline = None if timeout is None else self.clock() + timeout
        while self.num_pending and (deadline is None or self.clock() < deadline):
            self.run_one(busy=False)
        return not self.num_pending
