"""Host-to-device copies that never wait for queued device work.

A blocking host-to-device copy synchronises the stream, and the pipelined engine always has a step queued, so
every small host array a step sends (positions, slot mappings, row indices, frame-pool write indices) goes
asynchronously from pinned memory. `t.pin_memory()` per array did that at ~20-30 us of host time each (an
allocation from torch's pinned pool, an event recorded when it returns there; a dozen arrays a step, r11 /
r27 profiles). Here the bytes go into one pinned ring per process instead, and the copy is queued from it:
a numpy memcpy and one copy launch.

The ring is split into quarters. Leaving a quarter records an event on the current stream after the copies
that read it; a quarter is written again only once that event has passed, three quarters of traffic later
(an event query: the engine has waited for several steps since). Copies are queued on the current stream
only, the engine's one stream; under CUDA-graph capture (a captured copy would read the ring forever) and
for arrays larger than a quarter the per-array pinned copy is used.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

RING_BYTES = 8 << 20  # a served step sends ~0.1 MB: a quarter lasts ~20 steps
_ALIGN = 64


class PinnedRing:
    """A pinned host ring buffer of `nbytes`, filled round-robin; see the module docstring."""

    def __init__(self, nbytes: int = RING_BYTES, num_parts: int = 4, pin: bool = True) -> None:
        self.part = nbytes // num_parts // _ALIGN * _ALIGN
        self.buf = torch.empty(self.part * num_parts, dtype=torch.uint8, pin_memory=pin)
        self.bytes = self.buf.numpy()
        self.num_parts, self.current, self.pos = num_parts, 0, 0  # the part being filled, bytes used in it
        self.events: list[torch.cuda.Event | None] = [None] * num_parts  # recorded on leaving part i
        self.waits = 0  # reuses that had to wait for the device (should stay 0)
        self._lock = threading.Lock()

    def copy(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """t (host, contiguous or not) as a new tensor on `device`, copied asynchronously via the ring."""
        host = t.numpy() if t.dtype != torch.bfloat16 else None
        if host is None or t.nbytes > self.part or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return t.pin_memory().to(device, non_blocking=True)
        n = t.nbytes
        with self._lock:
            start = self._reserve(n)
            staged = self.bytes[start:start + n]
            staged.view(host.dtype).reshape(host.shape)[...] = host
            return self.buf[start:start + n].view(t.dtype).view(t.shape).to(device, non_blocking=True)

    def _reserve(self, n: int) -> int:
        """The ring offset of n free bytes, moving to the next part (waiting for its last copies) if needed."""
        size = -(-n // _ALIGN) * _ALIGN
        if self.pos + size > self.part:
            self.events[self.current] = self._record()  # after every copy queued from this part
            self.current = (self.current + 1) % self.num_parts
            event, self.events[self.current] = self.events[self.current], None
            if event is not None and not event.query():
                self.waits += 1
                event.synchronize()
            self.pos = 0
        start = self.current * self.part + self.pos
        self.pos += size
        return start

    def _record(self):
        event = torch.cuda.Event()
        event.record()
        return event


_RING: PinnedRing | None = None


def async_h2d(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> `device` without waiting for queued device work (on CUDA through the pinned ring;
    CPU: as is)."""
    if device.type != "cuda":
        return t
    global _RING
    if _RING is None:
        _RING = PinnedRing()
    return _RING.copy(t, device)


def to_device(values, device: torch.device) -> torch.Tensor:
    """int64 tensor of a numpy array or (nested) list on `device`, asynchronously as async_h2d."""
    t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=torch.int64)
    return async_h2d(t, device)
