"""Scheduler under pressure with a fake runner (scheduler_testutil.py), pure Python: preemption by recompute
and swap, impossible requests, aborts, stop conditions, limits and validation."""

from __future__ import annotations

import pytest
from scheduler_testutil import (
    FakeRunner,
    create_requests,
    create_scheduler,
    drain,
    fake_sample,
    run_to_completion,
    scheduled,
    step,
)

from ttsserve.engine.request import Request, RequestStatus
from ttsserve.engine.scheduler import SchedulerConfig


def _pressure_pair(first_audio_a: int, first_audio_b: int):
    # 10 blocks of 2: two prompts of 8 take 8 blocks; decoding soon needs more than the pool.
    sched = create_scheduler(num_gpu_blocks=10, block_size=2, max_model_len=64)
    a = Request(
        "a", [(1, p, 0, 0) for p in range(8)], max_new_tokens=12, arrival_time=0.0, first_audio_frames=first_audio_a
    )
    b = Request(
        "b", [(2, p, 0, 0) for p in range(8)], max_new_tokens=12, arrival_time=1.0, first_audio_frames=first_audio_b
    )
    runner = FakeRunner(sched, {"a": a, "b": b})
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(20):
        out, _ = step(sched, runner)
        if out.preempted_ids:
            drain(sched, runner)
            return out.preempted_ids, a, b
    raise AssertionError("no preemption happened")


def test_preemption_spares_requests_still_waiting_for_first_audio():
    preempted, a, b = _pressure_pair(first_audio_a=1, first_audio_b=100)
    assert preempted == ["a"]  # a arrived first, but its listener already hears audio
    assert a.output_token_ids == [fake_sample(a, i) for i in range(12)]  # recompute reproduced it


def test_preemption_takes_latest_arrived_among_equals():
    assert _pressure_pair(first_audio_a=1, first_audio_b=1)[0] == ["b"]
    assert _pressure_pair(first_audio_a=100, first_audio_b=100)[0] == ["b"]


def test_recompute_reprefills_prompt_and_outputs_with_prefix_hits():
    # 12 blocks: the survivor ends with 10, so the victim's 2 leading blocks stay cached (LRU).
    sched = create_scheduler(num_gpu_blocks=12, block_size=2, max_model_len=64, max_num_seqs=2)
    reqs = create_requests(3, prompt_len=8, max_new_tokens=12)  # r2 waits for a seat
    runner = FakeRunner(sched, {r.request_id: r for r in reqs})
    for r in reqs:
        sched.add_request(r)
    victim = None
    while victim is None:
        victim = next(iter(step(sched, runner)[0].preempted_ids), None)
    v = {r.request_id: r for r in reqs}[victim]
    assert v.status is RequestStatus.PREEMPTED and v.num_computed_tokens == 0 and v.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == [victim, "r2"]  # back at the FRONT of waiting
    while True:
        out, _ = step(sched, runner)
        if victim in scheduled(out):
            break
    (s,) = [s for s in out.scheduled if s.request_id == victim]
    assert s.num_computed_tokens > 0  # its own freed blocks were still cached
    # It re-prefills the rest of prompt + outputs so far in one chunk, then samples the next frame.
    assert s.num_computed_tokens + s.num_new_tokens == 8 + s.num_output_tokens and s.will_sample
    assert s.num_output_tokens > 0 and s.new_token_ids[-1] == fake_sample(v, s.num_output_tokens - 1)
    drain(sched, runner)
    assert v.output_token_ids == [fake_sample(v, i) for i in range(12)]


