"""Random add / abort / step / error sequences on the tiny CPU engine leave no request state behind.

A live sequence is held by the engine's registry, the scheduler, the runner and (code sequences) the audio stage;
engine/registry.py releases it from all of them in one place. The machine checks after every rule that the
owners agree with the registry, and at the end of each run (everything finished or aborted, a few more steps)
that every map is empty and every KV block is free. The KV pool holds 6 blocks, so preemption (recompute or
swap) happens; errors come from a prompt too long for the pool (the scheduler ends it), a refused refine ->
code hand-off, a refused later segment at add time, and a step that raises (Engine.fail_all, as the serving
loop does).
"""

from __future__ import annotations

from collections import Counter

import pytest
from engine_testutil import make_engine
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ttsserve.params import SamplingParams, SynthesisRequest
from ttsserve.text.segments import Segment

DOOMED_PROMPT = "[speed_4]"  # a code prompt the patched front end refuses: the refine -> code hand-off fails
HUGE_PROMPT = "[speed_3]"  # a code prompt the patched front end makes too long for the pool: the scheduler fails it
POOL_BLOCKS, BLOCK_SIZE = 6, 8  # three 10-frame streams fill it
LONG_TEXT = "hello there " * 30  # 64 prompt positions, more than the pool's 48: the scheduler ends it with an error
SEEN: Counter = Counter()  # what the runs exercised, summed (the test checks each path was taken)


