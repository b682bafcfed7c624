"""Early chunks for the exact incremental vocoder: a stream's first audio decoded from windows of its first frames
alone, long before the exact stage can emit it.

The exact stage emits a frame's samples once the 52 frames of its right context have arrived (the conv stack's lag
and half an FFT), so the first audio waits for F + 52 frames. A one-shot decode of frames [0, e + L) gives the first
e frames' samples with exact left edges (the utterance starts there too) and a right edge that has seen L frames
instead of 52: with L = 16 they differ from the exact samples by 6.9e-6 at most, under a quarter of one 16-bit step
(docs/MODEL.md).

One early chunk is not enough under load: after it the exact stage's first new samples wait until frame 2F + 52 (its
first call emits F frames), so the F frames out must cover F + 52 - L frames of generation (5.5x real time per stream at
F = 8, L = 16). So the early chunks are planned for a floor of MIN_SPEED frames generated per frame played (512 H100
streams run at about 4.4): chunk k + 1 (window e' + L) must leave before the e_k frames out have played, e' - F <=
MIN_SPEED * e_k, and the exact stage, whose first call waits until it has new samples past the last end (last end + F +
52 frames), must emit before the last end has played. The fewest, narrowest chunks that do so end at 8 and 24 at F = 8,
L = 16 (windows 24 and 40): each call is as wide as the widest window (below), so the two decode 80 frames a stream
where ends doubling from 8 while their windows are shorter than the exact first call (8, 16, 32: windows to 48, three
calls) would decode 144, and keep ahead down to 2.1x. Each emits [previous end, e); the exact stage goes on from the
last end, so a stream's early samples are approximate and the rest exact.

The step's due streams, whichever chunk they are at, share one call, each row masked to its own window (the
networks mask every conv's input past a row's length, so a row decodes as its window alone). On CUDA every call has
one shape, [B, widest window] frames, and is one replay of the graph of its power-of-two row bucket instead of a few
hundred kernel launches: at small batch a replay costs its launches, not its rows (one graph per window took one
replay per window a step). Rows past B in a bucket compute whatever the static buffers hold and are dropped. Eager
(a CPU), a call is as wide as its widest row: there a padded frame costs its compute.
"""

from __future__ import annotations

import bisect
import logging
import math
import time

import torch
from torch import Tensor

from ttsserve.audio.decoder_net import HiddenDecoder
from ttsserve.audio.frame_pool import FramePool
from ttsserve.audio.stream_base import ChunkSpec, Stream, crop_rows
from ttsserve.audio.vocos import Vocos
from ttsserve.graph_capture import capture
from ttsserve.h2d import to_device

logger = logging.getLogger(__name__)


MIN_SPEED = 2.5  # frames generated per frame played that the early chunks keep ahead of (the docstring above)


def early_chunk_ends(
    first_frames: int, lookahead: int, exact_first_call: int, min_speed: float = MIN_SPEED
) -> list[int]:
    """Frames each early chunk ends at: the first at first_frames, each next one as late as the audio out covers at
    min_speed and no later than the exact stage needs (its first call, first_frames + right context, past the last
    end, in time at min_speed); windows (end + lookahead) shorter than the exact first call. Empty: the exact first
    chunk is as early."""
    assert min_speed > 1, min_speed
    f = first_frames
    if f + lookahead >= exact_first_call:
        return []
    exact_wait = exact_first_call - f - lookahead  # frames generated after the first chunk until the exact one
    need = max(f, math.ceil(exact_wait / (min_speed - 1)))  # the smallest last end the exact stage is in time for
    ends = [f]
    while ends[-1] < need:
        nxt = min(need, int(f + min_speed * ends[-1]))
        if nxt + lookahead >= exact_first_call:  # no window early enough covers the floor: the exact stage next
            break
        ends.append(nxt)
    return ends


