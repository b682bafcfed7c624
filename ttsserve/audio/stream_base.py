"""What every streaming vocoder stage shares: the request registry, frame appends, and the deferred hand-off.

Two stages build on it (both exact unless a lookahead is set):
- `AudioStage` (audio/stage.py): decodes overlapping windows, each with L + R frames of context.
- `IncrementalAudioStage` (audio/incremental_stage.py): every conv keeps the tail of its input per request,
  so each frame is decoded once. The engine's default for exact streaming.

On CUDA a stage may queue its device work on a stream of its own (`use_own_stream`), so its kernels run beside
the GPT's instead of after them. Every kernel that touches the stage's buffers (frame pool, conv states, static
graph inputs) is then on that stream, in host order: appends, shifts and growths of the pool, calls, crops and
copies to the host. What crosses streams: the appended frames (the stream waits for the producer's event, and the
tensor's memory is kept until the stream has read it) and the audio (an event after each call's copy to the host).
"""

from __future__ import annotations

import copy
import functools
from collections import deque
from dataclasses import dataclass
from itertools import accumulate, compress
from operator import add, attrgetter

import numpy as np
import torch
from torch import Tensor

from ttsserve.audio.decoder_net import DVAE, HiddenDecoder
from ttsserve.audio.frame_pool import FramePool
from ttsserve.audio.vocos import Vocos
from ttsserve.h2d import to_device


@dataclass
class AudioChunk:
    """New audio of one request. Concatenating a request's chunks in order gives its whole waveform."""

    req_id: str
    samples: np.ndarray  # float32 [num_samples] at 24 kHz
    start_sample: int  # position of samples[0] in the request's waveform
    is_final: bool  # the last chunk of the request (may be empty)


@dataclass
class Stream:
    use_codes: bool
    slot: int
    base: int = 0  # frame index stored at pool position 0
    num_frames: int = 0  # frames appended
    num_emitted_frames: int = 0  # windowed stage: frames emitted; incremental stage: frames fed to the nets
    num_chunks: int = 0
    finished: bool = False
    final_out: bool = False  # its final chunk is decoded (maybe still in flight): nothing more to plan
    num_emitted_samples: int = 0  # incremental stage: samples emitted so far


_USE_CODES, _FINISHED, _SLOT = attrgetter("use_codes"), attrgetter("finished"), attrgetter("slot")
_REQ_ID, _START, _IS_FINAL = attrgetter("req_id"), attrgetter("start_sample"), attrgetter("is_final")


@dataclass
class ChunkSpec:
    """Where a decoded row's crop goes: one AudioChunk once its samples reach the host."""

    req_id: str
    start_sample: int
    is_final: bool


@dataclass
class Pending:
    """Chunks decoded on the device whose samples are still on their way to the host."""

    specs: list[ChunkSpec]  # crops laid back to back in `flat`, in this order
    sizes: list[int]
    flat: Tensor  # [sum(sizes)] fp32, pinned host memory on CUDA
    event: object | None  # torch.cuda.Event recorded after the copy (None: already on the host)
    empty_finals: list  # [AudioChunk] of zero-frame requests, released in order with this decode


def crop_rows(wav: Tensor, starts: list[int], sizes: list[int]) -> Tensor:
    """Row b's samples [starts[b], starts[b] + sizes[b]) of wav [B, S], back to back, as fp32 on wav's device.
    No sync: the gather index is built on the device with a known output size."""
    total, dev = sum(sizes), wav.device
    info = to_device([starts, sizes, np.cumsum([0] + sizes[:-1]).tolist()], dev)
    row = torch.repeat_interleave(torch.arange(len(sizes), device=dev), info[1], output_size=total)
    col = torch.arange(total, device=dev) - info[2][row] + info[0][row]
    return wav.reshape(-1)[row * wav.shape[1] + col].float()


