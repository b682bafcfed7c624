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

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ttsserve.audio.decoder_net import DVAE, HiddenDecoder
from ttsserve.audio.frame_pool import FramePool, to_device
from ttsserve.audio.vocos import Vocos


@dataclass
class AudioChunk:
    """New audio of one request. Concatenating a request's chunks in order gives its whole waveform."""

    req_id: str
    samples: np.ndarray  # float32 [num_samples] at 24 kHz
    start_sample: int  # position of samples[0] in the request's waveform
    is_final: bool  # the last chunk of the request (may be empty)


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
class _Stream:
    use_codes: bool
    slot: int
    base: int = 0  # frame index stored at pool position 0
    num_frames: int = 0  # frames appended
    num_emitted_frames: int = 0  # frames [0, num_emitted_frames) have been emitted as audio
    num_chunks: int = 0
    finished: bool = False
    final_out: bool = False  # its final chunk is decoded (maybe still in flight): nothing more to plan


@dataclass
class _Pending:
    """Chunks decoded on the device whose samples are still on their way to the host."""

    windows: list  # [_Window]: crops laid back to back in `flat`
    sizes: list[int]
    flat: Tensor  # [sum(sizes)] fp32, pinned host memory on CUDA
    event: object | None  # torch.cuda.Event recorded after the copy (None: already on the host)
    empty_finals: list  # [AudioChunk] of zero-frame requests, released in order with this decode


@dataclass
class _Window:
    req_id: str
    stream: _Stream
    start: int  # first frame decoded (a - L, or 0)
    end: int  # one past the last frame decoded
    emit_start: int  # a
    emit_end: int  # b
    is_final: bool


