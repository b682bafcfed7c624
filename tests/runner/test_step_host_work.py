"""The runner's host work per step does not grow with the rows that did not change (runner/input_batch.py).

N code streams decode in step; every step is counted, not timed: the Python-level calls of ModelRunner.launch +
wait (sys.setprofile: Python calls, generator resumptions and C calls made from bytecode; C-level maps over
the rows are not events), and the rows InputBatch.update_states read from their ScheduledRequests (num_rows_read)
and the block tables it wrote (num_tables_synced). A steady step must make as many calls for 256 rows as for 8,
read only the rows that did not decode last step (here: a sequence new to the batch, in its prefill and in its
first decode), and write only the tables of new rows and of decodes that open a block.
"""

from __future__ import annotations

import pytest

from tests.call_count import counting_calls
from ttsserve.config import EngineConfig
from ttsserve.engine.engine import Engine
from ttsserve.params import SamplingParams, SynthesisRequest
from ttsserve.runner.input_batch import InputBatch

SIZES = (8, 64, 256)
BLOCK_SIZE = 16


def _request(i: int) -> SynthesisRequest:
    params = SamplingParams(seed=i, max_new_tokens=400, min_new_tokens=400)  # no EOS: every row stays
    return SynthesisRequest("host work per step.", code_params=params)


def _engine(n: int, burst: int) -> Engine:
    cfg = EngineConfig(
        load_format="dummy",
        dummy_size="tiny",
        device="cpu",
        kv_cache_memory=64 << 20,
        swap_space=0,
        block_size=BLOCK_SIZE,
        max_num_seqs=n + 1,
        max_num_batched_tokens=max(4096, 64 * n),
        num_scheduler_steps=burst,
    )
    engine = Engine(cfg)
    for i in range(n):
        engine.add_synthesis(_request(i))
    return engine


def _step(engine: Engine, decoded: set[str], count_rows: bool = True) -> tuple[int, tuple, tuple[int, int]]:
    """One scheduler -> runner -> scheduler step -> (Python calls in the runner, (rows read, tables synced) or
    () without count_rows, (rows that did not decode last step, rows new to the batch or whose step opens a
    block)). decoded: the sequences that decoded the longest burst last step, updated."""
    sched = engine.scheduler.schedule()
    runner, ib = engine.runner, engine.runner.input_batch
    new = [s.request_id not in ib.row_of for s in sched.scheduled]
    fresh = [s.request_id not in decoded for s in sched.scheduled]
    opens = [
        -(-(s.num_computed_tokens + s.num_new_tokens) // BLOCK_SIZE) > -(-s.num_computed_tokens // BLOCK_SIZE)
        for s in sched.scheduled
    ]
    counters = (lambda: (ib.num_rows_read, ib.num_tables_synced)) if count_rows else tuple
    before = counters()
    with counting_calls() as calls:  # the collector paused: the engine times its pauses in callbacks
        out = runner.wait(runner.launch(sched, engine.scheduler.requests))
    engine.scheduler.update_from_output(sched, out.sampled, out.stopped)
    done = tuple(b - a for a, b in zip(before, counters()))
    burst = engine.scheduler.config.num_scheduler_steps
    decoded.clear()
    decoded.update(
        s.request_id for s in sched.scheduled if s.num_computed_tokens >= s.num_prompt_tokens and s.num_steps == burst
    )
    return calls.count, done, (sum(fresh), sum(a or b for a, b in zip(new, opens)))


def _steps(n: int, burst: int, count_rows: bool):
    """12 steps of n steady decode rows, a new sequence joining at the 7th."""
    engine = _engine(n, burst)
    decoded: set[str] = set()
    for _ in range(3):  # prefill, then every row decodes
        _step(engine, decoded, count_rows)
    for k in range(12):
        if k == 6:
            engine.add_synthesis(_request(n))
        yield _step(engine, decoded, count_rows)


@pytest.mark.parametrize("burst", [1, 4])
def test_steady_decode_step_makes_the_same_python_calls_for_any_number_of_rows(burst: int, monkeypatch) -> None:
    monkeypatch.setattr(InputBatch, "verify", False, raising=False)  # it reads every row: not the step path
    steady_calls = {}
    for n in SIZES:
        counts = [calls for calls, _, changed in _steps(n, burst, count_rows=False) if changed == (0, 0)]
        assert counts, "no step without a changed row"
        steady_calls[n] = max(counts)
    # a per-row Python loop, call or generator would add at least N - 8 calls
    assert steady_calls[SIZES[-1]] <= steady_calls[SIZES[0]] + 8, steady_calls


@pytest.mark.parametrize("burst", [1, 4])
def test_a_step_reads_and_writes_only_the_rows_that_changed(burst: int, monkeypatch) -> None:
    monkeypatch.setattr(InputBatch, "verify", False)
    saw = set()
    for k, (_, done, changed) in enumerate(_steps(64, burst, count_rows=True)):
        assert done == changed, f"step {k}: (read, synced) {done}, (not decoded last step, new or opening) {changed}"
        saw.update(i for i in (0, 1) if changed[i])
    assert saw == {0, 1}, "the steps include a row read and a table synced"
