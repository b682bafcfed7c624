"""Sampler: each processor against a per-row loop, seeded batch invariance, greedy, EOS ban, distribution."""

from __future__ import annotations

import random

import pytest
import torch

from ttsserve.params import SamplingParams
from ttsserve.sample.penalties import apply_repetition_penalty, apply_top_k, apply_top_p, apply_top_p_top_k, ban_token
from ttsserve.sample.rng import MASK32, hash_uniform, mix32
from ttsserve.sample.sampler import SamplingBatch, make_sampling_batch, process_logits, sample

NEG_INF = float("-inf")


def rand_logits(b: int, r: int, v: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, r, v, generator=torch.Generator().manual_seed(seed)) * 2.5


# ---------------------------------------------------------------- per-row loop references


def loop_rep_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for b in range(logits.shape[0]):
        for r in range(logits.shape[1]):
            toks = [t for t in history[b, r].tolist() if t >= 0]
            for tok in set(toks):
                alpha = float(penalty[b]) ** toks.count(tok)
                x = float(logits[b, r, tok])
                out[b, r, tok] = x * alpha if x < 0 else x / alpha
    return out


def loop_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    out = logits.clone()
    for b in range(logits.shape[0]):
        for r in range(logits.shape[1]):
            row = logits[b, r]
            vals, idx = torch.sort(row, stable=True)
            cum = vals.softmax(0).cumsum(0)
            for j in range(len(row) - 3):  # the 3 largest are always kept
                if float(cum[j]) <= float(torch.tensor(1.0 - top_p[b], dtype=torch.float32)):
                    out[b, r, idx[j]] = NEG_INF
    return out


def loop_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    out = logits.clone()
    for b in range(logits.shape[0]):
        k = min(max(top_k[b], 3), logits.shape[-1])
        for r in range(logits.shape[1]):
            kth = sorted(logits[b, r].tolist(), reverse=True)[k - 1]
            out[b, r][logits[b, r] < kth] = NEG_INF
    return out


# ---------------------------------------------------------------- processors


def test_repetition_penalty_matches_loop_and_rp1_is_noop() -> None:
    b, r, v, w = 5, 4, 40, 16
    logits = rand_logits(b, r, v)
    g = torch.Generator().manual_seed(1)
    history = torch.randint(0, 12, (b, r, w), generator=g)  # small alphabet: repeated tokens
    history[1, :, :9] = -1  # a short history
    history[2] = -1  # no history
    penalty = torch.tensor([1.05, 1.3, 2.0, 1.0, 0.8])
    got = apply_repetition_penalty(logits, history, penalty)
    ref = loop_rep_penalty(logits, history, penalty)
    assert torch.allclose(got, ref, rtol=1e-6, atol=0)
    assert not torch.equal(got[0], logits[0])
    assert torch.equal(got[2:4], logits[2:4])  # no history; rp == 1: bitwise no-op


def test_top_p_matches_loop_and_keeps_three() -> None:
    b, r, v = 6, 2, 50
    logits = rand_logits(b, r, v, seed=2)
    top_p = [0.7, 0.1, 0.95, 1.0, 0.5, 0.01]
    got = apply_top_p(logits, torch.tensor(top_p, dtype=torch.float64))
    assert torch.equal(got, loop_top_p(logits, top_p))
    kept = (got > NEG_INF).sum(-1)
    assert kept.min() >= 3 and kept[5].eq(3).all() and kept[3].eq(v).all()
    # probs 0.5, 0.3, 0.1, 0.05, 0.05 with p = 0.7: HF removes the two 0.05 tokens only (keep >= 3).
    hand = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05]).log()[None, None]
    out = apply_top_p(hand, torch.tensor([0.7], dtype=torch.float64))
    assert (out[0, 0] > NEG_INF).tolist() == [True, True, True, False, False]


def test_top_k_matches_loop_ties_and_k1_is_top3() -> None:
    b, r, v = 5, 3, 30
    logits = rand_logits(b, r, v, seed=3)
    logits[0, 0, :4] = 9.0  # a 4-way tie at the top: k_eff=3 keeps all four
    top_k = [1, 3, 20, 100, 5]
    got = apply_top_k(logits, torch.tensor(top_k))
    assert torch.equal(got, loop_top_k(logits, top_k))
    kept = (got > NEG_INF).sum(-1)
    assert kept[0, 0] == 4 and kept[0, 1:].eq(3).all() and kept[1].eq(3).all()
    assert kept[2].eq(20).all() and kept[3].eq(v).all()


