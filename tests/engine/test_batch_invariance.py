"""Each request's codes equal its solo run with the same seed, whatever else is in the batch, with chunked
prefill, and across preemption by recompute and by swap; paged output equals the dense single-request oracle."""

import random

import numpy as np
import pytest
import torch
from engine_testutil import FrameRecorder, make_engine, run_all

from ttsserve.params import SamplingParams, SynthesisRequest, Voice

WORDS = "hello world this is a test of the speech model today weather good very nice thank you".split()


def _requests(n: int, seed: int = 0) -> list[SynthesisRequest]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
        frames = rng.randint(4, 24)
        greedy = rng.random() < 0.25
        params = SamplingParams(
            temperature=rng.choice([0.3, 0.7, 1.0]),
            top_p=rng.choice([0.5, 0.7, 1.0]),
            top_k=rng.choice([1, 5, 20]),
            repetition_penalty=rng.choice([1.0, 1.05, 1.3]),
            seed=1000 + i,
            greedy=greedy,
            max_new_tokens=frames,
            min_new_tokens=rng.choice([0, frames]),
        )
        reqs.append(SynthesisRequest(text, code_params=params, raw_text=True, request_id=f"r{i}"))
    return reqs


def _run(model, reqs, **engine_kw) -> tuple[FrameRecorder, object]:
    e = make_engine(model, **engine_kw)
    rec = FrameRecorder(e)
    for r in reqs:
        e.add_synthesis(r)
    run_all(e)
    return rec, e


def _codes(model, reqs, **engine_kw) -> tuple[dict, object]:
    rec, e = _run(model, reqs, **engine_kw)
    return {r.request_id: [t for t, _ in rec.frames[f"{r.request_id}/0/code"]] for r in reqs}, e


@pytest.fixture(scope="module")
def solo_codes(tiny_model):
    reqs = _requests(64)
    return {r.request_id: _codes(tiny_model, [r])[0][r.request_id] for r in reqs}


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_batch_equals_solo(tiny_model, solo_codes, batch_size):
    reqs = _requests(64)[:batch_size]
    got, _ = _codes(tiny_model, reqs, max_num_batched_tokens=96)  # chunked prefill: prompts span steps
    for r in reqs:
        assert got[r.request_id] == solo_codes[r.request_id], r.request_id


def test_steps_where_nothing_samples(tiny_model, solo_codes, monkeypatch):
    """A 16-token budget: some steps hold only prompt chunks before their last, so no row samples; the engine goes
    on and each request's codes are its solo run's."""
    from ttsserve.runner.model_runner import ModelRunner

    launch, empty = ModelRunner.launch, []

    def counting(self, *args, **kwargs):
        step = launch(self, *args, **kwargs)
        empty.append(step is not None and not step.groups)
        return step

    monkeypatch.setattr(ModelRunner, "launch", counting)
    reqs = _requests(64)[:7]
    got, _ = _codes(tiny_model, reqs, max_num_batched_tokens=16, max_num_seqs=8)
    assert any(empty)
    for r in reqs:
        assert got[r.request_id] == solo_codes[r.request_id], r.request_id


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_preserves_outputs(tiny_model, solo_codes, mode):
    """A KV pool far too small for 24 concurrent requests forces preemptions."""
    reqs = _requests(64)[:24]
    kv_bytes = 24 * 16 * 1024  # 24 blocks of 16 frames (1 KiB per frame on the tiny model)
    got, e = _codes(
        tiny_model,
        reqs,
        kv_cache_memory=kv_bytes,
        preemption_mode=mode,
        swap_space=(64 * 16 * 1024) / 2**30 if mode == "swap" else 0.0,
        max_num_batched_tokens=64,
    )
    st = e.stats()
    assert st["num_preemptions_total"] > 0
    if mode == "swap":
        assert st["num_swaps_total"] > 0
    assert st["num_free_blocks"] == st["num_blocks"]  # everything freed at the end
    for r in reqs:
        assert got[r.request_id] == solo_codes[r.request_id], r.request_id


def test_paged_equals_dense_oracle(tiny_model, tiny_speaker):
    from ttsserve.model.oracle import generate_dense

    e = make_engine(tiny_model, max_num_batched_tokens=32)
    rec = FrameRecorder(e)
    params = SamplingParams(seed=7, max_new_tokens=20, min_new_tokens=20, temperature=0.7)
    req = SynthesisRequest(
        "hello world this is a test",
        voice=Voice(spk_emb=tiny_speaker),
        code_params=params,
        raw_text=True,
        request_id="o",
    )
    e.add_synthesis(req)
    run_all(e)
    ids, mask = e.frontend.code_inputs(req.text, req.code_prompt, req.voice)
    with torch.inference_mode():
        embeds = tiny_model.embed.embed_prompt(
            ids, mask, torch.as_tensor(tiny_speaker), tiny_model.tokenizer.spk_emb_id
        )
        tokens, hiddens = generate_dense(tiny_model.gpt, tiny_model.embed, embeds, "code", params)
    assert rec.codes("o/0/code").tolist() == tokens.tolist()
    np.testing.assert_allclose(rec.hidden("o/0/code"), hiddens.numpy(), atol=1e-5, rtol=0)


