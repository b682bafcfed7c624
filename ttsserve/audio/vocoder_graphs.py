"""CUDA graphs of the incremental vocoder call (Decoder + Vocos) over (rows, frames) buckets.

One incremental call is a few hundred small kernels (every conv gathers and scatters its state tail), so on a
GPU its cost is the host's launches: 5-10 ms whatever the batch. With streams that arrive at different times
a call happens nearly every step, and that host time bounded the served throughput. A replayed graph
is one launch.

Static buffers shared by every bucket: x [R, N, C] (the new frames of each row, in the frame pool's dtype) and
info [4, R] int64 (IncrementalAudioStage._row_info: slot, first new mel frame, new mel frames, mel length once
finished). A call of B rows and n frames replays the smallest bucket (b, w) >= (B, n): rows past B point at a
scratch state slot that no stream owns, with 0 new frames; frames past a row's own are zeros, as the eager
path pads them. Wider rows change nothing a row keeps (audio/incremental.py: junk past a row's count only
reaches positions past it), so the graphed call returns what the eager call returns.

`capture(defer=True)` captures the largest bucket only and leaves the others to `capture_next()` (the engine
calls it between served steps, engine/deferred_capture.py); until then a call replays the captured bucket
with the fewest padded (row, frame) cells that holds it, which returns the same samples.

Graphs hold the addresses of the stage's state tensors: when the stage grows its slots (more streams than
planned for) every graph is dropped, and each bucket is captured again when a call first needs it (about 0.2 s
each on an H200, where capturing all 40 at once stalled the engine for 8 s), or, after a deferred capture,
the largest at once and the rest by capture_next(). Off CUDA nothing is captured and run() calls the same body
on the static buffers, which is how the CPU tests check the padding and bucketing.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from ttsserve.audio.incremental import NOT_FINISHED
from ttsserve.graph_capture import capture
from ttsserve.h2d import to_device

logger = logging.getLogger(__name__)


def _doubling(first: int, last: int) -> list[int]:
    """first, 2 * first, ... below last, and last itself."""
    sizes, n = [], first
    while n < last:
        sizes.append(n)
        n *= 2
    return sizes + [last]


def default_frame_buckets(max_call_frames: int) -> list[int]:
    """Powers of two from 8 and, from 64, their midpoints (96, ...) below max_call_frames, and max_call_frames:
    a stream's first exact call with early chunks feeds 84 frames, which the 116-frame bucket computed 38 %
    padding for."""
    sizes = _doubling(8, max_call_frames)
    mids = [3 * n // 2 for n in sizes if n >= 64 and 3 * n // 2 < max_call_frames]
    return sorted(set(sizes + mids))


def default_row_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 below max_rows, and max_rows: at 512 served streams about 64 rows
    are due a step, and one row past 64 made a power-of-two bucket compute 128 (up to 4,000 padded cells, 2.4 ms
    of an H100's time at 0.6 us a cell)."""
    return sorted({n for n in [1, 2, 4, 8, *range(16, max_rows, 16)] if n < max_rows} | {max_rows})


