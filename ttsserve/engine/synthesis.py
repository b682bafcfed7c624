"""Per-synthesis bookkeeping: segments run in parallel, audio leaves in order with a short crossfade."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

# Why a synthesis ended: EOS in every segment, a segment hit max_new_tokens, aborted, or failed (the worst wins).
FinishReason = Literal["stop", "length", "abort", "error"]

CROSSFADE_SAMPLES = 480  # 20 ms at 24 kHz: long enough to hide a seam, short enough to keep words intact


@dataclass(frozen=True)
class SegmentSpan:
    """Where one segment's audio lies in the synthesis' output stream, in samples at the engine's rate.

    start: its first sample; end: one past its last. A segment after the first starts inside the previous
    one's end by the crossfade overlap (0..CROSSFADE_SAMPLES), so spans are contiguous up to that overlap and
    the last span's end is the stream's length. Starts never decrease: after a segment shorter than the fade,
    the next one's start is clamped to that segment's start (its first, faded-in samples lie earlier).
    """

    index: int
    text: str
    start: int
    end: int


@dataclass
class AudioOutput:
    """What a synthesis request's stream yields.

    samples: float32 [n] at 24 kHz (may be empty). The final output has finished=True and the usage fields.
    finish_reason: a FinishReason on the final output (the worst over all segments), None before it.
    truncated_segments: indices of segments that hit max_new_tokens instead of ending naturally.
    """

    request_id: str
    samples: np.ndarray
    finished: bool
    num_frames: int = 0
    finish_reason: FinishReason | None = None
    truncated_segments: list[int] = field(default_factory=list)
    error: str | None = None
    dropped_chars: list[str] = field(default_factory=list)
    # the segments whose audio this output completes (in order; a segment's end may leave with a later output)
    segments: list[SegmentSpan] = field(default_factory=list)


@dataclass
class _SegmentAudio:
    chunks: list[np.ndarray] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_frames: int = 0
    num_samples: int = 0  # every sample it produced, before the crossfade
    fade_in: int = 0  # samples of its start mixed into the previous segment's end


class SynthesisTracker:
    """Collects per-segment chunks (any order) and releases audio in segment order.

    The current segment streams live; later segments buffer until it finishes. Between segments the last
    CROSSFADE_SAMPLES of one are mixed with the first of the next (linear fade).
    """

    def __init__(self, request_id: str, num_segments: int, dropped: list[str], texts: list[str] | None = None) -> None:
        self.request_id = request_id
        self.segments = [_SegmentAudio() for _ in range(num_segments)]
        self.texts = texts if texts is not None else [""] * num_segments
        self.spans: list[SegmentSpan] = []  # finished segments not yet handed out on an output
        self.span_start = self.span_end = 0  # start and end of the last finished segment in the output stream
        self.current = 0
        self.tail: np.ndarray | None = None  # held back end of the previous segment, for the crossfade
        self.held = np.zeros(0, np.float32)  # start of the current segment, waiting to be faded in
        self.error: str | None = None
        self.dropped = dropped
        self.done = False

    def add_audio(self, seg: int, samples: np.ndarray) -> None:
        if samples.size:
            self.segments[seg].chunks.append(samples.astype(np.float32, copy=False))
            self.segments[seg].num_samples += samples.size

    def add_frames(self, seg: int, n: int) -> None:
        self.segments[seg].num_frames += n

    def finish_segment(self, seg: int, reason: str) -> None:
        s = self.segments[seg]
        s.finished, s.finish_reason = True, reason

    def fail(self, message: str) -> None:
        self.error = message

    def drain(self) -> list[AudioOutput]:
        """Audio that may leave now, and the final output once every segment finished."""
        if self.done:
            return []
        seg = self.segments[self.current]
        streaming = not seg.finished and self.tail is None and self.error is None and not self.held.size
        if streaming and len(seg.chunks) == 1:
            # a segment streaming with nothing held back for a fade: its one new chunk leaves as it is (what the
            # general path below gives, without its two copies)
            out = AudioOutput(self.request_id, seg.chunks[0], False)
            seg.chunks = []
            if self.spans:
                out.segments, self.spans = self.spans, []
            return [out]
        out: list[np.ndarray] = []
        while self.current < len(self.segments):
            seg = self.segments[self.current]
            out.extend(self._release(seg.chunks))
            seg.chunks = []
            if not seg.finished:
                break
            if self.held.size:  # a very short segment: its whole audio sat in the fade buffer
                out.extend(self._release([], flush=True))
            self._end_span(seg)
            self.current += 1
        finished = self.current == len(self.segments) or self.error is not None
        if finished and self.tail is not None:
            out.append(self.tail)
            self.tail = None
        samples = np.concatenate(out) if out else np.zeros(0, np.float32)
        outputs = [AudioOutput(self.request_id, samples, False)] if samples.size else []
        if finished:
            self.done = True
            outputs.append(self._final())
        if outputs and self.spans:
            outputs[0].segments, self.spans = self.spans, []
        return outputs

    def _end_span(self, seg: _SegmentAudio) -> None:
        """The current segment finished and its start was faded in: its place in the output is known."""
        start = self.span_end - seg.fade_in
        self.span_end = start + seg.num_samples
        # a fade after a segment shorter than the fade reaches back into the one before it: keep starts in order
        start = max(start, self.span_start)
        self.span_start = start
        self.spans.append(SegmentSpan(self.current, self.texts[self.current], start, self.span_end))

    def _release(self, chunks: list[np.ndarray], flush: bool = False) -> list[np.ndarray]:
        """Apply the crossfade at segment starts and hold back each finished segment's end."""
        seg = self.segments[self.current]
        audio = np.concatenate([self.held, *chunks]) if chunks or flush else self.held
        if self.tail is not None:
            n = CROSSFADE_SAMPLES
            if audio.size < n and not (seg.finished and flush or seg.finished and not seg.chunks):
                self.held = audio  # wait until the new segment has enough samples to fade in
                return []
            n = min(n, audio.size, self.tail.size)
            seg.fade_in = n
            ramp = np.linspace(0.0, 1.0, n, dtype=np.float32)
            head = self.tail[self.tail.size - n :] * (1 - ramp) + audio[:n] * ramp
            audio = np.concatenate([self.tail[: self.tail.size - n], head, audio[n:]])
            self.tail = None
        self.held = np.zeros(0, np.float32)
        if seg.finished and self.current + 1 < len(self.segments):
            cut = max(0, audio.size - CROSSFADE_SAMPLES)
            self.tail, audio = audio[cut:], audio[:cut]
        return [audio] if audio.size else []

    def _final(self) -> AudioOutput:
        reasons = [s.finish_reason for s in self.segments if s.finish_reason]
        worst = "error" if self.error else next((r for r in ("abort", "error", "length") if r in reasons), "stop")
        truncated = [i for i, s in enumerate(self.segments) if s.finish_reason == "length"]
        return AudioOutput(
            self.request_id,
            np.zeros(0, np.float32),
            True,
            num_frames=sum(s.num_frames for s in self.segments),
            finish_reason=worst,
            truncated_segments=truncated,
            error=self.error,
            dropped_chars=self.dropped,
        )
