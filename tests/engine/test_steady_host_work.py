"""The scheduler's host work per step does not grow with the steady decode rows (engine/steady.py).

N code requests decode in step, driven as the engine drives the scheduler (schedule, then update_from_output with
the runner's samples; pipelined: step n + 1 is scheduled before step n's results come back). Every step is
counted, not timed: the Python-level calls of schedule + update_from_output (sys.setprofile: Python calls and C
calls made from bytecode; C-level maps over the rows are not events). A step in which no row is new to decoding
and none opens a KV block must make as many calls for 256 rows as for 8. Pure Python: no torch.
"""

from __future__ import annotations

import pytest

from tests.call_count import counting_calls
from ttsserve.engine.block_manager import KVCacheManager
from ttsserve.engine.request import Request
from ttsserve.engine.scheduler import Scheduler, SchedulerConfig

SIZES = (8, 64, 256)
BLOCK_SIZE, PROMPT_LEN, MAX_MODEL_LEN = 16, 40, 1024


def _scheduler(n: int, burst: int) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=n,
        max_num_batched_tokens=max(4096, n * PROMPT_LEN),
        max_model_len=MAX_MODEL_LEN,
        num_scheduler_steps=burst,
    )
    s = Scheduler(cfg, KVCacheManager(n * MAX_MODEL_LEN // BLOCK_SIZE, BLOCK_SIZE))
    for i in range(n):
        prompt = [(i, j, 0, 0) for j in range(PROMPT_LEN)]
        s.add_request(Request(f"r{i}", prompt, mode="code", max_new_tokens=MAX_MODEL_LEN))
    return s


def _samples(out) -> dict:
    """The runner's samples for a SchedulerOutput: a frame per sampling row, a tuple of frames for a burst."""
    frame = (1, 2, 3, 4)
    return {s.request_id: (frame,) * s.num_steps if s.num_steps > 1 else frame for s in out.scheduled if s.will_sample}


def _steps(n: int, burst: int, pipelined: bool, num_steps: int = 24):
    """-> [(Python calls of schedule + update, whether the step was steady)] per step after the first three. A
    step is steady when the steps it schedules and commits are clean: every row decoded the step before and none
    opens a block (pipelined, the step committed is the one before)."""
    s = _scheduler(n, burst)
    in_flight, decoded, result, was_clean = None, set(), [], False
    for k in range(num_steps):
        tables = {r.request_id: len(r.block_table) for r in s.running}
        with counting_calls() as calls:
            out = s.schedule()
            done = in_flight if pipelined else (out, _samples(out))
            if done is not None:
                s.update_from_output(done[0], done[1], {})
        in_flight = (out, _samples(out))
        rows = {x.request_id: x for x in out.scheduled}
        opens = any(len(s.requests[rid].block_table) != tables.get(rid, -1) for rid in rows)
        clean = len(rows) == n and not opens and decoded == set(rows)
        steady, was_clean = clean and (was_clean or not pipelined), clean
        decoded = {rid for rid, x in rows.items() if x.num_computed_tokens >= x.num_prompt_tokens}
        if k >= 3:
            result.append((calls.count, steady))
    return result


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("burst", [1, 4])
def test_steady_decode_step_makes_the_same_python_calls_for_any_number_of_rows(burst: int, pipelined: bool) -> None:
    steady_calls = {}
    for n in SIZES:
        counts = [calls for calls, steady in _steps(n, burst, pipelined) if steady]
        assert counts, "no steady step"
        steady_calls[n] = max(counts)
    # a per-row Python loop, call or generator would add at least N - 8 calls
    assert steady_calls[SIZES[-1]] <= steady_calls[SIZES[0]] + 8, steady_calls


@pytest.mark.parametrize("burst", [1, 4])
def test_a_step_that_opens_blocks_costs_per_row_work_only_for_those_rows(burst: int) -> None:
    """Opening a block is the amortised exception: the rows that open one take the per-row path, and every step
    still schedules every row (the counts are the same steps for 8 and 64 rows, all rows in phase)."""
    by_n = {n: _steps(n, burst, pipelined=True) for n in (8, 64)}
    assert [st for _, st in by_n[8]] == [st for _, st in by_n[64]]
    assert not all(st for _, st in by_n[64]), "the steps include rows opening a block"


@pytest.mark.parametrize("pipelined", [False, True])
def test_bulk_path_schedules_the_steps_of_the_per_row_path(pipelined: bool) -> None:
    """The steady rows in bulk, and the rows whose horizon ends for want of a KV block extended in bulk
    (SteadyRows.extend), schedule exactly what the per-row path schedules step by step: the same rows, chunks,
    bursts and table lengths, through EOS stops, length limits and staggered admissions."""

    def run(bulk: bool) -> list:
        s = _scheduler(24, 4)
        if not bulk:
            s._schedule_steady = lambda *args: False
        reqs = list(s.waiting)
        for i, r in enumerate(reqs):
            r.max_new_tokens = 37 + 11 * i  # length limits inside and at the edge of a burst
        stop_at = {r.request_id: 29 + 13 * i for i, r in enumerate(reqs) if i % 3 == 0}
        log, in_flight = [], None
        s.max_num_seqs_limit = 8  # admissions staggered: rows start in other phases of their blocks
        for k in range(140):
            if k in (9, 23):
                s.max_num_seqs_limit += 8
            out = s.schedule()
            log.append(
                [
                    (x.request_id, x.num_computed_tokens, x.num_new_tokens, x.num_steps, x.will_sample)
                    for x in out.scheduled
                ]
                + [(rid, len(s.requests[rid].block_table)) for rid in sorted(s.requests)]
            )
            sampled, stop = {}, {}
            for x in out.scheduled:
                if not x.will_sample:
                    continue
                first = x.num_computed_tokens + x.num_new_tokens - x.num_steps + 1 - x.num_prompt_tokens
                idx = range(first, first + x.num_steps)
                end = stop_at.get(x.request_id)
                if end is not None and end in idx:
                    stop[x.request_id] = True
                    idx = range(first, end)
                frames = [(i % 7, 1, 2, 3) for i in idx]
                sampled[x.request_id] = tuple(frames) if x.num_steps > 1 else (frames[0] if frames else None)
            done = in_flight if pipelined else (out, sampled, stop)
            in_flight = (out, sampled, stop)
            if done is not None:
                s.update_from_output(*done)
        assert not s.requests, "every request ended"
        return log

    assert run(True) == run(False)
