"""The wire protocol between API servers and the engine core: typed msgspec Structs, msgpack-encoded.

API server -> core (one DEALER per API server, identity `api-<index>`, to the core's ROUTER):
    Hello         first message of a client: the core forgets requests of an earlier incarnation, replies CoreInfo
    AddRequest    one synthesis; answered in the next CoreOutputs (admitted or rejected)
    Abort         request ids whose consumer went away
    UtilityCall   stats / memory_report / random_speaker / parse_speaker / encode_reference_audio; UtilityReply

core -> API server:
    CoreInfo      reply to Hello: what the client serves from memory (sample rate, memory report, speaker stats,
                  the tokenizer)
    CoreOutputs   per engine step, one message per API server: admissions, rejections, audio, the latest stats
    UtilityReply  result or error of one UtilityCall

Arrays travel as raw little-endian bytes with dtype and shape (ArrayMsg; a segment's prompt ids as int32
bytes), never as lists. Errors travel as ErrorInfo (kind, message, param) and are re-raised as the same
typed error (engine/errors.py): "invalid" as InvalidRequestError with its param, "overloaded" as
EngineOverloadedError, "dead" as EngineDeadError, anything else as RuntimeError.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

from ttsserve.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
)
from ttsserve.engine.synthesis import AudioOutput, FinishReason, SegmentSpan
from ttsserve.params import SamplingParams, SynthesisRequest, Voice
from ttsserve.text.segments import Segment

ErrorKind = Literal["invalid", "overloaded", "dead", "runtime"]


class ArrayMsg(msgspec.Struct, array_like=True, frozen=True):
    """A numpy array: dtype string (e.g. '<f2'), shape, the C-order bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, a) -> ArrayMsg:
        a = np.ascontiguousarray(a)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        return cls(a.dtype.str, tuple(int(n) for n in a.shape), a.tobytes())

    def array(self) -> np.ndarray:
        """A writable copy (these arrays are small and end up in torch, which wants writable memory)."""
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape).copy()


class ErrorInfo(msgspec.Struct, array_like=True, frozen=True):
    """A typed engine error on the wire. param: InvalidRequestError's field (None for the other kinds).
    A plain ValueError travels as "invalid" without a param; any other exception as "runtime"."""

    kind: ErrorKind
    message: str
    param: str | None = None

    @classmethod
    def of(cls, e: BaseException) -> ErrorInfo:
        if isinstance(e, EngineDeadError):
            return cls("dead", str(e))
        if isinstance(e, EngineOverloadedError):
            return cls("overloaded", str(e))
        if isinstance(e, ValueError):
            return cls("invalid", str(e), e.param if isinstance(e, InvalidRequestError) else None)
        return cls("runtime", f"{type(e).__name__}: {e}")

    def exception(self) -> Exception:
        if self.kind == "invalid":
            return InvalidRequestError(self.message, self.param)
        if self.kind == "dead":
            return EngineDeadError(self.message)
        if self.kind == "overloaded":
            return EngineOverloadedError(self.message)
        return RuntimeError(self.message)


class VoiceMsg(msgspec.Struct, array_like=True, frozen=True):
    spk_emb: ArrayMsg | None  # float16 [hidden]
    spk_smp: ArrayMsg | None  # int32 [num_vq, P]
    txt_smp: str | None
    name: str


class SynthesisMsg(msgspec.Struct, frozen=True):
    """SynthesisRequest on the wire (the params are the frozen dataclasses; decoding re-runs their checks)."""

    text: str
    voice: VoiceMsg
    code_params: SamplingParams
    refine_text: bool
    refine_params: SamplingParams
    refine_prompt: str
    code_prompt: str
    normalize: bool
    split: bool
    raw_text: bool
    request_id: str | None

    @classmethod
    def of(cls, req: SynthesisRequest) -> SynthesisMsg:
        v = req.voice
        voice = VoiceMsg(
            None if v.spk_emb is None else ArrayMsg.of(np.asarray(v.spk_emb)),
            None if v.spk_smp is None else ArrayMsg.of(np.asarray(v.spk_smp)),
            v.txt_smp,
            v.name,
        )
        return cls(
            req.text,
            voice,
            req.code_params,
            req.refine_text,
            req.refine_params,
            req.refine_prompt,
            req.code_prompt,
            req.normalize,
            req.split,
            req.raw_text,
            req.request_id,
        )

    def request(self, request_id: str | None = None) -> SynthesisRequest:
        """ValueError for a request the engine's dataclasses reject. request_id: in place of the message's."""
        v = self.voice
        voice = Voice(
            None if v.spk_emb is None else v.spk_emb.array(),
            None if v.spk_smp is None else v.spk_smp.array(),
            v.txt_smp,
            v.name,
        )
        return SynthesisRequest(
            self.text,
            voice,
            self.code_params,
            self.refine_text,
            self.refine_params,
            self.refine_prompt,
            self.code_prompt,
            self.normalize,
            self.split,
            self.raw_text,
            self.request_id if request_id is None else request_id,
        )


# ---- API server -> core ---------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello", frozen=True):
    api_server_index: int
    pid: int


