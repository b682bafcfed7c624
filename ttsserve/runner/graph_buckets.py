"""The bucket bookkeeping of the runner's CUDA graph families (decode, piecewise prefill, sampler): which
buckets are captured, which are left for later (largest first), and the smallest captured bucket for a size.

A family captures every bucket at once, or with defer only its largest and smallest and the rest one per
capture_next() (the engine's deferred captures, engine/deferred_capture.py); a size whose own bucket is not captured yet
replays the smallest captured one above it, which is always there (the largest is captured first).
"""

from __future__ import annotations

import bisect


class BucketedGraphs:
    """The bucket bookkeeping the runner's graph families share. `sizes` ascending; `graphs` maps each captured
    size to its graph (None off CUDA, where the body runs eagerly); `pending` holds the sizes capture_next()
    takes, largest first. Subclasses implement capture(defer), _capture_bucket(size) and _or_uncompiled(fn,
    what) (runner/cuda_graphs.or_uncompiled), and may override _stale()."""

    sizes: list[int]
    graphs: dict

    def _init_buckets(self, sizes: list[int]) -> None:
        self.sizes = sorted(set(sizes))
        self.graphs = {}
        self.pool = None
        self.pending: list[int] = []
        self.deferred = False  # the last capture() deferred all but the largest bucket
        self._captured: list[int] = []  # sorted

    def _reset_buckets(self, defer: bool) -> list[int]:
        """Forget every graph -> the sizes to capture now, largest first (defer: the largest and the smallest;
        the rest become pending). The smallest too, because its kernels may be variants of their own (the
        decode attention splits its context below ~44 rows; the sampler's one row): compiled in a deferred
        capture, a fresh cache's compile (0.4-1.9 s on an H100) stalled the served steps around it."""
        self.graphs.clear()
        self.pool = None
        self._captured = []
        self.deferred = defer
        now = self.sizes[::-1] if not defer else sorted({self.sizes[-1], self.sizes[0]}, reverse=True)
        self.pending = self.sizes[-2:0:-1] if defer else []
        return now

    def _add_graph(self, size: int, graph) -> None:
        self.graphs[size] = graph
        bisect.insort(self._captured, size)

    def bucket(self, n: int) -> int:
        """The smallest captured size >= n (n at most the largest size, which is always captured)."""
        return self._captured[bisect.bisect_left(self._captured, n)]

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    def capture_next(self) -> None:
        """Capture the largest pending bucket. Safe between engine steps with a step in flight: each bucket's
        capture synchronizes the device before it writes a buffer a queued step may read."""
        if self._stale():  # the tensors the graphs read were reallocated: start over, largest first
            self.capture(defer=True)
            return
        size = self.pending.pop(0)
        self._or_uncompiled(lambda: self._capture_bucket(size), f"capturing {type(self).__name__} bucket {size}")

    def _stale(self) -> bool:
        return False

    def capture(self, defer: bool = False) -> None:
        raise NotImplementedError

    def _capture_bucket(self, size: int) -> None:
        raise NotImplementedError

    def _or_uncompiled(self, fn, what: str) -> None:
        raise NotImplementedError
