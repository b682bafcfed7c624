"""Scheduler tests with a fake runner (vLLM tests/v1/core style), pure Python.

The fake runner keeps a fake paged KV cache: each slot holds (request prefix identity, position, token).
Every step it checks that the KV a chunk attends to is exactly the request's own prefix (so prefix
sharing, eviction, swap copies and recompute are all verified), then writes the new slots. Its samples
are a deterministic function of (request_id, output index), so any preemption must reproduce the
same output sequence.
"""

from __future__ import annotations

import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ttsserve.engine.block_manager import KVCacheManager
from ttsserve.engine.outputs import SchedulerOutput
from ttsserve.engine.request import Request, RequestStatus
from ttsserve.engine.scheduler import Scheduler, SchedulerConfig


def create_scheduler(
    num_gpu_blocks: int = 64,
    block_size: int = 4,
    num_cpu_blocks: int = 0,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    enable_chunked_prefill: bool = True,
    preemption_mode: str = "recompute",
    long_prefill_token_threshold: int = 0,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        max_model_len=max_model_len,
        preemption_mode=preemption_mode,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    return Scheduler(cfg, KVCacheManager(num_gpu_blocks, block_size, num_cpu_blocks))


def create_requests(
    num: int, prompt_len: int = 10, max_new_tokens: int = 8, prefix: str = "r", **kw
) -> list[Request]:
    return [
        Request(f"{prefix}{i}", [(i, p, 0, 0) for p in range(prompt_len)], max_new_tokens=max_new_tokens,
                arrival_time=float(i), **kw)
        for i in range(num)
    ]


def fake_sample(req: Request, index: int) -> object:
    """The token a deterministic fake model samples as output number `index` of req."""
    v = zlib.crc32(f"{req.request_id}:{index}".encode())
    return tuple((v >> (8 * q)) % 625 for q in range(4)) if req.mode == "code" else v % 21178


class FakeRunner:
    """Executes a SchedulerOutput on a fake paged KV cache; checks every read against the truth."""

    def __init__(self, sched: Scheduler, reqs: dict[str, Request], stop_at: dict[str, int] | None = None):
        bm = sched.block_manager
        self.bs = bm.block_size
        self.gpu = [[None] * self.bs for _ in range(bm.num_gpu_blocks)]
        self.cpu = [[None] * self.bs for _ in range(max(bm.num_cpu_blocks, 1))]
        self.reqs = reqs
        self.stop_at = stop_at or {}
        self.chains: dict[str, list[int]] = {}

    def expected_token(self, req: Request, pos: int) -> object:
        n = req.num_prompt_tokens
        return req.prompt_token_ids[pos] if pos < n else fake_sample(req, pos - n)

    def kv(self, req: Request, pos: int) -> tuple:
        """The KV of a slot depends on prefix_key, mode and every token up to and including pos."""
        chain = self.chains.setdefault(req.request_id, [])
        while len(chain) <= pos:
            parent = chain[-1] if chain else (req.prefix_key, req.mode)
            chain.append(hash((parent, self.expected_token(req, len(chain)))))
        return (pos, chain[pos])

    def execute(self, out: SchedulerOutput) -> tuple[dict, dict]:
        assert not (out.swap_out and out.swap_in)
        for g, c in out.swap_out:  # before the forward: these GPU blocks may be rewritten this step
            self.cpu[c] = list(self.gpu[g])
        for c, g in out.swap_in:
            self.gpu[g] = list(self.cpu[c])
        reads, writes = set(), set()
        for s in out.scheduled:  # reads first: a batched forward writes every layer's KV before reading
            req = self.reqs[s.request_id]
            for pos in range(s.num_computed_tokens):
                b = s.block_table[pos // self.bs]
                assert self.gpu[b][pos % self.bs] == self.kv(req, pos), (s.request_id, pos)
                reads.add((b, pos % self.bs))
        sampled, stop = {}, {}
        for s in out.scheduled:
            req = self.reqs[s.request_id]
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            assert len(s.block_table) == -(-end // self.bs)
            assert s.new_token_ids == [self.expected_token(req, p) for p in range(start, end)]
            for pos in range(start, end):
                slot = (s.block_table[pos // self.bs], pos % self.bs)
                assert slot not in writes and slot not in reads, f"{s.request_id} overwrites a live slot"
                writes.add(slot)
                self.gpu[slot[0]][slot[1]] = self.kv(req, pos)
            if s.will_sample:
                idx = end - s.num_prompt_tokens
                sampled[s.request_id] = fake_sample(req, idx)
                if self.stop_at.get(s.request_id) == idx:
                    stop[s.request_id] = True
        return sampled, stop


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    bm, cfg = sched.block_manager, sched.config
    assert out.num_scheduled_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
    refs = [0] * bm.num_gpu_blocks
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        for b in r.block_table:
            refs[b] += 1
    for r in list(sched.waiting) + list(sched.swapped):
        assert r.block_table == [] and r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED,
                                                    RequestStatus.SWAPPED)
    assert refs == bm.ref_cnt
    assert set(bm.free_queue) == {b for b in range(bm.num_gpu_blocks) if refs[b] == 0}
    assert bm.num_free_blocks + sum(1 for x in refs if x) == bm.num_gpu_blocks
    cpu_used = [c for r in sched.swapped for c in bm._cpu_tables.get(r.request_id, [])]
    assert sorted(cpu_used + bm.cpu_free) == list(range(bm.num_cpu_blocks))
    for h, b in bm.cached_blocks.items():
        assert bm.block_hash[b] == h
    assert len(sched.requests) == len(sched.running) + len(sched.waiting) + len(sched.swapped)
    # No running stream ever stalls: budget >= max_num_seqs and chunks leave a token for each.
    assert {r.request_id for r in sched.running} == {s.request_id for s in out.scheduled}


def run_to_completion(sched, reqs, arrivals=None, aborts=None, stop_at=None, limits=None, max_steps=5000):
    """Drive schedule -> fake execute -> update_from_output. Returns (streams, steps)."""
    by_id = {r.request_id: r for r in reqs}
    arrivals = arrivals or {r.request_id: 0 for r in reqs}
    runner = FakeRunner(sched, by_id, stop_at)
    streams: dict[str, list] = {r.request_id: [] for r in reqs}
    closed: set[str] = set()
    step = 0
    while step <= max(arrivals.values()) or sched.has_unfinished_requests():
        assert step < max_steps, "livelock: requests never finish"
        for r in reqs:
            if arrivals[r.request_id] == step:
                sched.add_request(r)
        for rid, at in (aborts or {}).items():
            if at == step:
                sched.abort_request(rid)
        if limits and step in limits:
            sched.max_num_seqs_limit = limits[step]
        out = sched.schedule()
        check_invariants(sched, out)
        for rid in out.finished_ids:
            assert rid not in closed and by_id[rid].status in (RequestStatus.FINISHED_ABORTED,
                                                               RequestStatus.FINISHED_ERROR)
            closed.add(rid)
        sampled, stop = runner.execute(out)
        for u in sched.update_from_output(out, sampled, stop):
            assert u.request_id not in closed
            if u.new_token is not None:
                streams[u.request_id].append(u.new_token)
            if u.finished:
                closed.add(u.request_id)
        step += 1
    assert closed == set(by_id)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_gpu_blocks and all(c == 0 for c in bm.ref_cnt)
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks
    return streams, step


def check_outputs(sched: Scheduler, reqs: list[Request], streams: dict, stop_at: dict) -> None:
    """Every request ended, with exactly the tokens the fake model sampled for it."""
    for r in reqs:
        assert r.is_finished and r.block_table == []
        assert streams[r.request_id] == r.output_token_ids
        assert r.output_token_ids == [fake_sample(r, i) for i in range(r.num_output_tokens)]
        if r.status is RequestStatus.FINISHED_ERROR:
            assert r.num_prompt_tokens >= sched.token_limit and r.error and not r.output_token_ids
            continue
        cap = min(r.max_new_tokens, sched.token_limit - r.num_prompt_tokens)
        k = stop_at.get(r.request_id)
        if r.status is RequestStatus.FINISHED_ABORTED:
            assert r.num_output_tokens <= cap
        elif k is not None and k < cap:
            assert r.status is RequestStatus.FINISHED_STOPPED and r.num_output_tokens == k
        else:
            assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == cap


@st.composite
def scenarios(draw):
    chunked = draw(st.booleans())
    pressure = draw(st.booleans())  # tiny pool, many requests: preemption on most steps
    preemption = draw(st.sampled_from(["recompute", "swap", "auto"]))
    max_num_seqs = draw(st.integers(3, 6) if pressure else st.integers(1, 6))
    max_model_len = draw(st.integers(4, 80))
    min_budget = max_num_seqs if chunked else max(max_num_seqs, max_model_len)
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    pool_tokens = draw(st.integers(8, 48) if pressure else st.integers(8, 200))
    sched = create_scheduler(
        num_gpu_blocks=max(2, pool_tokens // block_size),
        block_size=block_size,
        num_cpu_blocks=draw(st.integers(1 if preemption == "swap" else 0, 12)),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(min_budget, min_budget + 24)),
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        preemption_mode=preemption,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 8])) if chunked else 0,
    )
    templates = [draw(st.lists(st.integers(0, 3), min_size=1, max_size=60)) for _ in range(3)]
    reqs, arrivals, aborts, stop_at = [], {}, {}, {}
    for i in range(draw(st.integers(4 if pressure else 1, 10))):
        mode = draw(st.sampled_from(["code", "text"]))
        tpl = templates[draw(st.integers(0, 2))]
        prompt = tpl[: draw(st.integers(1, len(tpl)))]  # shared prefixes exercise the prefix cache
        prompt = [(t, 0, 0, 0) for t in prompt] if mode == "code" else prompt
        rid = f"q{i}"
        reqs.append(Request(
            rid, prompt, mode=mode, max_new_tokens=draw(st.integers(1, 30)), arrival_time=float(i),
            prefix_key=draw(st.sampled_from([None, "spk_a", "spk_b"])), first_audio_frames=draw(st.integers(0, 6)),
        ))
        arrivals[rid] = draw(st.integers(0, 20))
        if draw(st.integers(0, 3)) == 0:
            aborts[rid] = draw(st.integers(0, 40))
        if draw(st.booleans()):
            stop_at[rid] = draw(st.integers(0, 30))
    limits = draw(st.dictionaries(st.integers(0, 40), st.integers(1, max_num_seqs), max_size=3))
    return sched, reqs, arrivals, aborts, stop_at, limits


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_property_random_workloads(scenario):
    sched, reqs, arrivals, aborts, stop_at, limits = scenario
    streams, _ = run_to_completion(sched, reqs, arrivals, aborts, stop_at, limits)
    check_outputs(sched, reqs, streams, stop_at)
    assert not sched.requests and not sched.running and not sched.waiting and not sched.swapped


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list]:
    out = sched.schedule()
    check_invariants(sched, out)
    sampled, stop = runner.execute(out)
    return out, sched.update_from_output(out, sampled, stop)


def drain(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        step(sched, runner)
    raise AssertionError("requests never finish")


def scheduled(out: SchedulerOutput) -> dict[str, tuple[int, int, bool]]:
    return {s.request_id: (s.num_computed_tokens, s.num_new_tokens, s.will_sample) for s in out.scheduled}


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
    a, b, c = (Request(rid, list(range(12)), prefix_key=k, max_new_tokens=4, arrival_time=i)
               for i, (rid, k) in enumerate([("a", "spk1"), ("b", "spk1"), ("c", "spk2")]))
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


def _pressure_pair(first_audio_a: int, first_audio_b: int):
    # 10 blocks of 2: two prompts of 8 take 8 blocks; decoding soon needs more than the pool.
    sched = create_scheduler(num_gpu_blocks=10, block_size=2, max_model_len=64)
    a = Request("a", [(1, p, 0, 0) for p in range(8)], max_new_tokens=12, arrival_time=0.0,
                first_audio_frames=first_audio_a)
    b = Request("b", [(2, p, 0, 0) for p in range(8)], max_new_tokens=12, arrival_time=1.0,
                first_audio_frames=first_audio_b)
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

    code = ("import sys, ttsserve.engine.scheduler, ttsserve.engine.block_manager, ttsserve.engine.outputs; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
