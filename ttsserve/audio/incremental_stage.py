"""The incremental vocoder stage: exact streaming audio that decodes every frame once (audio/incremental.py).

Same interface and chunk contract as the windowed `AudioStage`. A request's first call waits for its first chunk
plus `right_context_frames` (52 for the real model: the conv stack's lag and half an FFT), later calls feed only
the frames that came since (chunk k: min(first * 2^k, max) frames); a finished request is fed zero frames past
its end until its last sample is final. Per stream it keeps each conv's input tail (about 0.4 MB for the real
model in fp32) instead of the L + R = 104 frames of context the windowed stage re-decodes with every chunk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from ttsserve.audio.call_plan import plan_calls
from ttsserve.audio.decoder_net import DVAE, HiddenDecoder, halves_to_frames
from ttsserve.audio.first_chunk import EarlyChunkDecoder, EarlyChunks, early_chunk_ends
from ttsserve.audio.incremental import (
    NOT_FINISHED,
    IncrementalDecoder,
    IncrementalVocos,
    Rows,
)
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

# A graphed call's fixed device cost in (row, frame) cells of its bucket (audio/call_plan.py): calls are cut
# where the cut saves more cells than this. Real size, fp16 networks, H100: a replay took 0.515 ms + 0.604 us a
# cell, 0.57 ms for (1, 8) to 9.58 ms for (128, 116) (vocoder_stage_profile.py --bucket-costs)
REPLAY_CELLS = 853

# rows of one early-chunk call: a step starts a few streams (about 2 at 512 H100 streams), a burst takes several
# calls, and each power-of-two row bucket is a CUDA graph
EARLY_MAX_ROWS = 32

if TYPE_CHECKING:
    from ttsserve.audio.vocoder_graphs import VocoderGraphs


@dataclass
class _Feed:
    """One row of a call: `count` frames of a stream from frame `stream.num_emitted_frames` on (zeros past its end)."""

    req_id: str
    stream: Stream
    count: int


class IncrementalAudioStage(StreamingStage):
    """Batched, exact, streaming Decoder(or DVAE)+Vocos that decodes each frame once.

    Arguments as AudioStage's (no lookahead: it is always exact); max_windows_per_call bounds the rows of one
    call, and a row feeds at most max_chunk_frames + right_context_frames frames (116 against the windowed
    stage's 168, so twice its rows per call take about as much activation memory: fewer calls, and a call is
    bound by the host's kernel launches on a GPU). cadence k: calls happen on every k-th step() only, each for
    every stream due by then, so streams that arrived at different times share calls. first_chunk_lookahead L:
    a hidden-state stream's first audio leaves once it has first_chunk_frames + L frames, in early chunks decoded
    from its first frames alone (audio/first_chunk.py: within 7e-6 of exact at L = 16); None: every sample exact.
    """

    def __init__(
        self,
        decoder: HiddenDecoder | None,
        dvae: DVAE | None,
        vocos: Vocos,
        *,
        first_chunk_frames: int = 8,
        max_chunk_frames: int = 64,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        net_dtype: torch.dtype | None = None,
        max_windows_per_call: int = 128,
        deferred: bool = False,
        cadence: int = 1,
        first_chunk_lookahead: int | None = None,
    ) -> None:
        if cadence < 1:
            raise ValueError(f"cadence must be >= 1, got {cadence}")
        if first_chunk_lookahead is not None and first_chunk_lookahead < 1:
            raise ValueError(f"first_chunk_lookahead must be None or >= 1, got {first_chunk_lookahead}")
        self.cadence = cadence
        self._steps = 0
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
            pool_capacity=2 * max_chunk_frames,
        )
        self._decoders: dict[bool, IncrementalDecoder] = {}
        for kind, net in ((False, self.decoder), (True, self.dvae)):
            if net is not None:
                self._decoders[kind] = IncrementalDecoder(net.decoder, net.out_conv, net.coef)
        self._vocos = IncrementalVocos(self.vocos)
        hop, half, spf = self.vocos.hop_length, self.vocos.n_fft // 2, self.samples_per_frame
        # samples [0, s) are final once mel frames up to s/hop + n_fft/(2 hop) + lag reached the input
        self._lag = {kind: d.lag + self._vocos.lag for kind, d in self._decoders.items()}
        self.right_context_frames = max(-(-(hop * lag + half) // spf) for lag in self._lag.values())
        self.left_context_frames = 0
        self.max_call_frames = max_chunk_frames + self.right_context_frames
        self._chunk_table = [self._chunk_frames(k) for k in range(33)]  # by num_chunks; constant from 32 on
        self._num_slots = 0
        self.slot_generation = 0  # changes whenever the state tensors are reallocated (graphs capture them)
        self._free_slots: list[int] = []
        self._state_slot: dict[str, int] = {}
        self._free_slots.append(self._allocate_slot())  # sizes the state tensors (state_bytes_per_request)
        self.graphs: dict[bool, VocoderGraphs] = {}
        self.early: EarlyChunks | None = None  # hidden-state streams' early chunks (audio/first_chunk.py)
        if first_chunk_lookahead is not None and self.decoder is not None:
            ends = early_chunk_ends(first_chunk_frames, first_chunk_lookahead, self._first_call_frames)
            if ends:  # else the exact first chunk is as early
                rows = min(max_windows_per_call, EARLY_MAX_ROWS)
                decoder = EarlyChunkDecoder(self.decoder, self.vocos, ends, first_chunk_lookahead, rows)
                self.early = EarlyChunks(decoder, self._first_call_frames)

    @property
    def state_bytes_per_request(self) -> int:
        """Device memory one request's conv tails and overlap-add tail take (both kinds' decoders counted)."""
        states = [s for d in self._decoders.values() for s in d.states] + self._vocos.states
        per_slot = sum(s.cache[0].numel() * s.cache.element_size() for s in states)
        return per_slot + self._vocos.tails[0].numel() * self._vocos.tails.element_size()

    # ---- requests ------------------------------------------------------------------------------------
    @on_stage_stream
    def add_request(self, req_id: str, use_codes: bool = False) -> None:
        super().add_request(req_id, use_codes)
        slot = self._allocate_slot()
        self._vocos.reset(slot)
        self._state_slot[req_id] = slot
        if self.early is not None and not use_codes:
            self.early.add_request(req_id)

    def abort(self, req_id: str) -> None:
        super().abort(req_id)
        slot = self._state_slot.pop(req_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _allocate_slot(self) -> int:
        if not self._free_slots:
            self._resize_slots(max(4, 2 * self._num_slots))
        return self._free_slots.pop()

    def _resize_slots(self, n: int) -> None:
        for net in (*self._decoders.values(), self._vocos):
            net.resize(n)
        self._free_slots = list(range(n - 1, self._num_slots - 1, -1)) + self._free_slots
        self._num_slots = n
        self.slot_generation += 1

    @on_stage_stream
    def reserve_scratch_slot(self) -> int:
        """A state slot no stream will own: padding rows of graphed calls write their state there."""
        return self._allocate_slot()

    @on_stage_stream
    def enable_cuda_graphs(
        self,
        max_streams: int,
        row_buckets: list[int] | None = None,
        frame_buckets: list[int] | None = None,
        defer: bool = False,
    ) -> None:
        """Capture the calls of every (rows, frames) bucket for each decoder kind, with state slots for
        2 * max_streams streams allocated first (growing past them drops the graphs; each bucket is captured
        again when a call needs it). defer: the largest bucket only; graph_families()' capture_next() takes
        the others. Off CUDA the graphs' padded static-buffer path runs eagerly (tests)."""
        from ttsserve.audio.vocoder_graphs import VocoderGraphs, default_frame_buckets, default_row_buckets

        # waiting requests and multi-segment texts hold streams too: twice the batch before slots grow
        need = 2 * max_streams + len(self._decoders) + 1
        if need > self._num_slots:
            self._resize_slots(need)
        rows = row_buckets or default_row_buckets(self.max_windows_per_call)
        frames = frame_buckets or default_frame_buckets(self.max_call_frames)
        for kind in self._decoders:
            self.graphs[kind] = VocoderGraphs(self, kind, rows, frames)
        for graphs in self.graphs.values():
            graphs.capture(defer=defer)
        if self.early is not None:
            self.early.decoder.enable_graphs(defer=defer)

    def graph_families(self) -> list:
        """The captured call graphs, one family per decoder kind, and the early chunks' (num_pending,
        capture_next())."""
        return list(self.graphs.values()) + ([self.early.decoder] if self.early else [])

    def _first_needed_frame(self, st: Stream) -> int:
        return st.num_emitted_frames  # frames before it are fed: their trace lives in the conv caches

    # ---- planning ------------------------------------------------------------------------------------
    def _frames_to_finish(self, st: Stream) -> int:
        """Frames (real, then zeros) a finished stream must have fed for its last sample to be final."""
        hop, half = self.vocos.hop_length, self.vocos.n_fft // 2
        last = hop * (2 * st.num_frames - 1)  # one past the utterance's last sample
        return -(-(last + half + hop * self._lag[st.use_codes]) // self.samples_per_frame)

    @property
    def _first_call_frames(self) -> int:
        """Frames a stream's first call needs: its first chunk and the right context."""
        return self.first_chunk_frames + self.right_context_frames

    def _plan(self, streams: dict[str, Stream] | None = None) -> tuple[list[_Feed], list[AudioChunk]]:
        """The streams due now (of `streams`, default all) -> (their feeds, final chunks of empty streams). A
        stream is fed all its pending frames (at most max_call_frames) once they make its next chunk (its first:
        the first chunk and the right context), a finished one what it needs for its last sample to be final.
        Runs over every stream each vocoder call: the test per stream is inline, no call."""
        feeds, empty = [], []
        if self._steps % self.cadence and not self._first_chunk_due():
            return feeds, empty  # off-cadence step: due streams wait for the next shared call
        first_call, max_call, chunks = self._first_call_frames, self.max_call_frames, self._chunk_table
        spf = self.samples_per_frame
        for req_id, st in (self._streams if streams is None else streams).items():
            if st.final_out:
                continue
            fed = st.num_emitted_frames
            if st.finished:
                if st.num_frames == 0:
                    empty.append(self._empty_final(req_id, st))
                    continue
                n = self._frames_to_finish(st) - fed
            else:
                n = st.num_frames - fed
                # a first call past early chunks waits until it has samples beyond them to emit
                need = first_call + st.num_emitted_samples // spf if fed == 0 else chunks[min(st.num_chunks, 32)]
                if n < need:
                    continue
            if n > 0:
                feeds.append(_Feed(req_id, st, min(n, max_call)))
        return feeds, empty

    def _first_chunk_due(self) -> bool:
        """A stream can emit its first audio: the cadence does not hold it back (its wait is the time to first
        audio), and the call it makes takes every other due stream along. A stream whose early chunks left
        already waits for the cadence like any other."""
        need = self._first_call_frames
        return any(
            st.num_emitted_frames == 0
            and st.num_emitted_samples == 0
            and (st.finished or st.num_frames >= need)
            and not st.final_out
            for st in self._streams.values()
        )

    def _launch(self) -> Pending | None:
        self._steps += 1
        pieces, specs, sizes = self.early.launch(self._streams, self._pools[False]) if self.early else ([], [], [])
        feeds, empty = self._plan()
        while feeds:  # a burst of frames can need several calls of at most max_call_frames
            for call in self._calls(feeds):
                flat, part_specs, part_sizes = self._decode(call)
                pieces.append(flat)
                specs += part_specs
                sizes += part_sizes
            # only a stream fed a full max_call_frames can be due again: the others fed all they had
            capped = {f.req_id: f.stream for f in feeds if f.count == self.max_call_frames}
            feeds, new_empty = self._plan(capped) if capped else ([], [])
            empty += new_empty
        if not specs and not empty:
            return None
        flat, event = self._to_host(pieces)
        return Pending(specs, sizes, flat, event, empty)

    def _calls(self, feeds: list[_Feed]) -> list[list[_Feed]]:
        """The due rows -> their calls. Graphed: one decoder kind a call, rows sorted by frames and cut where a
        narrower call saves more padded cells than a replay costs (audio/call_plan.py). Eager: rows share calls
        of max_windows_per_call, hidden-state rows first (an eager call costs its launches, milliseconds)."""
        w = self.max_windows_per_call
        if not self.graphs:
            feeds.sort(key=lambda f: f.stream.use_codes)  # one decoder pass per kind
            return [feeds[i : i + w] for i in range(0, len(feeds), w)]
        calls = []
        for kind in sorted({f.stream.use_codes for f in feeds}):
            rows = sorted((f for f in feeds if f.stream.use_codes == kind), key=lambda f: -f.count)
            g = self.graphs[kind]
            cuts = plan_calls([f.count for f in rows], w, g.frame_bucket, lambda b, n: g.cells(b, n) + REPLAY_CELLS)
            calls += [rows[a:b] for a, b in cuts]
        return calls

    # ---- decoding ------------------------------------------------------------------------------------
    @torch.no_grad()
    def _decode(self, feeds: list[_Feed]) -> tuple[Tensor, list[ChunkSpec], list[int]]:
        """Feed every row, advance its stream, and crop the samples that became final. feeds: hiddens rows
        first, then codes rows (the order of the decoder passes)."""
        assert all(not a.stream.use_codes or b.stream.use_codes for a, b in itertools.pairwise(feeds))
        self._vocos.flush_resets()  # new streams' overlap-add tails start empty
        kinds = sorted({f.stream.use_codes for f in feeds})
        n = max(f.count for f in feeds)
        if len(kinds) == 1:  # the engine's case: one pipeline, graphed on CUDA
            wav = self._decode_one_kind(kinds[0], feeds, n)
        else:
            wav = self._decode_mixed(kinds, feeds)
        self.calls_total += 1
        self.frames_decoded_total += sum(f.count for f in feeds)
        self.frames_padded_total += len(feeds) * n
        return self._emit(feeds, wav)

    def _decode_one_kind(self, kind: bool, feeds: list[_Feed], n: int) -> Tensor:
        x, info = self._gather(kind, feeds), self._row_info(feeds)
        graphs = self.graphs.get(kind)
        if graphs is not None and graphs.fits(len(feeds), n):
            return graphs.run(x, info)
        return self.pipeline(kind, x.transpose(1, 2), to_device(info, self.device), n)

    def _decode_mixed(self, kinds: list[bool], feeds: list[_Feed]) -> Tensor:
        """Rows of both kinds: a decoder pass per kind, one Vocos pass over the padded mels."""
        mels, lags = [], []
        for kind in kinds:
            rows = [f for f in feeds if f.stream.use_codes == kind]
            n = max(f.count for f in rows)
            info = to_device(self._row_info(rows), self.device)
            mels.append(self.mel(kind, self._gather(kind, rows).transpose(1, 2), info, n))
            lags += [self._decoders[kind].lag] * len(rows)
        width = max(m.shape[-1] for m in mels)
        mel = torch.cat([F.pad(m, (0, width - m.shape[-1])) for m in mels])
        info = to_device(self._row_info(feeds), self.device)
        return self._vocos(mel, self._rows(info, info[1] - to_device(lags, self.device), width, self._vocos.reach))

    def _gather(self, kind: bool, feeds: list[_Feed]) -> Tensor:
        """The new frames of these rows -> [B, max count, C] in the pool's dtype (zeros past a stream's end)."""
        pool = self._pools[kind]
        real = [min(f.count, f.stream.num_frames - f.stream.num_emitted_frames) for f in feeds]
        n = max(f.count for f in feeds)
        if max(real) <= 0:  # only the zeros past the ends
            return pool.data.new_zeros(len(feeds), n, pool.data.shape[2])
        x = pool.gather(
            [f.stream.slot for f in feeds], [f.stream.num_emitted_frames - f.stream.base for f in feeds], real
        )
        return F.pad(x, (0, 0, 0, n - x.shape[1]))

    def _row_info(self, feeds: list[_Feed]) -> list[list[int]]:
        """[4][B] host ints: state slot, first new mel frame, new mel frames, mel length once finished."""
        limits = [2 * f.stream.num_frames if f.stream.finished else NOT_FINISHED for f in feeds]
        return [
            [self._state_slot[f.req_id] for f in feeds],
            [2 * f.stream.num_emitted_frames for f in feeds],
            [2 * f.count for f in feeds],
            limits,
        ]

    @staticmethod
    def _rows(info: Tensor, start: Tensor, width: int, reach: int) -> Rows:
        return Rows(info[0], start, info[2], info[3], width, reach)

    def mel(self, kind: bool, x: Tensor, info: Tensor, n: int) -> Tensor:
        """x [B, C, n] new frames (pool dtype), info [4, B] int64 on the device (_row_info) -> mel
        [B, n_mels, 2n] in the Vocos dtype. No host sync: graph-capturable."""
        dec = self._decoders[kind]
        x = self.dvae.vq_layer.dequantize(x) if kind else x.to(self.decoder.coef.dtype)
        mel = dec(halves_to_frames(x), self._rows(info, info[1], 2 * n, dec.reach))
        return mel.to(next(self.vocos.parameters()).dtype)

    def pipeline(self, kind: bool, x: Tensor, info: Tensor, n: int) -> Tensor:
        """mel() then Vocos: x [B, C, n], info [4, B] -> wav [B, hop * 2n] (row position 0 is sample
        hop * (2 * fed - lag) - n_fft / 2). Graph-capturable; the conv and overlap-add states advance."""
        start = info[1] - self._decoders[kind].lag
        return self._vocos(self.mel(kind, x, info, n), self._rows(info, start, 2 * n, self._vocos.reach))

    def _emit(self, feeds: list[_Feed], wav: Tensor) -> tuple[Tensor, list[ChunkSpec], list[int]]:
        """Advance each stream past its fed frames; crop the samples that are final now (row position 0 is
        sample hop * (2 * fed - lag) - n_fft / 2 of the utterance)."""
        hop, half = self.vocos.hop_length, self.vocos.n_fft // 2
        specs, rows, starts, sizes = [], [], [], []
        for i, f in enumerate(feeds):
            st = f.stream
            first = hop * (2 * st.num_emitted_frames - self._lag[st.use_codes]) - half
            end = first + 2 * hop * f.count
            if st.finished:
                end = min(end, hop * (2 * st.num_frames - 1))
            lo = st.num_emitted_samples
            st.num_emitted_frames += f.count
            st.num_chunks += 1
            st.final_out = st.finished and st.num_emitted_frames >= self._frames_to_finish(st)
            if end <= lo and not st.final_out:
                continue  # nothing final yet (a call cut short by max_call_frames): no empty chunk
            st.num_emitted_samples = max(lo, end)
            specs.append(ChunkSpec(f.req_id, lo, st.final_out))
            rows.append(i)
            starts.append(lo - first)
            sizes.append(max(0, end - lo))
        kept = wav if len(rows) == len(feeds) else wav[to_device(rows, wav.device)]
        return crop_rows(kept, starts, sizes), specs, sizes

    @on_stage_stream
    def warm_chunk_shapes(self, rows: int = 1) -> None:
        """One call of `rows` rows per call size streams started together make (their first call, then each
        chunk size), in scratch slots, counters untouched: a call of a new shape pays the convolutions' first
        use (oneDNN)."""
        sizes = {self._first_call_frames} | {self._chunk_frames(k) for k in range(1, 33)}
        for n in sorted(sizes):
            self._scratch_call(rows, n)

    @on_stage_stream
    @torch.no_grad()
    def profile_max_call(self, num_windows: int | None = None) -> None:
        """Run the largest call this stage makes (max_windows_per_call rows of max_call_frames new frames) in
        scratch slots: for memory profiling, and as a warm-up of the convolution kernels. Counters untouched."""
        self._scratch_call(num_windows or self.max_windows_per_call, self.max_call_frames)

    @torch.no_grad()
    def _scratch_call(self, b: int, n: int) -> None:
        """b rows of n new frames (whatever the pool slots hold) in scratch streams, counters untouched."""
        counters = self.calls_total, self.frames_decoded_total, self.frames_padded_total
        for kind in self._decoders:
            ids = [f"__profile_{int(kind)}_{i}" for i in range(b)]
            for req_id in ids:
                self.add_request(req_id, use_codes=kind)
                self._streams[req_id].num_frames = n  # whatever the pool slot holds stands in for frames
            self._decode([_Feed(req_id, self._streams[req_id], n) for req_id in ids])
            for req_id in ids:
                self.abort(req_id)
        self.calls_total, self.frames_decoded_total, self.frames_padded_total = counters