class AudioStage:
    """Batched streaming Decoder(or DVAE)+Vocos over many requests.

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
    """

    def __init__(self, decoder: HiddenDecoder | None, dvae: DVAE | None, vocos: Vocos, *,
                 first_chunk_frames: int = 8, max_chunk_frames: int = 64, lookahead_frames: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 net_dtype: torch.dtype | None = None, max_windows_per_call: int = 64,
                 deferred: bool = False) -> None:
        if decoder is None and dvae is None:
            raise ValueError("AudioStage needs a decoder or a dvae")
        if not (1 <= first_chunk_frames <= max_chunk_frames):
            raise ValueError(f"need 1 <= first_chunk_frames <= max_chunk_frames, got {first_chunk_frames}, "
                             f"{max_chunk_frames}")
        if lookahead_frames is not None and lookahead_frames < 1:
            # a chunk's last sample needs the next frame's first mel frame, so at least one frame
            raise ValueError(f"lookahead_frames must be None or >= 1, got {lookahead_frames}")
        param = next(vocos.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = dtype or param.dtype
        for net in (decoder, dvae, vocos):
            if net is not None and next(net.parameters()).device.type != self.device.type:
                raise ValueError(f"AudioStage: {type(net).__name__} is on {next(net.parameters()).device}, "
                                 f"not on {self.device}")
        if net_dtype is not None:
            decoder, dvae, vocos = (None if n is None else copy.deepcopy(n).to(net_dtype)
                                    for n in (decoder, dvae, vocos))
        if max_windows_per_call < 1:
            raise ValueError(f"max_windows_per_call must be >= 1, got {max_windows_per_call}")
        self.decoder, self.dvae, self.vocos = decoder, dvae, vocos
        self.max_windows_per_call = max_windows_per_call
        self.deferred = deferred
        self._pending: _Pending | None = None
        self.first_chunk_frames, self.max_chunk_frames = first_chunk_frames, max_chunk_frames
        self.samples_per_frame = 2 * vocos.hop_length
        half_width = max(net.receptive_field for net in (decoder, dvae) if net is not None) + vocos.receptive_field
        self.left_context_frames, exact_right = context_frames(half_width, vocos.n_fft, vocos.hop_length)
        self.right_context_frames = exact_right if lookahead_frames is None else lookahead_frames
        capacity = 2 * (self.left_context_frames + max_chunk_frames + self.right_context_frames)
        self._pools: dict[bool, FramePool] = {}
        if decoder is not None:
            self._pools[False] = FramePool(decoder.hidden_size, self.dtype, self.device, capacity)
        if dvae is not None:
            self._pools[True] = FramePool(dvae.num_vq, torch.long, self.device, capacity)
        self._streams: dict[str, _Stream] = {}
        self.frames_decoded_total = 0  # real frames in decoded windows (context included)
        self.frames_padded_total = 0  # B * max window length, summed over calls
        self.calls_total = 0  # batched network calls (at most one per step)
        self.chunks_total = 0

    # ---- requests ------------------------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def add_request(self, req_id: str, use_codes: bool = False) -> None:
        """Register a stream; use_codes=True feeds codes [n, 4] through the DVAE instead of hiddens."""
        if req_id in self._streams:
            raise ValueError(f"AudioStage: request {req_id!r} already exists")
        if use_codes not in self._pools:
            raise ValueError(f"AudioStage: no {'DVAE' if use_codes else 'decoder'} for request {req_id!r}")
        self._streams[req_id] = _Stream(use_codes, self._pools[use_codes].allocate())

    def append(self, req_id: str, frames: Tensor) -> None:
        """frames: [n, H] hidden states (fp32, any device) or LongTensor codes [n, 4] for a use_codes request."""
        st = self._get(req_id)
        self._check_frames(req_id, st, frames)
        n = frames.shape[0]
        if n == 0:
            return
        pool = self._reserve(st, n)
        pos = st.num_frames - st.base
        pool.data[st.slot, pos : pos + n] = frames.to(device=self.device, dtype=pool.data.dtype)
        st.num_frames += n

    def append_batch(self, req_ids: list[str], frames: Tensor) -> None:
        """One frame for each of many requests in one device write. frames: [len(req_ids), H] (or [.., 4])."""
        if frames.dim() != 2 or frames.shape[0] != len(req_ids):
            raise ValueError(f"AudioStage.append_batch: frames must be [{len(req_ids)}, C], got {tuple(frames.shape)}")
        if not req_ids:
            return
        streams = [self._get(r) for r in req_ids]
        kind = streams[0].use_codes
        if len(set(req_ids)) != len(req_ids) or any(st.use_codes != kind for st in streams):
            raise ValueError("AudioStage.append_batch: requests must be distinct and all of one kind (codes/hiddens)")
        self._check_frames(req_ids[0], streams[0], frames[:1])
        pool = self._pools[kind]
        index = np.empty((2, len(streams)), dtype=np.int64)  # (slot, position) of each new frame
        for i, st in enumerate(streams):
            if st.finished:
                raise ValueError(f"AudioStage: request {req_ids[i]!r} is finished; no more frames")
            if st.num_frames + 1 - st.base > pool.capacity:
                pool = self._reserve(st, 1)
            index[0, i], index[1, i] = st.slot, st.num_frames - st.base
            st.num_frames += 1
        idx = to_device(index, self.device)
        pool.data[idx[0], idx[1]] = frames.to(device=self.device, dtype=pool.data.dtype)

    def finish(self, req_id: str) -> None:
        """No more frames will come: the next step() flushes the tail and emits the final chunk."""
        self._get(req_id).finished = True

    def abort(self, req_id: str) -> None:
        """Drop a request and free its buffers (no-op for unknown or already completed requests)."""
        st = self._streams.pop(req_id, None)
        if st is not None:
            self._pools[st.use_codes].free.append(st.slot)

    def _get(self, req_id: str) -> _Stream:
        st = self._streams.get(req_id)
        if st is None:
            raise ValueError(f"AudioStage: unknown request {req_id!r}")
        return st

    def _check_frames(self, req_id: str, st: _Stream, frames: Tensor) -> None:
        if st.finished:
            raise ValueError(f"AudioStage: request {req_id!r} is finished; no more frames")
        width = self._pools[st.use_codes].data.shape[2]
        if frames.dim() != 2 or frames.shape[1] != width:
            raise ValueError(f"AudioStage: frames for {req_id!r} must be [n, {width}], got {tuple(frames.shape)}")
        if st.use_codes == frames.dtype.is_floating_point:
            kind = "integer codes" if st.use_codes else "float hidden states"
            raise ValueError(f"AudioStage: request {req_id!r} takes {kind}, got {frames.dtype}")

    def _reserve(self, st: _Stream, n: int) -> FramePool:
        """Make room for n more frames in the stream's slot: drop frames no window needs, grow if still short."""
        pool = self._pools[st.use_codes]
        if st.num_frames + n - st.base <= pool.capacity:
            return pool
        keep_from = max(st.base, st.num_emitted_frames - self.left_context_frames)
        if keep_from > st.base:
            pool.shift(st.slot, keep_from - st.base, st.num_frames - keep_from)
            st.base = keep_from
        need = st.num_frames + n - st.base
        if need > pool.capacity:
            pool.grow(max(2 * pool.capacity, need))
        return pool

    # ---- the step ------------------------------------------------------------------------------------
    def _chunk_frames(self, k: int) -> int:
        return min(self.first_chunk_frames << min(k, 32), self.max_chunk_frames)

    def _plan(self, req_id: str, st: _Stream) -> list[_Window]:
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

    @torch.no_grad()
    def profile_max_call(self, num_windows: int | None = None) -> None:
        """Run the largest batched call this stage makes (max_windows_per_call windows of the longest
        window) on random frames: for memory profiling, and as a warm-up of the convolution kernels."""
        b, n = num_windows or self.max_windows_per_call, self.max_window_frames
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

    def _ready(self, st: _Stream) -> bool:
        """Cheap pre-check of _plan: can this stream emit a window now?"""
        if st.finished:
            return True
        return st.num_frames - st.num_emitted_frames >= self._chunk_frames(st.num_chunks) + self.right_context_frames

    def step(self) -> list[AudioChunk]:
        """Decode every ready window of every request in batched calls; returns the new chunks, in order per
        request. A finished request's last chunk has is_final=True (empty for a zero-frame request).

        deferred: this step's decode is only queued; the chunks returned are those of the previous step."""
        pending = self._launch()
        if not self.deferred:
            return self._collect(pending)
        done = self._collect(self._pending)
        self._pending = pending
        return done

    def flush(self) -> list[AudioChunk]:
        """Chunks still in flight (deferred mode), waiting for the device."""
        pending, self._pending = self._pending, None
        return self._collect(pending)

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def _launch(self) -> _Pending | None:
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
                start = max(0, self.samples_per_frame * st.num_frames - self.vocos.hop_length)
                empty.append(AudioChunk(req_id, np.zeros(0, np.float32), start, True))
                st.final_out = True
        for w in windows:
            w.stream.num_emitted_frames = w.emit_end
            w.stream.num_chunks += 1
        if not windows and not empty:
            return None
        pieces, sizes = [], []
        for i in range(0, len(windows), self.max_windows_per_call):
            flat, n = self._decode(windows[i:i + self.max_windows_per_call])
            pieces.append(flat)
            sizes.extend(n)
        flat, event = self._to_host(pieces)
        return _Pending(windows, sizes, flat, event, empty)

    def _to_host(self, pieces: list[Tensor]) -> tuple[Tensor, object | None]:
        if not pieces:
            return torch.zeros(0), None
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if flat.device.type != "cuda":
            return flat.cpu(), None
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _collect(self, pending: _Pending | None) -> list[AudioChunk]:
        if pending is None:
            return []
        if pending.event is not None:
            pending.event.synchronize()
        # a copy: the chunks must not pin the (pinned, pooled) transfer buffer
        pieces = np.split(pending.flat.numpy().copy(), np.cumsum(pending.sizes)[:-1]) if pending.sizes else []
        spf = self.samples_per_frame
        chunks = [AudioChunk(w.req_id, p, spf * w.emit_start, w.is_final) for w, p in zip(pending.windows, pieces)]
        chunks += pending.empty_finals
        for ch in chunks:
            if ch.is_final:
                self.abort(ch.req_id)
        self.chunks_total += len(chunks)
        return chunks

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
            x = x.transpose(1, 2)  # [B, C, N]
            lens_t = to_device(lens, self.device)
            if use_codes:
                mels.append(self.dvae.decode_codes(x, lens_t))
            else:
                mels.append(self.decoder(x.to(self.decoder.coef.dtype), lens_t))
            lengths.extend(lens)
            order.extend(rows)
        t = max(m.shape[-1] for m in mels)
        dtype = next(self.vocos.parameters()).dtype
        mel = torch.cat([F.pad(m.to(dtype), (0, t - m.shape[-1])) for m in mels])
        wav = self.vocos(mel, 2 * to_device(lengths, self.device))  # [B, hop * (t - 1)]
        self.calls_total += 1
        self.frames_decoded_total += sum(lengths)
        self.frames_padded_total += len(lengths) * (t // 2)
        if any(a is not b for a, b in zip(order, windows)):  # both kinds: back to `windows` order
            rank = {id(w): i for i, w in enumerate(order)}
            wav = wav[to_device([rank[id(w)] for w in windows], wav.device)]
        return self._crop(windows, wav)

    def _crop(self, windows: list[_Window], wav: Tensor) -> tuple[Tensor, list[int]]:
        """The emitted part of each row, back to back: ([sum(sizes)] fp32 on wav's device, sizes). No sync:
        the gather index is built on the device from per-row (start, size) with a known output size."""
        spf, hop = self.samples_per_frame, self.vocos.hop_length
        starts = [spf * (w.emit_start - w.start) for w in windows]
        # a final chunk runs to the utterance's end, spf * n - hop, which is also the window's end
        sizes = [spf * (w.emit_end - w.start) - (hop if w.is_final else 0) - a for w, a in zip(windows, starts)]
        total = sum(sizes)
        dev = wav.device
        info = to_device([starts, sizes, np.cumsum([0] + sizes[:-1]).tolist()], dev)
        row = torch.repeat_interleave(torch.arange(len(windows), device=dev), info[1], output_size=total)
        col = torch.arange(total, device=dev) - info[2][row] + info[0][row]
        return wav.reshape(-1)[row * wav.shape[1] + col].float(), sizes
