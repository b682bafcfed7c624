"""An early first chunk for the exact incremental vocoder: the first F frames' audio decoded from a window of
F + L frames (L the first chunk's lookahead), long before the exact stage can emit them.

The exact stage emits a frame's samples once the 52 frames of its right context have arrived (the conv stack's lag
and half an FFT), so the first audio waits for F + 52 frames. A one-shot decode of frames [0, F + L) gives the
first F frames' samples with exact left edges (the utterance starts there too) and a right edge that has seen L
frames instead of 52: with L = 16 they differ from the exact samples by 6.9e-6 at most, under a quarter of one
16-bit step (docs/MODEL.md). The exact stage then goes on from sample F * 512 and never emits those samples
again, so the stream has one seam, at the end of its first chunk.

The decode has one shape per call, [B, F + L] frames: on CUDA one graph per power-of-two row bucket (a handful,
captured at set-up), so a call is one replay instead of a few hundred kernel launches. Rows past B in a bucket
compute whatever the static buffer holds and are dropped (every op of the networks is per row).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from ttsserve.audio.decoder_net import HiddenDecoder
from ttsserve.audio.vocos import Vocos
from ttsserve.graph_capture import capture

logger = logging.getLogger(__name__)


class FirstChunkDecoder:
    """decoder + Vocos over [B, F + L] windows of hidden states -> the first F frames' samples of each row."""

    def __init__(self, decoder: HiddenDecoder, vocos: Vocos, first_frames: int, lookahead: int, max_rows: int) -> None:
        if first_frames < 1 or lookahead < 1 or max_rows < 1:
            raise ValueError(f"need first_frames, lookahead, max_rows >= 1: {first_frames}, {lookahead}, {max_rows}")
        self.decoder, self.vocos = decoder, vocos
        self.width = first_frames + lookahead
        self.samples = 2 * vocos.hop_length * first_frames
        self.row_buckets = [1 << k for k in range(max_rows.bit_length()) if 1 << k < max_rows] + [max_rows]
        self.device = next(vocos.parameters()).device
        self.vocos_dtype = next(vocos.parameters()).dtype
        # full-length masks: the masked ISTFT (vocos.istft_rows) has no host sync, torch.istft's check has one
        self.lens = torch.full((self.max_rows,), self.width, dtype=torch.int64, device=self.device)
        self.x: Tensor | None = None  # [max_rows, C, width] in the decoder's dtype, once graphs are enabled
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.outputs: dict[int, Tensor] = {}
        self.calls = 0

    @property
    def max_rows(self) -> int:
        return self.row_buckets[-1]

    def _decode(self, x: Tensor) -> Tensor:
        """x [B, C, width] (decoder dtype) -> [B, samples] fp32. Graph-capturable."""
        lens = self.lens[: x.shape[0]]
        mel = self.decoder(x, lens)
        return self.vocos(mel.to(self.vocos_dtype), 2 * lens)[:, : self.samples].float()

    @torch.no_grad()
    def enable_graphs(self) -> None:
        """Static buffers for every row bucket and, on CUDA, one captured graph each, largest first into one
        memory pool. Off CUDA the buckets run eagerly on the same buffers (tests of the padding). A capture that
        fails leaves the plain decode (slower, the same samples) and says so."""
        try:
            self._capture_all()
        except Exception as exc:
            if self.device.type != "cuda":
                raise
            logger.warning("first-chunk vocoder graphs failed (%s: %s); decoding eagerly", type(exc).__name__, exc)
            self.x, self.graphs, self.outputs = None, {}, {}

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        c = self.decoder.hidden_size
        self.x = torch.zeros(self.max_rows, c, self.width, dtype=self.decoder.coef.dtype, device=self.device)
        pool = None
        for b in reversed(self.row_buckets):
            if self.device.type != "cuda":
                self.graphs[b] = None
                continue
            self._decode(self.x[:b])  # warm-up: cuDNN / cuFFT pick kernels and plans outside the capture
            graph = torch.cuda.CUDAGraph()
            self.outputs[b] = capture(graph, lambda b=b: self._decode(self.x[:b]), pool)
            pool = pool or graph.pool()
            graph.replay()  # a graph's first launch uploads it: not in a served step
            self.graphs[b] = graph
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            logger.info(
                "captured %d first-chunk vocoder CUDA graphs (rows 1..%d, %d frames) in %.1f s",
                len(self.graphs),
                self.max_rows,
                self.width,
                time.perf_counter() - t0,
            )

    @torch.no_grad()
    def __call__(self, frames: Tensor) -> Tensor:
        """frames [B, width, C] (any float dtype), B <= max_rows -> [B, samples] fp32 on the device. With graphs:
        a view of a static buffer, valid until the next call (stream order keeps a queued crop safe)."""
        b = frames.shape[0]
        assert frames.shape[1] == self.width and 1 <= b <= self.max_rows, (frames.shape, self.width, self.max_rows)
        self.calls += 1
        if self.x is None:
            return self._decode(frames.transpose(1, 2).to(self.decoder.coef.dtype))
        bucket = next(r for r in self.row_buckets if r >= b)
        self.x[:b].copy_(frames.transpose(1, 2))
        graph = self.graphs[bucket]
        if graph is None:
            return self._decode(self.x[:bucket])[:b]
        graph.replay()
        return self.outputs[bucket][:b]
