"""One engine-core process (engine/core/proc.py) owned by the process that starts it: a Ray Serve replica
runs its engine this way and serves it through a CoreClient, the same client as `ttsserve serve`'s API servers.

The core is `spawn`ed (a fresh interpreter: torch must not be inherited half-initialised, and OpenMP reads its
environment at torch's import), with its ipc socket in a run directory of its own under $TMPDIR. Lifetime:
  - start() returns once the core has built its Engine and bound its socket, or raises CoreStartError;
  - stop() asks it to stop (SIGTERM: it drains, then exits), kills it past the timeout, removes the run dir;
  - the core is SIGKILLed when its owner dies (SIGKILL included): nothing reads its audio any more, and a
    stalled core would never act on a SIGTERM, holding its GPU. The run directory of an owner that died is
    removed by the next start() on the machine (the directory names its owner's pid).
Contract: call start() from a thread that lives as long as the owner. Linux delivers the owner-death signal
when the *thread* that started the child exits (PR_SET_PDEATHSIG), not only the process.

This module imports neither torch nor Ray; the child imports torch only after its OpenMP defaults are set.
"""

from __future__ import annotations

import glob
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile

logger = logging.getLogger("ttsserve.deploy.core")

RUN_DIR_PREFIX = "ttsserve-core-"
_OWNER_FILE = "owner.pid"
_LOG_FORMAT = "%(asctime)s %(levelname)s [core] %(name)s: %(message)s"


class CoreStartError(RuntimeError):
    """The engine core failed to start: its own one-line reason, or how it exited."""


def _core_main(engine_cfg, address: str, ready, drain_timeout_s: float, log_level: str, owner_pid: int) -> None:
    """The child's main (what entrypoints/launcher_procs._core_main does for `ttsserve serve`, minus the
    launcher's process group and heartbeat: the owner watches the core through its CoreClient)."""
    from ttsserve.engine.core.parent_death import die_with_parent

    die_with_parent(owner_pid, signal.SIGKILL)
    logging.basicConfig(level=log_level.upper(), format=_LOG_FORMAT, stream=sys.stderr)
    from ttsserve.runner.cpu_threads import openmp_env_defaults

    openmp_env_defaults()  # before torch loads (the next imports): idle OpenMP threads must sleep, not spin
    from ttsserve.engine.core.proc import run_engine_core
    from ttsserve.server.args import server_cpu_defaults

    server_cpu_defaults(engine_cfg)
    sys.exit(run_engine_core(engine_cfg, address, ready, drain_timeout_s))


class EngineCoreProcess:
    """The engine core of `engine_cfg` in a child process (see the module docstring)."""

    def __init__(self, engine_cfg, drain_timeout_s: float = 30.0, log_level: str = "info") -> None:
        self.engine_cfg = engine_cfg
        self.drain_timeout_s = drain_timeout_s
        self.log_level = log_level
        self.run_dir: str | None = None
        self.proc: multiprocessing.process.BaseProcess | None = None

    @property
    def address(self) -> str:
        if self.run_dir is None:
            raise RuntimeError("the engine core is not started")
        return f"ipc://{self.run_dir}/core.sock"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def start(self) -> None:
        """Spawn the core and wait until it is ready (no timeout: a model load takes what it takes; a core that
        dies while loading is seen at once). CoreStartError, with everything cleaned up, if it failed."""
        mp = multiprocessing.get_context("spawn")
        remove_orphaned_run_dirs()
        self.run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
        with open(os.path.join(self.run_dir, _OWNER_FILE), "w") as f:
            f.write(str(os.getpid()))
        ready_r, ready_w = mp.Pipe(duplex=False)
        # not daemonic: a daemonic process may not start processes of its own (torch.compile's workers)
        self.proc = mp.Process(
            target=_core_main,
            name="ttsserve-core",
            daemon=False,
            args=(
                self.engine_cfg,
                self.address,
                ready_w,
                self.drain_timeout_s,
                self.log_level,
                os.getpid(),
            ),
        )
        try:
            self.proc.start()
            ready_w.close()  # the core holds the only write end now: its death reads as EOF
            logger.info("engine core: pid %d, loading the model", self.proc.pid)
            status, detail = self._wait_ready(ready_r)
        except BaseException:  # KeyboardInterrupt included: no orphan core, no leftover run directory
            self.stop()
            raise
        finally:
            ready_r.close()
            ready_w.close()  # closing twice is a no-op
        if status != "ready":
            self.stop()
            raise CoreStartError(f"the engine core failed to start: {detail}")
        logger.info("engine core ready (pid %d)", self.proc.pid)

    def _wait_ready(self, ready_r) -> tuple[str, str]:
        multiprocessing.connection.wait([ready_r, self.proc.sentinel])
        try:
            return ready_r.recv()
        except EOFError:
            self.proc.join(5)
            return "error", f"it exited while starting (status {self.proc.exitcode})"

    def stop(self, timeout_s: float | None = None) -> int | None:
        """Stop the core (SIGTERM, then SIGKILL after `timeout_s`, default the drain timeout + 10 s) and remove
        the run directory. Idempotent. Returns the core's exit status (None if it was never started)."""
        proc = self.proc
        if proc is not None and proc.pid is not None:
            if proc.is_alive():
                proc.terminate()
                proc.join(self.drain_timeout_s + 10 if timeout_s is None else timeout_s)
            if proc.is_alive():
                logger.error("the engine core (pid %d) did not stop: killing it", proc.pid)
                proc.kill()
                proc.join(5)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return None if proc is None else proc.exitcode


def remove_orphaned_run_dirs(tmp: str | None = None) -> list[str]:
    """Remove the run directories in $TMPDIR (or `tmp`) whose owner process is gone; returns their paths.
    A directory without a readable owner file, or of a live owner, is left alone."""
    removed = []
    for path in glob.glob(os.path.join(tmp or tempfile.gettempdir(), RUN_DIR_PREFIX + "*")):
        try:
            with open(os.path.join(path, _OWNER_FILE)) as f:
                owner = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if owner != os.getpid() and not _alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
