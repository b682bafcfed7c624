"""The launcher's bookkeeping for the processes it supervises: restart backoff, the core-death budget, and
run directories left behind by launchers that were killed.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import tempfile
from collections import deque

logger = logging.getLogger("ttsserve.launcher")

RUN_DIR_PREFIX = "ttsserve-"
_PID_FILE = "launcher.pid"


class RestartBackoff:
    """The delay before restarting a process that died: `first` s, doubling to `cap` s over crashes in a row,
    and back to `first` once the process had run `healthy_s` s (a crash after a long healthy run is not part
    of a crash loop)."""

    def __init__(self, first: float = 1.0, cap: float = 30.0, healthy_s: float = 60.0) -> None:
        self.first, self.cap, self.healthy_s = first, cap, healthy_s
        self.delay = first
        self.started_at: float | None = None

    def started(self, now: float) -> None:
        self.started_at = now

    def next_delay(self, now: float) -> float:
        """The delay for a restart now (the process just died); the one after it doubles."""
        if self.started_at is not None and now - self.started_at >= self.healthy_s:
            self.delay = self.first
        delay, self.delay = self.delay, min(self.delay * 2, self.cap)
        return delay


class DeathBudget:
    """At most `limit` deaths within `window_s` seconds; the one more says stop (the launcher exits non-zero
    so an orchestrator sees a core that cannot stay up)."""

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit, self.window_s = limit, window_s
        self.deaths: deque[float] = deque()

    def record(self, now: float) -> bool:
        """Count a death at `now`; True while within the budget."""
        self.deaths.append(now)
        while self.deaths and self.deaths[0] < now - self.window_s:
            self.deaths.popleft()
        return len(self.deaths) <= self.limit


def make_run_dir() -> str:
    """A fresh run directory in $TMPDIR, marked with this launcher's pid (see clean_stale_run_dirs)."""
    run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
    with open(os.path.join(run_dir, _PID_FILE), "w") as f:
        f.write(str(os.getpid()))
    return run_dir


def clean_stale_run_dirs(tmp: str | None = None) -> list[str]:
    """Remove the run directories (core.sock, metrics/, voices.db) of launchers that are gone (SIGKILLed, or
    the machine lost power): a directory with a pid file whose process does not exist. Directories without
    a pid file, or of a live pid, are left alone. Returns the paths removed."""
    removed = []
    for path in glob.glob(os.path.join(tmp or tempfile.gettempdir(), RUN_DIR_PREFIX + "*")):
        try:
            with open(os.path.join(path, _PID_FILE)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if pid == os.getpid() or _pid_alive(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed %d stale run directories of launchers that are gone: %s", len(removed), removed)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
