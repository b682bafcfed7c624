"""audio/call_plan.py: the due rows' calls cover every row once, in order, within max_rows, and cost the least
among the cuts where the frame bucket changes."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ttsserve.audio.call_plan import plan_calls

FRAMES = [8, 16, 32, 64, 116]
ROWS = [1, 2, 4, 8, 16, 32, 64, 128]


def _bucket(n: int, sizes: list[int] = FRAMES) -> int:
    return next(b for b in sizes if b >= n)


def _cost(replay: int):
    return lambda b, n: _bucket(b, ROWS) * _bucket(n) + replay


def _total(calls, counts, replay):
    return sum(_cost(replay)(b - a, counts[a]) for a, b in calls)


def test_a_wide_first_call_gets_its_own_call_when_the_cells_saved_pay_the_replay() -> None:
    counts = [84] + [64] * 70  # a first call (chunk, context, early audio) among steady 64-frame rows
    assert plan_calls(counts, 128, _bucket, _cost(1024)) == [(0, 1), (1, 71)]  # 116 + 128 * 64 against 128 * 116
    assert plan_calls(counts, 128, _bucket, _cost(10_000)) == [(0, 71)]
    assert plan_calls([], 128, _bucket, _cost(0)) == []


def test_rows_past_max_rows_are_cut_widest_first() -> None:
    counts = [116] * 3 + [64] * 200
    calls = plan_calls(counts, 128, _bucket, _cost(1024))
    assert calls[0] == (0, 3) and all(b - a <= 128 for a, b in calls) and calls[-1][1] == 203


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    counts=st.lists(st.sampled_from([3, 8, 12, 16, 30, 60, 64, 84, 116]), max_size=40),
    max_rows=st.sampled_from([4, 16, 128]),
    replay=st.sampled_from([0, 64, 1024, 100_000]),
)
def test_calls_cover_the_rows_and_cost_the_least_of_the_bucket_cuts(counts, max_rows, replay) -> None:
    counts = sorted(counts, reverse=True)
    calls = plan_calls(counts, max_rows, _bucket, _cost(replay))
    assert [i for a, b in calls for i in range(a, b)] == list(range(len(counts)))
    assert all(0 < b - a <= max_rows for a, b in calls)
    changes = [i for i in range(1, len(counts)) if _bucket(counts[i]) != _bucket(counts[i - 1])]
    best = min(  # every subset of the bucket changes as cuts, each run cut every max_rows rows
        _total(
            [
                (a, min(a + max_rows, b))
                for s, b in itertools.pairwise([0, *cut, len(counts)])
                for a in range(s, b, max_rows)
            ],
            counts,
            replay,
        )
        for k in range(len(changes) + 1)
        for cut in itertools.combinations(changes, k)
    )
    assert _total(calls, counts, replay) == best
