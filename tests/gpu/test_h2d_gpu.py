"""The pinned staging ring (ttsserve/h2d.py) on CUDA: copies queued behind a busy stream, wrapping the ring
many times, all arrive intact; the host sources can change at once; nothing waits while the device is busy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ttsserve.h2d import PinnedRing

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def test_copies_behind_a_busy_stream_arrive_intact_across_wraps() -> None:
    dev = torch.device("cuda")
    ring = PinnedRing(nbytes=1 << 20)  # small: 3,000 copies of up to 4 KB wrap it ~6 times
    rng = np.random.default_rng(0)
    torch.cuda._sleep(400_000_000)  # ~0.2 s of queued device work: the copies wait behind it on the stream
    sent, got = [], []
    for i in range(3000):
        dtype = (np.int64, np.int32, np.float32)[i % 3]
        host = rng.integers(-1000, 1000, size=int(rng.integers(1, 1024 // np.dtype(dtype).itemsize))).astype(dtype)
        t = torch.from_numpy(host)
        got.append(ring.copy(t, dev))
        sent.append(host.copy())
        host[...] = 0  # the ring staged the bytes: the source is free at once
    torch.cuda.synchronize()
    assert all(np.array_equal(g.cpu().numpy(), s) for g, s in zip(got, sent))
    assert ring.waits > 0  # the ring did wrap onto copies still queued behind the matmuls, and waited


def test_noncontiguous_and_large_tensors() -> None:
    dev = torch.device("cuda")
    ring = PinnedRing(nbytes=1 << 16)
    t = torch.arange(600, dtype=torch.int64).reshape(20, 30).t()
    assert torch.equal(ring.copy(t, dev).cpu(), t)
    big = torch.arange(1 << 14, dtype=torch.float64)  # larger than a part: the per-array pinned path
    assert torch.equal(ring.copy(big, dev).cpu(), big)
