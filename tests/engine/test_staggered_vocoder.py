"""Staggered arrivals: streams that start at different steps reach their chunk boundaries at
different steps, so without a cadence the vocoder runs nearly every step. With vocoder_cadence k it runs on
every k-th step, in one call for every stream that is due, and the audio is the same; a stream's first chunk
is the exception (its wait would be time to first audio): it makes a call on any step."""

import numpy as np

from ttsserve.config import EngineConfig
from ttsserve.engine.engine import Engine
from ttsserve.params import SamplingParams, SynthesisRequest

LENGTHS = [37, 90, 61, 120, 45, 77, 103, 58]  # frames per stream: natural-looking, all different


def _run(cadence: int) -> tuple[dict[str, np.ndarray], list[int], dict[str, int]]:
    """Stream i arrives at step 3 * i. Returns each stream's audio, the vocoder calls made in each step and
    the step (from 1) of each stream's first audio."""
    eng = Engine(
        EngineConfig(
            load_format="dummy",
            dummy_size="tiny",
            dtype="float32",
            device="cpu",
            kv_cache_memory=16 << 20,
            swap_space=0.01,
            vocoder_cadence=cadence,
        )
    )
    audio: dict[str, list] = {}
    calls_per_step, done, first = [], set(), {}
    for step in range(2000):
        if step % 3 == 0 and step // 3 < len(LENGTHS):
            i = step // 3
            p = SamplingParams(seed=i, min_new_tokens=LENGTHS[i], max_new_tokens=LENGTHS[i])
            eng.add_synthesis(SynthesisRequest(f"stream number {i}", code_params=p, request_id=f"s{i}"))
        before = eng.audio.calls_total
        for out in eng.step():
            audio.setdefault(out.request_id, []).append(out.samples)
            if len(out.samples):
                first.setdefault(out.request_id, step + 1)
            if out.finished:
                done.add(out.request_id)
        calls_per_step.append(eng.audio.calls_total - before)
        if len(done) == len(LENGTHS):
            break
    assert len(done) == len(LENGTHS)
    return {rid: np.concatenate(chunks) for rid, chunks in audio.items()}, calls_per_step, first


def test_cadence_bounds_vocoder_calls_and_keeps_the_audio():
    every_step, calls_1, first_1 = _run(1)
    shared, calls_4, first_4 = _run(4)
    for i, n in enumerate(LENGTHS):
        assert shared[f"s{i}"].shape == (512 * n - 256,)
        np.testing.assert_allclose(shared[f"s{i}"], every_step[f"s{i}"], atol=1e-5, rtol=0)
    steps = len(calls_4)
    assert max(calls_4) == 1  # 8 streams fit in one call
    first_steps = set(first_4.values())
    # off-cadence calls happen only where a stream's first chunk was due, and its first audio is not delayed
    assert all(c == 0 for k, c in enumerate(calls_4, start=1) if k % 4 and k not in first_steps)
    assert any(c for k, c in enumerate(calls_4, start=1) if k % 4)  # LENGTHS' arrivals are off-cadence too
    assert first_4 == first_1
    assert sum(calls_4) <= steps / 4 + len(LENGTHS) + 1
    # without the cadence the staggered streams' calls land on any step, and there are more of them
    assert any(c for k, c in enumerate(calls_1, start=1) if k % 4) and sum(calls_1) > sum(calls_4)
