"""One engine-core process as the launcher (api_servers.py) sees it: start, watch, restart, stop.

A core that dies, or stalls (its loop has not turned for --engine-stall-timeout s: it is killed), is
restarted after a backoff (1 s doubling to 30 s, back to 1 s after 60 s up). Its deaths are counted: more
than --core-restart-limit within --core-restart-window s and the slot gives up on it (`given_up`); the
launcher stops everything once every core has given up, so an orchestrator sees a server that cannot stay up
while one bad GPU of several leaves the others serving.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import time

from ttsserve.entrypoints.launcher_procs import _core_main
from ttsserve.entrypoints.supervision import DeathBudget, RestartBackoff

logger = logging.getLogger("ttsserve.launcher")


class CoreSlot:
    """Engine core `index` at `address`, with `env` (its GPU or its thread count) set before torch loads."""

    def __init__(self, mp, index: int, address: str, env: dict[str, str], engine_cfg, server_cfg, log_level: str):
        self.mp, self.index, self.address, self.env = mp, index, address, env
        self.engine_cfg, self.server_cfg, self.log_level = engine_cfg, server_cfg, log_level
        self.proc = None
        self.ready_pipe = None  # the starting core's pipe; None once it is up
        self._go = None  # a gated core's go pipe (write end) until release()
        self.restart_at: float | None = None  # down until then
        self.backoff = RestartBackoff()
        self.deaths = DeathBudget(server_cfg.core_restart_limit, server_cfg.core_restart_window_s)
        self.heartbeat = mp.Value("d", 0.0, lock=False)  # the core loop's last turn (time.monotonic())
        self.given_up = False
        self.name = f"engine core {index}"

    def sentinels(self) -> list:
        if self.proc is None or self.given_up:
            return []
        return [self.proc.sentinel] + ([self.ready_pipe] if self.ready_pipe is not None else [])

    def spawn(self, gated: bool = False) -> None:
        """Start the core process. gated: it imports torch and the engine, then waits for release() (or
        is killed by stop_gated()) before it loads the model."""
        ready_r, ready_w = self.mp.Pipe(duplex=False)
        go_r, self._go = self.mp.Pipe(duplex=False) if gated else (None, None)
        # not daemonic: a daemonic process may not start processes of its own (torch.compile's workers)
        self.proc = self.mp.Process(
            target=_core_main,
            name=f"ttsserve-core-{self.index}",
            daemon=False,
            args=(
                self.engine_cfg,
                self.address,
                ready_w,
                self.server_cfg.drain_timeout_s,
                self.log_level,
                os.getpid(),
                self.heartbeat,
                self.env,
                self.index,
                go_r,
            ),
        )
        self.proc.start()
        ready_w.close()  # the core holds the only write end now: its death reads as EOF
        if go_r is not None:
            go_r.close()
        self.ready_pipe, self.restart_at = ready_r, None
        if not gated:
            self._log_loading()

    def release(self) -> None:
        """Let a gated core load its model (one that died meanwhile shows as a failed start)."""
        try:
            self._go.send(True)
        except OSError:  # BrokenPipeError: it is gone; started() reads its end
            pass
        self._go.close()
        self._go = None
        self._log_loading()

    def stop_gated(self) -> None:
        """Kill a gated core (it has printed nothing yet) and wait for it."""
        self._go.close()
        self._go = None
        self.proc.kill()
        self.proc.join(10)

    def _log_loading(self) -> None:
        shown = ", ".join(f"{k}={v}" for k, v in self.env.items())
        logger.info("%s: pid %d, loading the model%s", self.name, self.proc.pid, f" ({shown})" if shown else "")

    def started(self, timeout_s: float) -> bool | None:
        """The starting core's news: True (ready), False (failed), None (still loading)."""
        if not multiprocessing.connection.wait([self.ready_pipe, self.proc.sentinel], timeout=timeout_s):
            return None
        ready_r, self.ready_pipe = self.ready_pipe, None
        try:
            status, detail = ready_r.recv()
        except EOFError:
            logger.error("%s exited while starting (status %s)", self.name, self.proc.exitcode)
            return False
        finally:
            ready_r.close()
        if status == "ready":
            self.heartbeat.value = time.monotonic()
            self.backoff.started(time.monotonic())
            logger.info("%s ready (pid %d)", self.name, self.proc.pid)
            return True
        logger.error("%s failed to start: %s", self.name, detail)
        return False

    def supervise(self) -> None:
        """Restart the core if it died or stalled (after its backoff); give up past the death budget."""
        if self.given_up:
            return
        now = time.monotonic()
        if self.restart_at is not None:  # down, waiting for its backoff
            if now >= self.restart_at:
                self.spawn()
            return
        if self.ready_pipe is not None:  # loading
            if self.started(0) is not False:
                return
            reason = "failed to start"
        elif not self.proc.is_alive():
            reason = f"exited (status {self.proc.exitcode})"
        elif now - self.heartbeat.value > self.server_cfg.engine_stall_timeout_s:
            reason = f"stalled (its loop has not turned in {now - self.heartbeat.value:.1f} s): killed"
            self.proc.kill()
        else:
            return
        self.proc.join(5)
        if not self.deaths.record(now):
            cfg = self.server_cfg
            logger.error(
                "%s %s; %d deaths within %.0f s is over --core-restart-limit %d: giving up on it",
                self.name,
                reason,
                len(self.deaths.deaths),
                cfg.core_restart_window_s,
                cfg.core_restart_limit,
            )
            self.given_up = True
            return
        delay = self.backoff.next_delay(now)
        logger.error("%s %s; restarting it in %.0f s", self.name, reason, delay)
        self.restart_at = now + delay

    def alive(self) -> bool:
        return self.proc is not None and self.proc.pid is not None and self.proc.is_alive()

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
