"""Continuous-batching scheduler: one token budget per step, one progress counter per request.

The budget (max_num_batched_tokens) counts the tokens of one forward pass: a prefill chunk costs its length, a
decode one, and so does a decode burst's row (its k positions run as k forward passes of one token a row). Counted
as k, bursts of 8 at 512 rows took the whole default budget of 4,096 and left new requests a few tokens a step: in
a closed loop of 512 streams with prompts of 40 positions (benchmarks/admission_steps.py) a request needed 7 / 9
steps (p50 / p99) to its 24th frame against 3 / 4 now, and the first wave's p99 was 23 steps against 8.

Each step (schedule):
  1. apply aborts;
  2. running requests, in admission order: each advances by min(remaining tokens, chunk limits), so a
     long prefill takes only what is left and never stalls the running streams. When blocks run out,
     preempt a victim (see _pick_victim);
  3. if nothing was preempted: swap swapped requests back in, then (once none is left swapped) admit
     waiting requests FCFS while the token budget, max_num_seqs_limit and the block pool allow.
Prefill, chunked prefill, decode and recompute are the same rule: compute tokens
[num_computed_tokens, num_computed_tokens + num_new_tokens) of prompt + outputs. The scheduler never looks
at token items; it only passes them on.

Asynchronous scheduling (vLLM V1's): the engine may call schedule() for step n + 1 before
update_from_output() of step n. A request then continues from its in-flight positions
(Request.num_scheduled_tokens): a chunk of known items, or, after a step that samples, a code decode whose
input is the placeholder (the runner reads it on the device). A text request waits for its sample, and
nothing is scheduled past a length limit the in-flight sample reaches. A request preempted while in flight
loses those results (update_from_output skips requests that are no longer running); an EOS sampled in
flight makes the next step's row wasted work, whose result is dropped the same way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import filterfalse
from operator import attrgetter

from ttsserve.engine.block_manager import KVCacheManager
from ttsserve.engine.outputs import ScheduledRequest, SchedulerOutput, SchedulerStats
from ttsserve.engine.request import Request, RequestStatus
from ttsserve.engine.scheduler_commit import OutputCommitter
from ttsserve.engine.scheduler_config import PreemptionMode, SchedulerConfig  # noqa: F401 (re-exported)
from ttsserve.engine.steady import SteadyRows, schedule_burst

_RUNNING = RequestStatus.RUNNING  # an enum member lookup costs ~0.2 us on CPython 3.11; the hot loops test it
_ID = attrgetter("request_id")


def budget_cost(num_new: int, num_steps: int) -> int:
    """Tokens of the step's budget a row takes: those of one forward pass (a decode burst's row: one)."""
    return 1 if num_steps > 1 else num_new


@dataclass
class _Step:
    budget: int  # tokens of one forward pass left (a burst's row costs one)
    tokens: int = 0  # positions scheduled (a burst's row: k): SchedulerOutput.num_scheduled_tokens
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)  # per-row path, insertion-ordered
    steady_rows: list[Request] = field(default_factory=list)  # the steady path's rows, running order
    steady_ids: list[str] = field(default_factory=list)
    steady_scheduled: list[ScheduledRequest] = field(default_factory=list)


class Scheduler(OutputCommitter):
    def __init__(self, config: SchedulerConfig, block_manager: KVCacheManager) -> None:
        if config.preemption_mode == "swap" and block_manager.num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs num_cpu_blocks > 0 in the block manager")
        self.config = config
        self.block_manager = block_manager
        pool_tokens = block_manager.num_gpu_blocks * block_manager.block_size
        # A request alone must always be able to grow, so the pool caps the length like the model does.
        self.token_limit = min(config.max_model_len, pool_tokens)
        self.requests: dict[str, Request] = {}  # every unfinished request (waiting, running, swapped)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.swapped: deque[Request] = deque()
        self._seq: dict[str, int] = {}  # arrival order, tie-break among equal arrival times
        self._next_seq = 0
        self._pending_aborts: dict[str, None] = {}
        self._finished_ids: list[str] = []  # errored at add_request, reported by the next schedule()
        self._max_num_seqs_limit = config.max_num_seqs
        self._steady = SteadyRows(block_manager.block_size, max(config.num_scheduler_steps, 1))
        self.num_preemptions = 0
        self._num_steps = 0

    # ---- queue management --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a fresh request. One that can never fit is finished at once with FINISHED_ERROR and
        reported in the next SchedulerOutput.finished_ids."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already in the scheduler")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.block_table:
            raise ValueError(f"request {rid!r} is not fresh (status {request.status.name})")
        reason = self._why_impossible(request)
        if reason is not None:
            request.status, request.error = RequestStatus.FINISHED_ERROR, reason
            self._finished_ids.append(rid)
            return
        self.requests[rid] = request
        self._seq[rid] = self._next_seq
        self._next_seq += 1
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        """Takes effect at the next schedule(). An id the scheduler does not hold (unknown, finished) is ignored
        at once: a pending abort must not outlive its request, or a new request under that id would inherit it."""
        if request_id in self.requests:
            self._pending_aborts[request_id] = None

    def has_unfinished_requests(self) -> bool:
        """True while some request is unfinished or a finish is still to be reported by schedule()."""
        return bool(self.requests) or bool(self._finished_ids)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def max_num_seqs_limit(self) -> int:
        """Admission cap the latency controller moves in [1, max_num_seqs]; running requests above a
        lowered cap keep running (no preemption), new ones wait."""
        return self._max_num_seqs_limit

    @max_num_seqs_limit.setter
    def max_num_seqs_limit(self, value: int) -> None:
        if not (1 <= value <= self.config.max_num_seqs):
            raise ValueError(f"max_num_seqs_limit must be in [1, {self.config.max_num_seqs}], got {value}")
        self._max_num_seqs_limit = value

    def reset_stats(self) -> None:
        """Zero the counters (the scheduler's and its block manager's); queues and requests stay."""
        self.num_preemptions = 0
        self.block_manager.reset_stats()

    def get_stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            len(self.running),
            len(self.waiting),
            len(self.swapped),
            bm.usage,
            bm.prefix_cache_hit_rate,
            self.num_preemptions,
        )

    # ---- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        self._apply_aborts(out)
        st = _Step(budget=self.config.max_num_batched_tokens)
        self._num_steps += 1
        admit = not self.running or self._num_steps % self.config.admission_interval == 0
        expired = self._steady.expire(self._num_steps)
        if not ((self._steady.horizon or expired) and self._schedule_steady(st, out, expired)):
            self._schedule_running(list(self.running), st, out)
        if not out.preempted_ids:  # admitting now would only take back the blocks just freed
            self._schedule_swapped(st, out)
            if not self.swapped and admit:  # swapped requests came first: new ones must not starve them
                self._schedule_waiting(st, out)
        out.per_row = list(st.scheduled.values())
        out.scheduled = self._merge(st, out.per_row) if st.steady_rows else out.per_row
        out.steady_rows, out.steady_ids, out.steady_num_steps = st.steady_rows, st.steady_ids, self._steady.num_steps
        out.num_scheduled_tokens = st.tokens
        return out

    def _schedule_steady(self, st: _Step, out: SchedulerOutput, expired: list[Request]) -> bool:
        """The steady rows in bulk (engine/steady.py), then the other running rows one by one. Only when the
        budget and the free blocks cover what every other row could ask for: then no row is short of budget or
        preempted, in any order, so the steps equal the per-row path's (False: nothing was done). expired: the
        rows whose horizon ended last step; those that only lack a block get it here and stay steady."""
        running, steady = self.running, self._steady
        rows = steady.rows_in(running)
        others = list(filterfalse(steady.horizon.__contains__, running)) if len(rows) < len(running) else []
        budget = st.budget - len(rows)
        if not self._covers(others, budget):
            return False
        if expired and steady.extend(expired, self._num_steps, self.block_manager, self.token_limit):
            rows = steady.rows_in(running)
            others = list(filterfalse(steady.horizon.__contains__, running)) if len(rows) < len(running) else []
            budget = st.budget - len(rows)
        if not rows:
            return False
        st.budget, st.steady_rows = budget, rows
        st.tokens += steady.num_steps * len(rows)
        st.steady_ids, st.steady_scheduled = schedule_burst(rows, steady.num_steps)
        self._schedule_running(others, st, out)
        return True

    def _covers(self, others: list[Request], budget: int) -> bool:
        """budget and the free blocks hold every other row's largest next step (its remaining positions, or a burst,
        which costs the budget one token)."""
        bm, burst, blocks = self.block_manager, self._steady.num_steps, 0
        for req in others:
            start = req.num_computed_tokens + req.num_inflight_tokens
            n = req.num_tokens_with_placeholders - start
            budget -= n
            blocks += max(bm.blocks_for(start + max(n, burst)) - len(req.block_table), 0)
        return budget >= 0 and blocks <= bm.num_free_blocks

    def _merge(self, st: _Step, per_row: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """Steady and per-row ScheduledRequests in running order (C-level when rows are many)."""
        if not per_row:
            return st.steady_scheduled
        merged = dict.fromkeys(map(_ID, self.running))  # admitted rows are at its end, in admission order
        merged.update(zip(st.steady_ids, st.steady_scheduled))
        merged.update(st.scheduled)
        return list(filter(None, merged.values()))  # None: a running row not scheduled this step

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens req may compute now (0: not this step)."""
        num_new = req.num_tokens_with_placeholders - req.num_scheduled_tokens
        assert num_new >= 1, f"{req.request_id}: nothing to compute"
        if num_new == 1:  # decode, and the last token of a prefill
            return 1 if budget >= 1 else 0
        if not self.config.enable_chunked_prefill:
            return num_new if num_new <= budget else 0
        if self.config.long_prefill_token_threshold:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return min(num_new, budget)

    def _schedule_running(self, running: list[Request], st: _Step, out: SchedulerOutput) -> None:
        """The per-row path over running (a copy: preemption edits self.running), in its order."""
        bm, limit, burst = self.block_manager, self.token_limit, self.config.num_scheduler_steps
        # Running order is admission order, and a partial chunk only happens when a request took the
        # rest of the budget (or the per-request threshold), so a prefilling request is never ahead of
        # more decodes than the budget holds: every running request gets its token (tests check it).
        # Lengths read once (Request's properties cost a call each); a decode skips _chunk.
        for i, req in enumerate(running):
            if req.status is not _RUNNING:
                continue  # preempted earlier in this step
            inflight = req.num_inflight_outputs
            n_prompt, done = len(req.prompt_token_ids), len(req.output_token_ids) + inflight
            # In flight with a sample: the next step may decode from that placeholder only for a code request
            # (a text token steers the next input on the host: the refine stage's end) below its length limits.
            if inflight and (req.mode != "code" or done >= req.max_new_tokens or n_prompt + done >= limit):
                continue
            start = req.num_computed_tokens + req.num_inflight_tokens
            num_new, num_steps = n_prompt + done - start, 1
            if num_new != 1:  # a prefill chunk (_chunk asserts there is something to compute)
                num_new = self._chunk(req, st.budget)
            elif st.budget < 1:
                num_new = 0
            elif (
                burst > 1
                and start >= n_prompt
                and req.mode == "code"
                and start + burst <= limit
                and st.budget - 1 >= len(running) - i - 1
            ):  # a token left for each request after it (a burst's row costs one token of the budget)
                num_new = num_steps = burst  # a decode burst: positions [start, start + burst)
            if num_new == 0:
                continue
            while not bm.allocate_slots(req, req.num_inflight_tokens + num_new):
                victim = self._pick_victim()
                self._preempt(victim, st, out)
                if victim is req:
                    break
            else:
                self._schedule(req, num_new, st, num_steps)

    def _schedule_swapped(self, st: _Step, out: SchedulerOutput) -> None:
        bm = self.block_manager
        while self.swapped and len(self.running) < self._max_num_seqs_limit and st.budget > 0:
            req = self.swapped[0]
            num_new = self._chunk(req, st.budget)
            if num_new == 0 or not bm.can_swap_in(req, num_new):
                break
            self.swapped.popleft()
            out.swap_in.extend(bm.swap_in(req))
            ok = bm.allocate_slots(req, num_new)
            assert ok, "can_swap_in promised room for the next chunk"
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._schedule(req, num_new, st)

    def _schedule_waiting(self, st: _Step, out: SchedulerOutput) -> None:
        bm = self.block_manager
        while self.waiting and len(self.running) < self._max_num_seqs_limit and st.budget > 0:
            req = self.waiting[0]
            reason = self._why_impossible(req)
            if reason is not None:
                self.waiting.popleft()
                req.error = reason
                self._finish(req, RequestStatus.FINISHED_ERROR)
                out.finished_ids.append(req.request_id)
                continue
            req.num_computed_tokens = bm.get_computed_blocks(req)
            num_new = self._chunk(req, st.budget)
            if num_new == 0 or not bm.allocate_slots(req, num_new):
                bm.free(req)  # give back the prefix hits; retry next step (FCFS: nobody overtakes)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._schedule(req, num_new, st)

    def _schedule(self, req: Request, num_new: int, st: _Step, num_steps: int = 1) -> None:
        prompt, outputs = req.prompt_token_ids, req.output_token_ids
        n_prompt = len(prompt)
        start = req.num_computed_tokens + req.num_inflight_tokens  # req.num_scheduled_tokens
        end = start + num_new
        num_outputs = len(outputs) + req.num_inflight_outputs
        will_sample = end == n_prompt + num_outputs or num_steps > 1
        # req.token_slice(start, end), inlined for a decode (positions past the prompt)
        new_ids = outputs[start - n_prompt : end - n_prompt] if start >= n_prompt else req.token_slice(start, end)
        st.scheduled[req.request_id] = ScheduledRequest(  # positional: this runs per request per step
            req.request_id,  # request_id
            req.mode,  # mode
            start,  # num_computed_tokens
            num_new,  # num_new_tokens
            new_ids,  # new_token_ids (without the in-flight placeholder)
            req.block_table,  # block_table
            will_sample,  # will_sample
            n_prompt,  # num_prompt_tokens
            num_outputs,  # num_output_tokens
            num_steps,  # num_steps
        )
        req.num_inflight_tokens += num_new
        req.num_inflight_outputs += num_steps if will_sample else 0
        st.budget -= budget_cost(num_new, num_steps)
        st.tokens += num_new
        steady = self._steady
        if num_new == num_steps == steady.num_steps and will_sample and start >= n_prompt and req.mode == "code":
            room = min(req.max_new_tokens, self.token_limit - n_prompt)
            steady.enter(req, self._num_steps, end, num_outputs + num_steps, room)
        elif req in steady.horizon:
            steady.discard(req)

    # ---- preemption --------------------------------------------------------------------------------
    def _pick_victim(self) -> Request:
        """Prefer requests whose listeners already hear audio, latest-arrived first; a request still
        waiting for its first audio only when no other victim exists."""
        return max(self.running, key=lambda r: (r.has_first_audio, r.arrival_time, self._seq[r.request_id]))

    def _preempt(self, victim: Request, st: _Step, out: SchedulerOutput) -> None:
        bm = self.block_manager
        self.running.remove(victim)
        self._steady.discard(victim)
        undone = st.scheduled.pop(victim.request_id, None)
        if undone is not None:  # scheduled earlier in this step: give its tokens back
            st.budget += budget_cost(undone.num_new_tokens, undone.num_steps)
            st.tokens -= undone.num_new_tokens
        # whatever it has in flight is dropped: update_from_output skips it, it is no longer running
        victim.num_inflight_tokens = victim.num_inflight_outputs = 0
        if self.config.preemption_mode != "recompute" and bm.can_swap_out(victim):
            out.swap_out.extend(bm.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
            out.swapped_out_ids.append(victim.request_id)
        else:
            bm.free(victim, keep_outputs=True)
            victim.num_computed_tokens = 0  # re-prefill prompt + outputs (prefix cache may cover most)
            victim.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_ids.append(victim.request_id)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Caller removes req from its queue."""
        req.status = status
        self._steady.discard(req)
        self.block_manager.free(req)
        del self.requests[req.request_id]
        del self._seq[req.request_id]

    def _apply_aborts(self, out: SchedulerOutput) -> None:
        for rid in self._pending_aborts:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status is RequestStatus.SWAPPED:
                self.swapped.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            out.finished_ids.append(rid)
        self._pending_aborts.clear()

    def _why_impossible(self, req: Request) -> str | None:
        cfg, bm = self.config, self.block_manager
        if req.num_prompt_tokens >= cfg.max_model_len:
            return (
                f"prompt of {req.num_prompt_tokens} positions leaves no room for output under "
                f"max_model_len={cfg.max_model_len}"
            )
        if req.num_tokens >= self.token_limit:
            return (
                f"{req.num_tokens} positions need {bm.blocks_for(req.num_tokens + 1)} KV blocks; "
                f"the pool has {bm.num_gpu_blocks} blocks of {bm.block_size}"
            )
        return None
