"""Decode bursts (num_scheduler_steps > 1, multi-step scheduling) on the CPU: k decode steps per schedule, each
reading the frame the last one sampled, give the codes, hidden states and audio of single steps, with bursts
cut by EOS and by max_new_tokens, staggered arrivals (bursts beside prefill chunks), the decode graphs'
static-buffer body and asynchronous scheduling."""

import random

import numpy as np
import pytest
from engine_testutil import FrameRecorder, make_engine

from ttsserve.params import SamplingParams, SynthesisRequest, Voice
from ttsserve.runner.cuda_graphs import DecodeGraphs

WORDS = ["hello", "world", "this", "is", "a", "test", "of", "the", "speech", "model"]


def _requests(speaker=None) -> list[SynthesisRequest]:
    """Three that end at max_new_tokens (31, 32, 45: cut inside a burst for k = 2, 3), four that end at the
    dummy model's EOS (whose position depends on the text), and one with a speaker whose code stage starts
    after a refine-text stage (text tokens are never bursts)."""
    rng = random.Random(5)
    reqs = []
    for i, n in enumerate([31, 32, 45, 0, 0, 0, 0]):
        params = SamplingParams(
            seed=70 + i, temperature=0.7, top_k=20, repetition_penalty=1.05, max_new_tokens=n or 300, min_new_tokens=n
        )
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 14)))
        reqs.append(SynthesisRequest(text, code_params=params, raw_text=True, request_id=f"b{i}"))
    reqs.append(
        SynthesisRequest(
            "hello world this is a test",
            voice=Voice(spk_emb=speaker),
            refine_text=True,
            refine_params=SamplingParams(seed=3, max_new_tokens=12),
            code_params=SamplingParams(seed=77, max_new_tokens=37, min_new_tokens=37),
            request_id="refined",
        )
    )
    return reqs


