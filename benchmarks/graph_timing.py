"""One CUDA graph of `reps` back-to-back calls of a function, as the engine replays its decode layers: what the
small-batch kernel benchmarks (small_batch_fusion.py, small_m_gemv.py) time, each with its own clock."""

from __future__ import annotations

import torch


def capture_reps(fn, reps: int) -> torch.cuda.CUDAGraph:
    """fn() once eagerly (compiles, warms), then reps calls of it captured in one graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph
