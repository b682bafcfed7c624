"""Counting a code path's Python work without timing it: the calls made inside `counting_calls()` (sys.setprofile
sees Python calls, generator resumptions and C calls made from bytecode; C-level maps over C functions stay one
call), with the garbage collector paused so a collection's callbacks are not counted."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class CallCount:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self, frame, event, arg) -> None:
        if event in ("call", "c_call"):
            self.count += 1


@contextmanager
def counting_calls() -> Iterator[CallCount]:
    calls = CallCount()
    gc.disable()
    sys.setprofile(calls)
    try:
        yield calls
    finally:
        sys.setprofile(None)
        gc.enable()
