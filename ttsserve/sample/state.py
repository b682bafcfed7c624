"""Per-row sampling state kept on the device across steps (MODEL.md §9.2): parameters, the repetition history as a
ring buffer and the last sampled row, so a step builds its SamplingBatch by indexing, never from Python lists.

A "row" is a slot of the runner's persistent batch (runner/input_batch.py); one extra scratch row (index
`num_rows`) absorbs the writes of padding rows in CUDA-graph batches. Everything here is graph-capturable:
`batch()` and `record()` are pure indexing with device index tensors and do no device-to-host sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ttsserve.h2d import async_h2d
from ttsserve.params import SamplingParams
from ttsserve.sample.sampler import SamplingBatch

# Columns of the float64 / int64 parameter tables.
_TOP_P, _PENALTY, _TEMPERATURE = 0, 1, 2  # fparams[:, :2]; temperatures in fparams[:, 2:2 + num_vq]
_TOP_K, _GREEDY, _SEED, _MIN_NEW, _WINDOW = range(5)


class SamplingState:
    """Device tables for `num_rows` rows (+1 scratch row), `num_vq` codebook rows each, a history of `window`.

    fparams: float64 [N + 1, 2 + num_vq]  (top_p, repetition_penalty, temperature per codebook)
    iparams: int64   [N + 1, 5]           (top_k, greedy, seed, min_new_tokens, repetition_window)
    ring:    int64   [N + 1, num_vq, W]   generated token g of a row sits at column g % window; -1 = empty
    last_tokens: int64 [N + 1, num_vq]    the row's last sampled frame (text rows: column 0), the next input
    """

    def __init__(self, num_rows: int, num_vq: int, window: int, device: torch.device) -> None:
        self.num_vq, self.device = num_vq, torch.device(device)
        n = num_rows + 1
        self.fparams = torch.ones(n, 2 + num_vq, dtype=torch.float64, device=device)
        self.iparams = torch.zeros(n, 5, dtype=torch.int64, device=device)
        self.iparams[:, _TOP_K] = 3
        self.iparams[:, _WINDOW] = 1
        self.ring = torch.full((n, num_vq, window), -1, dtype=torch.int64, device=device)
        self.last_tokens = torch.zeros(n, num_vq, dtype=torch.int64, device=device)
        self._rcols = torch.arange(num_vq, device=device)

    @property
    def num_rows(self) -> int:
        return self.ring.shape[0] - 1

    @property
    def scratch_row(self) -> int:
        return self.ring.shape[0] - 1

    @property
    def window(self) -> int:
        return self.ring.shape[2]

    def grow(self, num_rows: int | None = None, window: int | None = None) -> None:
        """Reallocate for more rows and / or a wider history (invalidates captured graphs; rare)."""
        n_old, w_old = self.num_rows, self.window
        n, w = max(num_rows or 0, n_old), max(window or 0, w_old)
        old = (self.fparams, self.iparams, self.ring, self.last_tokens)
        self.__init__(n, self.num_vq, w, self.device)
        self.fparams[:n_old] = old[0][:n_old]
        self.iparams[:n_old] = old[1][:n_old]
        self.ring[:n_old, :, :w_old] = old[2][:n_old]
        self.last_tokens[:n_old] = old[3][:n_old]

    # ---- host side: set up rows (once per admission / resume, batched) ------------------------------------
    def set_rows(
        self,
        rows: Sequence[int],
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        modes: Sequence[str],
        outputs: Sequence[Sequence],
    ) -> None:
        """Initialise rows for requests entering the running batch.

        outputs[i]: request i's generated items so far (4-tuples for code, ints for text); the ring gets the
        last `repetition_window` of them and last_tokens the final one.

        Built in numpy by columns (one Python pass per row only for rows with outputs: a resumed request), sent
        in two copies (the float64 table; the row indices, int64 table, ring and last rows back to back)."""
        n = len(rows)
        if not n:
            return
        q, w = self.num_vq, self.window
        fp = np.empty((n, 2 + q), dtype=np.float64)
        # fp32 first: the temperature of the batch is fp32 (exactly what torch.tensor(float32) rounds to). A text
        # row reads column 2 only; temperatures(q)[0] equals its temperatures(1)[0].
        fp[:, _TEMPERATURE:] = np.array([p.temperatures(q) for p in params], dtype=np.float32)
        fp[:, _TOP_P] = [p.top_p for p in params]
        fp[:, _PENALTY] = np.array([p.repetition_penalty for p in params], dtype=np.float32)
        # int64 back to back, each part contiguous: row index [n] | iparams [n, 5] | ring [n, q, w] | last [n, q]
        sizes = [n, n * 5, n * q * w, n * q]
        ints = np.empty(sum(sizes), dtype=np.int64)
        idx, ip, ring, last = np.split(ints, np.cumsum(sizes[:-1]))
        idx[:] = rows
        ip.reshape(n, 5)[:] = [
            (p.top_k, int(p.greedy), s, p.min_new_tokens, p.repetition_window) for p, s in zip(params, seeds)
        ]
        ring[:], last[:] = -1, 0
        ring, last = ring.reshape(n, q, w), last.reshape(n, q)
        for i in [i for i, outs in enumerate(outputs) if len(outs)]:
            self._history_row(ring[i], last[i], params[i].repetition_window, modes[i], outputs[i])
        dev = self.device
        idx_t, ip_t, ring_t, last_t = async_h2d(torch.from_numpy(ints), dev).split(sizes)
        self.fparams.index_copy_(0, idx_t, async_h2d(torch.from_numpy(fp), dev))
        self.iparams.index_copy_(0, idx_t, ip_t.view(n, 5))
        self.ring.index_copy_(0, idx_t, ring_t.view(n, q, w))
        self.last_tokens.index_copy_(0, idx_t, last_t.view(n, q))

    def _history_row(self, ring: np.ndarray, last: np.ndarray, window: int, mode: str, outs: Sequence) -> None:
        """ring [q, W] and last [q] of one row from its outputs: the last `window` of them at column g % window."""
        width = self.num_vq if mode == "code" else 1
        g = len(outs)
        for j in range(max(0, g - window), g):
            ring[:width, j % window] = np.asarray(outs[j]).reshape(-1)[:width]
        last[:width] = np.asarray(outs[-1]).reshape(-1)[:width]

    # ---- device side: graph-capturable ---------------------------------------------------------------------
    def batch(self, rows: torch.Tensor, steps: torch.Tensor, num_rows: int, eos_id: int) -> SamplingBatch:
        """The SamplingBatch of `rows` ([B] int64 device) at `steps` ([B] int64: tokens generated so far)."""
        fp, ip = self.fparams[rows], self.iparams[rows]
        return SamplingBatch(
            temperature=fp[:, _TEMPERATURE : _TEMPERATURE + num_rows].float(),
            top_p=fp[:, _TOP_P],
            top_k=ip[:, _TOP_K],
            repetition_penalty=fp[:, _PENALTY].float(),
            history=self.ring[rows, :num_rows],
            eos_banned=steps < ip[:, _MIN_NEW],
            greedy=ip[:, _GREEDY] != 0,
            seeds=ip[:, _SEED],
            steps=steps,
            eos_id=eos_id,
        )

    def record(self, rows: torch.Tensor, steps: torch.Tensor, tokens: torch.Tensor) -> None:
        """Append this step's sampled tokens ([B, R]) to the rows' histories and last_tokens."""
        r = tokens.shape[1]
        col = steps % self.iparams[rows, _WINDOW]
        self.ring[rows[:, None], self._rcols[None, :r], col[:, None]] = tokens
        self.last_tokens[rows[:, None], self._rcols[None, :r]] = tokens
