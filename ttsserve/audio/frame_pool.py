"""The audio stage's frame store: every streaming request's frames in one device tensor (audio/stage.py)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ttsserve.h2d import to_device


class FramePool:
    """Frames of every request in one device tensor [num_slots, capacity, width], one slot per request.

    Like a KV cache: appends of many requests are one indexed write, windows are one gather.
    """

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device, capacity: int) -> None:
        # zeros, not empty: positions past a row's length are read (then masked), and NaN * 0 is NaN
        self.data = torch.zeros(4, capacity, width, dtype=dtype, device=device)
        self.free = list(range(3, -1, -1))

    @property
    def capacity(self) -> int:
        return self.data.shape[1]

    def allocate(self) -> int:
        if not self.free:
            n = self.data.shape[0]
            self.data = torch.cat([self.data, torch.zeros_like(self.data)])
            self.free = list(range(2 * n - 1, n - 1, -1))
        return self.free.pop()

    def grow(self, capacity: int) -> None:
        s, c, w = self.data.shape
        extra = torch.zeros(s, capacity - c, w, dtype=self.data.dtype, device=self.data.device)
        self.data = torch.cat([self.data, extra], dim=1)

    def put(self, slots: np.ndarray, positions: np.ndarray, frames: Tensor, src: np.ndarray | None = None) -> None:
        """data[slots[i], positions[i]] = frames[i] for every i (pairs distinct, positions < capacity): one
        pinned copy of the flat row index and one index_copy_ (two index tensors cost an index_put_ more).
        src: the rows of frames to write instead (frames[src[i]] goes to pair i), gathered by one index_select;
        its indices travel in the same copy."""
        dev, (_, cap, width) = self.data.device, self.data.shape
        dst = slots * cap + positions
        if src is not None:
            assert len(slots) == len(positions) == len(src), "one (slot, position) per source row"
            flat = to_device(np.concatenate([dst, src]), dev)
            dst_t, src_t = flat[: len(dst)], flat[len(dst) :]
            frames = frames.to(device=dev).index_select(0, src_t)
        else:
            assert len(slots) == len(positions) == frames.shape[0], "one (slot, position) per frame"
            dst_t = to_device(dst, dev)
        self.data.view(-1, width).index_copy_(0, dst_t, frames.to(device=dev, dtype=self.data.dtype))

    def shift(self, slot: int, src: int, count: int) -> None:
        """Move positions [src, src + count) of a slot to [0, count)."""
        self.data[slot, :count] = self.data[slot, src : src + count].clone()

    def shift_many(self, slots: list[int], srcs: list[int], counts: list[int]) -> None:
        """shift() of several slots (distinct) in one gather and one write, with one index copy: positions
        [srcs[i], srcs[i] + counts[i]) of slots[i] to [0, counts[i])."""
        counts_np = np.asarray(counts, dtype=np.int64)
        n = int(counts_np.sum())
        if not n:
            return
        dev, (_, cap, width) = self.data.device, self.data.shape
        k = np.arange(n) - np.repeat(np.cumsum(counts_np) - counts_np, counts_np)  # position in its slot's run
        dst = np.repeat(np.asarray(slots, dtype=np.int64) * cap, counts_np) + k
        src = dst + np.repeat(np.asarray(srcs, dtype=np.int64), counts_np)
        flat = to_device(np.concatenate([dst, src]), dev)
        rows = self.data.view(-1, width)
        rows.index_copy_(0, flat[:n], rows.index_select(0, flat[n:]))

    def gather(self, slots: list[int], starts: list[int], lengths: list[int]) -> Tensor:
        """-> [B, max(lengths), width]; row b holds positions starts[b].. of slot b, zero past lengths[b]."""
        dev = self.data.device
        n = max(lengths)
        info = to_device([slots, starts, lengths], dev)
        pos = info[1][:, None] + torch.arange(n, device=dev)[None, :]
        valid = torch.arange(n, device=dev)[None, :] < info[2][:, None]
        rows = self.data[info[0][:, None], pos.clamp(max=self.capacity - 1)]
        return torch.where(valid[..., None], rows, torch.zeros_like(rows))