class RegistryMachine(RuleBasedStateMachine):
    model = None  # the session's tiny model (set by the test)
    model_bytes_per_token = 0

    @initialize(
        mode=st.sampled_from(["recompute", "swap"]),
        pipelined=st.booleans(),
        deferred=st.booleans(),
        burst=st.sampled_from([1, 2]),
    )
    def build(self, mode: str, pipelined: bool, deferred: bool, burst: int) -> None:
        pool = POOL_BLOCKS * BLOCK_SIZE * self.model_bytes_per_token
        e = make_engine(
            self.model,
            kv_cache_memory=pool,
            swap_space=pool / 2**30,
            block_size=BLOCK_SIZE,
            preemption_mode=mode,
            async_scheduling=pipelined,
            num_scheduler_steps=burst,
        )
        assert e.kv_spec.num_blocks == POOL_BLOCKS
        e.audio.deferred = deferred  # final chunks leave a step after their sequence ends, as on CUDA
        SEEN["deferred runs"] += deferred
        code_inputs = e.frontend.code_inputs

        def refusing_code_inputs(text, code_prompt, voice, code_ids=None):
            if code_prompt == DOOMED_PROMPT or "doom" in text:
                raise ValueError("injected: the code prompt is refused")
            return code_inputs(LONG_TEXT if code_prompt == HUGE_PROMPT else text, code_prompt, voice, code_ids)

        e.frontend.code_inputs = refusing_code_inputs
        self.engine, self.n = e, 0
        self.live: set[str] = set()  # added, not aborted, no final output yet
        self.aborted: set[str] = set()
        self.finals: Counter = Counter()
        self.failed_steps = 0

    def _deliver(self, outputs) -> None:
        for out in outputs:
            assert out.request_id not in self.aborted, f"{out.request_id}: output after its abort"
            if out.finished:
                self.finals[out.request_id] += 1
                self.live.discard(out.request_id)
                if out.error and "KV blocks" in out.error:
                    SEEN["scheduler error"] += 1
                elif out.error and "injected: the code prompt" in out.error:
                    SEEN["hand-off refused"] += 1

    def _add(self, req: SynthesisRequest, segments: list[Segment]) -> str | None:
        rid = req.request_id
        try:
            self.engine.add_synthesis(req, segments)
        except ValueError:
            SEEN["add refused"] += 1
            return None
        self.live.add(rid)
        return rid

    @rule(
        frames=st.integers(2, 10),
        eos=st.booleans(),
        segments=st.integers(1, 2),
        refine=st.booleans(),
        fault=st.sampled_from(
            ["none"] * 5 + ["later segment refused", "hand-off refused", "unservable", "hand-off unservable"]
        ),
    )
    def add(self, frames: int, eos: bool, segments: int, refine: bool, fault: str) -> None:
        """A synthesis of 1-2 segments, with or without its refine stage; a fault makes the add (a later
        segment), the refine -> code hand-off or the scheduler (a prompt longer than the pool, at the add or
        made by the hand-off while a sibling segment runs) refuse it."""
        self.n += 1
        code = SamplingParams(seed=self.n, min_new_tokens=0 if eos else frames, max_new_tokens=frames)
        refine_params = SamplingParams.refine_defaults(seed=self.n, min_new_tokens=0, max_new_tokens=3)
        texts = ["hello there", "how are you"][:segments]
        if fault == "later segment refused" and not refine:
            texts = ["hello there", "doom here"]
        elif fault == "unservable":
            texts[-1] = LONG_TEXT
        prompt = {"hand-off refused": DOOMED_PROMPT, "hand-off unservable": HUGE_PROMPT}.get(fault) if refine else None
        req = SynthesisRequest(
            " ".join(texts),
            request_id=f"r{self.n}",
            code_params=code,
            refine_text=refine,
            refine_params=refine_params,
            code_prompt=prompt or "[speed_5]",
        )
        self._add(req, [Segment(i, t, []) for i, t in enumerate(texts)])

    def _abort(self, rid: str) -> None:
        self.engine.abort(rid)
        self.live.discard(rid)
        self.aborted.add(rid)
        SEEN["abort"] += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data) -> None:
        self._abort(data.draw(st.sampled_from(sorted(self.live))))

    def _finishing(self) -> list[str]:
        """Syntheses with a sequence whose tokens are done and whose final chunk is still to come."""
        return sorted(rid for rid, syn in self.engine.syntheses.items() if any(r.finishing for r in syn.seqs.values()))

    @precondition(lambda self: hasattr(self, "engine") and self._finishing())
    @rule(data=st.data())
    def abort_while_final_chunk_is_due(self, data) -> None:
        self._abort(data.draw(st.sampled_from(self._finishing())))
        SEEN["abort while a final chunk is due"] += 1

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        """Up to n steps; it stops where a final chunk is due, so the next rule may abort in that window."""
        for _ in range(n):
            self._deliver(self.engine.step(emit=self._deliver))
            if self._finishing():
                break

    @precondition(lambda self: len(getattr(self, "live", ())) >= 2 and not self.failed_steps)
    @rule()
    def failing_step(self) -> None:
        """A step that raises after scheduling; the serving loop then fails every synthesis."""
        runner = self.engine.runner

        def launch(*args):
            del runner.launch  # once
            raise RuntimeError("injected step failure")

        runner.launch = launch
        with pytest.raises(RuntimeError, match="injected"):
            self.engine.step()
        outs = self.engine.fail_all("internal error: injected")
        assert {o.request_id for o in outs} == self.live and all(o.finished and o.error for o in outs)
        self._deliver(outs)
        self.failed_steps += 1
        SEEN["failed step"] += 1

    @invariant()
    def owners_agree_with_the_registry(self) -> None:
        e = getattr(self, "engine", None)
        if e is None:
            return
        live = e.sequences
        generating = {s for s, r in live.items() if r.finishing is None}
        assert set(e.runner.states) == generating
        assert set(e.runner.input_batch.row_of) <= generating
        assert set(e.audio._streams) == {s for s, r in live.items() if r.mode == "code"}
        pending = set(e.scheduler._pending_aborts)
        assert set(e.scheduler.requests) - pending <= generating
        assert pending <= set(e.scheduler.requests)
        assert {s for syn in e.syntheses.values() for s in syn.seqs} == set(live)
        assert all(e.syntheses.get(r.synthesis.request_id) is r.synthesis for r in live.values())
        assert all(n == 1 for n in self.finals.values()), "a synthesis got two final outputs"

    def teardown(self) -> None:
        e = getattr(self, "engine", None)
        if e is None:
            return
        for _ in range(2000):
            if not (e.has_unfinished() or e.scheduler.has_unfinished_requests() or e.audio.has_pending):
                break
            self._deliver(e.step(emit=self._deliver))
        for _ in range(3):  # nothing left must come back
            self._deliver(e.step(emit=self._deliver))
        SEEN["preemptions"] += e.counters.preemptions
        SEEN["steps"] += e.counters.steps
        SEEN["runs"] += 1
        SEEN["swaps"] += e.counters.swaps
        assert not self.live, f"no final output for {sorted(self.live)}"
        assert not e.syntheses and not e.sequences and not e.registry.failed
        s = e.scheduler
        assert not (s.requests or s.waiting or s.running or s.swapped or s._seq or s._pending_aborts or s._finished_ids)
        assert not e.runner.states and not e.runner.input_batch.row_of
        assert e.audio.num_requests == 0 and not e.audio.has_pending
        assert not getattr(e.audio, "_state_slot", {})
        bm = e.kv_manager
        assert bm.num_free_blocks == bm.num_gpu_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks
        assert not (bm._cpu_tables or bm._hashes or bm._num_registered or bm._pending_stats)


def test_registry_state_machine(tiny_model):
    RegistryMachine.model = tiny_model
    RegistryMachine.model_bytes_per_token = make_engine(tiny_model, swap_space=0).kv_spec.bytes_per_token
    SEEN.clear()
    run_state_machine_as_test(
        RegistryMachine,
        settings=settings(
            max_examples=30,
            stateful_step_count=30,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    # every path ran at least once (derandomized: the same runs every time)
    for what in (
        "preemptions",
        "swaps",
        "abort",
        "abort while a final chunk is due",
        "failed step",
        "add refused",
        "scheduler error",
        "hand-off refused",
    ):
        assert SEEN[what] > 0, f"no run exercised {what!r}: {dict(SEEN)}"
