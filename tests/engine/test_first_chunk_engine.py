"""The engine with early chunks (--first-chunk-lookahead-frames): the same codes as the exact engine, each
request's first audio steps earlier, and every sample after its early chunks the exact engine's."""

import numpy as np
import pytest
from engine_testutil import make_engine

from ttsserve.params import SamplingParams, SynthesisRequest

FIRST = 4


def _serve(model, **engine_kw) -> tuple[dict[str, np.ndarray], dict[str, int], int]:
    """-> (audio per request, the engine step each request's first audio came out of, samples of early audio)."""
    e = make_engine(model, first_chunk_frames=FIRST, **engine_kw)
    for i, n in enumerate((40, 33, 50)):
        params = SamplingParams(seed=7 + i, min_new_tokens=n, max_new_tokens=n)
        e.add_synthesis(
            SynthesisRequest(f"hello number {i} of three", code_params=params, raw_text=True, request_id=f"r{i}")
        )
    audio, first_step = {}, {}
    for step in range(10000):
        if not e.has_unfinished():
            break
        for out in e.step():
            if len(out.samples):
                first_step.setdefault(out.request_id, step)
            audio.setdefault(out.request_id, []).append(out.samples)
    assert not e.has_unfinished()
    head = 512 * e.audio.early.decoder.ends[-1] if e.audio.early else 0
    return {k: np.concatenate(v) for k, v in audio.items()}, first_step, head


def test_early_chunks_in_the_engine(tiny_model):
    exact, exact_first, _ = _serve(tiny_model)
    early, early_first, head = _serve(tiny_model, first_chunk_lookahead_frames=3)
    assert head > 512 * FIRST  # more than one early chunk
    for rid in exact:
        assert early_first[rid] < exact_first[rid], rid
        assert early[rid].shape == exact[rid].shape, rid
        np.testing.assert_allclose(early[rid][head:], exact[rid][head:], rtol=0, atol=1e-5, err_msg=rid)
        assert np.abs(early[rid][:head] - exact[rid][:head]).max() > 0  # the early chunks are approximate


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_early_chunks_across_preemption_and_abort(tiny_model, mode):
    """A KV pool too small for the batch preempts streams after their early chunks; one request is
    aborted after its first audio. Every finished request's audio is the exact engine's past its early chunks,
    and the aborted one leaves no stream behind."""
    kw = dict(
        kv_cache_memory=12 * 16 * 1024,
        preemption_mode=mode,
        swap_space=(64 * 16 * 1024) / 2**30 if mode == "swap" else 0.0,
        max_num_batched_tokens=64,
    )
    runs = {}
    for early in (None, 3):
        e = make_engine(tiny_model, first_chunk_frames=FIRST, first_chunk_lookahead_frames=early, **kw)
        for i in range(10):
            n = 30 + 3 * i
            params = SamplingParams(seed=40 + i, min_new_tokens=n, max_new_tokens=n)
            e.add_synthesis(
                SynthesisRequest(f"stream {i} goes on", code_params=params, raw_text=True, request_id=f"p{i}")
            )
        audio, aborted = {}, False
        for _ in range(10000):
            if not e.has_unfinished():
                break
            for out in e.step():
                audio.setdefault(out.request_id, []).append(out.samples)
            if not aborted and "p9" in audio:
                e.abort("p9")
                aborted = True
        assert not e.has_unfinished() and e.audio.num_requests == 0
        assert e.stats()["num_preemptions_total"] > 0
        runs[early] = {k: np.concatenate(v) for k, v in audio.items() if k != "p9"}
        head = 512 * e.audio.early.decoder.ends[-1] if early else 0
    assert runs[None].keys() == runs[3].keys() and len(runs[3]) == 9
    for rid, ref in runs[None].items():
        np.testing.assert_allclose(runs[3][rid][head:], ref[head:], rtol=0, atol=1e-5, err_msg=rid)
