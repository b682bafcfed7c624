"""The Triton code sampler (sample/triton_sampler.py) against sampler.sample, the reference of MODEL.md §4.

Runs on CUDA. Without CUDA it is skipped, unless TRITON_INTERPRET=1 and triton is installed: then the kernel runs
through Triton's CPU interpreter (a development aid, not CI). The reference runs on the CPU in both cases.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from triton_env import require_cuda_or_interpreter  # noqa: E402

require_cuda_or_interpreter()

from ttsserve.params import SamplingParams  # noqa: E402
from ttsserve.sample import triton_sampler  # noqa: E402
from ttsserve.sample.sampler import make_sampling_batch, process_logits, sample  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
R, V, EOS = 4, 626, 625
B = 96 if DEVICE == "cuda" else 8  # the interpreter takes ~1.6 s per (request, row) program


def _agree(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same token almost always: a float sum landing on the top-p threshold, or two races within an ulp,
    can flip one (at most 1 % of the draws, and one draw in the interpreter's small batches)."""
    assert got.shape == want.shape and got.dtype == torch.int64
    assert int((got != want).sum()) <= max(1, got.numel() // 100), (got, want)


def _case(b: int, seed: int, params_of):
    g = torch.Generator().manual_seed(seed)
    params = [params_of(i) for i in range(b)]
    seeds = torch.randint(0, 2**62, (b,), generator=g).tolist()
    steps = (torch.arange(b) * 37 % 50).tolist()
    hist = [torch.randint(0, V, (i % 20, R), generator=g) for i in range(b)]
    logits = torch.randn(b, R, V, generator=g) * 2.5
    ref_batch = make_sampling_batch(params, seeds, steps, hist, R, EOS)
    want = sample(logits, ref_batch)
    batch = make_sampling_batch(params, seeds, steps, hist, R, EOS, device=DEVICE)
    got = triton_sampler.sample(logits.to(DEVICE), batch).cpu()
    # every draw is a token the processors kept (top-p, top-k, the EOS ban), whatever the float rounding
    kept = process_logits(logits, ref_batch).isfinite()
    assert bool(kept.gather(-1, got[:, :, None]).all())
    return got, want


def test_matches_the_reference_sampler() -> None:
    """Seeded draws under every processor (_agree); greedy rows exactly."""
    got, want = _case(
        B,
        0,
        lambda i: SamplingParams(
            top_k=[1, 3, 20, 40, 700][i % 5],
            top_p=[0.5, 0.7, 0.9, 1.0][i % 4],
            temperature=[0.3, 0.8, 1.0][i % 3],
            repetition_penalty=[1.0, 1.1, 1.5][i % 3],
            greedy=i % 7 == 0,
            min_new_tokens=30 if i % 2 else 0,
        ),
    )
    _agree(got, want)
    greedy = torch.arange(B) % 7 == 0
    assert torch.equal(got[greedy], want[greedy])


def _engine_rows(g: torch.Generator, b: int, num_rows: int, length_of) -> tuple[torch.Tensor, list, list[int]]:
    """b distinct state rows out of num_rows in random order, request i's length_of(i) generated frames and seeds."""
    rows = torch.randperm(num_rows, generator=g)[:b]
    outputs = [[tuple(torch.randint(0, V, (R,), generator=g).tolist()) for _ in range(length_of(i))] for i in range(b)]
    seeds = torch.randint(0, 2**62, (b,), generator=g).tolist()
    return rows, outputs, seeds


def test_the_engines_sampling_state_layout() -> None:
    """The engine's SamplingBatch (sample/state.py): [B] parameters are strided columns of its parameter tables
    and the history a ring, gathered for rows out of order. The kernel must read them as the reference does."""
    from ttsserve.sample.state import SamplingState

    b, num_rows = (48, 64) if DEVICE == "cuda" else (6, 8)
    g = torch.Generator().manual_seed(4)
    params = [
        SamplingParams(
            top_k=[3, 20, 700][i % 3],
            top_p=[0.5, 0.7, 1.0][i % 3],
            temperature=[0.3, 1.0][i % 2],
            repetition_penalty=[1.0, 1.5][i % 2],
            greedy=i % 5 == 0,
            min_new_tokens=4 * (i % 2),
        )
        for i in range(b)
    ]
    rows, outputs, seeds = _engine_rows(g, b, num_rows, lambda i: i % 9)
    steps = torch.tensor([len(o) for o in outputs])
    logits = torch.randn(b, R, V, generator=g) * 2.5
    batches = []
    for dev in ("cpu", DEVICE):
        state = SamplingState(num_rows, R, 16, torch.device(dev))
        state.set_rows(rows.tolist(), params, seeds, ["code"] * b, outputs)
        batches.append(state.batch(rows.to(dev), steps.to(dev), R, EOS))
    assert batches[1].top_p.stride(0) > 1 and batches[1].seeds.stride(0) > 1  # the layout under test
    want = sample(logits, batches[0])
    got = triton_sampler.sample(logits.to(DEVICE), batches[1]).cpu()
    _agree(got, want)
    greedy = torch.tensor([p.greedy for p in params])
    assert torch.equal(got[greedy], want[greedy])


def _window_and_sort(logits: torch.Tensor, params: list[SamplingParams], seed: int):
    """The kernel's draws with the window of the largest keys (the default) and with the full sort forced, and the
    reference's, for one batch."""
    b = logits.shape[0]
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2**62, (b,), generator=g).tolist()
    hist = [torch.randint(0, V, (i % 8, R), generator=g) for i in range(b)]
    want = sample(logits, make_sampling_batch(params, seeds, [3] * b, hist, R, EOS))
    batch = make_sampling_batch(params, seeds, [3] * b, hist, R, EOS, device=DEVICE)
    window = triton_sampler.sample(logits.to(DEVICE), batch).cpu()
    sort = triton_sampler.sample(logits.to(DEVICE), batch, top_window=0).cpu()
    return window, sort, want


