"""Early chunks for the exact incremental vocoder: a stream's first audio decoded from windows of its first frames
alone, long before the exact stage can emit it.

The exact stage emits a frame's samples once the 52 frames of its right context have arrived (the conv stack's lag
and half an FFT), so the first audio waits for F + 52 frames. A one-shot decode of frames [0, e + L) gives the first
e frames' samples with exact left edges (the utterance starts there too) and a right edge that has seen L frames
instead of 52: with L = 16 they differ from the exact samples by 6.9e-6 at most, under a quarter of one 16-bit step
(docs/MODEL.md).

One early chunk is not enough under load: after it the exact stage's first new samples wait until frame F + 52, so
the F frames out must cover 52 - L frames of generation (4.5x real time per stream at F = 8, L = 16; 512 H100
streams run at about 4x). So early chunks end at e = F, 2F, 4F, ... while the window e + L is shorter than the exact
first call's F + 52 frames: 8, 16, 32 at F = 8, L = 16, the last at frame 48 with 32 frames of audio out. Each
emits [previous end, e); the exact stage goes on from the last end (its first call waits until it has new samples to
emit: last end + F + 52 frames), so a stream's early samples are approximate and the rest exact.

Each window has one shape per call, [B, e + L] frames: on CUDA one graph per (window, power-of-two row bucket),
so a call is one replay instead of a few hundred kernel launches; 18 graphs took 5.3 s on an H100, so with deferred
capture only each window's largest is captured before the engine is ready. Rows past B in a bucket
compute whatever the static buffer holds and are dropped (every op of the networks is per row).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from torch import Tensor

from ttsserve.audio.decoder_net import HiddenDecoder
from ttsserve.audio.frame_pool import FramePool
from ttsserve.audio.stream_base import ChunkSpec, Stream
from ttsserve.audio.vocos import Vocos
from ttsserve.graph_capture import capture

logger = logging.getLogger(__name__)


def early_chunk_ends(first_frames: int, lookahead: int, exact_first_call: int) -> list[int]:
    """Frames each early chunk ends at: first_frames doubling while the window (end + lookahead) is shorter than
    the exact stage's first call (first chunk + right context). Empty: the exact first chunk is as early."""
    ends, e = [], first_frames
    while e + lookahead < exact_first_call:
        ends.append(e)
        e *= 2
    return ends


class EarlyChunkDecoder:
    """decoder + Vocos over [B, e + L] windows of hidden states -> the first e frames' samples of each row, for
    each early chunk end e of `ends`."""

    def __init__(self, decoder: HiddenDecoder, vocos: Vocos, ends: list[int], lookahead: int, max_rows: int) -> None:
        if not ends or min(ends) < 1 or lookahead < 1 or max_rows < 1:
            raise ValueError(f"need ends, lookahead, max_rows >= 1: {ends}, {lookahead}, {max_rows}")
        self.decoder, self.vocos = decoder, vocos
        self.ends = sorted(ends)
        self.widths = [e + lookahead for e in self.ends]
        self.samples_per_frame = 2 * vocos.hop_length
        self.row_buckets = [1 << k for k in range(max_rows.bit_length()) if 1 << k < max_rows] + [max_rows]
        self.device = next(vocos.parameters()).device
        self.vocos_dtype = next(vocos.parameters()).dtype
        # full-length masks: the masked ISTFT (vocos.istft_rows) has no host sync, torch.istft's check has one
        self.lens = torch.full((self.max_rows,), self.widths[-1], dtype=torch.int64, device=self.device)
        self.x: dict[int, Tensor] = {}  # window -> [max_rows, C, window] in the decoder's dtype, once enabled
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}  # (window, rows)
        self.outputs: dict[tuple[int, int], Tensor] = {}
        self.pending: list[tuple[int, int]] = []  # buckets left for capture_next(), largest first
        self.pool = None  # the graphs' memory pool
        self.calls = 0

    @property
    def max_rows(self) -> int:
        return self.row_buckets[-1]

    def _decode(self, x: Tensor) -> Tensor:
        """x [B, C, e + L] (decoder dtype) -> [B, e * 512] fp32. Graph-capturable."""
        b, width = x.shape[0], x.shape[2]
        lens = self.lens[:b].clamp(max=width)
        mel = self.decoder(x, lens)
        samples = self.samples_per_frame * self.ends[self.widths.index(width)]
        return self.vocos(mel.to(self.vocos_dtype), 2 * lens)[:, :samples].float()

    @torch.no_grad()
    def enable_graphs(self, defer: bool = False) -> None:
        """Static buffers for every window and, on CUDA, one captured graph per (window, row bucket), largest
        first into one memory pool. defer: each window's largest bucket only; capture_next() takes the others
        (engine/deferred_capture.py) and until then a call replays the smallest captured bucket that holds it.
        Off CUDA the buckets run eagerly on the same buffers (tests of the padding). A capture that fails at
        set-up leaves the plain decode (slower, the same samples) and says so."""
        keys = [(w, b) for w in reversed(self.widths) for b in reversed(self.row_buckets)]
        now = [k for k in keys if k[1] == self.max_rows] if defer else keys
        self.pending = [k for k in keys if k not in now]
        t0 = time.perf_counter()
        try:
            c, dtype = self.decoder.hidden_size, self.decoder.coef.dtype
            for w in self.widths:
                self.x[w] = torch.zeros(self.max_rows, c, w, dtype=dtype, device=self.device)
            for key in now:
                self.capture_one(*key)
        except Exception as exc:
            if self.device.type != "cuda":
                raise
            logger.warning("early-chunk vocoder graphs failed (%s: %s); decoding eagerly", type(exc).__name__, exc)
            self.x, self.graphs, self.outputs, self.pending = {}, {}, {}, []
            return
        if self.device.type == "cuda":
            logger.info(
                "captured %d early-chunk vocoder CUDA graphs (rows ..%d, windows %s frames) in %.1f s; %d more "
                "after start-up, between steps",
                len(now),
                self.max_rows,
                self.widths,
                time.perf_counter() - t0,
                len(self.pending),
            )

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    def capture_next(self) -> None:
        """Capture the next pending bucket (between engine steps; stream order keeps a call in flight safe)."""
        self.capture_one(*self.pending.pop(0))

    @torch.no_grad()
    def capture_one(self, w: int, b: int) -> None:
        """The graph of window w at b rows (off CUDA: None, the eager call on the static buffer)."""
        x = self.x[w]
        if self.device.type != "cuda":
            self.graphs[w, b] = None
            return
        self._decode(x[:b])  # warm-up: cuDNN / cuFFT pick kernels and plans outside the capture
        graph = torch.cuda.CUDAGraph()
        self.outputs[w, b] = capture(graph, lambda: self._decode(x[:b]), self.pool)
        self.pool = self.pool or graph.pool()
        graph.replay()  # a graph's first launch uploads it: not in a served step
        torch.cuda.synchronize()
        self.graphs[w, b] = graph

    @torch.no_grad()
    def __call__(self, frames: Tensor) -> Tensor:
        """frames [B, e + L, C] (any float dtype; e one of ends), B <= max_rows -> [B, e * 512] fp32 on the
        device. With graphs: a view of a static buffer, valid until the next call (stream order keeps a queued
        crop safe)."""
        b, w = frames.shape[:2]
        assert w in self.widths and 1 <= b <= self.max_rows, (frames.shape, self.widths, self.max_rows)
        self.calls += 1
        if w not in self.x:
            return self._decode(frames.transpose(1, 2).to(self.decoder.coef.dtype))
        bucket = next(r for r in self.row_buckets if r >= b and (w, r) in self.graphs)  # max_rows always is
        x = self.x[w]
        x[:b].copy_(frames.transpose(1, 2))
        graph = self.graphs[w, bucket]
        if graph is None:
            return self._decode(x[:bucket])[:b]
        graph.replay()
        return self.outputs[w, bucket][:b]


