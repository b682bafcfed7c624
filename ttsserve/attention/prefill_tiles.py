"""The prefill kernel's query tiles as a table, for a launch whose grid cannot follow the step (a CUDA graph).

Launched eagerly, the prefill kernel's grid is (sequences, heads, cdiv(longest query, BLOCK_M)) and a program past
its sequence's queries exits. Captured in a graph, the grid is frozen for every step the graph serves, so the work
is listed instead: tile i is (sequence, query block) and the grid runs over a fixed number of tiles, the unused
ones (-1, -1) exiting at once. Pure numpy: built on the host each step, copied with the step's other metadata.
"""

from __future__ import annotations

import numpy as np


def prefill_block_m(max_query_len: int) -> int:
    """The prefill kernel's query tile for a launch whose longest query is max_query_len: a small BLOCK_M wastes
    less on decode rows and short chunks in mixed batches."""
    return 16 if max_query_len <= 16 else (32 if max_query_len <= 32 else 64)


def max_prefill_tiles(num_tokens: int, max_seqs: int, block_m: int) -> int:
    """Tiles that any step of at most num_tokens new queries over at most max_seqs sequences needs: a sequence of q
    queries takes cdiv(q, block_m) <= q / block_m + 1 tiles, so the sum is below num_tokens / block_m + seqs."""
    return -(-num_tokens // block_m) + min(max_seqs, num_tokens)


def prefill_tiles(num_new: np.ndarray, block_m: int, capacity: int) -> np.ndarray:
    """num_new [B] queries per sequence (each >= 1) -> int32 [capacity, 2]: (sequence, query block) per tile,
    sequence by sequence, then (-1, -1) to capacity. Raises ValueError if the tiles do not fit."""
    per_seq = -(-num_new.astype(np.int64) // block_m)
    total = int(per_seq.sum())
    if total > capacity:
        raise ValueError(f"{total} query tiles do not fit a table of {capacity}")
    tiles = np.full((capacity, 2), -1, dtype=np.int32)
    seq = np.repeat(np.arange(len(per_seq), dtype=np.int32), per_seq)
    first = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    tiles[:total, 0] = seq
    tiles[:total, 1] = np.arange(total) - first
    return tiles
