"""The dynamic-batching controller against synthetic step-cost models."""

import pytest

from ttsserve.engine.batch_control import BatchSizeController


def _simulate(target: float, fixed: float, per_seq: float, demand: int = 200, steps: int = 200) -> tuple:
    c = BatchSizeController(target, max_num_seqs=256)
    times = []
    for _ in range(steps):
        running = min(demand, c.limit)  # streams turn over quickly: the batch follows the admission limit
        t = fixed + per_seq * running
        times.append(t)
        c.observe(running, t)
    return c, times


@pytest.mark.parametrize("fixed,per_seq,target", [(5.0, 0.5, 20.0), (1.0, 0.1, 10.0), (8.0, 0.05, 12.0)])
def test_limit_converges_to_the_target(fixed, per_seq, target):
    c, _ = _simulate(target, fixed, per_seq)
    ideal = int((target - fixed) / per_seq)
    assert abs(c.limit - min(ideal, 256)) <= max(2, 0.05 * ideal)
    got_fixed, got_slope = c.fit()
    assert got_fixed == pytest.approx(fixed, rel=1e-3) and got_slope == pytest.approx(per_seq, rel=1e-3)


def test_unreachable_target_admits_one():
    c, _ = _simulate(target=4.0, fixed=5.0, per_seq=0.5)
    assert c.limit == 1


def test_disabled_controller_never_limits():
    c = BatchSizeController(0.0, max_num_seqs=64)
    for b in (1, 64, 64):
        c.observe(b, 1000.0)
    assert c.limit == 64 and not c.enabled


def test_burst_is_admitted_gradually():
    c = BatchSizeController(20.0, max_num_seqs=256)
    assert c.limit == 8  # a burst of 200 requests does not all enter at once
    c.observe(8, 6.0)
    assert c.limit == 16