class EarlyChunkDecoder:
    """decoder + Vocos over [B, W] frames of hidden states (W the widest window; eager: the call's widest), row b
    masked to its window widths[b] -> each row's samples up to W - L frames (valid up to the row's own end)."""

    def __init__(self, decoder: HiddenDecoder, vocos: Vocos, ends: list[int], lookahead: int, max_rows: int) -> None:
        if not ends or min(ends) < 1 or lookahead < 1 or max_rows < 1:
            raise ValueError(f"need ends, lookahead, max_rows >= 1: {ends}, {lookahead}, {max_rows}")
        self.decoder, self.vocos = decoder, vocos
        self.ends = sorted(ends)
        self.widths = [e + lookahead for e in self.ends]
        self.window = dict(zip(self.ends, self.widths))  # chunk end -> its window
        self.width = self.widths[-1]
        self.samples_per_frame = 2 * vocos.hop_length
        self.row_buckets = [1 << k for k in range(max_rows.bit_length()) if 1 << k < max_rows] + [max_rows]
        self.device = next(vocos.parameters()).device
        self.vocos_dtype = next(vocos.parameters()).dtype
        self.x: Tensor | None = None  # [max_rows, C, width] in the decoder's dtype, once graphs are enabled
        self.lens = torch.full((max_rows,), self.width, dtype=torch.int64, device=self.device)  # rows' windows
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}  # by row bucket
        self.outputs: dict[int, Tensor] = {}
        self.pending: list[int] = []  # row buckets left for capture_next(), largest first
        self.pool = None  # the graphs' memory pool
        self.calls = 0

    @property
    def max_rows(self) -> int:
        return self.row_buckets[-1]

    def _decode(self, x: Tensor, lens: Tensor) -> Tensor:
        """x [B, C, w] (decoder dtype), lens [B] <= w -> [B, (w - L) * 512] fp32. Graph-capturable (the masked
        ISTFT has no host sync)."""
        mel = self.decoder(x, lens)
        samples = self.samples_per_frame * (x.shape[2] - self.width + self.ends[-1])
        return self.vocos(mel.to(self.vocos_dtype), 2 * lens)[:, :samples].float()

    @torch.no_grad()
    def enable_graphs(self, defer: bool = False) -> None:
        """Static buffers and, on CUDA, one captured graph per row bucket, largest first into one memory pool.
        defer: the largest only; capture_next() takes the others (engine/deferred_capture.py) and until then a
        call replays the smallest captured bucket that holds it. Off CUDA the buckets run eagerly on the same
        buffers (tests of the padding). A capture that fails at set-up leaves the plain decode (slower, the same
        samples) and says so."""
        buckets = self.row_buckets[::-1]
        now, self.pending = (buckets[:1], buckets[1:]) if defer else (buckets, [])
        t0 = time.perf_counter()
        try:
            c, dtype = self.decoder.hidden_size, self.decoder.coef.dtype
            self.x = torch.zeros(self.max_rows, c, self.width, dtype=dtype, device=self.device)
            for b in now:
                self.capture_one(b)
        except Exception as exc:
            if self.device.type != "cuda":
                raise
            logger.warning("early-chunk vocoder graphs failed (%s: %s); decoding eagerly", type(exc).__name__, exc)
            self.x, self.graphs, self.outputs, self.pending = None, {}, {}, []
            return
        if self.device.type == "cuda":
            logger.info(
                "captured %d early-chunk vocoder CUDA graphs (rows ..%d, %d frames) in %.1f s; %d more after "
                "start-up, between steps",
                len(now),
                self.max_rows,
                self.width,
                time.perf_counter() - t0,
                len(self.pending),
            )

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    def capture_next(self) -> None:
        """Capture the next pending bucket (between engine steps; stream order keeps a call in flight safe)."""
        self.capture_one(self.pending.pop(0))

    @torch.no_grad()
    def capture_one(self, b: int) -> None:
        """The graph of b rows (off CUDA: None, the eager call on the static buffers)."""
        if self.device.type != "cuda":
            self.graphs[b] = None
            return
        x, lens = self.x, self.lens
        self._decode(x[:b], lens[:b])  # warm-up: cuDNN / cuFFT pick kernels and plans outside the capture
        graph = torch.cuda.CUDAGraph()
        self.outputs[b] = capture(graph, lambda: self._decode(x[:b], lens[:b]), self.pool)
        self.pool = self.pool or graph.pool()
        graph.replay()  # a graph's first launch uploads it: not in a served step
        torch.cuda.synchronize()
        self.graphs[b] = graph

    def call_width(self, widths: list[int]) -> int:
        """Frames a call of rows with these windows takes: the widest window with graphs (one shape), else the
        widest of the call's (eager, as on a CPU, a padded frame costs its compute)."""
        return self.width if self.x is not None else max(widths)

    @torch.no_grad()
    def __call__(self, frames: Tensor, widths: list[int]) -> Tensor:
        """frames [B, call_width(widths), C] (any float dtype), widths [B] (each one of self.widths), B <=
        max_rows -> [B, (call width - L) * 512] fp32 on the device, row b valid up to its own end. With graphs: a
        view of a static buffer, valid until the next call (stream order keeps a queued crop safe)."""
        b = frames.shape[0]
        assert frames.shape[1] == self.call_width(widths) and len(widths) == b <= self.max_rows, frames.shape
        self.calls += 1
        lens = to_device(widths, frames.device)
        if self.x is None:
            return self._decode(frames.transpose(1, 2).to(self.decoder.coef.dtype), lens)
        bucket = next(r for r in self.row_buckets if r >= b and r in self.graphs)  # max_rows always is
        self.x[:b].copy_(frames.transpose(1, 2))
        self.lens[:b].copy_(lens)
        graph = self.graphs[bucket]
        if graph is None:
            return self._decode(self.x[:bucket], self.lens[:bucket])[:b]
        graph.replay()
        return self.outputs[bucket][:b]