def test_the_window_of_the_largest_keys_cuts_as_the_full_sort() -> None:
    """ChatTTS's processors (top-k 20 <= the window; top-p 0.5-1.0) on logits rounded to a coarse grid, so values
    tie across the k-th: the window and the sort give the same draws (bar a float sum on the top-p threshold),
    and with top-p 1.0 exactly."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(B, R, V, generator=g) * 2.5 * 4).round() / 4
    params = [
        SamplingParams(top_k=[20, 3, 32][i % 3], top_p=[0.7, 1.0, 0.5][i % 3 if i % 2 else 1], temperature=0.7)
        for i in range(B)
    ]
    window, sort, want = _window_and_sort(logits, params, 6)
    _agree(window, sort)
    _agree(window, want)
    no_top_p = torch.tensor([p.top_p == 1.0 for p in params])
    assert torch.equal(window[no_top_p], sort[no_top_p])


def test_ties_past_the_window_take_the_full_sort() -> None:
    """40 tokens share the largest value and top-k is 20: top-k keeps all 40 (it cuts by value), more than the
    window's 32 keys hold, so the kernel must fall back to the full sort. Without that, the 8 tied tokens outside the
    window could never be drawn (a fifth of the draws)."""
    b = B
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(b, R, V, generator=g) - 10.0
    outside = torch.zeros(b, R, V, dtype=torch.bool)  # the tied tokens the window does not hold: lowest columns
    for i in range(b):
        for r in range(R):
            tied = torch.randperm(V, generator=g)[:40].sort().values
            logits[i, r, tied] = 3.0
            outside[i, r, tied[:8]] = True
    params = [SamplingParams(top_k=20, top_p=1.0, temperature=1.0, repetition_penalty=1.0) for _ in range(b)]
    window, sort, want = _window_and_sort(logits, params, 8)
    assert torch.equal(window, sort)
    assert torch.equal(window, want)
    assert bool(outside.gather(-1, window[:, :, None]).any())  # the case under test occurred


def test_plain_draws_are_the_reference_draws_exactly() -> None:
    """No top-p / top-k cut (p = 1, k = V) and no penalty: the draw is the hash race alone, whose integer math
    gives identical bits."""
    got, want = _case(B, 1, lambda i: SamplingParams(top_k=V, top_p=1.0, temperature=1.0, repetition_penalty=1.0))
    _agree(got, want)


def test_the_repetition_penalty_moves_a_greedy_pick() -> None:
    """Greedy rows whose best token is in their history under a strong penalty: the reference picks another
    token, and so must the kernel (exactly)."""
    g = torch.Generator().manual_seed(2)
    b = 4
    logits = torch.randn(b, R, V, generator=g).abs() + 0.1  # positive: the penalty divides
    best = logits.argmax(-1)  # [b, R]
    params = [SamplingParams(greedy=True, repetition_penalty=4.0, top_k=V, top_p=1.0) for _ in range(b)]
    hist = [best[i][None, :] for i in range(b)]
    ref = make_sampling_batch(params, [0] * b, [1] * b, hist, R, EOS)
    want = sample(logits, ref)
    assert bool((want != best).all())
    got = triton_sampler.sample(logits.to(DEVICE), make_sampling_batch(params, [0] * b, [1] * b, hist, R, EOS, DEVICE))
    assert torch.equal(got.cpu(), want)


def test_an_empty_batch() -> None:
    batch = make_sampling_batch([], [], [], [], R, EOS, device=DEVICE)
    assert triton_sampler.sample(torch.zeros(0, R, V, device=DEVICE), batch).shape == (0, R)


def test_the_text_vocabulary_and_host_logits_take_the_reference_sampler() -> None:
    assert not triton_sampler.can_sample(torch.zeros(1, 1, triton_sampler.MAX_VOCAB + 1, device=DEVICE))
    assert not triton_sampler.can_sample(torch.zeros(1, R, V))  # host memory: the kernel needs CUDA
    assert triton_sampler.can_sample(torch.zeros(1, R, V, device=DEVICE)) == (DEVICE == "cuda")
    params = [SamplingParams(greedy=True)]
    logits = torch.randn(1, 1, 5000, generator=torch.Generator().manual_seed(3))
    batch = make_sampling_batch(params, [0], [0], [torch.zeros(0, 1)], 1, 4999)
    assert torch.equal(triton_sampler.sample_or_reference(logits, batch), sample(logits, batch))


def test_sample_and_record_is_batch_sample_and_record_in_one_kernel() -> None:
    """sample_and_record (the decode graphs' sampler: one kernel reading SamplingState's tables by row) against
    state.batch -> sample -> state.record on a copy of the same state: the same tokens bit for bit (the same
    arithmetic on the same fp32 roundings of the float64 parameters), the same rings and last tokens after, for
    rows out of order, histories that wrap their window, and padding rows on the scratch row."""
    from ttsserve.sample.state import SamplingState

    b, num_rows = (40, 64) if DEVICE == "cuda" else (5, 8)
    g = torch.Generator().manual_seed(11)
    params = [
        SamplingParams(
            top_k=[20, 3, 700][i % 3],
            top_p=[0.7, 1.0, 0.5][i % 3],
            temperature=[0.3, 0.7, 1.0][i % 3],
            repetition_penalty=[1.05, 1.0, 2.0][i % 3],
            repetition_window=[16, 5][i % 2],
            greedy=i % 4 == 1,
            min_new_tokens=6 * (i % 2),
        )
        for i in range(b)
    ]
    rows, outputs, seeds = _engine_rows(g, b, num_rows, lambda i: 3 * i % 23)
    fused, ref = (SamplingState(num_rows, R, 16, torch.device(DEVICE)) for _ in range(2))
    for state in (fused, ref):
        state.set_rows(rows.tolist(), params, seeds, ["code"] * b, outputs)
    pad = 2  # padding rows of a graph bucket: the scratch row, at step 0
    rows_t = torch.cat([rows, torch.full((pad,), fused.scratch_row)]).to(DEVICE)
    steps_t = torch.tensor([len(o) for o in outputs] + [0] * pad, device=DEVICE)
    for step in range(2):  # the second step's penalties read what the first recorded
        logits = (torch.randn(b + pad, R, V, generator=g) * 2.5).to(DEVICE)
        got = triton_sampler.sample_and_record(logits, fused, rows_t, steps_t + step, EOS)
        want = triton_sampler.sample(logits, ref.batch(rows_t, steps_t + step, R, EOS))
        ref.record(rows_t, steps_t + step, want)
        assert torch.equal(got[:b].cpu(), want[:b].cpu())
        real = rows.to(DEVICE)
        assert torch.equal(fused.ring[real], ref.ring[real]) and torch.equal(
            fused.last_tokens[real], ref.last_tokens[real]
        )
        assert torch.equal(fused.fparams, ref.fparams) and torch.equal(fused.iparams, ref.iparams)