def on_stage_stream(method):
    """Run a stage method's device work on the stage's stream (StreamingStage.stream; None: the caller's)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.stream is None:
            return method(self, *args, **kwargs)
        with torch.cuda.stream(self.stream):
            return method(self, *args, **kwargs)

    return wrapper


class StreamingStage:
    """Requests, their frame buffers and the step protocol; subclasses plan and decode (`_launch`)."""

    def __init__(
        self,
        decoder: HiddenDecoder | None,
        dvae: DVAE | None,
        vocos: Vocos,
        *,
        first_chunk_frames: int,
        max_chunk_frames: int,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        net_dtype: torch.dtype | None,
        max_windows_per_call: int,
        deferred: bool,
        pool_capacity: int,
    ) -> None:
        if decoder is None and dvae is None:
            raise ValueError("AudioStage needs a decoder or a dvae")
        if not (1 <= first_chunk_frames <= max_chunk_frames):
            raise ValueError(
                f"need 1 <= first_chunk_frames <= max_chunk_frames, got {first_chunk_frames}, {max_chunk_frames}"
            )
        if max_windows_per_call < 1:
            raise ValueError(f"max_windows_per_call must be >= 1, got {max_windows_per_call}")
        param = next(vocos.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = dtype or param.dtype
        for net in (decoder, dvae, vocos):
            if net is not None and next(net.parameters()).device.type != self.device.type:
                raise ValueError(
                    f"AudioStage: {type(net).__name__} is on {next(net.parameters()).device}, not on {self.device}"
                )
        if net_dtype is not None:
            decoder, dvae, vocos = (
                None if n is None else copy.deepcopy(n).to(net_dtype) for n in (decoder, dvae, vocos)
            )
        self.decoder, self.dvae, self.vocos = decoder, dvae, vocos
        self.max_windows_per_call = max_windows_per_call
        self.deferred = deferred
        self._in_flight: deque[Pending] = deque()  # deferred calls not yet read back, oldest first
        self.first_chunk_frames, self.max_chunk_frames = first_chunk_frames, max_chunk_frames
        self.samples_per_frame = 2 * vocos.hop_length
        self._pools: dict[bool, FramePool] = {}
        if decoder is not None:
            self._pools[False] = FramePool(decoder.hidden_size, self.dtype, self.device, pool_capacity)
        if dvae is not None:
            self._pools[True] = FramePool(dvae.num_vq, torch.long, self.device, pool_capacity)
        self._streams: dict[str, Stream] = {}
        self.stream: torch.cuda.Stream | None = None  # use_own_stream()
        self.reset_stats()

    def use_own_stream(self) -> None:
        """From now on queue the stage's device work on a CUDA stream of its own (no-op off CUDA), so a call runs
        beside the GPT step queued before it (module docstring)."""
        if self.device.type == "cuda" and self.stream is None:
            torch.cuda.synchronize(self.device)  # work queued on the caller's stream so far is done
            self.stream = torch.cuda.Stream(self.device)

    def reset_stats(self) -> None:
        self.frames_decoded_total = 0  # real frames in decoded rows (context included)
        self.frames_padded_total = 0  # B * max row length, summed over calls
        self.calls_total = 0  # batched network calls
        self.chunks_total = 0
        self.collects_total = self.polled_total = 0  # deferred calls read back; those of them poll() handed out

    # ---- requests ------------------------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self._streams)

    @on_stage_stream
    def add_request(self, req_id: str, use_codes: bool = False) -> None:
        """Register a stream; use_codes=True feeds codes [n, 4] through the DVAE instead of hiddens."""
        if req_id in self._streams:
            raise ValueError(f"AudioStage: request {req_id!r} already exists")
        if use_codes not in self._pools:
            raise ValueError(f"AudioStage: no {'DVAE' if use_codes else 'decoder'} for request {req_id!r}")
        self._streams[req_id] = Stream(use_codes, self._pools[use_codes].allocate())

    def append(self, req_id: str, frames: Tensor, ready=None) -> None:
        """frames: [n, H] hidden states (fp32, any device) or LongTensor codes [n, 4] for a use_codes request.
        ready: as append_batch's."""
        st = self._get(req_id)
        self._check_frames(req_id, st, frames)
        n = frames.shape[0]
        if n == 0:
            return
        self._hand_over(frames, ready)
        self._write(st, frames)
        st.num_frames += n

    @on_stage_stream
    def _write(self, st: Stream, frames: Tensor) -> None:
        n = frames.shape[0]
        pool = self._reserve(st, n)
        pos = st.num_frames - st.base
        pool.data[st.slot, pos : pos + n] = frames.to(device=self.device, dtype=pool.data.dtype)

    def _hand_over(self, frames: Tensor, ready) -> None:
        """With a stream of its own: the stage's stream waits until the frames are written (ready: a CUDA event
        recorded after their producer, e.g. RunnerOutput.done; None: all the caller's stream has queued), and
        their memory is not reused before that stream has read them. Without one: nothing."""
        if self.stream is None or frames.device.type != "cuda":
            return
        if ready is None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            self.stream.wait_event(ready)
        frames.record_stream(self.stream)

    def append_batch(self, req_ids: list[str], frames: Tensor, counts: np.ndarray | None = None, ready=None) -> None:
        """One frame (frames [len(req_ids), C]) or m frames (frames [m, len(req_ids), C], step-major: a decode
        burst's) for each of many requests, in one device write. C: the hidden size (or 4 codes).
        counts: int [len(req_ids)], request i takes frames[:counts[i], i] only (0: none, and its id need not be
        live: a row whose results were dropped); None: all m each. ready: a CUDA event after the frames'
        producer (the stage's own stream waits on it; None: on everything the caller's stream has queued).

        Called every engine step for every running stream: the per-stream work is C-level maps and one
        Python loop, the device work one pinned copy of the write index and one index_copy_ (FramePool.put;
        with counts below m, an index_select of the kept frames too)."""
        self._hand_over(frames, ready)
        self._append_batch(req_ids, frames, counts)

    @on_stage_stream
    def _append_batch(self, req_ids: list[str], frames: Tensor, counts: np.ndarray | None) -> None:
        n = len(req_ids)
        if frames.dim() == 2:
            frames = frames[None]
        if frames.dim() != 3 or frames.shape[1] != n:
            raise ValueError(
                f"AudioStage.append_batch: frames must be [{n}, C] or [m, {n}, C], got {tuple(frames.shape)}"
            )
        m = frames.shape[0]
        cols = None  # the columns of frames the kept requests are (None: all, in order)
        if counts is not None and int(counts.min(initial=m)) < m:
            cols = np.flatnonzero(counts > 0)
            req_ids, counts = [req_ids[i] for i in cols.tolist()], counts[cols]
        if not req_ids or not m:
            return
        try:
            streams = list(map(self._streams.__getitem__, req_ids))
        except KeyError as e:
            raise ValueError(f"AudioStage: unknown request {e.args[0]!r}") from None
        self._check_batch(req_ids, streams, frames[0])
        pool = self._pools[streams[0].use_codes]
        num_new = [m] * len(streams) if cols is None else counts.tolist()
        pos = [st.num_frames - st.base for st in streams]  # pool position of each request's first new frame
        if max(map(add, pos, num_new)) > pool.capacity:
            self._reserve_many(pool, streams, pos, num_new)
        for st, k in zip(streams, num_new):
            st.num_frames += k
        slots, first = np.fromiter(map(_SLOT, streams), np.int64, len(streams)), np.array(pos, dtype=np.int64)
        if cols is not None:  # frame j of kept request i, step-major; its source row j * n + cols[i]
            j, i = np.nonzero(np.arange(m)[:, None] < counts[None, :])
            pool.put(slots[i], first[i] + j, frames.reshape(m * n, -1), src=j * n + cols[i])
        elif m == 1:
            pool.put(slots, first, frames[0])
        else:
            pool.put(np.tile(slots, m), (first[None, :] + np.arange(m)[:, None]).reshape(-1), frames.reshape(m * n, -1))

    def _check_batch(self, req_ids: list[str], streams: list[Stream], frame: Tensor) -> None:
        """Distinct requests of one kind, none finished, and frames of their pool's width and dtype."""
        kind = streams[0].use_codes
        n = len(streams)
        if len(set(req_ids)) != n or sum(map(_USE_CODES, streams)) != (n if kind else 0):
            raise ValueError("AudioStage.append_batch: requests must be distinct and all of one kind (codes/hiddens)")
        if any(map(_FINISHED, streams)):
            done = next(r for r, st in zip(req_ids, streams) if st.finished)
            raise ValueError(f"AudioStage: request {done!r} is finished; no more frames")
        self._check_frames(req_ids[0], streams[0], frame)

    def finish(self, req_id: str) -> None:
        """No more frames will come: the next step() flushes the tail and emits the final chunk."""
        self._get(req_id).finished = True

    def abort(self, req_id: str) -> None:
        """Drop a request and free its buffers (no-op for unknown or already completed requests)."""
        st = self._streams.pop(req_id, None)
        if st is not None:
            self._pools[st.use_codes].free.append(st.slot)

    def _get(self, req_id: str) -> Stream:
        st = self._streams.get(req_id)
        if st is None:
            raise ValueError(f"AudioStage: unknown request {req_id!r}")
        return st

    def _check_frames(self, req_id: str, st: Stream, frames: Tensor) -> None:
        if st.finished:
            raise ValueError(f"AudioStage: request {req_id!r} is finished; no more frames")
        width = self._pools[st.use_codes].data.shape[2]
        if frames.dim() != 2 or frames.shape[1] != width:
            raise ValueError(f"AudioStage: frames for {req_id!r} must be [n, {width}], got {tuple(frames.shape)}")
        if st.use_codes == frames.dtype.is_floating_point:
            kind = "integer codes" if st.use_codes else "float hidden states"
            raise ValueError(f"AudioStage: request {req_id!r} takes {kind}, got {frames.dtype}")

    def _reserve(self, st: Stream, n: int) -> FramePool:
        """Make room for n more frames in the stream's slot: drop frames no call needs, grow if still short."""
        pool = self._pools[st.use_codes]
        if st.num_frames + n - st.base <= pool.capacity:
            return pool
        keep_from = max(st.base, self._first_needed_frame(st))
        if keep_from > st.base:
            pool.shift(st.slot, keep_from - st.base, st.num_frames - keep_from)
            st.base = keep_from
        need = st.num_frames + n - st.base
        if need > pool.capacity:
            pool.grow(max(2 * pool.capacity, need))
        return pool

    def _reserve_many(self, pool: FramePool, streams: list[Stream], pos: list[int], num_new: list[int]) -> None:
        """_reserve() of each stream whose pos[i] + num_new[i] passes the pool's capacity, updating pos: their
        shifts in one batched move (a stream shifts about once per chunk it emits: a move per stream was two
        device ops for ~1/16 of the streams every step), then one growth to the largest need if any is short."""
        short = [i for i in range(len(streams)) if pos[i] + num_new[i] > pool.capacity]
        moves = []
        for i in short:
            st = streams[i]
            keep_from = max(st.base, self._first_needed_frame(st))
            if keep_from > st.base:
                moves.append((st.slot, keep_from - st.base, st.num_frames - keep_from))
                st.base = keep_from
            pos[i] = st.num_frames - st.base
        if moves:
            pool.shift_many(*map(list, zip(*moves)))
        need = max(pos[i] + num_new[i] for i in short)
        if need > pool.capacity:
            pool.grow(max(2 * pool.capacity, need))  # positions kept

    def _first_needed_frame(self, st: Stream) -> int:
        """Frames before this one will never be read again."""
        raise NotImplementedError

    # ---- the step ------------------------------------------------------------------------------------
    def _chunk_frames(self, k: int) -> int:
        return min(self.first_chunk_frames << min(k, 32), self.max_chunk_frames)

    @on_stage_stream
    def step(self) -> list[AudioChunk]:
        """Decode what every request can emit now, in batched calls; returns the new chunks, in order per
        request. A finished request's last chunk has is_final=True (empty for a zero-frame request).

        deferred: this step's decode is only queued; the chunks returned are those of earlier steps' calls
        that the device has finished (the previous step's on the CPU, where a call is done when queued).
        A call still running is not waited for, unless MAX_IN_FLIGHT calls would then be in flight: waiting
        held the engine's host loop for the vocoder's device time every step (12% of the served core's
        time), while the next step's host work can run beside it."""
        pending = self._launch()
        if not self.deferred:
            return self._collect(pending)
        done = self._collect_finished(must=len(self._in_flight) + 1 - self.MAX_IN_FLIGHT)
        if pending is not None:
            self._in_flight.append(pending)
        return done

    MAX_IN_FLIGHT = 2  # deferred calls queued and not read back, this step's included

    def poll(self) -> list[AudioChunk]:
        """Deferred mode: the chunks of the calls in flight that the device has finished (never waits), in
        order. The engine polls in mid-step, so a call's audio leaves once it exists."""
        n = self.collects_total
        done = self._collect_finished(must=0)
        self.polled_total += self.collects_total - n
        return done

    def flush(self) -> list[AudioChunk]:
        """Chunks still in flight (deferred mode), waiting for the device."""
        return self._collect_finished(must=len(self._in_flight))

    @property
    def has_pending(self) -> bool:
        return bool(self._in_flight)

    def _collect_finished(self, must: int) -> list[AudioChunk]:
        """Read back the oldest calls in flight: the first `must` of them whatever it takes (waiting for the
        device), then while the next one is finished. Calls leave in launch order: a request's chunks stay
        in order."""
        done: list[AudioChunk] = []
        queue = self._in_flight
        while queue and (must > 0 or queue[0].event is None or queue[0].event.query()):
            done += self._collect(queue.popleft())
            must -= 1
        return done

    def _launch(self) -> Pending | None:
        raise NotImplementedError

    def _empty_final(self, req_id: str, st: Stream) -> AudioChunk:
        """The final chunk of a request with nothing left to decode (no frames at all, or all emitted)."""
        st.final_out = True
        start = max(0, self.samples_per_frame * st.num_frames - self.vocos.hop_length)
        return AudioChunk(req_id, np.zeros(0, np.float32), start, True)

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

    def _collect(self, pending: Pending | None) -> list[AudioChunk]:
        if pending is None:
            return []
        self.collects_total += 1
        if pending.event is not None:
            pending.event.synchronize()
        # a copy per chunk, by C-level maps: a chunk (and the output that passes its samples on) must keep neither
        # the (pinned, pooled) transfer buffer nor its call's other chunks alive; an output may wait long in a
        # slow client's queue
        flat, specs = pending.flat.numpy(), pending.specs
        ends = list(accumulate(pending.sizes))
        pieces = map(np.ndarray.copy, map(flat.__getitem__, map(slice, [0, *ends], ends)))
        chunks = list(map(AudioChunk, map(_REQ_ID, specs), pieces, map(_START, specs), map(_IS_FINAL, specs)))
        chunks += pending.empty_finals
        for ch in compress(chunks, map(_IS_FINAL, chunks)):
            self.abort(ch.req_id)
        self.chunks_total += len(chunks)
        return chunks
