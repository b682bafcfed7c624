"""Capturing a CUDA graph the way torch.cuda.graph does, minus its cache flushes.

torch.cuda.graph empties the caching allocator's device cache and its pinned host cache before every capture.
The engine captures some graphs after it reports ready, between served steps (engine/deferred_capture.py):
there an emptied device cache makes the next steps allocate again (cudaMalloc / cudaFree synchronize), and an
emptied pinned cache makes every staged host-to-device copy allocate pinned memory again, which the engine's
warm-up grew to a full batch's size on purpose (engine/warm_up.py). The memory profile reserves room for the
graph pools beside the cached activations (runner/profile.py), so nothing needs flushing to fit.

Captures of one process are serial (one engine thread captures); one side stream serves them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_capture_stream: torch.cuda.Stream | None = None


def capture(graph: torch.cuda.CUDAGraph, body: Callable[[], Any], pool=None) -> Any:
    """Capture body() into `graph` on the side stream, allocating from memory pool `pool` (None: a new pool;
    graph.pool() names it afterwards); returns what body() returned (tensors allocated in the pool).

    The device is synchronized first, as torch.cuda.graph does: work queued before (a pipelined step in
    flight) has finished, so it neither overlaps the capture nor still reads buffers the body rewrites."""
    global _capture_stream
    if _capture_stream is None:
        _capture_stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(_capture_stream):
        graph.capture_begin(pool=pool)
        try:
            return body()
        finally:
            graph.capture_end()
