"""InputBatch's device block table mirror (runner/input_batch.py): after any sequence of row assignments,
releases, growth and append-only block table updates, a flush leaves the device table equal to the host table,
copying only the rows written since the last flush. On CPU with mirror=True, which takes the CUDA path's code;
on CUDA too where there is a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ttsserve.runner.input_batch import InputBatch

MAX_BLOCKS = 12
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _equal(ib: InputBatch) -> bool:
    return torch.equal(ib.block_table.cpu(), torch.from_numpy(ib.block_table_np))


_op = st.one_of(
    st.tuples(st.just("grow_table"), st.integers(0, 9), st.integers(1, 4)),  # request, blocks to append
    st.tuples(st.just("shrink"), st.integers(0, 9), st.integers(1, 4)),  # a new, shorter table
    st.tuples(st.just("release"), st.integers(0, 9), st.just(0)),
    st.tuples(st.just("flush"), st.just(0), st.just(0)),
)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(_op, max_size=60), seed=st.integers(0, 2**16))
def test_flush_mirrors_host_table_after_random_updates(device, ops, seed) -> None:
    rng = np.random.default_rng(seed)
    ib = InputBatch(2, MAX_BLOCKS, 16, torch.device(device), mirror=True)  # 10 ids on 2 rows: grows
    assert ib.block_table.data_ptr() != ib.block_table_np.ctypes.data  # a real mirror, not a view
    tables: dict[str, list[int]] = {}
    for op, i, n in ops:
        rid = f"r{i}"
        if op == "release":
            ib.release(rid)
            tables.pop(rid, None)
        elif op == "shrink" and len(tables.get(rid, ())) > 1:  # never for a running sequence; recopied
            tables[rid] = table = rng.integers(0, 1 << 20, size=min(n, len(tables[rid]) - 1)).tolist()
            ib.sync_block_table(ib.row_of[rid], table)
        elif op == "grow_table":
            table = tables.setdefault(rid, [])
            table += rng.integers(0, 1 << 20, size=min(n, MAX_BLOCKS - len(table))).tolist()
            row, _ = ib.assign(rid)
            ib.sync_block_table(row, table)
        elif op == "flush":
            ib.flush_block_tables()
            assert _equal(ib)
    ib.flush_block_tables()
    assert _equal(ib)
    for rid, table in tables.items():
        assert ib.block_table[ib.row_of[rid], : len(table)].tolist() == table


@pytest.mark.parametrize("device", DEVICES)
def test_flush_copies_only_the_rows_written_since_the_last_flush(device) -> None:
    ib = InputBatch(8, MAX_BLOCKS, 16, torch.device(device), mirror=True)
    rows = [ib.assign(f"r{i}")[0] for i in range(8)]
    tables = [[10 * i, 10 * i + 1] for i in range(8)]
    for r, t in zip(rows, tables):
        ib.sync_block_table(r, t)
    ib.flush_block_tables()
    assert _equal(ib)
    ib.block_table.fill_(-1)  # a sentinel: what a flush does not copy stays -1
    ib.flush_block_tables()  # nothing changed: no copy
    assert (ib.block_table == -1).all()
    for i in (2, 5):  # two sequences open a block: one copy of rows [2, 6)
        tables[i].append(99 + i)
        ib.sync_block_table(rows[i], tables[i])
    ib.sync_block_table(rows[3], tables[3])  # unchanged length: not written
    ib.flush_block_tables()
    dev, host = ib.block_table.cpu(), torch.from_numpy(ib.block_table_np)
    assert torch.equal(dev[2:6], host[2:6]) and (dev[:2] == -1).all() and (dev[6:] == -1).all()


def test_cpu_default_shares_the_host_array() -> None:
    ib = InputBatch(4, MAX_BLOCKS, 16, torch.device("cpu"))
    row, _ = ib.assign("a")
    ib.sync_block_table(row, [5, 6, 7])
    assert not ib.mirror and ib.block_table[row, :3].tolist() == [5, 6, 7]  # before any flush
    ib.flush_block_tables()
    assert _equal(ib)


class _RunningCopy:
    """A device copy the test controls: query() is False until done; synchronize() is a wait (and counted)."""

    def __init__(self) -> None:
        self.done, self.waits = False, 0

    def record(self, stream=None) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def test_writing_tables_never_waits_for_a_copy_and_staging_alternates() -> None:
    """The host table is not what a copy reads: writing it while the last flush's copy still runs (on CUDA,
    queued behind the device's previous step) does not wait; a staging table is reused two flushes later and
    waits only if its copy has still not run. The device table is the host's after every flush."""
    ib = InputBatch(4, MAX_BLOCKS, 16, torch.device("cpu"), mirror=True)
    ib._copied = [_RunningCopy(), _RunningCopy()]
    rows = [ib.assign(f"r{i}")[0] for i in range(4)]
    tables = [[i] for i in range(4)]
    waits_before = [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1], [1, 1]]  # flushes 2, 3 reuse a still-running one
    for flush in range(6):
        for r, t in zip(rows, tables):
            t.append(10 * flush + r)
            ib.sync_block_table(r, t)  # the last flush's copy is "running": no wait
        assert [c.waits for c in ib._copied] == waits_before[flush]
        ib.flush_block_tables()
        assert _equal(ib)
        if flush == 3:
            ib._copied[0].done = ib._copied[1].done = True  # the device caught up: the next reuses don't wait
    assert [c.waits for c in ib._copied] == [1, 1]
