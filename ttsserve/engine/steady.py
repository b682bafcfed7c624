"""Steady decode rows: the scheduler's bulk path for running code requests that repeat last step's decode burst.

A row is steady from the step after the scheduler's per-row path scheduled it as a full decode burst (a code
request past its prompt, num_new_tokens == num_steps == the configured burst) up to its horizon: the last step
whose burst still fits in the KV blocks it holds and leaves it short of its length limits. Until then a step
schedules it, and update_from_output commits its samples, without a Python call per row: C-level maps over the
steady rows build their ScheduledRequests and RequestUpdates and append the samples, and a loop without calls
advances the in-flight counters (sys.setprofile sees a fixed number of events per step for any number of rows;
tests/engine/test_steady_host_work.py counts them). The per-row path this replaces cost ~1.0 us (schedule) and
~0.35 us (update) per row per step on a shared CPU core; this path ~0.65 us and ~0.3 us (N = 256, burst 1).

A row leaves early when it finishes, is aborted or preempted (Scheduler._finish / _preempt discard it). A row
whose horizon ends because its next burst opens a KV block (every block_size / burst steps of a row) gets that
block from the bulk path's step (SteadyRows.extend: one allocate_slots, the per-row path's, and no per-row
scheduling or commit) and stays. The per-row path keeps everything else: prefill, the first decode, a burst
that nears a length limit, text rows, and any step whose budget or free blocks are short for the other rows.
"""

from __future__ import annotations

from collections import deque
from itertools import compress, repeat
from operator import add, attrgetter, getitem, is_, itemgetter, sub

from ttsserve.engine.block_manager import KVCacheManager
from ttsserve.engine.outputs import RequestUpdate, ScheduledRequest
from ttsserve.engine.request import Request, RequestStatus

_ID, _PROMPT, _OUTPUTS = attrgetter("request_id"), attrgetter("prompt_token_ids"), attrgetter("output_token_ids")
_COMPUTED, _TABLE, _STATUS = attrgetter("num_computed_tokens"), attrgetter("block_table"), attrgetter("status")
_IN_TOKENS, _IN_OUTPUTS = attrgetter("num_inflight_tokens"), attrgetter("num_inflight_outputs")
_LAST = itemgetter(-1)
_RUNNING = RequestStatus.RUNNING
_NO_ITEMS: list = []  # the new_token_ids of every pipelined steady row (its input is in flight): shared, read-only
_new_tuple = tuple.__new__  # a NamedTuple built from a field tuple at C level (no __new__ call in Python)


def _consume(it) -> None:
    deque(it, maxlen=0)


