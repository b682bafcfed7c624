"""The prefill kernel's tile table (attention/prefill_tiles.py): every query block of every sequence listed once,
in order, the rest unused, and the capacity bound the full prefill graphs size their tables by."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ttsserve.attention.prefill_tiles import max_prefill_tiles, prefill_block_m, prefill_tiles


@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.sampled_from([16, 32, 64]), st.integers(0, 5))
def test_tiles_cover_each_query_block_once(num_new: list[int], block_m: int, spare: int) -> None:
    new = np.array(num_new)
    capacity = max_prefill_tiles(int(new.sum()), len(new), block_m)
    tiles = prefill_tiles(new, block_m, capacity + spare)
    assert tiles.dtype == np.int32 and tiles.shape == (capacity + spare, 2)
    used = tiles[tiles[:, 0] >= 0]
    want = [(s, m) for s, q in enumerate(num_new) for m in range(-(-q // block_m))]
    assert [tuple(t) for t in used.tolist()] == want
    assert (tiles[len(used) :] == -1).all()


def test_capacity_bound_is_reached() -> None:
    """One token short of a tile boundary per sequence: the bound's seqs term is needed."""
    new = np.array([17] * 8)  # 2 tiles of 16 each: 16 tiles for 136 tokens
    assert max_prefill_tiles(136, 8, 16) == 17 and (prefill_tiles(new, 16, 17)[:16] >= 0).all()
    with pytest.raises(ValueError, match="16 query tiles do not fit a table of 15"):
        prefill_tiles(new, 16, 15)


def test_block_m_follows_the_longest_query() -> None:
    assert [prefill_block_m(n) for n in (1, 16, 17, 32, 33, 4096)] == [16, 16, 32, 32, 64, 64]
