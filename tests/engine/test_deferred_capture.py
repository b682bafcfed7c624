"""The deferred graph captures' driver (engine/deferred_capture.py) with fake graph families and a fake clock:
one bucket per call, families in order, a device sync before each capture, at most a share of a busy engine's
time, a failing family given up while the others go on, and the completion logged once."""

from __future__ import annotations

import logging

import pytest

from ttsserve.engine.deferred_capture import DeferredCapture


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Family:
    """A graph family with `n` pending buckets; each capture takes `cost` seconds of the fake clock."""

    def __init__(self, name: str, n: int, clock: Clock, log: list, cost: float = 0.1, fail_at: int | None = None):
        self.name, self.pending, self.clock, self.log, self.cost, self.fail_at = (
            name,
            list(range(n)),
            clock,
            log,
            cost,
            fail_at,
        )

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    def capture_next(self) -> None:
        bucket = self.pending.pop(0)
        if bucket == self.fail_at:
            raise RuntimeError("injected capture failure")
        self.clock.now += self.cost
        self.log.append((self.name, bucket))


def _driver(*families, clock, log, share=0.1):
    return DeferredCapture(families, sync=lambda: log.append("sync"), clock=clock, busy_share=share)


def test_idle_captures_one_bucket_per_call_in_family_order_after_a_sync():
    clock, log = Clock(), []
    d = _driver(Family("decode", 2, clock, log), Family("vocoder", 1, clock, log), clock=clock, log=log)
    assert d.num_pending == 3 and d.due(busy=False)
    assert d.run_one() and log == ["sync", ("decode", 0)]
    assert d.run_one() and d.run_one()
    assert log == ["sync", ("decode", 0), "sync", ("decode", 1), "sync", ("vocoder", 0)]
    assert d.num_pending == 0 and not d.due(busy=False) and not d.run_one()
    assert d.captured == 3 and d.capture_s == pytest.approx(0.3)


def test_busy_captures_take_at_most_their_share_of_the_time():
    clock, log = Clock(), []
    d = _driver(Family("decode", 5, clock, log, cost=0.2), clock=clock, log=log, share=0.1)
    assert d.run_one(busy=True)  # the first is due at once
    assert not d.run_one(busy=True)  # 0.2 s of capture: the next waits 1.8 s of serving
    clock.now += 1.7
    assert not d.run_one(busy=True)
    clock.now += 0.11
    assert d.run_one(busy=True)
    assert d.run_one(busy=False)  # idle: no wait
    busy_time = clock.now
    assert d.captured == 3 and d.capture_s <= busy_time


def test_a_failing_family_is_given_up_and_the_others_go_on(caplog):
    clock, log = Clock(), []
    d = _driver(Family("decode", 3, clock, log, fail_at=1), Family("vocoder", 2, clock, log), clock=clock, log=log)
    with caplog.at_level(logging.ERROR, logger="ttsserve.engine.engine"):
        assert d.run_one()
        assert not d.run_one()  # bucket 1 fails: the family is dropped, its bucket 2 never captured
    assert "capturing a deferred Family bucket failed" in caplog.text and d.failed == ["Family"]
    assert d.num_pending == 2 and d.run_all() and d.num_pending == 0
    assert [e for e in log if e != "sync"] == [("decode", 0), ("vocoder", 0), ("vocoder", 1)]


def test_completion_is_logged_once_and_run_all_honours_its_timeout(caplog):
    clock, log = Clock(), []
    d = _driver(Family("decode", 4, clock, log, cost=1.0), clock=clock, log=log)
    assert not d.run_all(timeout=1.5)  # two captures start before the deadline passes
    assert d.num_pending == 2
    with caplog.at_level(logging.INFO, logger="ttsserve.engine.engine"):
        assert d.run_all()
        assert not d.run_one()
    assert caplog.text.count("captured 4 deferred CUDA graph buckets") == 1
