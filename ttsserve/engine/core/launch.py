"""Starting engine-core processes: the child's main, and the run directories that hold their ipc sockets.

Both owners of core processes use these: the `ttsserve serve` launcher (entrypoints/api_servers.py, one
directory for its cores, API servers and metrics) and a Ray Serve replica (deploy/core_process.py, one per
core). A run directory names its owner's pid, so one left by an owner that was SIGKILLed (or a machine that
lost power) is removed by the next owner that starts on the machine.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import sys
import tempfile

logger = logging.getLogger("ttsserve.launcher")

RUN_DIR_PREFIX = "ttsserve-"
_OWNER_FILE = "owner.pid"
LOG_FORMAT = "%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"


def core_process_main(
    engine_cfg,
    address: str,
    ready,
    drain_timeout_s: float,
    log_level: str,
    owner_pid: int,
    role: str = "core",
    heartbeat=None,
    death_signal: int = signal.SIGTERM,
    go=None,
) -> None:
    """An engine core's process: dies with its owner (`death_signal`), logs as `role`, sets the OpenMP
    defaults before torch loads, then runs engine/core/proc.run_engine_core until told to stop.

    go: None, or the read end of a pipe: the core imports torch and the engine's modules (seconds), then
    waits, silent, for the owner to send True (build the engine) or False / close it (exit 0), so that the
    owner's own checks of the flags run meanwhile and a bad flag is still its one line of output."""
    from ttsserve.engine.core.parent_death import die_with_parent

    die_with_parent(owner_pid, death_signal)
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT.format(role=role), stream=sys.stderr)
    from ttsserve.runner.cpu_threads import openmp_env_defaults

    openmp_env_defaults()  # before torch loads (the next imports): how idle OpenMP threads wait
    from ttsserve.engine.core.proc import run_engine_core
    from ttsserve.runner.cpu_threads import log_cpu_step_mode

    if go is not None and not _wait_for_go(go, engine_cfg.device):
        sys.exit(0)

    log_cpu_step_mode(engine_cfg)
    sys.exit(run_engine_core(engine_cfg, address, ready, drain_timeout_s, heartbeat))


def _wait_for_go(go, device: str) -> bool:
    import torch

    import ttsserve.engine.engine  # noqa: F401 - torch and the engine's modules load while the owner checks

    if device in ("auto", "cuda") and torch.cuda.is_available():
        try:  # the CUDA context (the current device's, as the engine's) is made while waiting, not in the load
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - the engine's own start reports a broken device, once released
            pass
    try:
        return bool(go.recv())
    except EOFError:  # the owner is gone or gave up
        return False
    finally:
        go.close()


def make_run_dir() -> str:
    """A fresh run directory in $TMPDIR, marked with this process's pid (see clean_stale_run_dirs)."""
    run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
    with open(os.path.join(run_dir, _OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return run_dir


def clean_stale_run_dirs(tmp: str | None = None) -> list[str]:
    """Remove the run directories (sockets, metrics, voices.db) of owners that are gone: a directory with an
    owner file whose process does not exist. Directories without one, or of a live pid, are left alone.
    Returns the paths removed. Assumes one pid namespace per $TMPDIR."""
    removed = []
    for path in glob.glob(os.path.join(tmp or tempfile.gettempdir(), RUN_DIR_PREFIX + "*")):
        try:
            with open(os.path.join(path, _OWNER_FILE)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if pid == os.getpid() or pid_alive(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed %d stale run directories of owners that are gone: %s", len(removed), removed)
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