def test_swap_preemption_round_trip():
    sched = create_scheduler(num_gpu_blocks=10, block_size=2, num_cpu_blocks=16, preemption_mode="swap")
    reqs = create_requests(2, prompt_len=8, max_new_tokens=12)
    runner = FakeRunner(sched, {r.request_id: r for r in reqs})
    for r in reqs:
        sched.add_request(r)
    swap_out = None
    while not swap_out:
        out, _ = step(sched, runner)
        swap_out = out.swap_out
    (vid,) = out.swapped_out_ids
    v = {r.request_id: r for r in reqs}[vid]
    assert v.status is RequestStatus.SWAPPED and sched.num_swapped == 1
    assert len(swap_out) == -(-v.num_computed_tokens // 2)
    while True:
        out, _ = step(sched, runner)
        if out.swap_in:
            break
    assert sorted(c for c, _ in out.swap_in) == sorted(c for _, c in swap_out)
    assert [g for _, g in out.swap_in] == v.block_table[: len(out.swap_in)]
    assert scheduled(out)[vid][0] > 0  # resumes where it stopped, no recompute
    drain(sched, runner)  # the fake runner checks the KV came back intact
    assert v.output_token_ids == [fake_sample(v, i) for i in range(12)]


def test_swapped_requests_come_back_before_new_admissions():
    sched = create_scheduler(num_gpu_blocks=10, block_size=2, num_cpu_blocks=16, preemption_mode="swap")
    reqs = create_requests(2, prompt_len=8, max_new_tokens=12)
    late = Request("late", [(5, 0, 0, 0)] * 2, max_new_tokens=2, arrival_time=5.0)
    runner = FakeRunner(sched, {r.request_id: r for r in reqs + [late]})
    for r in reqs:
        sched.add_request(r)
    while not sched.num_swapped:
        step(sched, runner)
    sched.add_request(late)  # would fit now, but the swapped request is first in line
    while late.status is RequestStatus.WAITING:
        out, _ = step(sched, runner)
        assert "late" not in scheduled(out) or sched.num_swapped == 0
    drain(sched, runner)
    assert late.status is RequestStatus.FINISHED_LENGTH


def test_auto_without_host_blocks_recomputes_and_swap_needs_host_blocks():
    preempt_auto = create_scheduler(num_gpu_blocks=10, block_size=2, preemption_mode="auto")
    reqs = create_requests(2, prompt_len=8, max_new_tokens=12)
    streams, _ = run_to_completion(preempt_auto, reqs)
    assert preempt_auto.num_preemptions > 0 and sum(r.num_preemptions for r in reqs) > 0
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        create_scheduler(preemption_mode="swap", num_cpu_blocks=0)


def test_impossible_requests_finish_with_error_and_the_loop_goes_on():
    sched = create_scheduler(num_gpu_blocks=4, block_size=4, max_model_len=32)
    too_long = Request("long", [1] * 32, arrival_time=0.0)  # no room under max_model_len
    too_big = Request("big", [1] * 16, arrival_time=1.0)  # 16 positions + 1 > 4 blocks of 4
    ok = Request("ok", [1] * 4, max_new_tokens=3, arrival_time=2.0)
    for r in (too_long, too_big, ok):
        sched.add_request(r)
    out = sched.schedule()
    assert out.finished_ids == ["long", "big"]
    assert too_long.status is RequestStatus.FINISHED_ERROR and "max_model_len" in too_long.error
    assert too_big.status is RequestStatus.FINISHED_ERROR and "KV blocks" in too_big.error
    assert scheduled(out) == {"ok": (0, 4, True)}


def test_abort_takes_effect_at_next_schedule_and_frees_blocks():
    sched = create_scheduler(max_num_seqs=2)
    reqs = create_requests(3, prompt_len=6, max_new_tokens=20)
    runner = FakeRunner(sched, {r.request_id: r for r in reqs})
    for r in reqs:
        sched.add_request(r)
    step(sched, runner)
    sched.abort_request("r0")  # running
    sched.abort_request("r2")  # waiting
    sched.abort_request("nope")  # unknown: ignored
    assert reqs[0].status is RequestStatus.RUNNING  # not yet
    out, ups = step(sched, runner)
    assert out.finished_ids == ["r0", "r2"]
    assert reqs[0].finish_reason == "abort" and reqs[2].finish_reason == "abort"
    assert reqs[0].block_table == [] and [u.request_id for u in ups] == ["r1"]
    assert sched.num_running == 1 and sched.num_waiting == 0


def test_stop_is_not_appended_and_length_caps():
    sched = create_scheduler()
    a, b = create_requests(2, prompt_len=5, max_new_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    ups = sched.update_from_output(out, {"a": None, "r1": (1, 1, 1, 1)}, {"r0": True})
    assert (ups[0].new_token, ups[0].finished, ups[0].finish_reason) == (None, True, "stop")
    assert a.output_token_ids == [] and a.status is RequestStatus.FINISHED_STOPPED
    assert (ups[1].new_token, ups[1].finished) == ((1, 1, 1, 1), False)
    for _ in range(3):
        out = sched.schedule()
        ups = sched.update_from_output(out, {"r1": (2, 2, 2, 2)}, {})
    assert ups[0].finish_reason == "length" and b.num_output_tokens == 4
    assert not sched.has_unfinished_requests()
    with pytest.raises(ValueError, match="no sample"):
        sched.add_request(Request("x", [1, 2]))
        sched.update_from_output(sched.schedule(), {}, {})


def test_max_num_seqs_limit_moves_admission_only():
    sched = create_scheduler(max_num_seqs=4)
    reqs = create_requests(4, prompt_len=3, max_new_tokens=6)
    runner = FakeRunner(sched, {r.request_id: r for r in reqs})
    sched.max_num_seqs_limit = 2
    for r in reqs:
        sched.add_request(r)
    step(sched, runner)
    assert sched.num_running == 2 and sched.num_waiting == 2
    sched.max_num_seqs_limit = 4
    step(sched, runner)
    assert sched.num_running == 4
    sched.max_num_seqs_limit = 1  # lowering never preempts: running streams keep going
    out, _ = step(sched, runner)
    assert len(out.scheduled) == 4
    for bad in (0, 5):
        with pytest.raises(ValueError, match="max_num_seqs_limit"):
            sched.max_num_seqs_limit = bad


def test_config_and_request_validation():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="chunked"):
        SchedulerConfig(max_num_batched_tokens=512, max_model_len=4096, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="empty"):
        Request("x", [])
    with pytest.raises(ValueError, match="mode"):
        Request("x", [1], mode="audio")
    sched = create_scheduler()
    sched.add_request(Request("x", [1]))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(Request("x", [1]))


def test_engine_core_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys, ttsserve.engine.scheduler, ttsserve.engine.block_manager, ttsserve.engine.outputs; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
