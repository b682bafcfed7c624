"""Logit processors of MODEL.md §4.3, vectorised over [B, R, V] with per-request parameters.

Rows: B requests x R codebook rows (R = num_vq in code mode, 1 in text mode). Every function returns a new
tensor (inputs are not modified) and does no device-to-host sync.
"""

from __future__ import annotations

import torch

from ttsserve.sample.host_ops import stable_sort_last

MIN_TOKENS_TO_KEEP = 3  # both warpers of the reference keep at least 3 tokens (top_k=1 acts as top-3)


def stable_sort(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.sort(logits, dim=-1, stable=True); on the CPU (fp32) the same values and indices by numpy's sort
    of integer keys (sample/host_ops.py), ~10x faster."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return stable_sort_last(logits)
    return torch.sort(logits, dim=-1, stable=True)


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Frequency penalty: alpha = penalty ** count, negative logits * alpha, positive / alpha.

    logits: [B, R, V] fp32; history: [B, R, W] int64, the last W generated tokens of each row (-1 = absent);
    penalty: [B] fp32. A penalty of 1 gives alpha = 1 exactly (a no-op).
    """
    counts = torch.zeros_like(logits)
    present = (history >= 0).to(logits.dtype)
    counts.scatter_add_(-1, history.clamp(min=0), present)
    alpha = torch.pow(penalty.to(logits.dtype)[:, None, None], counts)
    return torch.where(logits < 0, logits * alpha, logits / alpha)


def _top_p_remove_sorted(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF TopPLogitsWarper on ascending-sorted logits -> bool [B, R, V] (True = remove)."""
    # 1 - p in float64 then fp32, as HF compares an fp32 cumsum against the Python float (1 - p).
    threshold = (1.0 - top_p.double()).to(sorted_logits.dtype)[:, None, None]
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= threshold
    remove[..., -MIN_TOKENS_TO_KEEP:] = False
    return remove


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF top-p with min_tokens_to_keep=3. logits: [B, R, V]; top_p: [B] in (0, 1] (float64 for exact
    HF thresholds)."""
    sorted_logits, sorted_idx = stable_sort(logits)
    remove_sorted = _top_p_remove_sorted(sorted_logits, top_p)
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def _effective_k(top_k: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return top_k.long().clamp(min=MIN_TOKENS_TO_KEEP).clamp(max=vocab_size)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """HF top-k with k_eff = min(max(k, 3), V): remove logits below the k_eff-th largest (ties kept).
    logits: [B, R, V]; top_k: [B] int64."""
    b, r, v = logits.shape
    desc = torch.sort(logits, dim=-1, descending=True).values
    idx = (_effective_k(top_k, v) - 1)[:, None, None].expand(b, r, 1)
    kth = desc.gather(-1, idx)
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p_top_k(logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """apply_top_k(apply_top_p(logits, top_p), top_k) with one sort.

    Top-p removes a prefix of the ascending order, so after it the order is unchanged and the k-th largest
    remaining value is sorted[V - k_eff], or -inf if top-p removed that position.
    """
    b, r, v = logits.shape
    sorted_logits, sorted_idx = stable_sort(logits)
    remove_sorted = _top_p_remove_sorted(sorted_logits, top_p)
    idx = (v - _effective_k(top_k, v))[:, None, None].expand(b, r, 1)
    kth = torch.where(remove_sorted.gather(-1, idx), float("-inf"), sorted_logits.gather(-1, idx))
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted) | (logits < kth)
    return logits.masked_fill(remove, float("-inf"))


def ban_token(logits: torch.Tensor, token_id: int, banned: torch.Tensor) -> torch.Tensor:
    """Set logits[b, :, token_id] = -inf where banned[b]. logits: [B, R, V]; banned: [B] bool."""
    is_tok = torch.arange(logits.shape[-1], device=logits.device) == token_id
    return logits.masked_fill(banned[:, None, None] & is_tok[None, None, :], float("-inf"))
