"""CUDA graphs of the code heads + sampler for the rows that a general (prefill) step samples.

A request's first frame is sampled on the general path, after the last chunk of its prompt. Run op by op the
heads, penalties, top-k / top-p and the seeded draw are ~60 small kernels launched from Python: on an H200
under served load that was 7% of the engine core's time (one first frame per admitted request).
Here one graph per row bucket replays them: the host copies [2, bucket] (rows, then steps) in one transfer,
the hidden states go into a static buffer, and padding rows point at the sampling state's scratch row.
Graphs hold the sampling state's addresses; when the runner's `generation` changes they are captured again.
"""

from __future__ import annotations

import numpy as np
import torch

from ttsserve.runner.cuda_graphs import capture_graph, or_uncompiled
from ttsserve.runner.graph_buckets import BucketedGraphs

_ROW, _STEP = range(2)


def default_sampler_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ..., 64 (first frames per step rarely exceed a few), capped at max_num_seqs."""
    return sorted({min(1 << i, max_num_seqs) for i in range(7)})


class SamplerGraphs(BucketedGraphs):
    """Bucketed graphs of ModelRunner.sample_rows(hidden, rows, steps, "code") (`capture()` before `run()`;
    with defer=True `capture_next()` captures the smaller buckets later; off CUDA nothing is captured and
    `run()` calls the same body on the static buffers)."""

    def __init__(self, runner, sizes: list[int], ops) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"sampler graph sizes must be positive, got {sizes}")
        self.runner, self.ops = runner, ops
        self._init_buckets(sizes)
        n, dev = self.sizes[-1], runner.device
        self.hidden = torch.zeros(n, runner.cfg.hidden_size, dtype=torch.float32, device=dev)
        # flat, viewed [2, bs] for a bucket of bs rows: the columns the body reads are contiguous (no copy kernels)
        self.meta = torch.zeros(2 * n, dtype=torch.int64, device=dev)
        # two pinned buffers in turn, as in DecodeGraphs: pipelined, the previous step's copy may be queued
        self._meta_hosts = [torch.zeros(2 * n, dtype=torch.int64, pin_memory=dev.type == "cuda") for _ in range(2)]
        self._turn = 0
        self.tokens = torch.zeros(n, runner.cfg.num_vq, dtype=torch.int64, device=dev)
        self.generation = None

    def can_run(self, num_rows: int) -> bool:
        return num_rows <= self.sizes[-1]

    def _body(self, bs: int) -> None:
        rows, steps = self.meta[: 2 * bs].view(2, bs)
        self.tokens[:bs] = self.runner.sample_rows(self.hidden[:bs], rows, steps, "code", ops=self.ops)

    def _fill(self, rows: np.ndarray, steps: np.ndarray, bs: int) -> None:
        self._turn ^= 1
        host = self._meta_hosts[self._turn][: 2 * bs]
        m = host.view(2, bs).numpy()
        b = len(rows)
        m[_ROW, :b], m[_STEP, :b] = rows, steps
        m[_ROW, b:], m[_STEP, b:] = self.runner.sampling.scratch_row, 0
        self.meta[: 2 * bs].copy_(host, non_blocking=True)

    def _or_uncompiled(self, fn, what: str) -> None:
        or_uncompiled(self, fn, what)

    @torch.inference_mode()
    def capture(self, defer: bool = False) -> None:
        """Capture every bucket, largest first, into one pool (defer: the largest and smallest only, the rest by
        capture_next()); with compiled ops that fail, again uncompiled."""
        or_uncompiled(self, lambda: self._capture_now(defer), "capturing the sampler graphs with compiled ops")

    def _capture_now(self, defer: bool) -> None:
        now = self._reset_buckets(defer)
        self.generation = self.runner.generation
        for bs in now:
            self._capture_bucket(bs)

    @torch.inference_mode()
    def _capture_bucket(self, bs: int) -> None:
        """Warm the body up on `bs` padding rows (compiles the ops, lets cuBLAS pick its kernels), capture it and
        replay it once (the first launch uploads a graph: not on a live step)."""
        if self.runner.device.type != "cuda":
            self._add_graph(bs, None)
            return
        empty = np.empty(0, dtype=np.int64)
        torch.cuda.synchronize()  # a step in flight may still copy from the pinned buffer filled next
        self._fill(empty, empty, bs)
        self._body(bs)
        graph, self.pool = capture_graph(lambda: self._body(bs), self.pool)
        graph.replay()
        torch.cuda.synchronize()
        self._add_graph(bs, graph)

    def _stale(self) -> bool:
        return self.generation != self.runner.generation

    def run(self, hidden: torch.Tensor, rows: np.ndarray, steps: np.ndarray) -> torch.Tensor:
        """sample_rows for hidden [B, H] fp32 of `rows` at `steps` (int64 [B] host arrays) -> tokens
        [B, num_vq] int64, a view of the static output valid until the next run()."""
        if self.generation != self.runner.generation:
            self.capture(defer=self.deferred)
        b = len(rows)
        bs = self.bucket(b)
        self._fill(rows, steps, bs)
        self.hidden[:b].copy_(hidden)
        graph = self.graphs[bs]
        if graph is None:
            self._body(bs)
        else:
            graph.replay()
        return self.tokens[:b]
