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

logger = logging.getLogger(__name__)


def freeze_startup_heap(process: str) -> int:
    """Collect once, then freeze every object alive now (they leave the GC's generations). Returns how many
    objects are frozen in all."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d start-up objects frozen (full GC passes skip them)", process, frozen)
    return frozen
