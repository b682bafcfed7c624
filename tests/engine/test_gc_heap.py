"""engine/core/heap.py: freezing the start-up heap takes what is alive out of the GC's generations."""

from __future__ import annotations

import gc

from ttsserve.engine.core.heap import freeze_startup_heap


class _Node:
    pass


def test_freeze_moves_live_objects_out_of_the_collected_generations(monkeypatch):
    import ttsserve.engine.core.heap as heap

    monkeypatch.setattr(heap, "_froze_this_process", False)  # restored after: later engines must not freeze
    node = _Node()
    node.self = node  # a live cycle: what only the cyclic GC would ever look at
    assert any(o is node for o in gc.get_objects())
    before = gc.get_freeze_count()
    try:
        frozen = freeze_startup_heap("test")
        assert frozen > before and gc.get_freeze_count() > before  # not equal: other threads free objects meanwhile
        assert not any(o is node for o in gc.get_objects())  # full collections no longer walk it
        late = _Node()
        late.self = late
        assert any(o is late for o in gc.get_objects())  # objects made afterwards are collected as usual
    finally:
        gc.unfreeze()
    assert any(o is node for o in gc.get_objects()) and heap._froze_this_process


class _Warming:
    """An engine whose background start-up work (the CPU compile) finishes when the test says."""

    def __init__(self) -> None:
        self.warm = False

    def wait_warm(self, timeout=None) -> bool:
        return self.warm


def test_freeze_when_warm_freezes_what_the_background_work_built(monkeypatch):
    import ttsserve.engine.core.heap as heap

    eng = _Warming()
    freeze = heap.FreezeWhenWarm(eng, "test")
    assert freeze.pending
    monkeypatch.setattr(heap, "_froze_this_process", True)  # as a serving process after freeze_startup_heap
    try:
        freeze.check()  # still compiling: nothing happens
        built = _Node()  # what the compile leaves behind, alive for good
        built.self = built
        assert any(o is built for o in gc.get_objects())
        eng.warm = True
        freeze.check()
        assert not freeze.pending and not any(o is built for o in gc.get_objects())
        freeze.check()  # once
    finally:
        gc.unfreeze()


def test_freeze_when_warm_does_nothing_where_nothing_was_frozen_or_pending(monkeypatch):
    import ttsserve.engine.core.heap as heap

    monkeypatch.setattr(heap, "_froze_this_process", False)  # a test process: its engines come and go
    eng = _Warming()
    freeze = heap.FreezeWhenWarm(eng, "test")
    eng.warm = True
    before = gc.get_freeze_count()
    freeze.check()
    assert gc.get_freeze_count() == before == 0 and not freeze.pending
    assert not heap.FreezeWhenWarm(eng, "test").pending  # warm from the start (CUDA): nothing to wait for


def test_frozen_heap_is_undone_on_exit():
    """bench offline's frozen heap: what is alive is out of the collected generations, with the step loop's
    thresholds, for the rounds only; then both are as before (a later engine of the process is not frozen)."""
    from ttsserve.engine.core.heap import STEP_LOOP_GC_THRESHOLDS, frozen_heap

    node = _Node()
    node.self = node
    thresholds = gc.get_threshold()
    assert thresholds != STEP_LOOP_GC_THRESHOLDS
    with frozen_heap() as frozen:
        assert frozen > 0 and gc.get_threshold() == STEP_LOOP_GC_THRESHOLDS
        assert not any(o is node for o in gc.get_objects())
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
    assert any(o is node for o in gc.get_objects())