class EarlyChunks:
    """Which hidden-state streams have an early chunk due, and their decode. Owned by the exact stage
    (audio/incremental_stage.py), which adds each hidden-state stream and launches these before its own calls."""

    def __init__(self, decoder: EarlyChunkDecoder, exact_first_call: int) -> None:
        self.decoder = decoder
        self.exact_first_call = exact_first_call  # frames the exact stage's first call needs
        self._awaiting: set[str] = set()  # streams that may still get an early chunk: few, not every stream

    def add_request(self, req_id: str) -> None:
        self._awaiting.add(req_id)

    def due(self, streams: dict[str, Stream]) -> dict[tuple[int, int], list[tuple[str, Stream]]]:
        """Streams with an early chunk to leave now, by (frames out, chunk end): the latest end whose window is in,
        past what is out. A stream leaves the set once its last early chunk is out, once it is gone or finished,
        or once the exact stage can emit past its early audio (its first call + the frames out)."""
        due: dict[tuple[int, int], list[tuple[str, Stream]]] = {}
        dec, spf = self.decoder, self.decoder.samples_per_frame
        for req_id in list(self._awaiting):
            st = streams.get(req_id)
            out = 0 if st is None else st.num_emitted_samples // spf
            if st is None or st.finished or st.num_frames >= out + self.exact_first_call:
                self._awaiting.discard(req_id)
                continue
            k = bisect.bisect_right(dec.widths, st.num_frames) - 1  # the latest window that is in
            if k >= 0 and dec.ends[k] > out:
                due.setdefault((out, dec.ends[k]), []).append((req_id, st))
                if k == len(dec.ends) - 1:
                    self._awaiting.discard(req_id)
        return due

    def launch(self, streams: dict[str, Stream], pool: FramePool) -> tuple[list[Tensor], list[ChunkSpec], list[int]]:
        """Decode the due early chunks -> (flat samples per call, specs, sizes): each stream's samples
        [out, end) * 512. The exact stage then emits from the stream's num_emitted_samples on. One gather of
        every due stream's frames, as wide as the widest window (each gather is several launches and a copy)."""
        pieces, specs, sizes = [], [], []
        due = self.due(streams) if self._awaiting else {}
        if not due:
            return pieces, specs, sizes
        dec, spf = self.decoder, self.decoder.samples_per_frame
        rows = [st for group in due.values() for _, st in group]  # each group's rows contiguous
        width = dec.widths[dec.ends.index(max(end for _, end in due))]
        x = pool.gather([st.slot for st in rows], [-st.base for st in rows], [width] * len(rows))
        row = 0
        for (out, end), group in due.items():
            w = dec.widths[dec.ends.index(end)]
            for i in range(0, len(group), dec.max_rows):
                part = group[i : i + dec.max_rows]
                wav = dec(x[row : row + len(part), :w])
                pieces.append(wav[:, out * spf :].reshape(-1).clone())  # the next call may replay the buffer
                row += len(part)
                for req_id, st in part:
                    st.num_emitted_samples = end * spf
                    specs.append(ChunkSpec(req_id, out * spf, False))
                sizes += [(end - out) * spf] * len(part)
        return pieces, specs, sizes
