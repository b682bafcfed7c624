"""The garbage collector in the serving processes: freeze what start-up built.

A full (generation-2) collection walks every tracked object. After start-up a serving process holds hundreds
of thousands of them (the model's modules and tensors, CUDA graphs, FastAPI / pydantic machinery) that live
as long as the process, so each full collection is a pause of the whole loop: 106 ms with 180k objects in an
engine on the CPU machine (`python benchmarks/gc_pause.py`), i.e. every running stream stalls for ~25 steps.
`gc.freeze()` moves them to the permanent generation, which collections skip (3.6 ms there), as vLLM's
processes do after start-up. Only processes that own their heap call this (the CLI's server process, the
engine core, each API server): frozen objects that later become cyclic garbage are never collected, which
a long-lived server's start-up objects do not become, but a test process that builds many engines would.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)
_froze_this_process = False


# The engine's step loop keeps thousands of new GC-tracked objects a step alive past it (a frame tuple per row and
# frame, appended to its sequence's outputs; 3.4k a step at 512 streams on the CPU), so the young generation fills
# ~5 times a step. A young pass is cheap and untracks the frame tuples, but Python's default makes every 10th
# pass a generation-1 pass and every 10th of those a full one (a 10 ms pause there). A process that runs the step
# loop makes those 5x rarer: GC time 0.97 -> 0.54 ms a step, no full pass in 300 steps against 12 of ~10 ms
# (benchmarks/core_loop_cost.py --served --concurrency 512 --gc-thresholds 700,10,10; 2 shared CPU cores).
STEP_LOOP_GC_THRESHOLDS = (700, 50, 50)


def freeze_startup_heap(process: str, step_loop: bool = False) -> int:
    """Collect once, then freeze every object alive now (they leave the GC's generations). step_loop: this
    process runs the engine's step loop (STEP_LOOP_GC_THRESHOLDS). Returns how many objects are frozen in all."""
    global _froze_this_process
    _froze_this_process = True
    frozen = _freeze(step_loop)
    logger.info("%s: %d start-up objects frozen (full GC passes skip them)", process, frozen)
    return frozen


def _freeze(step_loop: bool) -> int:
    gc.collect()
    gc.freeze()
    if step_loop:
        gc.set_threshold(*STEP_LOOP_GC_THRESHOLDS)
    return gc.get_freeze_count()


@contextmanager
def frozen_heap() -> Iterator[int]:
    """The step loop's heap (freeze_startup_heap with step_loop) for a while, in a process that does more than
    serve (`bench offline` runs an engine, then may build another): undone on exit, the frozen objects back in
    the generations and the thresholds restored. Yields how many objects are frozen."""
    thresholds = gc.get_threshold()
    try:
        yield _freeze(step_loop=True)
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


class FreezeWhenWarm:
    """Freezes again once the engine's background start-up work is done, if it had any (the CPU server
    compiles after /ready and leaves ~320k long-lived objects: full passes over them took 90-340 ms, one
    stalled a served step for 305 ms, and every later pass walks them again) and this process froze its
    start-up heap (never in a test process). check() after each step; cheap once done."""

    def __init__(self, engine, process: str) -> None:
        self.engine, self.process = engine, process
        self.pending = not engine.wait_warm(0)

    def check(self) -> None:
        if self.pending and self.engine.wait_warm(0):
            self.pending = False
            if _froze_this_process:
                freeze_startup_heap(f"{self.process}, after the background start-up work")
