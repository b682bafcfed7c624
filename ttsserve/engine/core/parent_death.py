"""Child processes that must not outlive the process that started them."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Deliver `sig` to this process when `parent_pid` exits (SIGKILL of the parent included).

    Linux: prctl(PR_SET_PDEATHSIG), immediate. Elsewhere a daemon thread polls getppid() every 0.5 s.
    Call it first thing in the child: a parent that died before the call is caught by the pid check.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=_watch_parent, args=(parent_pid, sig), name="parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def _watch_parent(parent_pid: int, sig: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os.kill(os.getpid(), sig)
