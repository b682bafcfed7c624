"""The engine's one owner of request state: a record per synthesis, a record per sequence, one way out.

A synthesis (one SynthesisRequest) runs one sequence per segment and stage: a segment's refine stage ("text")
and then its code stage ("code"). A live sequence is held, under its SeqId, by
  - the scheduler: its Request (queue position, KV blocks), until its tokens are done;
  - the runner: its prompt state and batch row, until its tokens are done;
  - the audio stage (code sequences): its frame buffer and vocoder state, until its final chunk left;
  - this registry: its SequenceRecord, until `release`.
`end_generation` hands a sequence's tokens back (runner; the scheduler already dropped a request it finished),
`release` is the only way out of the registry and takes the sequence out of every owner. Every owner ignores
an id it no longer holds, so release may run at any stage: abort, error, refine -> code hand-off, final chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

from ttsserve.engine.request import Mode, Request
from ttsserve.engine.synthesis import SynthesisTracker
from ttsserve.params import SynthesisRequest
from ttsserve.text.segments import Segment

if TYPE_CHECKING:
    from ttsserve.audio.stream_base import StreamingStage
    from ttsserve.engine.scheduler import Scheduler
    from ttsserve.runner.model_runner import ModelRunner
    from ttsserve.runner.step_types import SequenceInputs

# A sequence's key in every owner's map. A plain str at run time (a NewType costs nothing), so the scheduler's,
# runner's and audio stage's dict lookups stay str lookups; made by make_seq_id() only, never parsed back: the
# record holds the synthesis, segment and mode.
SeqId = NewType("SeqId", str)


def make_seq_id(request_id: str, segment: int, mode: Mode) -> SeqId:
    return SeqId(f"{request_id}/{segment}/{mode}")


@dataclass(eq=False)
class SynthesisRecord:
    request_id: str
    req: SynthesisRequest
    tracker: SynthesisTracker
    seed: int
    segments: list[Segment]
    seqs: dict[SeqId, SequenceRecord] = field(default_factory=dict)  # its live sequences
    # what every sequence of it shares, made once: the voice's prefix-cache key (Voice.key + the code prompt) and
    # its speaker vector (fp16 tensor [H] or None)
    prefix_key: str = ""
    spk_emb: object = None
    arrived: float = field(default_factory=time.monotonic)
    heard: bool = False  # its first audio left
    scheduled: bool = False  # one of its sequences was scheduled: its wait in the queue is over


@dataclass(eq=False, slots=True)
class SequenceRecord:
    seq_id: SeqId
    synthesis: SynthesisRecord
    segment: int
    mode: Mode
    request: Request  # the scheduler's Request (output_token_ids: the refined text of a "text" sequence)
    finishing: str | None = None  # a code sequence whose tokens are done: its finish reason, until its final chunk


class SequenceRegistry:
    """syntheses and sequences are the engine's only maps of request state (Engine exposes both). They are
    never rebound, so a reference to either stays valid."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, audio: StreamingStage) -> None:
        self.scheduler, self.runner, self.audio = scheduler, runner, audio
        self.syntheses: dict[str, SynthesisRecord] = {}
        self.sequences: dict[SeqId, SequenceRecord] = {}
        self.failed: list[SynthesisRecord] = []  # failed since the engine last collected outputs
        self.num_failed = 0  # syntheses failed so far (the engine's step tells whether one failed mid-step)

    # ---- in --------------------------------------------------------------------------------------------
    def add_synthesis(self, syn: SynthesisRecord) -> None:
        if syn.request_id in self.syntheses:
            raise ValueError(f"request_id {syn.request_id!r} is already in use")
        self.syntheses[syn.request_id] = syn

    def add_sequence(self, syn: SynthesisRecord, segment: int, request: Request, inputs: SequenceInputs) -> None:
        """Register a sequence with every owner. The record comes first: whatever an owner refuses, releasing
        the synthesis takes the sequence out of the owners that took it."""
        sid = SeqId(request.request_id)
        assert sid not in self.sequences, f"sequence {sid} is already live"
        rec = SequenceRecord(sid, syn, segment, request.mode, request)
        self.sequences[sid] = rec
        syn.seqs[sid] = rec
        self.runner.add_sequence(sid, inputs)
        self.scheduler.add_request(request)
        if request.mode == "code":
            self.audio.add_request(sid)

    # ---- out -------------------------------------------------------------------------------------------
    def end_generation(self, rec: SequenceRecord, reason: str) -> None:
        """A code sequence's tokens are done (the scheduler finished its Request): the runner lets it go, the
        audio stage decodes what is left; release follows its final chunk."""
        rec.finishing = reason
        self.runner.remove_sequence(rec.seq_id)
        self.audio.finish(rec.seq_id)

    def release(self, rec: SequenceRecord) -> None:
        """The one way out: the sequence leaves every owner and the registry (the scheduler's part takes effect
        at its next schedule())."""
        sid = rec.seq_id
        self.scheduler.abort_request(sid)
        self.runner.remove_sequence(sid)
        if rec.mode == "code":
            self.audio.abort(sid)
            # its frames are its outputs (the engine appends a frame per output): counted once, here
            rec.synthesis.tracker.add_frames(rec.segment, len(rec.request.output_token_ids))
        del self.sequences[sid]
        del rec.synthesis.seqs[sid]

    def fail(self, syn: SynthesisRecord, message: str) -> None:
        """The synthesis ends with an error: its sequences go now, its final output at the next collect."""
        syn.tracker.fail(message)
        for rec in list(syn.seqs.values()):
            self.release(rec)
        self.failed.append(syn)
        self.num_failed += 1

    def release_synthesis(self, syn: SynthesisRecord) -> None:
        """Abort or done: every sequence of it goes, then the synthesis."""
        for rec in list(syn.seqs.values()):
            self.release(rec)
        del self.syntheses[syn.request_id]

    def take_failed(self) -> list[SynthesisRecord]:
        """Failed syntheses still registered (an abort may have come after the failure)."""
        if not self.failed:
            return []
        failed, self.failed = self.failed, []
        return [s for s in failed if self.syntheses.get(s.request_id) is s]
