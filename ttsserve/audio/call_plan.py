"""Which rows of a step's vocoder work share a call. Pure Python.

A graphed call costs its bucket: every (row, frame) cell of the smallest captured (rows, frames) bucket that holds
it is computed, padding included, plus a fixed cost a replay pays whatever its size. One call for all due rows is
as wide as its widest row: at 512 served streams most rows feed 64 frames (their steady chunk) while a few feed a
first call of 84 (first chunk, right context, early audio) or a finished stream's last frames, and one such row
made every row of the call 116 frames wide. Rows sorted by frames and cut where a cut saves more cells than a
replay costs keep each call near its own rows' width.
"""

from __future__ import annotations

from collections.abc import Callable


def plan_calls(
    counts: list[int], max_rows: int, bucket: Callable[[int], int], cost: Callable[[int, int], float]
) -> list[tuple[int, int]]:
    """counts: each row's new frames, descending; max_rows: a call's most rows; bucket(frames): the frames a call
    that wide computes; cost(rows, frames): a call's cost -> [(start, stop)]: consecutive row ranges, one call
    each, covering every row in order, with the least total cost among cuts where the bucket changes (a range
    longer than max_rows is cut every max_rows rows, widest rows first)."""
    n = len(counts)
    cuts, last, width = [0], None, None  # rows where the bucket changes (counts repeat: one bucket() a value)
    for i, c in enumerate(counts):
        if c != last:
            assert last is None or c < last, "counts must be descending"
            w, last = bucket(c), c
            if i and w != width:
                cuts.append(i)
            width = w
    cuts.append(n)

    def pieces(start: int, stop: int) -> list[tuple[int, int]]:
        return [(a, min(a + max_rows, stop)) for a in range(start, stop, max_rows)]

    def run_cost(start: int, stop: int) -> float:
        return sum(cost(b - a, counts[a]) for a, b in pieces(start, stop))

    best = {0: (0.0, [])}  # cut index -> (cost of the rows before it, their calls)
    for j in range(1, len(cuts)):
        best[j] = min(
            ((best[i][0] + run_cost(cuts[i], cuts[j]), best[i][1] + pieces(cuts[i], cuts[j])) for i in range(j)),
            key=lambda c: c[0],
        )
    return best[len(cuts) - 1][1] if n else []
