"""Scheduler test helpers (vLLM tests/v1/core style), pure Python: a fake runner with a fake paged KV cache,
invariant checks, a random-workload driver and small stepping helpers.

The fake runner keeps a fake paged KV cache: each slot holds (request prefix identity, position, token).
Every step it checks that the KV a chunk attends to is exactly the request's own prefix (so prefix
sharing, eviction, swap copies and recompute are all verified), then writes the new slots. Its samples
are a deterministic function of (request_id, output index), so any preemption must reproduce the
same output sequence.
"""

from __future__ import annotations

import zlib

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
    admission_interval: int = 1,
    num_scheduler_steps: int = 1,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        max_model_len=max_model_len,
        preemption_mode=preemption_mode,
        long_prefill_token_threshold=long_prefill_token_threshold,
        admission_interval=admission_interval,
        num_scheduler_steps=num_scheduler_steps,
    )
    return Scheduler(cfg, KVCacheManager(num_gpu_blocks, block_size, num_cpu_blocks))


def create_requests(num: int, prompt_len: int = 10, max_new_tokens: int = 8, prefix: str = "r", **kw) -> list[Request]:
    return [
        Request(
            f"{prefix}{i}",
            [(i, p, 0, 0) for p in range(prompt_len)],
            max_new_tokens=max_new_tokens,
            arrival_time=float(i),
            **kw,
        )
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
            expected = [self.expected_token(req, p) for p in range(start, end)]
            if s.num_steps > 1:  # a burst: its first input may be in flight, the rest are its own samples
                assert s.mode == "code" and s.will_sample and s.num_new_tokens == s.num_steps
                assert start >= s.num_prompt_tokens and s.new_token_ids in ([], expected[:1]), (s.request_id, start)
                assert s.num_output_tokens == start + 1 - s.num_prompt_tokens
            elif s.new_token_ids != expected:  # only an in-flight sample may be missing: a code decode's input
                assert (
                    s.mode == "code"
                    and s.num_new_tokens == 1
                    and not s.new_token_ids  # (after a burst: later)
                    and start >= s.num_prompt_tokens + len(req.output_token_ids)
                ), (s.request_id, start)
            for pos in range(start, end):
                slot = (s.block_table[pos // self.bs], pos % self.bs)
                assert slot not in writes and slot not in reads, f"{s.request_id} overwrites a live slot"
                writes.add(slot)
                self.gpu[slot[0]][slot[1]] = self.kv(req, pos)
            if s.num_steps > 1:  # samples number start + 1 - P ... end - P, cut before the first EOS
                burst = []
                for idx in range(start + 1 - s.num_prompt_tokens, end + 1 - s.num_prompt_tokens):
                    if self.stop_at.get(s.request_id) == idx:
                        stop[s.request_id] = True
                        break
                    burst.append(fake_sample(req, idx))
                sampled[s.request_id] = burst
            elif s.will_sample:
                idx = end - s.num_prompt_tokens
                sampled[s.request_id] = fake_sample(req, idx)
                if self.stop_at.get(s.request_id) == idx:
                    stop[s.request_id] = True
        return sampled, stop


def check_invariants(sched: Scheduler, out: SchedulerOutput, pipelined: bool = False) -> None:
    bm, cfg = sched.block_manager, sched.config
    assert out.num_scheduled_tokens == sum(s.num_new_tokens for s in out.scheduled)
    # the budget counts one forward pass's tokens: a decode burst's row costs one
    assert sum(1 if s.num_steps > 1 else s.num_new_tokens for s in out.scheduled) <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
    refs = [0] * bm.num_gpu_blocks
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        for b in r.block_table:
            refs[b] += 1
    for r in list(sched.waiting) + list(sched.swapped):
        assert r.block_table == [] and r.status in (
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
            RequestStatus.SWAPPED,
        )
    assert refs == bm.ref_cnt
    assert set(bm.free_queue) == {b for b in range(bm.num_gpu_blocks) if refs[b] == 0}
    assert bm.num_free_blocks + sum(1 for x in refs if x) == bm.num_gpu_blocks
    cpu_used = [c for r in sched.swapped for c in bm._cpu_tables.get(r.request_id, [])]
    assert sorted(cpu_used + bm.cpu_free) == list(range(bm.num_cpu_blocks))
    for h, b in bm.cached_blocks.items():
        assert bm.block_hash[b] == h
    assert len(sched.requests) == len(sched.running) + len(sched.waiting) + len(sched.swapped)
    # No running stream ever stalls: budget >= max_num_seqs and chunks leave a token for each. In a
    # pipeline a request sits out only while its in-flight sample decides what comes next (a text token,
    # or the length limit it reaches).
    for r in sched.running:  # at most two steps in flight: the unread one and the one just scheduled
        k = cfg.num_scheduler_steps
        assert 0 <= r.num_inflight_outputs <= (2 * k if pipelined else k) and r.num_inflight_tokens >= 0, r.request_id
        assert r.num_computed_tokens + r.num_inflight_tokens <= r.num_tokens_with_placeholders, r.request_id
    idle = {r.request_id for r in sched.running} - {s.request_id for s in out.scheduled}
    for rid in idle:
        r = sched.requests[rid]
        assert pipelined and r.num_inflight_outputs, rid
        assert r.mode == "text" or r.num_output_tokens + r.num_inflight_outputs >= min(
            r.max_new_tokens, sched.token_limit - r.num_prompt_tokens
        ), rid


def run_to_completion(
    sched, reqs, arrivals=None, aborts=None, stop_at=None, limits=None, max_steps=5000, pipelined: bool = False
):
    """Drive schedule -> fake execute -> update_from_output. Returns (streams, steps). pipelined: the
    engine's asynchronous scheduling, step n + 1 scheduled (and executed, in order, as a device stream
    runs it) before step n's results reach update_from_output."""
    by_id = {r.request_id: r for r in reqs}
    arrivals = arrivals or {r.request_id: 0 for r in reqs}
    runner = FakeRunner(sched, by_id, stop_at)
    streams: dict[str, list] = {r.request_id: [] for r in reqs}
    closed: set[str] = set()
    step = 0
    in_flight = None  # (SchedulerOutput, sampled, stop) of the step whose results are not back yet
    while step <= max(arrivals.values()) or sched.has_unfinished_requests() or in_flight:
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
        check_invariants(sched, out, pipelined)
        for rid in out.finished_ids:
            assert rid not in closed and by_id[rid].status in (
                RequestStatus.FINISHED_ABORTED,
                RequestStatus.FINISHED_ERROR,
            )
            closed.add(rid)
        ran = (out, *runner.execute(out))  # in order, as the device runs the queued steps
        if pipelined:  # the results come back one step later; an empty step has none
            done, in_flight = in_flight, (ran if out.scheduled else None)
        else:
            done = ran
        for u in sched.update_from_output(*done) if done else ():
            assert u.request_id not in closed
            outputs = by_id[u.request_id].output_token_ids  # an update appends num_new_tokens, ending in new_token
            assert outputs[: len(streams[u.request_id])] == streams[u.request_id]
            assert len(outputs) == len(streams[u.request_id]) + u.num_new_tokens
            assert u.new_token == (outputs[-1] if u.num_new_tokens else None)
            streams[u.request_id] = list(outputs)
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
        num_scheduler_steps=draw(st.sampled_from([1, 1, 2, 3])),  # decode bursts in a third of the scenarios
    )
    templates = [draw(st.lists(st.integers(0, 3), min_size=1, max_size=60)) for _ in range(3)]
    reqs, arrivals, aborts, stop_at = [], {}, {}, {}
    for i in range(draw(st.integers(4 if pressure else 1, 10))):
        mode = draw(st.sampled_from(["code", "text"]))
        tpl = templates[draw(st.integers(0, 2))]
        prompt = tpl[: draw(st.integers(1, len(tpl)))]  # shared prefixes exercise the prefix cache
        prompt = [(t, 0, 0, 0) for t in prompt] if mode == "code" else prompt
        rid = f"q{i}"
        reqs.append(
            Request(
                rid,
                prompt,
                mode=mode,
                max_new_tokens=draw(st.integers(1, 30)),
                arrival_time=float(i),
                prefix_key=draw(st.sampled_from([None, "spk_a", "spk_b"])),
                first_audio_frames=draw(st.integers(0, 6)),
            )
        )
        arrivals[rid] = draw(st.integers(0, 20))
        if draw(st.integers(0, 3)) == 0:
            aborts[rid] = draw(st.integers(0, 40))
        if draw(st.booleans()):
            stop_at[rid] = draw(st.integers(0, 30))
    limits = draw(st.dictionaries(st.integers(0, 40), st.integers(1, max_num_seqs), max_size=3))
    return sched, reqs, arrivals, aborts, stop_at, limits


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
