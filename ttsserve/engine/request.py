"""One flat Request with one progress counter (vLLM v1 style).

Every step the scheduler decides how many tokens each request advances; `num_computed_tokens` is the
only progress counter, so prefill, chunked prefill, decode and recompute after preemption are one rule:
compute tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) of `prompt + outputs`.

A "token" is one position and one KV slot: an int for a text position, a 4-tuple of codes for an audio
frame (prompt audio codes or generated frames). The scheduler treats items as opaque hashable values.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["code", "text"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # recompute preemption: back in the waiting queue, blocks freed
    SWAPPED = "swapped"  # swap preemption: blocks copied to host, waiting to be swapped back in
    FINISHED_STOPPED = "stop"  # the model sampled its end marker (EOS frame / [Ebreak])
    FINISHED_LENGTH = "length"  # max_new_tokens reached, or the model/pool length limit
    FINISHED_ABORTED = "abort"  # the client went away / abort_request
    FINISHED_ERROR = "error"  # can never be served (too long for the model or the KV pool)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)


@dataclass(eq=False, slots=True)
class Request:
    """A refine-text ("text") or code ("code") generation request.

    request_id: unique within the engine.
    prompt_token_ids: [num_prompt_tokens] hashable items (int text ids, 4-tuples of audio prompt codes);
        the runner owns their meaning.
    max_new_tokens: generation cap (the EOS step is not counted, as in the reference).
    prefix_key: mixed into the prefix-cache block hashes (e.g. the speaker identity), so an equal prompt
        with another speaker never shares KV blocks.
    first_audio_frames: frames this request needs before its first audio chunk can leave; a code request
        with fewer outputs than this is "still waiting for its first audio" and is preempted last.

    Mutated only by the scheduler (status, outputs, num_computed_tokens, the in-flight counts) and the
    block manager (block_table).

    In flight (asynchronous scheduling): positions scheduled in a step whose results are not back yet.
    `num_computed_tokens` counts committed positions only (their items are known, so the prefix cache may
    hash them); `num_inflight_tokens` more are being computed, and `num_inflight_outputs` of those steps
    will sample a token not known yet (a placeholder: the device already holds it, the host does not).
    """

    request_id: str
    prompt_token_ids: list
    mode: Mode = "code"
    max_new_tokens: int = 2048
    arrival_time: float = field(default_factory=time.monotonic)
    prefix_key: str | None = None
    first_audio_frames: int = 1

    output_token_ids: list = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_inflight_tokens: int = 0
    num_inflight_outputs: int = 0
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)  # [cdiv(num allocated slots, block_size)] GPU block ids
    error: str | None = None  # why the request ended with FINISHED_ERROR

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: prompt_token_ids is empty")
        try:  # items key the prefix cache: an unhashable one would crash the step loop later
            hash(tuple(self.prompt_token_ids))
        except TypeError:
            raise ValueError(
                f"request {self.request_id}: prompt items must be hashable (int or tuple of codes)"
            ) from None
        if self.mode not in ("code", "text"):
            raise ValueError(f"request {self.request_id}: mode must be 'code' or 'text', got {self.mode!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.first_audio_frames < 0:
            raise ValueError(
                f"request {self.request_id}: first_audio_frames must be >= 0, got {self.first_audio_frames}"
            )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs: the positions a recompute must re-prefill."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Committed plus in-flight positions: where the next chunk starts."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Prompt + outputs, counting the outputs still in flight."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight_outputs

    @property
    def all_token_ids(self) -> list:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list:
        """Items at positions [start, end) of prompt + outputs, without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """ "stop" | "length" | "abort" | "error" once finished, else None."""
        return self.status.value if self.status.is_finished else None

    @property
    def has_first_audio(self) -> bool:
        """True when the listener already hears audio (preempting it costs a stall, not a late start).

        Refine (text) requests never have audio: their utterance has not started yet.
        """
        return self.mode == "code" and len(self.output_token_ids) >= self.first_audio_frames