class VocoderGraphs:
    """Bucketed graphs of `stage.pipeline` for one decoder kind (False: hidden states, True: DVAE codes)."""

    def __init__(self, stage, kind: bool, row_buckets: list[int], frame_buckets: list[int]) -> None:
        if not row_buckets or not frame_buckets or min(row_buckets) < 1 or min(frame_buckets) < 1:
            raise ValueError(f"bucket sizes must be positive, got rows {row_buckets}, frames {frame_buckets}")
        self.stage, self.kind = stage, kind
        self.row_buckets, self.frame_buckets = sorted(set(row_buckets)), sorted(set(frame_buckets))
        pool = stage._pools[kind].data
        rows, frames = self.row_buckets[-1], self.frame_buckets[-1]
        self.x = torch.zeros(rows, frames, pool.shape[2], dtype=pool.dtype, device=stage.device)
        self.info = torch.zeros(4, rows, dtype=torch.int64, device=stage.device)
        self.scratch_slot = stage.reserve_scratch_slot()
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        self.outputs: dict[tuple[int, int], Tensor] = {}
        self.pending: list[tuple[int, int]] = []  # buckets capture_next() takes, in capture order
        self.deferred = False  # the last capture() left all but the largest bucket to capture_next()
        self.pool = None
        self.generation: int | None = None
        self.capture_s = 0.0
        self.replays = 0

    def fits(self, rows: int, frames: int) -> bool:
        return rows <= self.row_buckets[-1] and frames <= self.frame_buckets[-1]

    def bucket(self, rows: int, frames: int) -> tuple[int, int]:
        """The smallest (rows, frames) bucket that holds a call; while captures are pending, the captured one
        with the fewest cells that holds it, when one does (else the smallest: run() captures it)."""
        key = (next(b for b in self.row_buckets if b >= rows), next(n for n in self.frame_buckets if n >= frames))
        if key in self.graphs or not self.pending:
            return key
        fits = [k for k in self.graphs if k[0] >= rows and k[1] >= frames]
        return min(fits, key=lambda k: (k[0] * k[1], k)) if fits else key

    def frame_bucket(self, frames: int) -> int:
        """The frames a call this wide computes (its own past the largest bucket: eager)."""
        return next((n for n in self.frame_buckets if n >= frames), frames)

    def cells(self, rows: int, frames: int) -> int:
        """(row, frame) cells a call computes: its bucket's (bucket()), or its own where none holds it (eager)."""
        b, n = self.bucket(rows, frames) if self.fits(rows, frames) else (rows, frames)
        return b * n

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    # ---- the captured body ---------------------------------------------------------------------------------
    def _body(self, b: int, n: int) -> Tensor:
        info = self.info[:, :b]
        return self.stage.pipeline(self.kind, self.x[:b, :n].transpose(1, 2), info, n)

    def _fill(self, b: int, n: int, x: Tensor | None, info: list[list[int]]) -> None:
        """Load a call's rows into the static buffers of bucket (b, n); the rest of the bucket is padding."""
        rows = len(info[0])
        pad = b - rows
        host = [
            info[0] + [self.scratch_slot] * pad,
            info[1] + [0] * pad,
            info[2] + [0] * pad,
            info[3] + [NOT_FINISHED] * pad,
        ]
        self.info[:, :b].copy_(to_device(host, self.stage.device), non_blocking=True)
        self.x[:b, :n].zero_()
        if x is not None:
            self.x[:rows, : x.shape[1]].copy_(x)

    # ---- capture / replay ----------------------------------------------------------------------------------
    def _drop(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.pending = []
        self.pool = None
        self.generation = self.stage.slot_generation

    @torch.no_grad()
    def capture(self, defer: bool = False) -> None:
        """Capture every bucket, largest first, so that each fits in the pool of the larger ones (defer: the
        largest only; capture_next() takes the rest in the same order)."""
        t0 = time.perf_counter()
        self._drop()
        self.deferred = defer
        keys = sorted(
            ((b, n) for b in self.row_buckets for n in self.frame_buckets), key=lambda k: (k[0] * k[1], k), reverse=True
        )
        now, self.pending = (keys[:1], keys[1:]) if defer else (keys, [])
        for key in now:
            self._capture_one(*key)
        self.capture_s = time.perf_counter() - t0
        logger.info(
            "captured %d vocoder CUDA graph%s (rows %d..%d, frames %d..%d) in %.1f s%s%s",
            len(now),
            "s" if len(now) > 1 else "",
            min(k[0] for k in now),
            max(k[0] for k in now),
            min(k[1] for k in now),
            max(k[1] for k in now),
            self.capture_s,
            self._pool_report(),
            f"; {len(self.pending)} more after start-up, between steps" if self.pending else "",
        )

    @torch.no_grad()
    def capture_next(self) -> None:
        """Capture the next pending bucket (between engine steps; stream order keeps a call in flight safe)."""
        key = self.pending.pop(0)
        if key not in self.graphs:  # a call may have captured it meanwhile
            self._capture_one(*key)

    def _pool_report(self) -> str:
        if self.stage.device.type != "cuda" or self.pool is None:
            return ""
        segments = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == self.pool]
        if not segments:  # this torch's snapshot does not name pools
            return ""
        return f"; their memory pool holds {sum(s['total_size'] for s in segments) / 2**30:.2f} GiB"

    def _capture_one(self, b: int, n: int) -> None:
        """Capture bucket (b, n) into the shared pool (off CUDA: record it as 'run the body eagerly')."""
        if self.stage.device.type != "cuda":
            self.graphs[(b, n)] = None
            return
        self._fill(b, n, None, [[], [], [], []])
        self._body(b, n)  # warm-up: cuDNN / cuFFT pick their kernels and plans outside the capture
        graph = torch.cuda.CUDAGraph()
        self.outputs[(b, n)] = capture(graph, lambda: self._body(b, n), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        # a graph's first launch uploads it (an H200 test saw 30 ms of host time for a 64-row call): pay it now
        graph.replay()
        torch.cuda.synchronize()
        self.graphs[(b, n)] = graph

    @torch.no_grad()
    def run(self, x: Tensor, info: list[list[int]]) -> Tensor:
        """One call: x [B, n, C] new frames (zeros past each row's), info [4][B] host ints (_row_info) ->
        wav [b, hop * 2w] of bucket (b, w) >= (B, n); rows >= B are padding. A view of a static buffer, valid
        until the next replay (stream order keeps a crop queued before it safe)."""
        if self.generation != self.stage.slot_generation:
            logger.warning(
                "the vocoder's state slots grew to %d: its graphs are captured again %s (raise max_num_seqs' "
                "headroom to avoid this)",
                self.stage._num_slots,
                "(the largest now, the rest between steps)" if self.deferred else "as calls need them",
            )
            self._drop()
            if self.deferred:  # the largest now (so every call fits), the rest by capture_next()
                self.capture(defer=True)
        b, n = self.bucket(x.shape[0], x.shape[1])
        if (b, n) not in self.graphs:
            self._capture_one(b, n)  # after _fill below the body reads this call's rows, not the capture's
        self._fill(b, n, x, info)
        graph = self.graphs[(b, n)]
        self.replays += 1
        if graph is None:
            return self._body(b, n)
        graph.replay()
        return self.outputs[(b, n)]