@pytest.mark.parametrize("seed", range(4))
def test_fused_top_p_top_k_equals_sequential(seed: int) -> None:
    b, r, v = 16, 4, 64
    logits = rand_logits(b, r, v, seed=seed)
    g = torch.Generator().manual_seed(seed)
    top_p = torch.rand(b, generator=g, dtype=torch.float64) * 0.99 + 0.01
    top_k = torch.randint(1, 80, (b,), generator=g)
    ref = loop_top_k(loop_top_p(logits, top_p.tolist()), top_k.tolist())
    assert torch.equal(apply_top_p_top_k(logits, top_p, top_k), ref)
    assert torch.equal(apply_top_k(apply_top_p(logits, top_p), top_k), ref)


def test_ban_token() -> None:
    logits = rand_logits(3, 4, 10)
    out = ban_token(logits, 7, torch.tensor([True, False, True]))
    assert out[[0, 2], :, 7].eq(NEG_INF).all() and torch.equal(out[1], logits[1])
    assert torch.equal(out[..., :7], logits[..., :7])


# ---------------------------------------------------------------- the sampler


def make_batch(
    params: list[SamplingParams], seeds: list[int], steps: list[int], r: int, eos_id: int, histories: list | None = None
) -> SamplingBatch:
    histories = histories if histories is not None else [torch.empty(0, r, dtype=torch.int64)] * len(params)
    return make_sampling_batch(params, seeds, steps, histories, r, eos_id)


def test_make_sampling_batch_fields() -> None:
    p0 = SamplingParams(temperature=(0.1, 0.2, 0.3, 0.4), repetition_window=3, min_new_tokens=5, seed=7)
    p1 = SamplingParams(temperature=0.5, repetition_window=6, greedy=True)
    h0 = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    b = make_sampling_batch([p0, p1], [7, 9], [4, 5], [h0, []], 4, 625)
    assert b.temperature.flatten().tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4] + [0.5] * 4)
    assert b.history.shape == (2, 4, 6)
    assert b.history[0, 0].tolist() == [-1, -1, -1, 5, 9, 13]  # last 3 frames of codebook 0
    assert b.history[1].eq(-1).all()
    assert b.eos_banned.tolist() == [True, False] and b.greedy.tolist() == [False, True]
    assert b.steps.tolist() == [4, 5] and b.seeds.tolist() == [7, 9] and b.top_p.dtype == torch.float64
    text = make_sampling_batch([p0], [1], [0], [[3, 4]], 1, 982)
    assert text.temperature.flatten().tolist() == pytest.approx([0.1]) and text.history.shape == (1, 1, 3)


def test_greedy_is_argmax_of_processed_logits() -> None:
    b, r, v = 6, 4, 626
    logits = rand_logits(b, r, v, seed=5)
    # Histories that repeat each row's argmax (n times), so the penalty must move some argmaxes.
    hist = [logits[i].argmax(-1)[None].expand(i, r) for i in range(b)]
    params = [SamplingParams(greedy=True, repetition_penalty=1.5)] * b
    batch = make_batch(params, list(range(b)), [3] * b, r, 625, hist)
    x = process_logits(logits, batch)
    tokens = sample(logits, batch)
    assert torch.equal(tokens, x.argmax(-1))
    # The penalty changes some argmaxes (so the penalty is really applied before the argmax).
    assert not torch.equal(tokens, logits.argmax(-1))


def test_eos_ban_and_top_k1_acts_as_top3() -> None:
    r, v, eos = 4, 20, 19
    logits = torch.zeros(1, r, v)
    logits[..., eos] = 50.0  # EOS dominates
    logits[..., :3] = torch.tensor([5.0, 4.9, 4.8])
    n = 300
    params = [SamplingParams(temperature=1.0, top_k=1, top_p=1.0, min_new_tokens=10)] * n
    batch = make_batch(params, list(range(n)), [i % 20 for i in range(n)], r, eos)
    toks = sample(logits.expand(n, r, v).contiguous(), batch)
    banned = batch.eos_banned
    assert toks[~banned].eq(eos).all()
    # top_k=1 behaves as top-3 = {EOS, 0, 1}; the ban comes AFTER top-k, so banned rows draw from {0, 1}.
    assert set(toks[banned].flatten().tolist()) == {0, 1}
    # Without EOS in the way, top-3 = {0, 1, 2} and all three occur.
    logits[..., eos] = 0.0
    no_eos = sample(logits.expand(n, r, v).contiguous(), make_batch(params, list(range(n)), [0] * n, r, eos))
    assert set(no_eos.flatten().tolist()) == {0, 1, 2}