class EarlyChunks:
    """Which hidden-state streams have an early chunk due, and their decode. Owned by the exact stage
    (audio/incremental_stage.py), which adds each hidden-state stream and launches these before its own calls."""

    def __init__(self, decoder: EarlyChunkDecoder, exact_first_call: int) -> None:
        self.decoder = decoder
        self.exact_first_call = exact_first_call  # frames the exact stage's first call needs
        self._awaiting: set[str] = set()  # streams that may still get an early chunk: few, not every stream

    def add_request(self, req_id: str) -> None:
        self._awaiting.add(req_id)

    def due(self, streams: dict[str, Stream]) -> list[tuple[str, Stream, int, int]]:
        """Streams with an early chunk to leave now -> (id, stream, frames out, chunk end): the latest end whose
        window is in, past what is out. A stream leaves the set once its last early chunk is out, once it is gone
        or finished, or once the exact stage can emit past its early audio (its first call + the frames out)."""
        due = []
        dec, spf = self.decoder, self.decoder.samples_per_frame
        for req_id in list(self._awaiting):
            st = streams.get(req_id)
            out = 0 if st is None else st.num_emitted_samples // spf
            if st is None or st.finished or st.num_frames >= out + self.exact_first_call:
                self._awaiting.discard(req_id)
                continue
            k = bisect.bisect_right(dec.widths, st.num_frames) - 1  # the latest window that is in
            if k >= 0 and dec.ends[k] > out:
                due.append((req_id, st, out, dec.ends[k]))
                if k == len(dec.ends) - 1:
                    self._awaiting.discard(req_id)
        return due

    def launch(self, streams: dict[str, Stream], pool: FramePool) -> tuple[list[Tensor], list[ChunkSpec], list[int]]:
        """Decode the due early chunks, every window in one call of at most max_rows rows -> (flat samples per
        call, specs, sizes): each stream's samples [out, end) * 512. The exact stage then emits from the
        stream's num_emitted_samples on."""
        pieces, specs, sizes = [], [], []
        due = self.due(streams) if self._awaiting else []
        dec, spf = self.decoder, self.decoder.samples_per_frame
        for i in range(0, len(due), dec.max_rows):
            part = due[i : i + dec.max_rows]
            rows, widths = [st for _, st, _, _ in part], [dec.window[end] for *_, end in part]
            width = dec.call_width(widths)
            x = pool.gather([st.slot for st in rows], [-st.base for st in rows], [width] * len(part))
            wav = dec(x, widths)
            starts = [out * spf for *_, out, _ in part]
            counts = [(end - out) * spf for *_, out, end in part]
            pieces.append(crop_rows(wav, starts, counts))  # a copy: the next call may replay the static buffer
            for req_id, st, out, end in part:
                st.num_emitted_samples = end * spf
                specs.append(ChunkSpec(req_id, out * spf, False))
            sizes += counts
        return pieces, specs, sizes
