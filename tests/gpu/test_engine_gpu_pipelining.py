"""The pipelined CUDA engine (async scheduling, decode bursts, deferred audio) against the same engine stepping
synchronously, and the syncs it must not make: none inside a graph step, none while the next step is queued,
audio handed out mid-step equal to end-of-step audio. Fresh random requests each run (the seed is printed so a
failure can be replayed)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import sys
from pathlib import Path

from engine_gpu_util import SEED, WORDS, _engine, _requests, _run
from engine_gpu_util import free_engines as free_engines  # autouse fixtures: active where imported
from engine_gpu_util import no_tf32 as no_tf32
from engine_gpu_util import real_bf16 as real_bf16  # a fixture, used by name
from engine_gpu_util import real_fp32 as real_fp32  # a fixture, used by name
from engine_gpu_util import tiny_cuda as tiny_cuda  # a fixture, used by name

from ttsserve.engine.engine import Engine
from ttsserve.params import SamplingParams, SynthesisRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_testutil import FrameRecorder, run_all


def _staggered(engine: Engine, reqs, abort: set[str]) -> FrameRecorder:
    """Requests arrive two per step; those in `abort` leave after six steps."""
    rec = FrameRecorder(engine)
    pending, steps = list(reqs), 0
    while pending or engine.has_unfinished():
        for r in pending[:2]:
            engine.add_synthesis(r)
        pending = pending[2:]
        engine.step()
        steps += 1
        if steps == 6:
            for rid in abort:
                engine.abort(rid)
    engine.step()
    return rec


def test_pipelined_engine_equals_synchronous_engine(real_fp32):
    """async_scheduling on CUDA (the default) against the same engine stepping synchronously: staggered
    arrivals (mixed steps), length ends, aborts while a step is in flight; fp32, greedy: the same codes."""
    print(f"seed {SEED}")
    # different lengths: rows end (and leave a wasted pipelined row) on many steps
    reqs = [
        dataclasses.replace(
            r, code_params=dataclasses.replace(r.code_params, max_new_tokens=20 + 3 * i, min_new_tokens=20 + 3 * i)
        )
        for i, r in enumerate(_requests(12, 40, greedy=True))
    ]
    abort = {"q3", "q8"}
    e = _engine(real_fp32, kv_cache_memory=1 << 30)
    assert e.pipelined and e.runner.graphs is not None
    rec_async = _staggered(e, reqs, abort)
    assert e.runner.timings.mixed_graph_steps > 0
    assert e.kv_manager.num_free_blocks == e.kv_spec.num_blocks
    rec_sync = _staggered(_engine(real_fp32, kv_cache_memory=1 << 30, async_scheduling=False), reqs, abort)
    for r in reqs:
        seq = f"{r.request_id}/0/code"
        if r.request_id in abort:
            n = min(len(rec_async.frames.get(seq, [])), len(rec_sync.frames.get(seq, [])))
            assert rec_async.frames.get(seq, [])[:n] == rec_sync.frames.get(seq, [])[:n], seq
            continue
        assert len(rec_async.frames[seq]) == r.code_params.max_new_tokens
        assert rec_async.frames[seq] == rec_sync.frames[seq], seq
        np.testing.assert_allclose(rec_async.hidden(seq), rec_sync.hidden(seq), atol=1e-3, rtol=0)


def test_decode_bursts_on_cuda_equal_single_steps(real_fp32):
    """num_scheduler_steps=3 on CUDA (pipelined, decode graphs replayed 3 times per step, mixed steps, aborts in
    flight, lengths ending inside a burst) against single steps: fp32, greedy: the same codes and hiddens."""
    print(f"seed {SEED}")
    reqs = [
        dataclasses.replace(
            r, code_params=dataclasses.replace(r.code_params, max_new_tokens=20 + 5 * i, min_new_tokens=20 + 5 * i)
        )
        for i, r in enumerate(_requests(10, 40, greedy=True))
    ]
    abort = {"q2", "q7"}
    e = _engine(real_fp32, kv_cache_memory=1 << 30, num_scheduler_steps=3)
    assert e.pipelined and e.runner.graphs is not None and e.runner.graphs.max_steps == 3
    rec_burst = _staggered(e, reqs, abort)
    assert e.kv_manager.num_free_blocks == e.kv_spec.num_blocks
    rec_one = _staggered(_engine(real_fp32, kv_cache_memory=1 << 30, num_scheduler_steps=1), reqs, abort)
    for r in reqs:
        seq = f"{r.request_id}/0/code"
        got, want = rec_burst.codes(seq), rec_one.codes(seq)
        if r.request_id in abort:
            n = min(len(got), len(want))
            assert got[:n].tolist() == want[:n].tolist(), seq
            continue
        assert len(got) == r.code_params.max_new_tokens and got.tolist() == want.tolist(), seq
        np.testing.assert_allclose(rec_burst.hidden(seq), rec_one.hidden(seq), atol=1e-3, rtol=0)


def test_graph_step_has_no_host_sync(real_bf16):
    e = _engine(real_bf16, kv_cache_memory=1 << 30)
    runner = e.runner
    orig = runner.graphs.run

    def checked(*args):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return orig(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.graphs.run = checked
    _run(e, _requests(3, 24, greedy=False))
    assert runner.timings.graph_steps >= 3  # 23 frames after the prefill's, in bursts of 8 (the CUDA default)


def test_pipelined_eos_rows_do_not_sync_the_queued_step(real_bf16, monkeypatch):
    """Pipelined, the step after n is queued before n's results are read: reading them (the runner's outputs,
    the engine's frames, rows that ended by EOS and the wasted rows after them dropped) must not wait for
    it (a pageable index copy there once did)."""
    e = _engine(real_bf16, kv_cache_memory=1 << 30)
    assert e.pipelined
    dropped = []

    def no_sync(fn):
        def checked(*args):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return checked

    orig_append = e._append_frames

    def append(frames, updates, done=None):
        accepted = {u.request_id: u.num_new_tokens for u in updates}
        dropped.append(sum(accepted.get(rid, 0) < h.shape[0] for ids, h in frames for rid in ids))  # h: [m, n, H]
        return orig_append(frames, updates, done)

    import ttsserve.runner.model_runner as model_runner

    monkeypatch.setattr(model_runner, "runner_output", no_sync(model_runner.runner_output))
    e._append_frames = no_sync(append)
    rng = random.Random(SEED)
    reqs = [
        SynthesisRequest(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))),
            request_id=f"eos{i}",
            code_params=SamplingParams(seed=i, max_new_tokens=400),
        )
        for i in range(16)
    ]
    for r in reqs:  # no FrameRecorder: its copies of the hiddens to the host are syncs of the test's own
        e.add_synthesis(r)
    run_all(e)
    assert sum(dropped) > 0  # some rows ended by EOS while the next step was queued


def test_mid_step_audio_on_cuda_equals_end_of_step_audio(tiny_cuda):
    """Engine.step(emit=...) on CUDA (pipelined, deferred vocoder, the defaults): a vocoder call whose event has
    completed by the time the next GPT step is queued hands its audio out then (once), the rest at the step's
    end, and every request's audio is what step() alone returns."""
    print(f"seed {SEED}")
    reqs = _requests(6, 70, greedy=True)

    def audio_of(use_emit: bool) -> tuple[dict, Engine]:
        e = _engine(tiny_cuda)
        assert e.pipelined and e.audio.deferred
        got: dict[str, list] = {}

        def keep(outputs) -> None:
            for out in outputs:
                got.setdefault(out.request_id, []).append(out.samples)

        for r in reqs:
            e.add_synthesis(r)
            for _ in range(3):  # staggered: chunk boundaries of different requests on different steps
                keep(e.step(emit=keep) if use_emit else e.step())
        while e.has_unfinished():
            keep(e.step(emit=keep) if use_emit else e.step())
        return {rid: np.concatenate(a) for rid, a in got.items()}, e

    plain, _ = audio_of(False)
    early, e = audio_of(True)
    assert set(early) == set(plain) == {r.request_id for r in reqs}
    for rid, audio in plain.items():
        np.testing.assert_allclose(early[rid], audio, atol=1e-5, rtol=0)
    # a tiny model's vocoder call is done long before the host has queued the next step
    assert 0 < e.audio.polled_total <= e.audio.collects_total


