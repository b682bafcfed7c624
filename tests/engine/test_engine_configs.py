"""Any valid engine configuration serves every request to its end: block sizes, budgets down to one token a step
(steps where no row samples), with and without chunked prefill, prefix caching, preemption by recompute or swap
in a KV pool of a few blocks, decode bursts, asynchronous scheduling, chunk sizes and the three vocoder modes.
Each request asks for a fixed number of frames, so each must end with exactly that many and their audio."""

from __future__ import annotations

from engine_testutil import make_engine, run_all
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ttsserve.params import SamplingParams, SynthesisRequest

WORDS = "hello world this is a test of the speech model today weather good very nice thank you".split()
SAMPLES_PER_FRAME = 512  # 24 kHz / 46.875 frames a second; a stream's audio is that per frame less half a frame

configs = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([8, 16, 32]),
        "max_num_seqs": st.sampled_from([1, 2, 3, 8]),
        "max_num_batched_tokens": st.sampled_from([1, 2, 7, 16, 64, 300]),
        "enable_chunked_prefill": st.booleans(),
        "enable_prefix_caching": st.booleans(),
        "preemption_mode": st.sampled_from(["recompute", "swap", "auto"]),
        "kv_cache_memory": st.sampled_from([80 << 10, 200 << 10, 16 << 20]),  # 2-3 blocks .. hundreds
        "num_scheduler_steps": st.sampled_from([None, 1, 2, 4]),
        "async_scheduling": st.sampled_from([None, True, False]),
        "max_chunk_frames": st.sampled_from([8, 64]),
        "first_chunk_frames": st.sampled_from([1, 4, 8]),
        "vocoder": st.sampled_from(["exact", "windowed", "early"]),
    }
)
requests = st.lists(st.tuples(st.integers(1, 30), st.integers(1, 40)), min_size=1, max_size=5)  # (words, frames)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, reqs=requests, data=st.data())
def test_every_valid_config_serves_every_request(tiny_model, cfg, reqs, data) -> None:
    vocoder = cfg.pop("vocoder")
    if vocoder == "windowed":
        cfg["lookahead_frames"] = 4
    elif vocoder == "early":
        cfg["first_chunk_lookahead_frames"] = 4
    e = make_engine(tiny_model, swap_space=0.01, **cfg)
    for i, (words, frames) in enumerate(reqs):
        text = " ".join(data.draw(st.lists(st.sampled_from(WORDS), min_size=words, max_size=words)))
        params = SamplingParams(seed=i, temperature=0.7, max_new_tokens=frames, min_new_tokens=frames)
        e.add_synthesis(SynthesisRequest(text, code_params=params, raw_text=True, request_id=f"r{i}"))
    done = run_all(e, max_steps=20000)
    assert sorted(done) == [f"r{i}" for i in range(len(reqs))]
    for i, (_, frames) in enumerate(reqs):
        audio, final = done[f"r{i}"]
        assert final.error is None and final.finish_reason == "length" and final.num_frames == frames
        assert len(audio) == frames * SAMPLES_PER_FRAME - SAMPLES_PER_FRAME // 2
