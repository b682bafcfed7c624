"""The batched streaming vocoder stage: the "detokenizer" of the engine.

Each request streams frames (one GPT hidden state [H], or 4 codes for the DVAE path, per frame). `step()` decodes
every ready window of every request in ONE zero-padded batch (Decoder/DVAE then Vocos, with per-row masks so
padding never reaches a real row) and returns the new audio as `AudioChunk`s, with one device-to-host copy.

Exactness. Frame f owns samples [spf*f, spf*(f+1)) (spf = 2*hop = 512); the utterance has spf*n - hop samples.
A chunk emits frames [a, b) from a window [a - L, b + R] of frames. Every conv is zero padded, so a window
differs from the one-shot decode only within the receptive field of its edges; with L and R from
`context_frames()` (52 / 52 for the real model) the cropped samples are exactly the one-shot ones. A window that
starts at frame 0 or ends at the last frame of a finished request has the same edges (conv zero padding, ISTFT
center padding, the final -hop samples) as the one-shot decode, so no context is needed there.

Work per frame is bounded: frames older than a - L are dropped, each window is at most L + max_chunk + R frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ttsserve.audio.decoder_net import DVAE, HiddenDecoder
from ttsserve.audio.stream_base import (
    AudioChunk,
    ChunkSpec,
    Pending,
    Stream,
    StreamingStage,
    crop_rows,
    on_stage_stream,
)
from ttsserve.audio.vocos import Vocos
from ttsserve.h2d import to_device

__all__ = ["AudioChunk", "AudioStage", "context_frames"]

# With shape buckets, a call's window width is padded to a multiple of this many frames (and its rows to a power
# of two): on CUDA the eager networks' first call of a (rows, width) took 170-330 ms against 5-12 ms for the next
# (H100, benchmarks/vocoder_stage_profile.py --shape-sweep), and served windows come in every width.
SHAPE_FRAME_STEP = 16


def context_frames(mel_half_width: int, n_fft: int, hop: int) -> tuple[int, int]:
    """(left, right) frames of context that make a cropped window exact.

    mel_half_width: mel frames each side that one spectrum frame depends on (decoder + Vocos convs).
    Frame f feeds mel frames 2f, 2f+1, hence spectrum frames [2f - W, 2f + 1 + W], hence samples
    [hop*(2f - W) - n_fft/2, hop*(2f + 1 + W) + n_fft/2 - 1]. Left: frame a - L - 1 must not reach sample
    2*hop*a; right: frame b + R must not reach sample 2*hop*b - 1.
    """
    w, half, spf = mel_half_width, n_fft // 2, 2 * hop
    left = (hop * (w - 1) + half - 1) // spf + 1
    right = (hop * w + half - 1) // spf + 1
    return left, right


@dataclass
class _Window:
    req_id: str
    stream: Stream
    start: int  # first frame decoded (a - L, or 0)
    end: int  # one past the last frame decoded
    emit_start: int  # a
    emit_end: int  # b
    is_final: bool


class AudioStage(StreamingStage):
    """Batched streaming Decoder(or DVAE)+Vocos over many requests, by overlapping windows.

    first_chunk_frames / max_chunk_frames: chunk k emits min(first * 2^k, max) frames.
    lookahead_frames: right context; None = exact (from the receptive field). Smaller values lower the time to
        first audio (a chunk waits for its frames plus the right context) at the cost of small seams.
    device: where the frame buffers live and the networks run (the networks must already be there); default:
        the device of `vocos`' parameters.
    dtype: storage dtype of the hidden-state buffer (e.g. bf16 to halve it); windows are cast to the networks'
        own dtype before decoding. Default: the dtype of `vocos`' parameters.
    net_dtype: run the Decoder / DVAE / Vocos backbone in this dtype (cast copies; the ISTFT stays fp32);
        None: as given.
    max_windows_per_call: windows decoded per batched network call (bounds the activation memory).
    deferred: step() returns the chunks of the PREVIOUS step's decode and leaves this step's on the device
        (decode kernels queued, device-to-host copy in flight), so the vocoder overlaps the caller's next
        CPU work; flush() returns what is still in flight. The engine turns it on for CUDA.
    shape_buckets: pad each call to a few (rows, width) shapes (_bucketed); default: on CUDA, where a new shape
        costs a first use, not on the CPU, where padding costs compute.
    """

    def __init__(
        self,
        decoder: HiddenDecoder | None,
        dvae: DVAE | None,
        vocos: Vocos,
        *,
        first_chunk_frames: int = 8,
        max_chunk_frames: int = 64,
        lookahead_frames: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        net_dtype: torch.dtype | None = None,
        max_windows_per_call: int = 64,
        deferred: bool = False,
        shape_buckets: bool | None = None,
    ) -> None:
        if lookahead_frames is not None and lookahead_frames < 1:
            # a chunk's last sample needs the next frame's first mel frame, so at least one frame
            raise ValueError(f"lookahead_frames must be None or >= 1, got {lookahead_frames}")
        nets = [n for n in (decoder, dvae) if n is not None]
        if not nets:
            raise ValueError("AudioStage needs a decoder or a dvae")
        half_width = max(net.receptive_field for net in nets) + vocos.receptive_field
        left, exact_right = context_frames(half_width, vocos.n_fft, vocos.hop_length)
        right = exact_right if lookahead_frames is None else lookahead_frames
        super().__init__(
            decoder,
            dvae,
            vocos,
            first_chunk_frames=first_chunk_frames,
            max_chunk_frames=max_chunk_frames,
            device=device,
            dtype=dtype,
            net_dtype=net_dtype,
            max_windows_per_call=max_windows_per_call,
            deferred=deferred,
            pool_capacity=2 * (left + max_chunk_frames + right),
        )
        self.left_context_frames, self.right_context_frames = left, right
        self.shape_buckets = self.device.type == "cuda" if shape_buckets is None else shape_buckets

    def _first_needed_frame(self, st: Stream) -> int:
        return st.num_emitted_frames - self.left_context_frames

    # ---- the step ------------------------------------------------------------------------------------
    def _plan(self, req_id: str, st: Stream) -> list[_Window]:
        """Every window of this stream that can be emitted now, in order."""
        windows = []
        a, k, n = st.num_emitted_frames, st.num_chunks, st.num_frames
        left, right = self.left_context_frames, self.right_context_frames
        while a < n:
            c = self._chunk_frames(k)
            if st.finished:
                b = n if n <= a + c + right else a + c  # a short tail joins this chunk: same window size
            elif a + c + right <= n:
                b = a + c
            else:
                break
            windows.append(_Window(req_id, st, max(0, a - left), min(n, b + right), a, b, st.finished and b == n))
            a, k = b, k + 1
        return windows

    @property
    def max_window_frames(self) -> int:
        return self.left_context_frames + self.max_chunk_frames + self.right_context_frames

    @on_stage_stream
    def profile_max_call(self, num_windows: int | None = None) -> None:
        """Run the largest batched call this stage makes (max_windows_per_call windows of the longest
        window) on random frames: for memory profiling, and as a warm-up of the convolution kernels."""
        self._scratch_call(num_windows or self.max_windows_per_call, self.max_window_frames)

    @on_stage_stream
    def warm_chunk_shapes(self, rows: int = 1) -> None:
        """One call of `rows` windows per window length the chunks of streams started together make (they grow
        with the left context until it is full): a call of a new shape pays the convolutions' first use."""
        sizes, a = set(), 0
        for k in range(33):
            c = self._chunk_frames(k)
            sizes.add(min(a, self.left_context_frames) + c + self.right_context_frames)
            a += c
            if a >= self.left_context_frames and c == self.max_chunk_frames:
                break
        for n in sorted(sizes):
            self._scratch_call(rows, n)

    @torch.no_grad()
    def _scratch_call(self, b: int, n: int) -> None:
        """b windows of n random frames through the networks (no stream state: windows have none)."""
        lens = to_device([n] * b, self.device)
        mels = []
        if self.decoder is not None:
            x = torch.randn(b, self.decoder.hidden_size, n, device=self.device, dtype=self.decoder.coef.dtype)
            mels.append(self.decoder(x, lens))
        if self.dvae is not None:
            codes = torch.randint(0, 2, (b, self.dvae.num_vq, n), device=self.device)
            mels.append(self.dvae.decode_codes(codes, lens))
        dtype = next(self.vocos.parameters()).dtype
        for mel in mels:
            self.vocos(mel.to(dtype), 2 * lens)

    def _ready(self, st: Stream) -> bool:
        """Cheap pre-check of _plan: can this stream emit a window now?"""
        if st.finished:
            return True
        return st.num_frames - st.num_emitted_frames >= self._chunk_frames(st.num_chunks) + self.right_context_frames

    def _launch(self) -> Pending | None:
        windows: list[_Window] = []
        empty: list[AudioChunk] = []
        for req_id, st in self._streams.items():
            if st.final_out or (st.num_emitted_frames == st.num_frames and not st.finished):
                continue
            planned = self._plan(req_id, st) if self._ready(st) else []
            windows.extend(planned)
            if planned and planned[-1].is_final:
                st.final_out = True
            elif st.finished and st.num_emitted_frames == st.num_frames and not planned:
                empty.append(self._empty_final(req_id, st))
        for w in windows:
            w.stream.num_emitted_frames = w.emit_end
            w.stream.num_chunks += 1
        if not windows and not empty:
            return None
        pieces, sizes = [], []
        for i in range(0, len(windows), self.max_windows_per_call):
            flat, n = self._decode(windows[i : i + self.max_windows_per_call])
            pieces.append(flat)
            sizes.extend(n)
        flat, event = self._to_host(pieces)
        specs = [ChunkSpec(w.req_id, self.samples_per_frame * w.emit_start, w.is_final) for w in windows]
        return Pending(specs, sizes, flat, event, empty)

    @torch.no_grad()
    def _decode(self, windows: list[_Window]) -> tuple[Tensor, list[int]]:
        """Decoder/DVAE on each kind's rows, one Vocos call on all rows, crop -> (flat fp32 samples on the
        device, the rows' crop sizes in `windows` order)."""
        mels, lengths, order = [], [], []
        for use_codes, pool in self._pools.items():
            rows = [w for w in windows if w.stream.use_codes == use_codes]
            if not rows:
                continue
            lens = [w.end - w.start for w in rows]
            x = pool.gather([w.stream.slot for w in rows], [w.start - w.stream.base for w in rows], lens)
            x, padded_lens = self._bucketed(x.transpose(1, 2), lens, SHAPE_FRAME_STEP)  # [B', C, N']
            lens_t = to_device(padded_lens, self.device)
            if use_codes:
                mel = self.dvae.decode_codes(x, lens_t)
            else:
                mel = self.decoder(x.to(self.decoder.coef.dtype), lens_t)
            mels.append(mel[: len(rows)])
            lengths.extend(lens)
            order.extend(rows)
        t = max(m.shape[-1] for m in mels)
        dtype = next(self.vocos.parameters()).dtype
        mel = torch.cat([F.pad(m.to(dtype), (0, t - m.shape[-1])) for m in mels])
        mel, padded_lens = self._bucketed(mel, lengths, 2 * SHAPE_FRAME_STEP)  # 2 mel frames a frame
        wav = self.vocos(mel, 2 * to_device(padded_lens, self.device))[: len(lengths)]  # [B, hop * (t' - 1)]
        self.calls_total += 1
        self.frames_decoded_total += sum(lengths)
        self.frames_padded_total += len(lengths) * (t // 2)
        if any(a is not b for a, b in zip(order, windows)):  # both kinds: back to `windows` order
            rank = {id(w): i for i, w in enumerate(order)}
            wav = wav[to_device([rank[id(w)] for w in windows], wav.device)]
        return self._crop(windows, wav)

    def _bucketed(self, x: Tensor, lens: list[int], step: int) -> tuple[Tensor, list[int]]:
        """x [B, C, N] -> (x zero padded to [B', C, N'], lens + zeros for the new rows): with shape_buckets, B'
        the next power of two (at most max_windows_per_call) and N' the next multiple of `step`, so the calls
        reuse a few shapes; the length masks keep the padding out of every real row."""
        if not self.shape_buckets:
            return x, lens
        b, n = x.shape[0], x.shape[-1]
        rows = min(1 << (b - 1).bit_length(), max(b, self.max_windows_per_call))
        width = -(-n // step) * step
        return F.pad(x, (0, width - n, 0, 0, 0, rows - b)), lens + [0] * (rows - b)

    def _crop(self, windows: list[_Window], wav: Tensor) -> tuple[Tensor, list[int]]:
        """The emitted part of each row, back to back: ([sum(sizes)] fp32 on wav's device, sizes)."""
        spf, hop = self.samples_per_frame, self.vocos.hop_length
        starts = [spf * (w.emit_start - w.start) for w in windows]
        # a final chunk runs to the utterance's end, spf * n - hop, which is also the window's end
        sizes = [spf * (w.emit_end - w.start) - (hop if w.is_final else 0) - a for w, a in zip(windows, starts)]
        return crop_rows(wav, starts, sizes), sizes
