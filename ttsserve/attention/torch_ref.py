"""TorchPagedAttention: the CPU reference (and test oracle) of the paged attention backend.

Gathers each sequence's pages through its block table and runs torch SDPA. Decode-only batches are done as
one padded SDPA with a length mask; batches with prefill chunks loop over sequences (simple beats fast here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttsserve.attention.backend import AttentionMetadata
from ttsserve.attention.dense import causal_sdpa


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k / v ([T, Hkv, D]) at flat slots (block_id * block_size + offset); slots < 0 are padding
    tokens and are not stored. kv_cache: [2, num_blocks, block_size, Hkv, D], written in place."""
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    slots = slot_mapping.long()
    if bool((slots < 0).any()):  # a host sync; acceptable in the reference backend
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's context: block_table [num_blocks_of_seq] -> k, v: [ctx_len, Hkv, D]."""
    block_size = kv_cache.shape[2]
    nb = -(-ctx_len // block_size)
    pages = kv_cache[:, block_table[:nb].long()]  # [2, nb, block_size, Hkv, D]
    pages = pages.reshape(2, nb * block_size, *kv_cache.shape[3:])[:, :ctx_len]
    return pages[0], pages[1]


class TorchPagedAttention:
    """PagedAttentionBackend in plain torch (see attention/backend.py for the contract)."""

    name = "torch_ref"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D].

        Writes k / v at md.slot_mapping, then for each sequence attends its new queries (the LAST q_len
        positions of its context of md.seq_lens tokens) causally over that context. Returns [T, Hq, D].
        """
        write_kv(kv_cache, k, v, md.slot_mapping)
        if md.is_decode_only and q.shape[0] == md.num_seqs:
            return self._decode(q, kv_cache, md, scale)
        out = torch.empty_like(q)
        cu = md.cu_seqlens_q_cpu
        for b, ctx_len in enumerate(md.seq_lens_cpu):
            s, e = cu[b], cu[b + 1]
            if e == s:
                continue
            kb, vb = gather_kv(kv_cache, md.block_tables[b], ctx_len)
            out[s:e] = causal_sdpa(q[s:e], kb.to(q.dtype), vb.to(q.dtype), scale)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float) -> torch.Tensor:
        """One new token per sequence: a single padded SDPA over [B, max_seq_len] keys with a length mask."""
        b, hq, d = q.shape
        block_size, hkv = kv_cache.shape[2], kv_cache.shape[3]
        nb = -(-md.max_seq_len // block_size)
        pages = kv_cache[:, md.block_tables[:, :nb].long()]  # [2, B, nb, block_size, Hkv, D]
        kv = pages.reshape(2, b, nb * block_size, hkv, d)[:, :, :md.max_seq_len].to(q.dtype)
        keys, values = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [B, Hkv, L, D]
        if hq != hkv:
            keys = keys.repeat_interleave(hq // hkv, dim=1)
            values = values.repeat_interleave(hq // hkv, dim=1)
        pos = torch.arange(md.max_seq_len, device=q.device)
        mask = (pos[None, :] < md.seq_lens.to(q.device).long()[:, None])[:, None, None, :]  # [B, 1, 1, L]
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask, scale=scale)
        return out[:, :, 0, :]


def make_metadata(block_tables: list[list[int]], num_computed_tokens: list[int], num_new_tokens: list[int],
                  block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    """AttentionMetadata for one step from host lists (tests and simple callers).

    block_tables[i]: physical block ids of sequence i (enough for num_computed + num_new tokens);
    sequence i's new tokens sit at positions num_computed_tokens[i] .. + num_new_tokens[i] - 1.
    """
    seq_lens = [c + n for c, n in zip(num_computed_tokens, num_new_tokens)]
    for i, (bt, n) in enumerate(zip(block_tables, seq_lens)):
        if len(bt) * block_size < n:
            raise ValueError(f"sequence {i}: {len(bt)} blocks of {block_size} cannot hold {n} tokens")
    cu = [0]
    slots: list[int] = []
    for bt, c, n in zip(block_tables, num_computed_tokens, num_new_tokens):
        cu.append(cu[-1] + n)
        slots += [bt[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
    width = max((len(bt) for bt in block_tables), default=0)
    table = [bt + [0] * (width - len(bt)) for bt in block_tables]
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(table, dtype=torch.int32, device=device).reshape(len(table), width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(num_new_tokens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_size=block_size,
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=seq_lens,
    )
