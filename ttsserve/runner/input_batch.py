"""The runner's persistent batch: one row per running sequence, host block tables, and vectorised step inputs.

A sequence gets a row when it is first scheduled (or resumes after preemption) and gives it back when it is
preempted, finished or aborted; per-row device state (sampling parameters, repetition ring, last frame) lives
in `SamplingState` under the same row index. Block tables live per row in a host array [rows, max_blocks]
(`block_table_np`; on CUDA a view of pinned memory, `block_table_cpu`) and in a device mirror (`block_table`).
As in vLLM's BlockTable.commit, a flush is one asynchronous copy of the rows written since the last flush,
straight from the pinned table (no staging copy, no index kernel), and none when no table changed: a decode
step copies only when some sequence opened a block. Before the host table is written again, the last flush's
copy must have read it (vLLM's synchronize_input_prep); it has by then in practice (the engine waited for the
step that precedes it), so the wait costs an event query.

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

    def __init__(self, max_rows: int, max_blocks_per_seq: int, block_size: int, device: torch.device,
                 mirror: bool | None = None) -> None:
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
        self._copied = torch.cuda.Event() if cuda else None
        self._copy_pending = False  # a flush's copy may still read block_table_cpu
        self.generation = 0  # bumped when tensors are reallocated (captured graphs must be re-captured)

    def _alloc_tables(self, max_rows: int) -> None:
        """Zeroed host and device tables of max_rows + 1 rows (+1: the scratch row), nothing dirty."""
        shape, pin = (max_rows + 1, self.max_blocks), self.device.type == "cuda"
        self.block_table_cpu = torch.zeros(shape, dtype=torch.int32, pin_memory=pin)
        self.block_table_np = self.block_table_cpu.numpy()
        self.block_table = self.block_table_cpu.to(self.device, copy=True) if self.mirror else self.block_table_cpu
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
        self._host_writable()
        bt, nb = self.block_table_np, self.num_blocks_np
        self._alloc_tables(max_rows)
        self.block_table_np[:old] = bt[:old]
        self.num_blocks_np = np.zeros(max_rows + 1, dtype=np.int64)
        self.num_blocks_np[:old] = nb[:old]
        if self.mirror:
            self.block_table.copy_(self.block_table_cpu)  # blocking: a rare reallocation
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
        if self._copy_pending:
            self._host_writable()
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
        self.block_table[lo:hi].copy_(self.block_table_cpu[lo:hi], non_blocking=True)
        if self._copied is not None:
            self._copied.record(self._stream)
            self._copy_pending = True

    def _host_writable(self) -> None:
        """Wait until the last flush's copy has read the pinned host table (an event query when it has)."""
        if self._copy_pending:
            if not self._copied.query():
                self._copied.synchronize()
            self._copy_pending = False

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
