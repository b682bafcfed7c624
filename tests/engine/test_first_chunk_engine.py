"""The engine with an early first chunk (--first-chunk-lookahead-frames): the same codes as the exact engine,
each request's first audio steps earlier, and every sample after its first chunk the exact engine's."""

import numpy as np
from engine_testutil import make_engine

from ttsserve.params import SamplingParams, SynthesisRequest

FIRST = 4


def _serve(model, **engine_kw) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """-> (audio per request, the engine step each request's first audio came out of)."""
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
    return {k: np.concatenate(v) for k, v in audio.items()}, first_step


def test_early_first_chunk_in_the_engine(tiny_model):
    exact, exact_first = _serve(tiny_model)
    early, early_first = _serve(tiny_model, first_chunk_lookahead_frames=3)
    head = 512 * FIRST
    for rid in exact:
        assert early_first[rid] < exact_first[rid], rid
        assert early[rid].shape == exact[rid].shape, rid
        np.testing.assert_allclose(early[rid][head:], exact[rid][head:], rtol=0, atol=1e-5, err_msg=rid)
        assert np.abs(early[rid][:head] - exact[rid][:head]).max() > 0  # the first chunk is the approximate one
