"""The batched sampler (MODEL.md §4.2-4.3): one call per step for all requests, no device-to-host sync.

Order: / temperature -> repetition penalty -> top-p -> top-k -> EOS ban while num_generated < min_new_tokens
-> sample. Greedy rows take the argmax of the processed logits. Seeded rows sample by the exponential race
argmax(probs / -log(u)) with u from a counter-based hash of (seed, step, row, vocab index) (sample/rng.py):
the same distribution as multinomial(probs), and the same token for a request whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ttsserve.params import SamplingParams
from ttsserve.sample.host_ops import hash_uniform_host
from ttsserve.sample.penalties import apply_repetition_penalty, apply_top_p_top_k, ban_token
from ttsserve.sample.rng import hash_uniform


@dataclass
class SamplingBatch:
    """Per-request sampling state of one step, all tensors on the logits' device (B requests, R rows)."""

    temperature: torch.Tensor  # [B, R] fp32, per request per codebook row
    top_p: torch.Tensor  # [B] float64 (exact HF thresholds; fp32 also accepted)
    top_k: torch.Tensor  # [B] int64, raw k (k_eff = min(max(k, 3), V) inside)
    repetition_penalty: torch.Tensor  # [B] fp32, 1.0 = off
    history: torch.Tensor  # [B, R, W] int64, last <= W generated tokens per row, -1 where absent
    eos_banned: torch.Tensor  # [B] bool, num_generated < min_new_tokens
    greedy: torch.Tensor  # [B] bool
    seeds: torch.Tensor  # [B] int64 in [0, 2**63)
    steps: torch.Tensor  # [B] int64, index of the token being sampled (= number generated so far)
    eos_id: int


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """All processors of MODEL.md §4.3 in order. logits: [B, R, V] fp32 -> [B, R, V] fp32 (-inf = removed)."""
    x = logits.float() / batch.temperature[:, :, None]
    x = apply_repetition_penalty(x, batch.history, batch.repetition_penalty)
    x = apply_top_p_top_k(x, batch.top_p, batch.top_k)
    return ban_token(x, batch.eos_id, batch.eos_banned)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits: [B, R, V] -> tokens [B, R] int64 (one per request and codebook row, rows independent)."""
    b, r, v = logits.shape
    x = process_logits(logits, batch)
    probs = x.softmax(dim=-1)
    u = (hash_uniform_host if logits.device.type == "cpu" else hash_uniform)(batch.seeds, batch.steps, r, v)
    sampled = (probs / -torch.log(u)).argmax(dim=-1)
    if x.device.type == "cpu" and not bool(batch.greedy.any()):  # a host read is free on the CPU
        return sampled
    return torch.where(batch.greedy[:, None], x.argmax(dim=-1), sampled)


def make_sampling_batch(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    num_generated: Sequence[int],
    histories: Sequence[torch.Tensor | Sequence],
    num_rows: int,
    eos_id: int,
    device: torch.device | str = "cpu",
) -> SamplingBatch:
    """Build a SamplingBatch from Python-side request state (a convenience; loops over requests).

    histories[i]: request i's generated tokens so far, oldest first: [n, num_rows] (code frames) or [n]
    (text, num_rows = 1); only the last params[i].repetition_window are used. seeds[i] must be an int
    (draw one for unseeded requests at admission so recompute gives the same tokens).
    """
    n = len(params)
    if not (len(seeds) == len(num_generated) == len(histories) == n):
        raise ValueError("params, seeds, num_generated and histories must have the same length")
    window = max((p.repetition_window for p in params), default=1)
    hist = torch.full((n, num_rows, window), -1, dtype=torch.int64)
    for i, (p, h) in enumerate(zip(params, histories)):
        h = torch.as_tensor(h, dtype=torch.int64).reshape(-1, num_rows)[-p.repetition_window :]
        if h.shape[0]:
            hist[i, :, window - h.shape[0] :] = h.T
    return SamplingBatch(
        temperature=torch.tensor(
            [p.temperatures(num_rows) for p in params], dtype=torch.float32, device=device
        ).reshape(n, num_rows),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        repetition_penalty=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device),
        history=hist.to(device),
        eos_banned=torch.tensor(
            [g < p.min_new_tokens for p, g in zip(params, num_generated)], dtype=torch.bool, device=device
        ),
        greedy=torch.tensor([p.greedy for p in params], dtype=torch.bool, device=device),
        seeds=torch.tensor(list(seeds), dtype=torch.int64, device=device),
        steps=torch.tensor(list(num_generated), dtype=torch.int64, device=device),
        eos_id=eos_id,
    )


def sample_and_record(sample_fn, logits: torch.Tensor, state, rows: torch.Tensor, steps: torch.Tensor, eos_id: int):
    """sample_fn(logits [B, R, V], the SamplingBatch of a SamplingState's `rows` at `steps`), recorded in the
    state's histories: tokens [B, R] int64. Graph-capturable (pure indexing)."""
    tokens = sample_fn(logits, state.batch(rows, steps, logits.shape[1], eos_id))
    state.record(rows, steps, tokens)
    return tokens
