"""The runner's persistent batch: one row per running sequence, host block tables, and vectorised step inputs.

A sequence gets a row when it is first scheduled (or resumes after preemption) and gives it back when it is
preempted, finished or aborted; per-row device state (sampling parameters, repetition ring, last frame) lives
in `SamplingState` under the same row index. Block tables live per row in a numpy array [rows, max_blocks]
(vLLM's block_table_np) with a device mirror that is updated by the entries that changed only (block tables are
append-only while a sequence runs): a decode step that fills no block copies nothing, one that opens blocks for
k sequences copies k (index, block id) pairs in one pinned host-to-device copy and one indexed write.

All per-token arithmetic (positions, slot_mapping, cu_seqlens) is numpy over the whole step, no Python loop
over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ttsserve.sample.state import async_h2d


@dataclass
class StepArrays:
    """Host arrays of one step (B scheduled sequences, T tokens), all numpy.

    rows [B] int64; starts [B] (num_computed_tokens); num_new [B]; steps [B] (outputs before this step);
    positions [T] int64; slot_mapping [T] int64; cu_seqlens_q [B + 1] int32; seq_lens [B] int32.
    """

    rows: np.ndarray
    starts: np.ndarray
    num_new: np.ndarray
    steps: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    cu_seqlens_q: np.ndarray
    seq_lens: np.ndarray


class InputBatch:
    """Row allocation and block tables for up to `max_rows` running sequences (grows if ever exceeded)."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int, block_size: int, device: torch.device,
                 mirror: bool | None = None) -> None:
        """mirror: keep block_table a separate copy of block_table_np (default: off CPU only; on CPU the table
        is the host array itself, no copies at all). mirror=True on CPU exercises the device path in tests."""
        self.block_size, self.max_blocks = block_size, max_blocks_per_seq
        self.device = torch.device(device)
        self.mirror = self.device.type != "cpu" if mirror is None else mirror
        self.row_of: dict[str, int] = {}
        self._free = list(range(max_rows - 1, -1, -1))
        self.block_table_np = np.zeros((max_rows + 1, max_blocks_per_seq), dtype=np.int32)  # +1: scratch row
        self.num_blocks_np = np.zeros(max_rows + 1, dtype=np.int64)
        self.block_table = self._device_table()
        # flat indices (row * max_blocks + block) of host entries written since the last flush (mirror only);
        # the flush sends their current host values, so a repeated or stale index is harmless
        self._dirty: list[int] = []
        self.generation = 0  # bumped when tensors are reallocated (captured graphs must be re-captured)

    def _device_table(self) -> torch.Tensor:
        """The device table: a copy of block_table_np (mirror), else the numpy memory itself."""
        table = torch.from_numpy(self.block_table_np)
        return table.to(self.device, copy=True) if self.mirror else table

    @property
    def max_rows(self) -> int:
        return self.block_table_np.shape[0] - 1

    @property
    def scratch_row(self) -> int:
        return self.max_rows

    # ---- rows ----------------------------------------------------------------------------------------------
    def assign(self, req_id: str) -> tuple[int, bool]:
        """The row of req_id, allocating one if needed -> (row, is_new). Grows the tables when full."""
        row = self.row_of.get(req_id)
        if row is not None:
            return row, False
        if not self._free:
            self._grow(2 * self.max_rows)
        row = self._free.pop()
        self.row_of[req_id] = row
        self.num_blocks_np[row] = 0
        return row, True

    def release(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.num_blocks_np[row] = 0
            self._free.append(row)

    def _grow(self, max_rows: int) -> None:
        old = self.max_rows
        bt = np.zeros((max_rows + 1, self.max_blocks), dtype=np.int32)
        bt[:old] = self.block_table_np[:old]
        nb = np.zeros(max_rows + 1, dtype=np.int64)
        nb[:old] = self.num_blocks_np[:old]
        self.block_table_np, self.num_blocks_np = bt, nb
        self.block_table = self._device_table()
        self._free = list(range(max_rows - 1, old - 1, -1))
        self._dirty.clear()
        self.generation += 1

    # ---- block tables ------------------------------------------------------------------------------------
    def sync_block_table(self, row: int, table: list[int]) -> None:
        """Copy the new tail of a sequence's (append-only) block table into the row."""
        n_old, n = int(self.num_blocks_np[row]), len(table)
        if n == n_old:
            return
        if n > self.max_blocks:
            raise ValueError(f"a sequence needs {n} KV blocks, more than max_model_len allows ({self.max_blocks})")
        if n < n_old:  # cannot happen for a running sequence; recopy to be safe
            n_old = 0
        if n == n_old + 1:  # the decode step that opens a block
            self.block_table_np[row, n_old] = table[n_old]
        else:
            self.block_table_np[row, n_old:n] = table[n_old:]
        self.num_blocks_np[row] = n
        if self.mirror:
            base = row * self.max_blocks
            self._dirty.extend(range(base + n_old, base + n))

    def flush_block_tables(self) -> None:
        """Bring the device table up to date with the host table: the entries written since the last flush,
        as one pinned host-to-device copy of int32 [indices | values] and one indexed write (the whole table
        in one copy when that is smaller). Nothing to do without a mirror, or when no table changed."""
        dirty = self._dirty
        if not dirty:
            return
        self._dirty = []
        k, host = len(dirty), self.block_table_np
        if 2 * k >= host.size:
            self.block_table.copy_(async_h2d(torch.from_numpy(host), self.device))
            return
        packed = np.empty(2 * k, dtype=np.int32)
        packed[:k] = dirty
        np.take(host.reshape(-1), packed[:k], out=packed[k:])
        dev = async_h2d(torch.from_numpy(packed), self.device)
        self.block_table.view(-1)[dev[:k]] = dev[k:]

    # ---- step arrays ---------------------------------------------------------------------------------------
    def step_arrays(self, rows: np.ndarray, starts: np.ndarray, num_new: np.ndarray,
                    steps: np.ndarray) -> StepArrays:
        """Positions, slots and offsets of one step: sequence b computes positions [starts[b], +num_new[b])."""
        bs = self.block_size
        if len(num_new) == int(num_new.sum()):  # decode: one token per sequence (the common step)
            slots = self.block_table_np[rows, starts // bs].astype(np.int64) * bs + starts % bs
            return StepArrays(rows, starts, num_new, steps, starts, slots,
                              np.arange(len(rows) + 1, dtype=np.int32), (starts + 1).astype(np.int32))
        cu = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(num_new, out=cu[1:])
        total = int(cu[-1])
        seq_of_token = np.repeat(np.arange(len(rows)), num_new)
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64) - starts, num_new)
        blocks = self.block_table_np[rows[seq_of_token], positions // bs].astype(np.int64)
        slots = blocks * bs + positions % bs
        return StepArrays(rows, starts, num_new, steps, positions, slots, cu, (starts + num_new).astype(np.int32))