def _run(model, reqs, k: int, graphs: bool = False, **kw):
    """Request i arrives at step 3 * i with a small token budget, so prefill chunks share steps with bursts."""
    e = make_engine(model, max_model_len=512, max_num_batched_tokens=32, num_scheduler_steps=k, **kw)
    if graphs:  # off CUDA the "graphs" run their captured body eagerly on the static buffers
        e.runner.graphs = DecodeGraphs(e.runner, [1, 2, 4, 8], max_steps=k)
        e.runner.graphs.capture()
    rec = FrameRecorder(e)
    bursts, audio, finals = [0], {}, {}
    launch = e.runner.launch

    def counting_launch(sched, requests):
        bursts[0] += sum(s.num_steps > 1 for s in sched.scheduled)
        return launch(sched, requests)

    e.runner.launch = counting_launch
    for step in range(5000):
        if step % 3 == 0 and step // 3 < len(reqs):
            e.add_synthesis(reqs[step // 3])
        for out in e.step():
            audio.setdefault(out.request_id, []).append(out.samples)
            if out.finished:
                finals[out.request_id] = out
        if step // 3 >= len(reqs) and not e.has_unfinished():
            break
    return rec, {r: np.concatenate(a) for r, a in audio.items()}, finals, bursts[0]


@pytest.mark.parametrize(
    "k, graphs, pipelined", [(2, False, False), (3, True, False), (3, True, True), (16, True, True)]
)
def test_decode_bursts_equal_single_steps(tiny_model, tiny_speaker, k, graphs, pipelined):
    reqs = _requests(tiny_speaker)
    rec1, audio1, finals1, _ = _run(tiny_model, reqs, 1, graphs=graphs, async_scheduling=pipelined)
    reck, audiok, finalsk, num_bursts = _run(tiny_model, reqs, k, graphs=graphs, async_scheduling=pipelined)
    assert num_bursts > min(50, 400 // k)
    cut_by_eos = 0
    for r in reqs:
        seq = f"{r.request_id}/0/code"
        codes = rec1.codes(seq)
        np.testing.assert_array_equal(reck.codes(seq), codes)
        np.testing.assert_allclose(reck.hidden(seq), rec1.hidden(seq), atol=1e-5, rtol=0)
        np.testing.assert_allclose(audiok[r.request_id], audio1[r.request_id], atol=1e-5, rtol=0)
        assert finalsk[r.request_id].finish_reason == finals1[r.request_id].finish_reason
        assert finalsk[r.request_id].num_frames == finals1[r.request_id].num_frames == len(codes)
        if finals1[r.request_id].finish_reason == "stop":
            cut_by_eos += (len(codes) - 1) % k != 0  # frame 0 is the prefill's; bursts cover 1..k, k+1..2k, ...
        else:
            assert len(codes) == r.code_params.max_new_tokens
    assert cut_by_eos >= 1  # an EOS inside a burst: the samples after it were dropped


def test_cuda_step_intervals_count_frames():
    """The CUDA defaults of vocoder_cadence and admission_interval are 8 frames' worth of steps."""
    from ttsserve.config import EngineConfig

    assert EngineConfig(num_scheduler_steps=1).step_intervals("cuda") == (8, 8)
    assert EngineConfig().scheduler_steps("cuda") == 8 and EngineConfig().step_intervals("cuda") == (1, 1)
    assert EngineConfig().scheduler_steps("cpu") == 1 and EngineConfig(enforce_eager=True).scheduler_steps("cuda") == 1
    assert EngineConfig(num_scheduler_steps=4).step_intervals("cuda") == (2, 2)
    assert EngineConfig(num_scheduler_steps=16).step_intervals("cuda") == (1, 1)
    assert EngineConfig(num_scheduler_steps=4).step_intervals("cpu") == (1, 1)
    assert EngineConfig(num_scheduler_steps=4, admission_interval=3).step_intervals("cuda") == (2, 3)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(num_scheduler_steps=0)


@pytest.mark.parametrize("deferred, poll", [(False, False), (True, False), (True, True)])
def test_pipelined_first_audio_step(tiny_model, deferred, poll):
    """The CUDA schedule's time to first audio in engine steps: 1 prefill step (it samples frame 1), the bursts
    for the remaining first_audio_frames - 1 frames, 1 step to read the last burst's results (pipelined) and,
    with the deferred vocoder, 1 to collect its call unless poll_audio() between steps hands it out as soon as
    the device has it. The vocoder call is queued in the step that reads the frames (not the next one), and the
    cadence does not hold a first chunk back."""
    k = 4
    e = make_engine(tiny_model, num_scheduler_steps=k, async_scheduling=True, vocoder_cadence=2, admission_interval=2)
    e.audio.deferred = deferred  # the CUDA engine's mode (off CUDA a call has no event: polled, it is done)
    p = SamplingParams(seed=1, min_new_tokens=200, max_new_tokens=200)
    e.add_synthesis(SynthesisRequest("hello world", code_params=p, raw_text=True, request_id="a"))
    first = None  # the number of steps run when the first audio came out
    for step in range(60):
        if poll and any(len(out.samples) for out in e.poll_audio()):
            first = step
            break
        if any(len(out.samples) for out in e.step()):
            first = step + 1
            break
    bursts = -(-(e.first_audio_frames - 1) // k)
    assert first == 1 + bursts + 1 + (deferred and not poll)


def test_a_batch_with_rows_ending_inside_it_is_one_append_of_each_rows_accepted_frames(tiny_model):
    """A burst's [k, n, H] hidden states where some rows accepted fewer than k frames (EOS, max_new_tokens, or
    a pipelined row the previous step ended) reach the audio stage in one append with their counts, and each
    row gets exactly its accepted frames, in order: at 128 streams most pipelined steps hold such a row, and
    splitting the batch by count cost a gather, an index copy and an append per distinct count."""
    import torch

    from ttsserve.engine.outputs import RequestUpdate

    e = make_engine(tiny_model, max_model_len=512)
    for i in range(5):
        e.add_synthesis(
            SynthesisRequest(
                "hello world",
                raw_text=True,
                request_id=f"g{i}",
                code_params=SamplingParams(seed=i, min_new_tokens=200, max_new_tokens=200),
            )
        )
    for _ in range(6):
        e.step()
    ids = sorted(s for s, seq in e.sequences.items() if seq.mode == "code")
    assert len(ids) == 5
    pool = e.audio._pools[False]
    hidden = torch.randn(4, 6, pool.data.shape[2], generator=torch.Generator().manual_seed(3))
    rows = [*ids[:3], "gone/0/code", *ids[3:]]  # a dropped row whose sequence is gone: no update, no frames
    counts = [4, 0, 2, None, 4, 1]
    calls = []
    append = e.audio.append_batch

    def recording_append(seq_ids, frames, counts=None, ready=None):
        calls.append(len(seq_ids))
        return append(seq_ids, frames, counts, ready)

    e.audio.append_batch = recording_append
    before = {s: e.audio._streams[s].num_frames for s in ids}
    updates = [RequestUpdate(s, None, False, None, n) for s, n in zip(rows, counts) if n is not None]
    e._append_frames([(rows, hidden)], updates)
    assert calls == [6]
    for i, (s, n) in enumerate(zip(rows, counts)):
        if n is None:
            continue
        st = e.audio._streams[s]
        assert st.num_frames - before[s] == n
        written = pool.data[st.slot, before[s] - st.base : st.num_frames - st.base]
        assert torch.equal(written, hidden[:n, i].to(pool.data.dtype))
