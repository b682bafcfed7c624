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

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal

from ttsserve.engine.core.launch import clean_stale_run_dirs, core_process_main, make_run_dir

logger = logging.getLogger("ttsserve.deploy.core")


class CoreStartError(RuntimeError):
    """The engine core failed to start: its own one-line reason, or how it exited."""


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
        clean_stale_run_dirs()
        self.run_dir = make_run_dir()
        ready_r, ready_w = mp.Pipe(duplex=False)
        # not daemonic: a daemonic process may not start processes of its own (torch.compile's workers)
        # SIGKILL when the owner dies: a stalled core would never act on a SIGTERM, holding its GPU
        args = (self.engine_cfg, self.address, ready_w, self.drain_timeout_s, self.log_level, os.getpid())
        self.proc = mp.Process(
            target=core_process_main,
            name="ttsserve-core",
            daemon=False,
            args=args,
            kwargs={"death_signal": signal.SIGKILL},
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
