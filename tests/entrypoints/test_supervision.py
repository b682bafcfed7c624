"""The launcher's bookkeeping: restart backoff that resets after a healthy run, the core-death budget, and the
removal of run directories whose launcher is gone."""

from __future__ import annotations

import os
import subprocess
import sys

from ttsserve.engine.core.launch import clean_stale_run_dirs
from ttsserve.entrypoints.supervision import DeathBudget, RestartBackoff


def test_backoff_doubles_over_a_crash_loop_and_resets_after_a_healthy_run():
    b = RestartBackoff(first=1.0, cap=30.0, healthy_s=60.0)
    t = 0.0
    delays = []
    for _ in range(7):  # crash 1 s after each start
        b.started(t)
        t += 1
        delays.append(b.next_delay(t))
        t += delays[-1]
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    b.started(t)
    assert b.next_delay(t + 45) == 30  # 45 s up is not yet healthy
    b.started(t + 100)
    assert b.next_delay(t + 161) == 1  # 61 s up: a new crash starts over


def test_death_budget_counts_deaths_in_a_sliding_window():
    d = DeathBudget(limit=2, window_s=10)
    assert d.record(0) and d.record(5)
    assert not d.record(8)  # a third within 10 s
    d = DeathBudget(limit=2, window_s=10)
    assert d.record(0) and d.record(5) and d.record(11) and d.record(15.5)  # the early ones left the window


def test_stale_run_dirs_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name, pid in (("ttsserve-dead", dead.pid), ("ttsserve-live", os.getppid())):
        d = tmp_path / name
        (d / "metrics").mkdir(parents=True)
        (d / "voices.db").write_text("x")
        (d / "owner.pid").write_text(str(pid))
    (tmp_path / "ttsserve-nopid").mkdir()
    (tmp_path / "other-dir").mkdir()
    assert clean_stale_run_dirs(str(tmp_path)) == [str(tmp_path / "ttsserve-dead")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-dir", "ttsserve-live", "ttsserve-nopid"]
