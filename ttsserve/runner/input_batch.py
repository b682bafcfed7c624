"""The runner's persistent batch: one row per running sequence, host block tables, and vectorised step inputs.

A sequence gets a row when it is first scheduled (or resumes after preemption) and gives it back when it is
preempted, finished or aborted; per-row device state (sampling parameters, repetition ring, last frame) lives
in `SamplingState` under the same row index. Block tables live per row in a host array [rows, max_blocks]
(`block_table_np`) and in a device mirror (`block_table`). A flush copies the rows written since the last
flush into one of two pinned staging tables and from there, asynchronously, to the device (no index kernel),
and does nothing when no table changed: a decode step copies only when some sequence opened a block. The
host table is never read by a copy, so writing it never waits; a staging table is reused two flushes later,
by when its copy has run (an event query; the pipelined engine's step in between has been waited for). A
single pinned table written in place had to wait for its last copy, queued behind the device's previous
step and vocoder call: 3% of the served engine core's time on the H200.

All per-token arithmetic (positions, slot_mapping, cu_seqlens) is numpy over the whole step, no Python loop
over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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

    def __init__(
        self, max_rows: int, max_blocks_per_seq: int, block_size: int, device: torch.device, mirror: bool | None = None
    ) -> None:
        """mirror: keep block_table a separate copy of the host table (default: off CPU only; on CPU the table
        is the host array itself, no copies at all). mirror=True on CPU exercises the device path in tests."""
        self.block_size, self.max_blocks = block_size, max_blocks_per_seq
        self.device = torch.device(device)
        self.mirror = self.device.type != "cpu" if mirror is None else mirror
        self.row_of: dict[str, int] = {}
        self._free = list(range(max_rows - 1, -1, -1))
        self._alloc_tables(max_rows)
        self.num_blocks_np = np.zeros(max_rows + 1, dtype=np.int64)  # blocks synced per row
        # recorded on the runner's stream after a flush (the engine uses one stream; current_stream() costs ~5 us)
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.current_stream(self.device) if cuda else None
        self._copied = [torch.cuda.Event() if cuda else None for _ in self._staging]  # after each one's copy
        self._copy_pending = [False] * len(self._staging)  # its last copy may still read it
        self._next_staging = 0
        self.generation = 0  # bumped when tensors are reallocated (captured graphs must be re-captured)

    def _alloc_tables(self, max_rows: int) -> None:
        """Zeroed host and device tables of max_rows + 1 rows (+1: the scratch row), nothing dirty."""
        shape, pin = (max_rows + 1, self.max_blocks), self.device.type == "cuda"
        host = torch.zeros(shape, dtype=torch.int32)
        self.block_table_np = host.numpy()
        self.block_table = host.to(self.device, copy=True) if self.mirror else host
        self._staging = [torch.zeros(shape, dtype=torch.int32, pin_memory=pin) for _ in range(2 if self.mirror else 0)]
        self._staging_np = [t.numpy() for t in self._staging]
        self._dirty_lo, self._dirty_hi = max_rows + 1, 0  # rows [lo, hi) were written since the last flush

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
        for i in range(len(self._staging)):
            self._staging_writable(i)  # the old staging tables are dropped: their copies must be done
        bt, nb = self.block_table_np, self.num_blocks_np
        self._alloc_tables(max_rows)
        self.block_table_np[:old] = bt[:old]
        self.num_blocks_np = np.zeros(max_rows + 1, dtype=np.int64)
        self.num_blocks_np[:old] = nb[:old]
        if self.mirror:
            self.block_table.copy_(torch.from_numpy(self.block_table_np))  # blocking: a rare reallocation
        self._free = list(range(max_rows - 1, old - 1, -1))
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
        if row < self._dirty_lo:
            self._dirty_lo = row
        if row >= self._dirty_hi:
            self._dirty_hi = row + 1

    def flush_block_tables(self) -> None:
        """Bring the device table up to date: one asynchronous copy of the host rows [lo, hi) written since
        the last flush (rows are handed out lowest first, so that is about the running rows), none when no
        table changed or without a mirror."""
        lo, hi = self._dirty_lo, self._dirty_hi
        if lo >= hi:
            return
        self._dirty_lo, self._dirty_hi = self.max_rows + 1, 0
        if not self.mirror:
            return
        i = self._next_staging
        self._next_staging = 1 - i
        self._staging_writable(i)
        self._staging_np[i][lo:hi] = self.block_table_np[lo:hi]
        self.block_table[lo:hi].copy_(self._staging[i][lo:hi], non_blocking=True)
        if self._copied[i] is not None:
            self._copied[i].record(self._stream)
            self._copy_pending[i] = True

    def _staging_writable(self, i: int) -> None:
        """Wait until staging table i's last copy has read it (an event query when it has)."""
        if self._copy_pending[i]:
            if not self._copied[i].query():
                self._copied[i].synchronize()
            self._copy_pending[i] = False

    # ---- step arrays ---------------------------------------------------------------------------------------
    def step_arrays(self, rows: np.ndarray, starts: np.ndarray, num_new: np.ndarray, steps: np.ndarray) -> StepArrays:
        """Positions, slots and offsets of one step: sequence b computes positions [starts[b], +num_new[b])."""
        bs = self.block_size
        if len(num_new) == int(num_new.sum()):  # decode: one token per sequence (the common step)
            slots = self.block_table_np[rows, starts // bs].astype(np.int64) * bs + starts % bs
            return StepArrays(
                rows,
                starts,
                num_new,
                steps,
                starts,
                slots,
                np.arange(len(rows) + 1, dtype=np.int32),
                (starts + 1).astype(np.int32),
            )
        cu = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(num_new, out=cu[1:])
        total = int(cu[-1])
        seq_of_token = np.repeat(np.arange(len(rows)), num_new)
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64) - starts, num_new)
        blocks = self.block_table_np[rows[seq_of_token], positions // bs].astype(np.int64)
        slots = blocks * bs + positions % bs
        return StepArrays(rows, starts, num_new, steps, positions, slots, cu, (starts + num_new).astype(np.int32))
