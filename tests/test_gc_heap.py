"""engine/core/heap.py: freezing the start-up heap takes what is alive out of the GC's generations."""

from __future__ import annotations

import gc

from ttsserve.engine.core.heap import freeze_startup_heap


class _Node:
    pass


def test_freeze_moves_live_objects_out_of_the_collected_generations():
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
    assert any(o is node for o in gc.get_objects())