def test_audio_on_its_own_stream_equals_audio_on_the_gpt_stream(real_bf16):
    """The vocoder on a CUDA stream of its own (--audio-stream) against the same engine with every kernel on one
    stream: real size, 40 streams arriving four a step with aborts, 120-360 frames each (the frame pool shifts
    and grows, rows end by EOS and by length while calls are in flight): the same audio, sample for sample."""
    print(f"seed {SEED}")
    rng = random.Random(SEED)
    reqs = [
        SynthesisRequest(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 20))),
            request_id=f"s{i}",
            code_params=SamplingParams(seed=rng.getrandbits(40), max_new_tokens=rng.randint(120, 360)),
        )
        for i in range(40)
    ]
    abort = {"s5", "s17", "s30"}

    def audio_of(own_stream: bool) -> tuple[dict, Engine]:
        e = _engine(real_bf16, kv_cache_memory=1 << 30, max_num_seqs=64, audio_stream=own_stream)
        assert (e.audio.stream is not None) == own_stream
        got: dict[str, list] = {}
        pending, steps = list(reqs), 0
        while pending or e.has_unfinished():
            for r in pending[:4]:
                e.add_synthesis(r)
            pending = pending[4:]
            for out in e.step():
                got.setdefault(out.request_id, []).append(out.samples)
            steps += 1
            if steps == 12:
                for rid in abort:
                    e.abort(rid)
        return {rid: np.concatenate(a) for rid, a in got.items()}, e

    one, _ = audio_of(False)
    own, e = audio_of(True)
    assert set(own) == set(one)
    assert e.audio.calls_total > 20
    for rid, audio in one.items():
        assert own[rid].shape == audio.shape, rid
        np.testing.assert_array_equal(own[rid], audio, err_msg=rid)
