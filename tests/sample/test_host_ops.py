"""The sampler's numpy CPU kernels (sample/host_ops.py) equal their torch forms bit for bit."""

from __future__ import annotations

import pytest
import torch

from ttsserve.sample.host_ops import hash_uniform_host, stable_sort_last
from ttsserve.sample.rng import hash_uniform


@pytest.mark.parametrize("b", [1, 3, 16])
def test_stable_sort_last_equals_torch_stable_sort(b: int) -> None:
    g = torch.Generator().manual_seed(b)
    x = torch.randn(b, 4, 626, generator=g) * 3
    x[..., ::5] = torch.round(x[..., ::5])  # many ties: their index order must survive
    x[..., 7], x[..., 8], x[..., 9], x[..., 10] = float("-inf"), float("inf"), -0.0, 0.0
    x[..., 11] = -0.0  # -0.0 ties with +0.0 in torch's order
    x[0, 0, 20], x[0, 0, 3] = float("nan"), -float("nan")  # NaNs last, in index order
    values, idx = torch.sort(x, dim=-1, stable=True)
    got_values, got_idx = stable_sort_last(x)
    assert got_idx.dtype == torch.int64
    assert torch.equal(got_idx, idx)
    assert torch.equal(got_values.view(torch.int32), values.view(torch.int32))


def test_stable_sort_last_of_a_non_contiguous_view() -> None:
    x = torch.randn(6, 30).t()
    assert torch.equal(stable_sort_last(x)[1], torch.sort(x, dim=-1, stable=True)[1])


@pytest.mark.parametrize("rows,vocab", [(4, 626), (1, 1024)])
def test_hash_uniform_host_equals_torch(rows: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 2**63 - 1, (9,), generator=g)
    steps = torch.randint(0, 2**40, (9,), generator=g)
    seeds[0], steps[0] = 0, 0
    seeds[1] = 2**63 - 1
    assert torch.equal(hash_uniform_host(seeds, steps, rows, vocab), hash_uniform(seeds, steps, rows, vocab))
