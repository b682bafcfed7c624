"""Host-to-device copies that never wait for queued device work.

A blocking host-to-device copy synchronises the stream, and the pipelined engine always has a step queued, so
every small host array a step sends (positions, slot mappings, row indices, frame-pool write indices) goes
through pinned memory (pooled by torch) and is copied asynchronously.

A persistent pinned ring in place of `pin_memory()` per array does not pay: its per-copy host cost in the
served core's profile was no lower (8.8% of samples against 7.6% for the two functions here), since torch's
per-op overhead, not the pinned allocation, is most of it; fewer copies per step is what would cut it.
"""

from __future__ import annotations

import numpy as np
import torch


def async_h2d(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> `device` without waiting for queued device work. CPU: as is."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_device(values, device: torch.device) -> torch.Tensor:
    """int64 tensor of a numpy array or (nested) list on `device`, asynchronously as async_h2d."""
    t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=torch.int64)
    return async_h2d(t, device)
