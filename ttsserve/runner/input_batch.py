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
over tokens. Per row the host keeps the step state too (`_PER_ROW`), so a step's columns are gathers from
those arrays by row: `update_states` reads a ScheduledRequest only for a row that did not decode last step
(new, resumed, prefilling, text) and writes a table only when the row opens a block; a steady decode row
costs no Python work (its id and row are looked up by C-level maps), as in vLLM's persistent InputBatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

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


_ID, _START = attrgetter("request_id"), attrgetter("num_computed_tokens")
_NUM_NEW, _STEPS, _NUM_STEPS = attrgetter("num_new_tokens"), attrgetter("num_output_tokens"), attrgetter("num_steps")
_SAMPLES = attrgetter("will_sample")


@dataclass
class ScheduledColumns:
    """A step's B scheduled sequences as columns, in scheduled order (gathered from the per-row arrays):
    req_ids list[str]; rows (their batch rows), starts (num_computed_tokens), num_new, steps
    (num_output_tokens), num_steps: int64 [B]; code, will_sample, decode: bool [B]. decode: a code row past
    its prompt advancing by the num_steps frames it samples, the rows the decode path (graph replay) takes."""

    req_ids: list
    rows: np.ndarray
    starts: np.ndarray
    num_new: np.ndarray
    steps: np.ndarray
    num_steps: np.ndarray
    code: np.ndarray
    will_sample: np.ndarray
    decode: np.ndarray


# Host state per row [max_rows + 1] (+1: the scratch row). num_blocks: table blocks synced; the rest are the
# row's ScheduledRequest fields as of its last step, num_computed / num_output advanced past that step;
# steady: that step was a decode of max_num_steps frames, so the next one continues it unread.
_PER_ROW = {
    "num_blocks_np": np.int64,
    "num_computed_np": np.int64,
    "num_output_np": np.int64,
    "num_new_np": np.int64,
    "num_steps_np": np.int64,
    "num_prompt_np": np.int64,
    "is_code_np": bool,
    "will_sample_np": bool,
    "steady_np": bool,
}


def _column(scheduled: list, get: attrgetter, dtype=np.int64) -> np.ndarray:
    return np.fromiter(map(get, scheduled), dtype, len(scheduled))


def _check_columns(cols: ScheduledColumns, scheduled: list) -> None:
    """The columns a step computed from its rows equal its ScheduledRequests' (InputBatch.verify)."""
    for name, get in (("starts", _START), ("num_new", _NUM_NEW), ("steps", _STEPS), ("num_steps", _NUM_STEPS)):
        assert np.array_equal(getattr(cols, name), _column(scheduled, get)), f"stale row state: {name}"
    assert np.array_equal(cols.will_sample, _column(scheduled, _SAMPLES, bool)), "stale row state: will_sample"
    assert cols.code.tolist() == [s.mode == "code" for s in scheduled], "stale row state: mode"