def test_abort_frees_blocks(tiny_model):
    e = make_engine(tiny_model)
    for r in _requests(8):
        e.add_synthesis(r)
    for _ in range(3):
        e.step()
    assert e.kv_manager.num_free_blocks < e.kv_spec.num_blocks
    for i in range(8):
        e.abort(f"r{i}")
    e.step()
    assert not e.has_unfinished()
    assert e.kv_manager.num_free_blocks == e.kv_spec.num_blocks


@pytest.mark.parametrize("mode", ["none", "recompute", "swap"])
def test_pipelined_steps_equal_solo(tiny_model, solo_codes, mode):
    """async_scheduling: step n + 1 is scheduled and queued before step n's samples are read, so decode rows
    continue from tokens the host has not seen, EOS and length ends leave a wasted row, preemption drops an
    in-flight result. Every request still gets exactly its solo codes."""
    reqs = _requests(64)[:24]
    kw = dict(max_num_batched_tokens=64, async_scheduling=True)
    if mode != "none":
        kw.update(
            kv_cache_memory=24 * 16 * 1024,
            preemption_mode=mode,
            swap_space=(64 * 16 * 1024) / 2**30 if mode == "swap" else 0.0,
        )
    got, e = _codes(tiny_model, reqs, **kw)
    assert e.pipelined and e.runner.pipelined
    st = e.stats()
    if mode != "none":
        assert st["num_preemptions_total"] > 0
    assert st["num_free_blocks"] == st["num_blocks"]
    for r in reqs:
        assert got[r.request_id] == solo_codes[r.request_id], r.request_id


def test_pipelined_abort_in_flight(tiny_model, solo_codes):
    """Aborting requests whose next step is already queued: their results are dropped, the rest unchanged."""
    reqs = _requests(64)[:8]
    e = make_engine(tiny_model, async_scheduling=True)
    rec = FrameRecorder(e)
    for r in reqs:
        e.add_synthesis(r)
    for _ in range(4):
        e.step()
    for r in reqs[:3]:
        e.abort(r.request_id)
    run_all(e)
    e.step()  # reads the last queued step
    assert e.kv_manager.num_free_blocks == e.kv_spec.num_blocks
    for r in reqs[3:]:
        assert [t for t, _ in rec.frames[f"{r.request_id}/0/code"]] == solo_codes[r.request_id]
    for r in reqs[:3]:
        frames = [t for t, _ in rec.frames.get(f"{r.request_id}/0/code", [])]
        assert frames == solo_codes[r.request_id][: len(frames)]


def _frames(model, reqs, **engine_kw) -> tuple[dict, object]:
    """{request id: appended frames (EOS excluded)}, the engine."""
    rec, e = _run(model, reqs, **engine_kw)
    return {r.request_id: rec.codes(f"{r.request_id}/0/code").tolist() for r in reqs}, e


@pytest.mark.parametrize(
    "mode, pipelined", [("recompute", False), ("swap", False), ("recompute", True), ("swap", True)]
)
def test_decode_bursts_across_preemption(tiny_model, mode, pipelined):
    """Bursts of 3 in a KV pool of 16 blocks, small enough to preempt (by recompute / swap) requests with
    bursts in flight, which are dropped; a resumed request re-initialises its row from host state. Every
    request still gets the frames of single steps without pressure."""
    reqs = _requests(64)[:24]
    want, _ = _frames(tiny_model, reqs, max_num_batched_tokens=64)
    got, e = _frames(
        tiny_model,
        reqs,
        max_num_batched_tokens=64,
        num_scheduler_steps=3,
        async_scheduling=pipelined,
        kv_cache_memory=16 * 16 * 1024,
        preemption_mode=mode,
        swap_space=(64 * 16 * 1024) / 2**30 if mode == "swap" else 0.0,
    )
    st = e.stats()
    assert st["num_preemptions_total"] > 0 and (mode != "swap" or st["num_swaps_total"] > 0)
    assert st["num_free_blocks"] == st["num_blocks"]
    for r in reqs:
        assert got[r.request_id] == want[r.request_id], r.request_id
