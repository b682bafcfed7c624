"""Scheduler tests with a fake runner (scheduler_testutil.py), pure Python: random workloads (hypothesis),
continuous batching, prefix sharing and chunked prefill. Preemption, swap, errors and limits:
test_scheduler_preemption.py."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from scheduler_testutil import (
    FakeRunner,
    check_outputs,
    create_requests,
    create_scheduler,
    drain,
    fake_sample,
    run_to_completion,
    scenarios,
    scheduled,
    step,
)

from ttsserve.engine.request import Request, RequestStatus


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_property_random_workloads(scenario):
    sched, reqs, arrivals, aborts, stop_at, limits = scenario
    streams, _ = run_to_completion(sched, reqs, arrivals, aborts, stop_at, limits)
    check_outputs(sched, reqs, streams, stop_at)
    assert not sched.requests and not sched.running and not sched.waiting and not sched.swapped


def test_continuous_batching_mixed_modes_until_length():
    sched = create_scheduler()
    reqs = create_requests(2, prompt_len=10, max_new_tokens=5)
    reqs.append(Request("t0", [7] * 6, mode="text", max_new_tokens=3, arrival_time=2.0))
    runner = FakeRunner(sched, {r.request_id: r for r in reqs})
    for r in reqs:
        sched.add_request(r)
    out, ups = step(sched, runner)
    assert scheduled(out) == {"r0": (0, 10, True), "r1": (0, 10, True), "t0": (0, 6, True)}
    assert {s.mode for s in out.scheduled} == {"code", "text"}
    assert [u.new_token for u in ups] == [fake_sample(r, 0) for r in reqs]
    out, _ = step(sched, runner)
    assert scheduled(out) == {"r0": (10, 1, True), "r1": (10, 1, True), "t0": (6, 1, True)}
    assert out.scheduled[0].new_token_ids == [fake_sample(reqs[0], 0)]  # decode feeds the last sample
    drain(sched, runner)
    assert [r.num_output_tokens for r in reqs] == [5, 5, 3]
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)


def test_prefix_sharing_only_with_equal_prefix_key():
    sched = create_scheduler(block_size=4)
    a, b, c = (
        Request(rid, list(range(12)), prefix_key=k, max_new_tokens=4, arrival_time=i)
        for i, (rid, k) in enumerate([("a", "spk1"), ("b", "spk1"), ("c", "spk2")])
    )
    runner = FakeRunner(sched, {"a": a, "b": b, "c": c})
    sched.add_request(a)
    step(sched, runner)  # a's prompt KV is written by this step
    sched.add_request(b)
    sched.add_request(c)
    out, _ = step(sched, runner)
    # b reuses a's 2 full blocks (the 3rd holds the last prompt token, which must be computed).
    assert scheduled(out)["b"] == (8, 4, True) and scheduled(out)["c"] == (0, 12, True)
    assert b.block_table[:2] == a.block_table[:2]
    assert not set(c.block_table) & set(a.block_table)
    drain(sched, runner)  # the fake runner checks b's reads of a's blocks
    assert b.output_token_ids == [fake_sample(b, i) for i in range(4)]


def test_chunked_prefill_progression_never_stalls_decode():
    sched = create_scheduler(max_num_batched_tokens=16, max_model_len=80)
    short = Request("s", [(1, 0, 0, 0)] * 4, max_new_tokens=20, arrival_time=0.0)
    long = Request("l", [(2, p, 0, 0) for p in range(40)], max_new_tokens=2, arrival_time=1.0)
    runner = FakeRunner(sched, {"s": short, "l": long})
    sched.add_request(short)
    step(sched, runner)
    sched.add_request(long)
    got = [scheduled(step(sched, runner)[0]) for _ in range(4)]
    assert got == [
        {"s": (4, 1, True), "l": (0, 15, False)},  # the chunk leaves one token for the decode
        {"s": (5, 1, True), "l": (15, 15, False)},
        {"s": (6, 1, True), "l": (30, 10, True)},
        {"s": (7, 1, True), "l": (40, 1, True)},
    ]


def test_long_prefill_token_threshold_caps_chunks():
    sched = create_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    (r,) = create_requests(1, prompt_len=20, max_new_tokens=1)
    runner = FakeRunner(sched, {"r0": r})
    sched.add_request(r)
    got = [scheduled(step(sched, runner)[0])["r0"] for _ in range(3)]
    assert got == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert r.status is RequestStatus.FINISHED_LENGTH


def test_without_chunked_prefill_a_prompt_larger_than_the_budget_left_waits():
    sched = create_scheduler(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    small = create_requests(3, prompt_len=4, max_new_tokens=3)
    big = Request("big", [(9, p, 0, 0) for p in range(30)], max_new_tokens=1, arrival_time=9.0)
    runner = FakeRunner(sched, {r.request_id: r for r in small + [big]})
    for r in small:
        sched.add_request(r)
    step(sched, runner)
    sched.add_request(big)
    out, _ = step(sched, runner)  # 3 decodes leave 29 < 30 tokens: big waits whole
    assert "big" not in scheduled(out) and sched.num_waiting == 1
    outs = [scheduled(step(sched, runner)[0]) for _ in range(2)]
    assert outs[-1] == {"big": (0, 30, True)}
    assert big.status is RequestStatus.FINISHED_LENGTH


def test_admission_interval_groups_arrivals_while_requests_run():
    sched = create_scheduler(admission_interval=3)
    reqs = create_requests(5, prompt_len=6, max_new_tokens=30)
    runner = FakeRunner(sched, {r.request_id: r for r in reqs})
    sched.add_request(reqs[0])
    out, _ = step(sched, runner)  # step 1: an idle batch admits at once
    assert set(scheduled(out)) == {"r0"}
    admitted_at = {}
    for k in range(2, 9):
        if k in (2, 3, 4, 5):
            sched.add_request(reqs[k - 1])  # one arrival per step
        out, _ = step(sched, runner)
        for rid, (start, _, _) in scheduled(out).items():
            if start == 0:
                admitted_at[rid] = k
    # while r0 runs, arrivals wait for steps 3, 6, ...: r1 (step 2) and r2 (step 3) together at 3
    assert admitted_at == {"r1": 3, "r2": 3, "r3": 6, "r4": 6}
    drain(sched, runner)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    with pytest.raises(ValueError, match="admission_interval"):
        create_scheduler(admission_interval=0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_property_random_workloads_pipelined(scenario):
    """Asynchronous scheduling: step n + 1 is scheduled before step n's results are in. Every request must
    still end with exactly the tokens the model sampled, and the fake KV cache proves every read."""
    sched, reqs, arrivals, aborts, stop_at, limits = scenario
    streams, _ = run_to_completion(sched, reqs, arrivals, aborts, stop_at, limits, pipelined=True)
    check_outputs(sched, reqs, streams, stop_at)
    assert not sched.requests and not sched.running and not sched.waiting and not sched.swapped


def test_pipelined_decode_continues_from_the_in_flight_sample():
    sched = create_scheduler()
    (r,) = create_requests(1, prompt_len=6, max_new_tokens=3)
    sched.add_request(r)
    first = sched.schedule()  # the prefill, in flight
    assert scheduled(first) == {"r0": (0, 6, True)}
    second = sched.schedule()  # before the prefill's sample is back: decode its placeholder
    assert scheduled(second) == {"r0": (6, 1, True)} and second.scheduled[0].new_token_ids == []
    assert second.scheduled[0].num_output_tokens == 1 and r.num_inflight_outputs == 2
    sched.update_from_output(first, {"r0": (1, 1, 1, 1)}, {})
    assert r.num_computed_tokens == 6 and r.num_inflight_tokens == 1 and r.output_token_ids == [(1, 1, 1, 1)]
    third = sched.schedule()
    assert scheduled(third) == {"r0": (7, 1, True)}
    sched.update_from_output(second, {"r0": (2, 2, 2, 2)}, {})
    assert sched.schedule().scheduled == []  # the third sample is the last (max_new_tokens=3): nothing past it
    (u,) = sched.update_from_output(third, {"r0": (3, 3, 3, 3)}, {})
    assert u.finished and u.finish_reason == "length" and r.num_output_tokens == 3


def test_pipelined_step_after_eos_is_dropped_and_text_waits_for_its_token():
    sched = create_scheduler()
    (c,) = create_requests(1, prompt_len=4, max_new_tokens=8)
    t = Request("t0", [5] * 4, mode="text", max_new_tokens=8, arrival_time=1.0)
    sched.add_request(c)
    sched.add_request(t)
    first = sched.schedule()
    second = sched.schedule()
    assert set(scheduled(second)) == {"r0"}  # the text request waits for its sampled token
    (stop_c, _) = sched.update_from_output(first, {"r0": (9, 9, 9, 9), "t0": 3}, {"r0": True})
    assert stop_c.finished and stop_c.finish_reason == "stop" and c.is_finished and c.block_table == []
    assert sched.update_from_output(second, {"r0": (1, 2, 3, 4)}, {}) == []  # the wasted row: dropped
    third = sched.schedule()
    assert scheduled(third) == {"t0": (4, 1, True)} and third.scheduled[0].new_token_ids == [3]


def _bursts(out) -> dict[str, tuple[int, int, int]]:
    return {s.request_id: (s.num_computed_tokens, s.num_new_tokens, s.num_steps) for s in out.scheduled}


def test_decode_bursts_chain_k_samples_and_end_at_the_length_limit():
    sched = create_scheduler(num_scheduler_steps=3)
    (r,) = create_requests(1, prompt_len=4, max_new_tokens=7)
    runner = FakeRunner(sched, {"r0": r})
    sched.add_request(r)
    got = []
    while sched.has_unfinished_requests():
        out, ups = step(sched, runner)
        got.append((_bursts(out)["r0"], [(u.num_new_tokens, u.finish_reason) for u in ups]))
    # the prefill samples one frame; then bursts of 3 positions; the last burst's 3rd sample is past max_new_tokens
    assert got == [((0, 4, 1), [(1, None)]), ((4, 3, 3), [(3, None)]), ((7, 3, 3), [(3, "length")])]
    assert r.output_token_ids == [fake_sample(r, i) for i in range(7)] and r.block_table == []


def test_decode_burst_stops_at_eos_and_near_the_model_length_decodes_one_by_one():
    sched = create_scheduler(num_scheduler_steps=4, max_model_len=11)
    a, b = create_requests(2, prompt_len=4, max_new_tokens=30)
    runner = FakeRunner(sched, {"r0": a, "r1": b}, stop_at={"r0": 2})
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    out, ups = step(sched, runner)
    assert _bursts(out) == {"r0": (4, 4, 4), "r1": (4, 4, 4)}
    assert [(u.request_id, u.num_new_tokens, u.finish_reason) for u in ups] == [("r0", 1, "stop"), ("r1", 4, None)]
    assert a.output_token_ids == [fake_sample(a, 0), fake_sample(a, 1)]  # the EOS and the samples after it dropped
    got = [_bursts(step(sched, runner)[0])["r1"] for _ in range(2)]
    assert got == [(8, 1, 1), (9, 1, 1)]  # 8 + 4 > 11 positions: no room for a burst
    assert b.status is RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 11 - 4


def test_pipelined_bursts_continue_from_the_in_flight_burst():
    sched = create_scheduler(num_scheduler_steps=2)
    (r,) = create_requests(1, prompt_len=6, max_new_tokens=5)
    sched.add_request(r)
    first = sched.schedule()  # the prefill
    second = sched.schedule()  # a burst from the prefill's placeholder
    assert _bursts(second) == {"r0": (6, 2, 2)} and second.scheduled[0].new_token_ids == []
    assert r.num_inflight_outputs == 3 and second.scheduled[0].num_output_tokens == 1
    sched.update_from_output(first, {"r0": (1, 1, 1, 1)}, {})
    third = sched.schedule()
    assert _bursts(third) == {"r0": (8, 2, 2)}  # two bursts in flight: 5 outputs, nothing past them
    sched.update_from_output(second, {"r0": [(2, 2, 2, 2), (3, 3, 3, 3)]}, {})
    assert sched.schedule().scheduled == [] and r.num_computed_tokens == 8
    (u,) = sched.update_from_output(third, {"r0": [(4, 4, 4, 4), (5, 5, 5, 5)]}, {})
    assert u.finished and u.finish_reason == "length" and u.num_new_tokens == 2 and r.num_output_tokens == 5
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        create_scheduler(num_scheduler_steps=0)


def test_a_burst_costs_one_token_of_the_budget_a_forward_pass():
    """The budget counts one forward pass's tokens: a burst's row costs one (its k positions are k passes), so
    the rows' bursts leave the rest to a prefill (here a 5-position prompt gets 2 of the 6), where counting k
    would have left it nothing and cut the later rows to single steps."""
    sched = create_scheduler(num_scheduler_steps=3, max_num_seqs=5, max_num_batched_tokens=6)
    reqs = create_requests(4, prompt_len=1, max_new_tokens=20)
    late = create_requests(1, prompt_len=5, max_new_tokens=20, prefix="late")
    runner = FakeRunner(sched, {r.request_id: r for r in reqs + late})
    for r in reqs:
        sched.add_request(r)
    step(sched, runner)  # the four prefills, one token each
    sched.add_request(late[0])
    out, _ = step(sched, runner)
    assert [(s.num_new_tokens, s.num_steps) for s in out.scheduled] == [(3, 3)] * 4 + [(2, 1)]
    assert out.num_scheduled_tokens == 14  # positions: 4 bursts of 3 and the chunk of 2
    drain(sched, runner)
    reqs += late
    assert all(r.output_token_ids == [fake_sample(r, i) for i in range(20)] for r in reqs)