def test_seeded_sampling_is_batch_invariant() -> None:
    """The same request gives the same tokens in any batch position and next to any other requests."""
    r, v = 4, 626
    rng = random.Random(0)
    reqs = []
    for i in range(12):
        p = SamplingParams(
            temperature=rng.choice([0.3, 0.7, 1.5, (0.2, 0.5, 1.0, 2.0)]),
            top_p=rng.random(),
            top_k=rng.randint(1, 60),
            repetition_penalty=rng.choice([1.0, 1.05, 1.3]),
            min_new_tokens=rng.randint(0, 8),
            greedy=i % 5 == 4,
        )
        hist = torch.randint(0, v, (rng.randint(0, 20), r), generator=torch.Generator().manual_seed(i))
        logits = rand_logits(1, r, v, seed=100 + i)[0]
        reqs.append((p, rng.randrange(2**63), rng.randint(0, 30), hist, logits))

    def run(order: list[int]) -> dict[int, list]:
        batch = make_batch(
            [reqs[i][0] for i in order],
            [reqs[i][1] for i in order],
            [reqs[i][2] for i in order],
            r,
            625,
            [reqs[i][3] for i in order],
        )
        toks = sample(torch.stack([reqs[i][4] for i in order]), batch)
        return {i: toks[j].tolist() for j, i in enumerate(order)}

    full = run(list(range(12)))
    for _ in range(6):
        order = rng.sample(range(12), rng.randint(1, 12))
        got = run(order)
        assert all(got[i] == full[i] for i in order)
    # And the draws really depend on the seed and the step (not a constant stream).
    p, seed, step, hist, logits = reqs[0]
    p = p.replace(temperature=50.0, top_p=1.0, top_k=626, greedy=False)
    draws = {
        tuple(sample(logits[None], make_batch([p], [s], [st], r, 625, [hist]))[0].tolist())
        for s in (seed, seed + 1, seed + 2**40)
        for st in (step, step + 1)
    }
    assert len(draws) == 6


def test_hash_rng_matches_python_and_is_uniform() -> None:
    def py_mix32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & MASK32
        x ^= x >> 15
        x = (x * 0x846CA68B) & MASK32
        return x ^ (x >> 16)

    xs = [0, 1, 2, MASK32, MASK32 - 1, 0x80000000] + random.Random(3).sample(range(2**32), 500)
    assert mix32(torch.tensor(xs)).tolist() == [py_mix32(x) for x in xs]
    u = hash_uniform(torch.tensor([0, 1, 2**62 + 5]), torch.tensor([0, 7, 2**31]), 4, 5000)
    assert u.shape == (3, 4, 5000) and u.dtype == torch.float32
    assert u.min() > 0 and u.max() < 1
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max() < 0.005
    flat = u.reshape(12, 5000)
    corr = torch.corrcoef(flat)  # rows (request, codebook) are uncorrelated
    assert (corr - torch.eye(12)).abs().max() < 0.06
    assert abs(torch.corrcoef(torch.stack([flat[0, :-1], flat[0, 1:]]))[0, 1]) < 0.06  # neighbouring v


def test_sampled_frequencies_match_softmax() -> None:
    """One seeded request over many steps: empirical frequencies ~ softmax(logits / T) per codebook."""
    r, v, n = 4, 6, 6000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0]]).expand(r, v) * torch.tensor([[1.0], [0.5], [2.0], [0.1]])
    p = SamplingParams(temperature=(1.0, 0.5, 2.0, 1.0), top_p=1.0, top_k=v, repetition_penalty=1.0)
    batch = make_batch([p] * n, [1234] * n, list(range(n)), r, eos_id=v)  # steps 0..n-1 of one request
    toks = sample(logits.expand(n, r, v).contiguous(), batch)
    freq = torch.stack([torch.bincount(toks[:, q], minlength=v) for q in range(r)]).float() / n
    probs = (logits / batch.temperature[0][:, None]).softmax(-1)
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 4.5 * sigma + 1e-3).all(), (freq, probs)


@pytest.mark.gpu
def test_cuda_matches_cpu_and_never_syncs() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    r, v, b = 4, 626, 64
    seeds = torch.randint(0, 2**62, (b,), generator=torch.Generator().manual_seed(0))
    steps = torch.arange(b) * 37
    u_cpu = hash_uniform(seeds, steps, r, v)
    u_gpu = hash_uniform(seeds.cuda(), steps.cuda(), r, v)
    assert torch.equal(u_gpu.cpu(), u_cpu)  # integer math: identical bits
    params = [
        SamplingParams(top_k=40, top_p=0.9, temperature=0.8, repetition_penalty=1.1, greedy=i % 7 == 0)
        for i in range(b)
    ]
    hist = [torch.randint(0, v, (i % 20, r)) for i in range(b)]
    batch = make_sampling_batch(params, seeds.tolist(), steps.tolist(), hist, r, 625, device="cuda")
    logits = rand_logits(b, r, v).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        toks = sample(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu_batch = make_sampling_batch(params, seeds.tolist(), steps.tolist(), hist, r, 625)
    agree = (toks.cpu() == sample(logits.cpu(), cpu_batch)).float().mean()
    assert agree > 0.99  # float log/softmax may differ by an ulp across devices; draws are the same