class SteadyRows:
    """The steady rows and their horizons. horizon[req]: the last step the bulk path may schedule req."""

    def __init__(self, block_size: int, num_steps: int) -> None:
        self.block_size, self.num_steps = block_size, num_steps
        self.horizon: dict[Request, int] = {}  # a Request hashes by identity (eq=False)
        self._expiry: dict[int, list[Request]] = {}  # step -> rows whose horizon ended the step before

    def enter(self, req: Request, step: int, end: int, num_outputs: int, room: int) -> None:
        """req was scheduled in `step` as a full burst up to position `end`, making num_outputs outputs (with
        those in flight) of at most `room`: it stays steady while its next bursts need no block and end short of
        room (the length finish is the per-row path's)."""
        b = self.num_steps
        k = min((len(req.block_table) * self.block_size - end) // b, (room - num_outputs - 1) // b)
        if k < 1:
            self.horizon.pop(req, None)
            return
        self.horizon[req] = step + k
        self._expiry.setdefault(step + k + 1, []).append(req)

    def discard(self, req: Request) -> None:
        self.horizon.pop(req, None)

    def expire(self, step: int) -> list[Request]:
        """Rows whose horizon was the step before `step` leave (an entry re-entered since keeps its new one)
        -> those rows."""
        gone = []
        for req in self._expiry.pop(step, ()):
            if self.horizon.get(req) == step - 1:
                del self.horizon[req]
                gone.append(req)
        return gone

    def extend(self, expired: list[Request], step: int, bm: KVCacheManager, token_limit: int) -> bool:
        """Rows whose horizon ended (expire) because their next burst opens a KV block, their length limits still
        a burst away: allocate that block now, as the per-row path would (allocate_slots), and let them stay
        steady, so a row leaves the bulk path near its length limits only, not every block_size / burst steps.
        The caller checked that the free blocks cover them (Scheduler._covers). -> whether any was extended."""
        b, extended = self.num_steps, False
        for req in expired:
            if req.status is not _RUNNING:
                continue
            num_outputs = len(req.output_token_ids) + req.num_inflight_outputs
            room = min(req.max_new_tokens, token_limit - len(req.prompt_token_ids))
            if num_outputs + b >= room:
                continue  # a length limit is within the next burst: the per-row path finishes it
            ok = bm.allocate_slots(req, req.num_inflight_tokens + b)
            assert ok, "the caller counted this row's next block"
            # as if it had entered last step with this block: the horizon the per-row path would give it now
            self.enter(req, step - 1, req.num_computed_tokens + req.num_inflight_tokens, num_outputs, room)
            extended = True
        return extended

    def rows_in(self, running: list[Request]) -> list[Request]:
        """The steady rows, in running order (C-level filter)."""
        return list(filter(self.horizon.__contains__, running))


def schedule_burst(rows: list[Request], b: int) -> tuple[list[str], list[ScheduledRequest]]:
    """The next burst of b positions of each steady row (a decode: start = prompt + outputs - 1, in flight
    included) -> (ids, ScheduledRequests); the rows' in-flight counters advance as Scheduler._schedule's do."""
    ids = list(map(_ID, rows))
    n_prompt = list(map(len, map(_PROMPT, rows)))
    starts = list(map(add, map(_COMPUTED, rows), map(_IN_TOKENS, rows)))
    outputs = list(map(_OUTPUTS, rows))
    num_out = list(map(add, map(len, outputs), map(_IN_OUTPUTS, rows)))
    # items at positions [start, start + b): the last output when none is in flight, else nothing known yet
    if all(map(_IN_OUTPUTS, rows)):
        new_ids = repeat(_NO_ITEMS)
    else:
        first = list(map(sub, num_out, repeat(1)))
        new_ids = map(getitem, outputs, map(slice, first, map(add, first, repeat(b))))
    fields = zip(
        ids,
        repeat("code"),
        starts,
        repeat(b),
        new_ids,
        map(_TABLE, rows),
        repeat(True),
        n_prompt,
        num_out,
        repeat(b),
    )
    scheduled = list(map(_new_tuple, repeat(ScheduledRequest), fields))
    for req in rows:  # no call per row; faster than setattr maps (3.11 specialises slot attribute updates)
        req.num_inflight_tokens += b
        req.num_inflight_outputs += b
    return ids, scheduled


def commit_burst(
    rows: list[Request], ids: list[str], b: int, sampled: dict, stop: dict
) -> tuple[list[RequestUpdate], list[Request]]:
    """Commit the steady rows' bursts (b samples each) -> (their updates, the rows left to the per-row commit:
    those whose burst stopped). Rows no longer running (finished, aborted, preempted since) are dropped."""
    live = list(map(is_, map(_STATUS, rows), repeat(_RUNNING)))
    if not all(live):
        rows, ids = list(compress(rows, live)), list(compress(ids, live))
    stopped: list[Request] = []
    if stop:
        flags = list(map(stop.get, ids, repeat(False)))
        if any(flags):
            stopped = list(compress(rows, flags))
            keep = [not f for f in flags]
            rows, ids = list(compress(rows, keep)), list(compress(ids, keep))
    try:
        items = list(map(sampled.__getitem__, ids))
    except KeyError as e:
        raise ValueError(f"runner output has no sample for request {e.args[0]!r}") from None
    if b > 1 and any(map(b.__ne__, map(len, items))):
        raise ValueError(f"runner output lacks a burst of {b} samples for a steady row of {ids[:4]}...")
    for req in rows:  # as in schedule_burst: a loop without calls
        req.num_computed_tokens += b
        req.num_inflight_tokens -= b
        req.num_inflight_outputs -= b
    outputs = map(_OUTPUTS, rows)
    if b > 1:
        _consume(map(list.extend, outputs, items))
        last = map(_LAST, items)
    else:
        _consume(map(list.append, outputs, items))
        last = iter(items)
    fields = zip(ids, last, repeat(False), repeat(None), repeat(b))
    return list(map(_new_tuple, repeat(RequestUpdate), fields)), stopped
