"""The engine's OpenMP team adapted to other work on its cores (runner/cpu_contention.py), on a fake /proc/stat
and a fake clock: 1 thread while others take more than CONTENDED CPUs of its cores, the full team once they
take less than FREE, nothing when the user fixed the count."""

from __future__ import annotations

import os

import pytest
import torch

from ttsserve.runner import cpu_contention
from ttsserve.runner.cpu_contention import ThreadMonitor, busy_seconds


class _Clock:
    def __init__(self) -> None:
        self.now, self.cpu = 100.0, 0.0

    def monotonic(self) -> float:
        return self.now

    def process_time(self) -> float:
        return self.cpu


def _stat(path, busy_ticks: list[int]) -> None:
    """cpu0..: user nice system idle iowait irq softirq steal; busy ticks split over user and steal."""
    lines = ["cpu  0 0 0 0 0 0 0 0"]
    lines += [f"cpu{i} {b - b // 4} 0 0 999 0 0 0 {b // 4}" for i, b in enumerate(busy_ticks)]
    path.write_text("\n".join(lines + ["intr 1 2 3"]) + "\n")


def test_busy_seconds_counts_only_the_given_cpus(tmp_path) -> None:
    stat = tmp_path / "stat"
    _stat(stat, [100, 200, 400])
    ticks = os.sysconf("SC_CLK_TCK")
    assert busy_seconds({0, 2}, stat) == pytest.approx(500 / ticks)
    assert busy_seconds({0}, tmp_path / "missing") is None


def test_monitor_drops_to_one_thread_under_contention_and_back(tmp_path, monkeypatch) -> None:
    clock, stat, ticks = _Clock(), tmp_path / "stat", os.sysconf("SC_CLK_TCK")
    monkeypatch.setattr(cpu_contention, "time", clock)
    before = torch.get_num_threads()
    mon = ThreadMonitor(2, explicit=False, proc_stat=stat)
    mon.cpus, mon.active = {0, 1}, True  # whatever this machine's affinity mask
    busy = [0, 0]

    def advance(others_cpus: float, own_cpus: float, seconds: float = 1.0) -> None:
        clock.now += seconds
        clock.cpu += own_cpus * seconds
        add = round((others_cpus + own_cpus) * seconds * ticks)
        busy[0] += add // 2
        busy[1] += add - add // 2
        _stat(stat, busy)
        mon.tick()

    try:
        _stat(stat, busy)
        mon.tick()  # the first reading: no window yet
        advance(0.05, 2.0)
        assert mon.current == 2 and mon.switches == 0
        advance(0.9, 1.1)  # another process takes most of a core
        assert mon.current == 1 and torch.get_num_threads() == 1
        advance(0.2, 1.0)  # between the thresholds: no change
        assert mon.current == 1
        clock.now += 0.1
        mon.tick()  # within the interval: not read
        advance(0.0, 1.0)
        assert mon.current == 2 and torch.get_num_threads() == 2 and mon.switches == 2
    finally:
        torch.set_num_threads(before)


def test_monitor_is_off_for_an_explicit_count_or_one_thread(tmp_path) -> None:
    assert not ThreadMonitor(2, explicit=True).active
    assert not ThreadMonitor(1, explicit=False).active
