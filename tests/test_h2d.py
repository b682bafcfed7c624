"""The pinned staging ring of host-to-device copies (ttsserve/h2d.py): where bytes go and when a part of the
ring may be written again. Device copies are the GPU tests' (tests/gpu/test_h2d_gpu.py)."""

from __future__ import annotations

import numpy as np
import torch

from ttsserve.h2d import PinnedRing, async_h2d, to_device


class _Copies:
    """The copies queued from one part of the ring, as an event the test completes."""

    def __init__(self) -> None:
        self.done, self.waited = False, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = self.waited = True


class _TestRing(PinnedRing):
    def __init__(self) -> None:
        super().__init__(nbytes=4096, num_parts=4, pin=False)
        self.recorded: list[_Copies] = []

    def _record(self) -> _Copies:
        self.recorded.append(_Copies())
        return self.recorded[-1]


def test_reserve_fills_parts_in_turn_and_waits_only_for_copies_still_running() -> None:
    ring = _TestRing()  # 4 parts of 1024 bytes; 300 bytes take 320 (64-byte aligned): 3 to a part
    starts = [ring._reserve(300) for _ in range(12)]
    assert starts[:4] == [0, 320, 640, 1024] and starts[6] == 2048 and starts[9:] == [3072, 3392, 3712]
    assert len(ring.recorded) == 3 and ring.waits == 0  # parts 0-2 left, after their copies; none reused yet
    ring.recorded[0].done = True  # part 0's copies ran: reusing it costs a query
    assert [ring._reserve(300) for _ in range(3)] == [0, 320, 640]
    assert ring.waits == 0 and not ring.recorded[0].waited and len(ring.recorded) == 4
    assert ring._reserve(300) == 1024  # part 1's copies are still queued: wait for them first
    assert ring.waits == 1 and ring.recorded[1].waited


def test_a_copy_stages_the_bytes_and_keeps_shape_and_dtype() -> None:
    ring = _TestRing()
    a = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()  # not contiguous
    got = ring.copy(a, torch.device("cpu"))
    assert got.dtype == a.dtype and got.shape == a.shape and torch.equal(got, a)
    b = ring.copy(torch.tensor([1.5, -2.0], dtype=torch.float64), torch.device("cpu"))
    assert b.tolist() == [1.5, -2.0] and torch.equal(got, a)  # the earlier bytes stay where they were


def test_cpu_targets_take_the_host_tensor_as_is() -> None:
    t = torch.arange(5)
    assert async_h2d(t, torch.device("cpu")) is t
    assert to_device(np.arange(3), torch.device("cpu")).tolist() == [0, 1, 2]
    assert to_device([[1, 2], [3, 4]], torch.device("cpu")).dtype == torch.int64


def test_a_part_filled_exactly_is_still_left_through_its_event() -> None:
    ring = _TestRing()
    assert [ring._reserve(1024) for _ in range(5)] == [0, 1024, 2048, 3072, 0]
    assert len(ring.recorded) == 4 and ring.waits == 1  # part 0 reused while its copies were "queued"