class SegmentMsg(msgspec.Struct, array_like=True, frozen=True):
    """One text segment as text/segments.py made it: normalized text, dropped characters and, when the API
    server tokenized it (no refine pass), the code-stage prompt's text ids as int32 little-endian bytes."""

    text: str
    dropped: list[str]
    code_ids: bytes | None = None

    @classmethod
    def of(cls, seg: Segment) -> SegmentMsg:
        ids = None if seg.code_ids is None else np.ascontiguousarray(seg.code_ids, dtype="<i4").tobytes()
        return cls(seg.text, list(seg.dropped), ids)

    def segment(self, index: int) -> Segment:
        """The engine's Segment (code_ids: a read-only int32 [P] view of the bytes; the engine checks their
        values). ValueError for bytes that are not whole int32 values."""
        ids = None
        if self.code_ids is not None:
            if len(self.code_ids) % 4:
                raise ValueError(f"segment {index}: code_ids has {len(self.code_ids)} bytes, not whole int32 values")
            ids = np.frombuffer(self.code_ids, dtype="<i4")
        return Segment(index, self.text, list(self.dropped), ids)


class AddRequest(msgspec.Struct, tag="add", frozen=True):
    """request_id: the core's key for the request (also request.request_id). `request` is an encoded
    SynthesisMsg decoded by the core on its own, so a request that fails its checks is rejected by id.
    segments: the text already split, normalized and (without refine_text) tokenized by the API server (None:
    the core does it), so that per-request text work stays off the core's step loop."""

    request_id: str
    request: msgspec.Raw
    segments: list[SegmentMsg] | None = None


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


UtilityArg = int | float | str | ArrayMsg | None


class UtilityCall(msgspec.Struct, tag="call", frozen=True):
    call_id: int
    method: str
    args: list[UtilityArg]


ClientMessage = Hello | AddRequest | Abort | UtilityCall


# ---- core -> API server ---------------------------------------------------------------------------
class CoreInfo(msgspec.Struct, tag="info", frozen=True):
    pid: int
    sample_rate: int
    model_name: str
    memory_report: str
    hidden_size: int
    spk_std: ArrayMsg  # float16 [hidden]: the model's speaker statistics, for random_speaker on the client
    spk_mean: ArrayMsg
    max_queue_len: int
    stats: dict[str, Any]
    # TextTokenizer.to_json(): the API server tokenizes code prompts itself (None: it leaves that to the core)
    tokenizer_json: str | None = None


class Rejection(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    error: ErrorInfo


class SpanMsg(msgspec.Struct, array_like=True, frozen=True):
    """A SegmentSpan on the wire (samples at the core's sample rate)."""

    index: int
    text: str
    start: int
    end: int


class RequestOutput(msgspec.Struct, array_like=True, frozen=True):
    """AudioOutput on the wire; samples: float32 little-endian [n] at the core's sample rate (bytes; made by of(),
    a byte memoryview of the output's array, which encodes the same without a copy of its own)."""

    request_id: str
    samples: bytes
    finished: bool
    num_frames: int
    finish_reason: FinishReason | None
    truncated_segments: list[int]
    error: str | None
    dropped_chars: list[str]
    segments: list[SpanMsg] = []  # trailing with a default: a message without it still decodes

    @classmethod
    def of(cls, out: AudioOutput) -> RequestOutput:
        samples = np.ascontiguousarray(out.samples, dtype="<f4")
        return cls(
            out.request_id,
            memoryview(samples).cast("B"),
            out.finished,
            out.num_frames,
            out.finish_reason,
            list(out.truncated_segments),
            out.error,
            list(out.dropped_chars),
            [SpanMsg(s.index, s.text, s.start, s.end) for s in out.segments] if out.segments else [],
        )

    def output(self, request_id: str | None = None) -> AudioOutput:
        """samples: a read-only view of the message's bytes (no copy; the encoders only read them)."""
        return AudioOutput(
            request_id or self.request_id,
            np.frombuffer(self.samples, dtype="<f4"),
            self.finished,
            self.num_frames,
            self.finish_reason,
            list(self.truncated_segments),
            self.error,
            list(self.dropped_chars),
            [SegmentSpan(s.index, s.text, s.start, s.end) for s in self.segments],
        )


class CoreOutputs(msgspec.Struct, tag="outputs", frozen=True):
    admitted: list[str] = []
    rejected: list[Rejection] = []
    outputs: list[RequestOutput] = []
    # the engine's stats when they changed (the core sends them pre-encoded, as a msgspec.Raw of this dict)
    stats: dict[str, Any] | None = None


class UtilityReply(msgspec.Struct, tag="reply", frozen=True):
    call_id: int
    result: ArrayMsg | str | dict[str, Any] | None = None
    error: ErrorInfo | None = None


CoreMessage = CoreInfo | CoreOutputs | UtilityReply

encoder = msgspec.msgpack.Encoder()
client_decoder = msgspec.msgpack.Decoder(ClientMessage)
core_decoder = msgspec.msgpack.Decoder(CoreMessage)
synthesis_decoder = msgspec.msgpack.Decoder(SynthesisMsg)


def decode_synthesis(raw: msgspec.Raw | bytes, request_id: str | None = None) -> SynthesisRequest:
    """An AddRequest's payload -> SynthesisRequest (request_id: in place of the payload's); ValueError (with the
    reason) for anything malformed."""
    try:
        return synthesis_decoder.decode(raw).request(request_id)
    except (msgspec.ValidationError, TypeError) as e:
        raise ValueError(str(e)) from None