class InputBatch:
    """Row allocation, per-row step state and block tables for up to `max_rows` running sequences (grows if
    ever exceeded)."""

    verify = False  # update_states checks its columns against every ScheduledRequest (tests; O(B) Python)

    def __init__(
        self,
        max_rows: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        mirror: bool | None = None,
        max_num_steps: int = 1,
    ) -> None:
        """mirror: keep block_table a separate copy of the host table (default: off CPU only; on CPU the table
        is the host array itself, no copies at all). mirror=True on CPU exercises the device path in tests.
        max_num_steps: the longest decode burst the scheduler makes (its num_scheduler_steps)."""
        self.block_size, self.max_blocks, self.max_num_steps = block_size, max_blocks_per_seq, max_num_steps
        self.device = torch.device(device)
        self.mirror = self.device.type != "cpu" if mirror is None else mirror
        self.row_of: dict[str, int] = {}
        self._free = list(range(max_rows - 1, -1, -1))
        self._alloc_tables(max_rows)
        for name, dtype in _PER_ROW.items():
            setattr(self, name, np.zeros(max_rows + 1, dtype=dtype))
        # recorded on the runner's stream after a flush (the engine uses one stream; current_stream() costs ~5 us)
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.current_stream(self.device) if cuda else None
        self._copied = [torch.cuda.Event() if cuda else None for _ in self._staging]  # after each one's copy
        self._copy_pending = [False] * len(self._staging)  # its last copy may still read it
        self._next_staging = 0
        self.generation = 0  # bumped when tensors are reallocated (captured graphs must be re-captured)
        # what update_states did per row, in all: rows it read from their ScheduledRequests, tables it wrote
        self.num_rows_read = self.num_tables_synced = 0

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
        self.num_blocks_np[row], self.steady_np[row] = 0, False
        return row, True

    def release(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.num_blocks_np[row], self.steady_np[row] = 0, False
            self._free.append(row)

    def _grow(self, max_rows: int) -> None:
        old = self.max_rows
        for i in range(len(self._staging)):
            self._staging_writable(i)  # the old staging tables are dropped: their copies must be done
        bt = self.block_table_np
        self._alloc_tables(max_rows)
        self.block_table_np[:old] = bt[:old]
        for name, dtype in _PER_ROW.items():
            per_row = getattr(self, name)
            setattr(self, name, np.zeros(max_rows + 1, dtype=dtype))
            getattr(self, name)[:old] = per_row[:old]
        if self.mirror:
            self.block_table.copy_(torch.from_numpy(self.block_table_np))  # blocking: a rare reallocation
        self._free = list(range(max_rows - 1, old - 1, -1))
        self.generation += 1

    def update_states(self, scheduled: list, num_tokens: int | None = None) -> tuple[ScheduledColumns, list[int]]:
        """The step's columns -> (columns, indices into scheduled of the sequences new to the batch, whose
        sampling state the caller initialises). scheduled: ScheduledRequest-like objects; num_tokens: the sum
        of their num_new_tokens (SchedulerOutput.num_scheduled_tokens; None: read every row's).

        A steady row (a decode of max_num_steps frames last step, not released since) is not read: it
        continues from its row (positions and outputs advanced by max_num_steps), so it costs no Python work;
        the others are read and written here (Python per row), and so is a table that must open a block. A
        steady row that decodes fewer frames this step (a budget or length edge) makes num_tokens disagree:
        then every row's num_new_tokens is read (C-level) and those rows are written."""
        ids = list(map(_ID, scheduled))
        rows = np.fromiter(map(self.row_of.get, ids, repeat(-1)), np.int64, len(ids))
        new = np.flatnonzero(rows < 0).tolist()
        for i in new:
            rows[i] = self.assign(ids[i])[0]
        self._write_rows(scheduled, rows, np.flatnonzero(~self.steady_np[rows]).tolist())
        num_new = self.num_new_np[rows]
        if num_tokens is None or int(num_new.sum()) != num_tokens:
            self._write_rows(scheduled, rows, np.flatnonzero(_column(scheduled, _NUM_NEW) != num_new).tolist())
            num_new = self.num_new_np[rows]
        starts, steps, num_steps = self.num_computed_np[rows], self.num_output_np[rows], self.num_steps_np[rows]
        code, will_sample = self.is_code_np[rows], self.will_sample_np[rows]
        decode = code & will_sample & (num_new == num_steps) & (starts >= self.num_prompt_np[rows])
        cols = ScheduledColumns(ids, rows, starts, num_new, steps, num_steps, code, will_sample, decode)
        if self.verify:
            _check_columns(cols, scheduled)
        self._sync_tables(scheduled, rows, starts + num_new)
        # the next step's view of these rows: positions and outputs advanced past this step's
        self.steady_np[rows] = decode & (num_steps == self.max_num_steps)
        self.num_computed_np[rows] = starts + num_new
        self.num_output_np[rows] = steps + num_steps * will_sample
        return cols, new

    def _write_rows(self, scheduled: list, rows: np.ndarray, idx: list[int]) -> None:
        """Rows rows[i] from scheduled[i], i in idx (Python per row)."""
        for i in idx:
            s, row = scheduled[i], rows[i]
            self.num_computed_np[row], self.num_output_np[row] = s.num_computed_tokens, s.num_output_tokens
            self.num_new_np[row], self.num_steps_np[row] = s.num_new_tokens, s.num_steps
            self.num_prompt_np[row], self.is_code_np[row] = s.num_prompt_tokens, s.mode == "code"
            self.will_sample_np[row] = s.will_sample
        self.num_rows_read += len(idx)

    def _sync_tables(self, scheduled: list, rows: np.ndarray, ends: np.ndarray) -> None:
        """Write the table tail of each row whose synced blocks do not reach its step's end positions [B] (a
        new row, a decode that opens a block), then flush."""
        short = np.flatnonzero(-(-ends // self.block_size) > self.num_blocks_np[rows]).tolist()
        for i in short:
            self.sync_block_table(int(rows[i]), scheduled[i].block_table)
        self.num_tables_synced += len(short)
        self.flush_block_tables()

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
