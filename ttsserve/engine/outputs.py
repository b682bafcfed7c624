"""Stage contracts between the scheduler and the rest of the engine: plain dataclasses, no tensors.

Token items are opaque hashable values: an int text id or a 4-tuple of audio codes (one frame).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class ScheduledRequest(NamedTuple):
    """One request's work in this step: compute positions [num_computed_tokens, +num_new_tokens).

    A tuple, so the scheduler's steady path builds one per row at C level (tuple.__new__ over a zip of
    columns, no Python __init__ call per row); its fields are read-only.
    """

    request_id: str
    mode: str  # "code" | "text"; the scheduler only passes it on
    num_computed_tokens: int  # start position of this chunk (KV for positions < this already exists)
    num_new_tokens: int  # positions computed in this step (1 for decode, a chunk for prefill/recompute)
    # [num_new_tokens] items at positions [num_computed_tokens, +num_new_tokens), without those still in flight;
    # read-only (the empty list of a pipelined decode may be shared)
    new_token_ids: list
    # [cdiv(num_computed_tokens + num_new_tokens, block_size)] GPU block ids. The request's live,
    # append-only list (no copy per step): read it before the next schedule(), never mutate it.
    block_table: list[int]
    will_sample: bool  # this chunk reaches the last token: sample one token from its last position
    num_prompt_tokens: int  # positions < this are prompt, the rest are earlier outputs
    num_output_tokens: int  # outputs before this step (for min_new_tokens / penalty windows)
    # A decode burst (multi-step decoding, num_steps > 1): the num_new_tokens == num_steps positions are that
    # many decode steps in a row on the device, each sampling a frame whose input is the previous sample.
    num_steps: int = 1


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one step.

    Order of work for the runner: swap_out copies, then swap_in copies, then the forward. At most one of
    swap_out / swap_in is non-empty in a step (swap-in only happens in steps without preemption).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # [num_scheduled_reqs]
    num_scheduled_tokens: int = 0  # sum of num_new_tokens <= max_num_batched_tokens
    preempted_ids: list[str] = field(default_factory=list)  # drop runner state of recomputed requests
    swapped_out_ids: list[str] = field(default_factory=list)  # subset of preempted_ids that were swapped
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # [(gpu_block, cpu_block)]
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # [(cpu_block, gpu_block)]
    finished_ids: list[str] = field(default_factory=list)  # aborted / errored since the last step
    # The scheduler's own bookkeeping for update_from_output (the runner does not read it): steady_rows are
    # the Requests its steady path scheduled (engine/steady.py), each a full burst of steady_num_steps, with
    # their ids; per_row the ScheduledRequests of the other rows (None: every row of scheduled).
    steady_rows: list = field(default_factory=list)
    steady_ids: list[str] = field(default_factory=list)
    steady_num_steps: int = 1
    per_row: list[ScheduledRequest] | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def retain(self, live) -> None:
        """Drop the rows whose request_id is not in live (a container), from every list above."""
        self.scheduled = [s for s in self.scheduled if s.request_id in live]
        if self.per_row is not None:
            self.per_row = [s for s in self.per_row if s.request_id in live]
        keep = [rid in live for rid in self.steady_ids]
        self.steady_rows = [r for r, k in zip(self.steady_rows, keep) if k]
        self.steady_ids = [rid for rid, k in zip(self.steady_ids, keep) if k]


class RequestUpdate(NamedTuple):
    """Result of one step for one request (only requests that sampled, or finished, get one). A tuple, built
    at C level for steady rows like ScheduledRequest."""

    request_id: str
    new_token: object | None  # the last appended item (int or 4-tuple); None when nothing was appended
    finished: bool
    finish_reason: str | None  # "stop" | "length" | None
    num_new_tokens: int = 1  # items appended by this step (0 on a stop at once; up to num_steps in a burst)


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float  # fraction of GPU blocks held by live requests
    prefix_cache_hit_rate: float  # hit tokens / queried tokens at admission
    num_preemptions: int  # total since start
