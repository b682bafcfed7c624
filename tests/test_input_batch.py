"""InputBatch's device block table mirror (runner/input_batch.py): after any sequence of row assignments,
releases, growth and append-only block table updates, a flush leaves the device table equal to the host table,
in at most one host-to-device copy. On CPU with mirror=True, which takes the CUDA path's code; on CUDA too
where there is a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ttsserve.runner import input_batch
from ttsserve.runner.input_batch import InputBatch

MAX_BLOCKS = 12
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _equal(ib: InputBatch) -> bool:
    return torch.equal(ib.block_table.cpu(), torch.from_numpy(ib.block_table_np))


def _counting_h2d(monkeypatch) -> list[int]:
    """Patch the module's async_h2d to count its copies (elements per call)."""
    calls: list[int] = []
    real = input_batch.async_h2d

    def counting(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        calls.append(t.numel())
        return real(t, device)

    monkeypatch.setattr(input_batch, "async_h2d", counting)
    return calls


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


def test_a_decode_step_is_one_copy_of_the_changed_entries(monkeypatch) -> None:
    calls = _counting_h2d(monkeypatch)
    ib = InputBatch(8, MAX_BLOCKS, 16, torch.device("cpu"), mirror=True)
    rows = [ib.assign(f"r{i}")[0] for i in range(8)]
    tables = [[10 * i, 10 * i + 1] for i in range(8)]
    for r, t in zip(rows, tables):
        ib.sync_block_table(r, t)
    ib.flush_block_tables()
    assert _equal(ib) and len(calls) == 1
    ib.flush_block_tables()  # nothing changed: no copy
    assert len(calls) == 1
    for i in (1, 4, 6):  # three sequences open a block
        tables[i].append(99 + i)
        ib.sync_block_table(rows[i], tables[i])
    ib.flush_block_tables()
    assert _equal(ib) and calls[1:] == [2 * 3]  # one copy: 3 indices + 3 block ids


def test_cpu_default_shares_the_host_array() -> None:
    ib = InputBatch(4, MAX_BLOCKS, 16, torch.device("cpu"))
    row, _ = ib.assign("a")
    ib.sync_block_table(row, [5, 6, 7])
    assert not ib.mirror and ib.block_table[row, :3].tolist() == [5, 6, 7]  # before any flush
    ib.flush_block_tables()
    assert _equal(ib)
