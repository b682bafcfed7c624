"""`ttsserve serve --api-server-count N`: one engine-core process and N API-server processes on one port.

Why: HTTP handling and container encoding (mp3 at ~30-60x real time per core) share the GIL with the
engine's step loop in a single process. Split, the engine core steps undisturbed and each API server is its
own interpreter.

Processes (all `spawn`ed; the children get their own process group, so Ctrl-C reaches only the launcher,
and die with the launcher even if it is SIGKILLed):
  launcher         binds the listening socket(s) (listening only once the core is ready, or on Linux once
                   each API server is: until then a connection is refused rather than left hanging),
                   starts and supervises the others,
                   hosts the shared rate limiter (server/shared_limits.py), owns SIGTERM / SIGINT
  engine core      engine/core/proc.py: the Engine and its step loop, at ipc://<run dir>/core.sock
  API server i     uvicorn + the FastAPI app around a CoreClient, accepting on its inherited socket; every
                   response carries `X-API-Server: i`

Connections: on Linux each API server listens on its own socket of one SO_REUSEPORT group, and the kernel
hashes each new connection to one of them. On one shared socket, whichever process woke first accepted
every connection then pending: 128 connections opened at once (a burst of clients, a restart under load)
landed 128-0-0-0 or 98-29-1-0 on 4 API servers, and with keep-alive stayed there, so with mp3 five of 8
servers ran at 100% CPU while the others idled (on the H200 machine). Elsewhere all share one socket.

Shared state: voices in one SQLite file (a `:memory:` store becomes a file in the run directory, so a voice
made through one API server is visible to all), Prometheus counters in PROMETHEUS_MULTIPROC_DIR (a scrape
of any API server sums all of them), rate limits in the launcher. Request ids are namespaced per API server.

Lifecycle: SIGTERM / SIGINT -> the API servers drain (server/drain.py: they keep listening and answer new
requests 503 until the streams of all of them finish, up to --drain-timeout), then the core stops; exit status
0, as the single-process server. A second signal kills everything at once. An API server that dies is restarted
(backoff 1 s doubling to 30 s, back to 1 s after 60 s up); its requests are aborted in the core.

The core is restarted in place the same way: when it dies, or stalls (its loop has not turned for
--engine-stall-timeout s: it is killed), its in-flight requests fail with 503 `engine_dead` (a stream already
under way ends with an error), /ready and /health answer 503 until the new core is up, and each API server's
CoreClient reconnects to it. More than --core-restart-limit core deaths within --core-restart-window s and
the launcher stops everything and exits with status 1, for an orchestrator to see.

The run directory ($TMPDIR/ttsserve-*: core.sock, limits.sock, metrics/, voices.db when --voices-db is
:memory:) is removed at exit; one left by a launcher that was SIGKILLed is removed by the next launcher.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable

from ttsserve.engine.core.launch import clean_stale_run_dirs, make_run_dir
from ttsserve.entrypoints.core_slots import CoreSlot
from ttsserve.entrypoints.launcher_procs import _api_server_main, _configure_logging
from ttsserve.entrypoints.supervision import RestartBackoff
from ttsserve.server.args import public_url
from ttsserve.server.paths import log_outside_paths
from ttsserve.server.preflight import REUSE_PORT_BALANCES, bind_socket

logger = logging.getLogger("ttsserve.launcher")
ENV_COUNT = "TTSSERVE_API_SERVER_COUNT"
_BACKLOG = 2048  # uvicorn's default


def add_api_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("API-server processes (the engine core in its own process)")
    g.add_argument(
        "--api-server-count",
        dest="api_server_count",
        default=None,
        metavar="N",
        help=f"N > 0: run the engine core in its own process and N HTTP/encoding processes on the "
        f"port; 0 = one process [env {ENV_COUNT}; default 0]",
    )


def api_server_count(args: argparse.Namespace, env: dict[str, str] | None = None) -> int:
    """The flag, else $TTSSERVE_API_SERVER_COUNT, else 0. ValueError unless a non-negative integer."""
    env = os.environ if env is None else env
    raw = getattr(args, "api_server_count", None)
    source = "--api-server-count"
    if raw is None:
        raw, source = env.get(ENV_COUNT) or "0", ENV_COUNT
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{source} must be a non-negative integer, got {raw!r}")
    return n


def run_api_servers(
    engine_cfg,
    server_cfg,
    host: str,
    port: int,
    log_level: str,
    count: int,
    sock: socket.socket | None = None,
    core_envs: list[dict[str, str]] | None = None,
    preflight: Callable[[], None] | None = None,
) -> int:
    """The launcher's main (count >= 1). Returns the exit status (see the module docstring). sock: the
    first listening socket, bound but not listening (None: bound here); with count > 1 on Linux, bound with
    preflight.bind_socket(reuse_port=True). core_envs: one environment per engine core
    (data_parallel.plan_cores; None: one core). preflight: the flag checks that import torch
    (preflight.check_engine_config), run while the cores import theirs; its ValueError is raised from here
    after the cores are stopped, with nothing printed."""
    _configure_logging(log_level, "launcher")
    run_dir = make_run_dir()
    try:
        launcher = _Launcher(engine_cfg, server_cfg, host, port, log_level, count, run_dir, core_envs)
        launcher.sock = sock
        if preflight is not None:
            launcher.start_cores(preflight)
        log_outside_paths(engine_cfg, server_cfg)
        clean_stale_run_dirs()
        logger.info("run directory: %s", run_dir)
        return launcher.run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


class _Launcher:
    def __init__(self, engine_cfg, server_cfg, host, port, log_level, count, run_dir, core_envs=None) -> None:
        import dataclasses

        if server_cfg.voices_db == ":memory:":  # per-process memory stores would disagree
            server_cfg = dataclasses.replace(server_cfg, voices_db=os.path.join(run_dir, "voices.db"))
        self.engine_cfg, self.server_cfg = engine_cfg, server_cfg
        self.host, self.port, self.log_level, self.count = host, port, log_level, count
        self.run_dir = run_dir
        limited = server_cfg.requests_per_minute > 0 or server_cfg.chars_per_minute > 0
        self.limits_address = f"ipc://{run_dir}/limits.sock" if limited else None
        self.mp = multiprocessing.get_context("spawn")
        self.signals = 0
        envs = core_envs or [{}]
        self.cores = [
            CoreSlot(self.mp, i, f"ipc://{run_dir}/core-{i}.sock", env, engine_cfg, server_cfg, log_level)
            for i, env in enumerate(envs)
        ]
        self.servers: list = [None] * count
        # 1 where API server i's drain is done or it is not running: they stop together (server/drain.py)
        self.drained = self.mp.RawArray("b", count)
        self.restart_at = [0.0] * count
        self.backoff = [RestartBackoff() for _ in range(count)]
        self.sock: socket.socket | None = None  # the first listening socket
        self.reuse_port = count > 1 and REUSE_PORT_BALANCES
        self.socks: list[socket.socket | None] = []  # API server i's (one shared socket without reuse_port)
        self.limiter = None
        self.serving = False  # every core came up once

    # ---- the launcher's life -----------------------------------------------------------------------
    def start_cores(self, preflight: Callable[[], None]) -> None:
        """Spawn the cores gated, so their interpreters import torch and the engine (seconds) while
        preflight() runs here; release them once it passed. A ValueError from it kills them first."""
        for core in self.cores:
            core.spawn(gated=True)
        try:
            preflight()
        except BaseException:
            for core in self.cores:
                core.stop_gated()
            raise
        for core in self.cores:
            core.release()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            self.sock = self.sock or bind_socket(self.host, self.port, reuse_port=self.reuse_port)
        except ValueError as e:
            logger.error("%s", e)
            return 1
        metrics_dir = os.path.join(self.run_dir, "metrics")
        os.makedirs(metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the API servers
        status = 1
        try:
            for core in self.cores:
                if core.proc is None:  # not started by start_cores()
                    core.spawn()
            # The API servers start while the cores load (their interpreters, imports and text path take
            # seconds): each handshakes with every core once it is up, then listens.
            self.socks = [self.sock] + [None] * (self.count - 1 if self.reuse_port else 0)
            self._start_limiter()
            for i in range(self.count):
                self._start_server(i)
            if self._wait_cores():
                self.serving = True
                if not self.reuse_port:  # one shared socket: connections queue until an API server accepts
                    self.sock.listen(_BACKLOG)
                url = public_url(self.host, self.port)
                logger.info(
                    "serving on %s with %d API servers and %d engine cores: playground %s/  API docs %s/docs",
                    url,
                    self.count,
                    len(self.cores),
                    url,
                    url,
                )
                status = self._supervise()
            elif self.signals:
                status = 0
        finally:
            stop_status = self._stop_all()
        return status or stop_status

    def _on_signal(self, signum, _frame) -> None:
        self.signals += 1
        if self.signals > 1:  # the second Ctrl-C: no more waiting
            for core in self.cores:
                core.kill()
            for p in self.servers:
                if p is not None and p.is_alive():
                    p.kill()

    def _wait_cores(self) -> bool:
        """Wait until every engine core has built its Engine. False if one failed (a bad setting fails them
        all alike) or we were told to stop."""
        pending = list(self.cores)
        while pending and not self.signals:
            for core in list(pending):
                started = core.started(0.5 / len(pending))
                if started is False:
                    return False
                if started:
                    pending.remove(core)
        return not pending

    def _start_limiter(self) -> None:
        if self.limits_address is None:
            return
        from ttsserve.server.limits import RateLimiter
        from ttsserve.server.shared_limits import RateLimitService

        cfg = self.server_cfg
        self.limiter = RateLimitService(
            RateLimiter(cfg.requests_per_minute, cfg.chars_per_minute), self.limits_address
        ).start()

    def _socket_for(self, i: int) -> socket.socket:
        """API server i's socket: the one shared socket, or its own of the SO_REUSEPORT group. Those are only
        bound here: each API server listens on its own once its app is up, and the kernel hashes connections
        over listening sockets only, so a starting or restarting API server is sent none until it can serve
        (and clients arriving during a start are spread over the servers up, not queued on the first)."""
        if not self.reuse_port:
            return self.socks[0]
        if self.socks[i] is None:
            self.socks[i] = bind_socket(self.host, self.port, join=True)
        return self.socks[i]

    def _drop_socket(self, i: int) -> None:
        """API server i died: close our copy of its socket, so the kernel stops sending it connections that
        nobody would accept until the restart (those queued on it are reset). The last one open stays: the
        port must not be lost."""
        if self.reuse_port and self.socks[i] is not None and sum(s is not None for s in self.socks) > 1:
            self.socks[i].close()
            self.socks[i] = None

    def _start_server(self, i: int) -> None:
        try:
            sock = self._socket_for(i)
        except ValueError as e:  # the port's group could not take another socket: retry like a crash
            delay = self.backoff[i].next_delay(time.monotonic())
            logger.error("API server %d: %s; retrying in %.0f s", i, e, delay)
            self.restart_at[i] = time.monotonic() + delay
            return
        addresses = [core.address for core in self.cores]
        p = self.mp.Process(
            target=_api_server_main,
            name=f"ttsserve-api-{i}",
            daemon=False,
            args=(i, sock, self.server_cfg, addresses, self.limits_address, self.log_level, os.getpid(), self.drained),
        )
        self.drained[i] = 0
        p.start()
        self.servers[i] = p
        self.backoff[i].started(time.monotonic())
        logger.info("API server %d: pid %d", i, p.pid)

    def _supervise(self) -> int:
        """Until a signal (-> 0) or every core given up (-> 1); restarts API servers and cores when they die."""
        while not self.signals:
            waiting = [p.sentinel for p in self.servers if p is not None]
            waiting += [w for core in self.cores for w in core.sentinels()]
            multiprocessing.connection.wait(waiting, timeout=0.2)
            for core in self.cores:
                core.supervise()
            if all(core.given_up for core in self.cores):
                logger.error("every engine core is over its restart budget: stopping")
                return 1
            now = time.monotonic()
            for i, p in enumerate(self.servers):
                if p is not None and not p.is_alive():
                    self._drop_socket(i)
                    delay = self.backoff[i].next_delay(now)
                    logger.error("API server %d exited (status %s); restarting in %.0f s", i, p.exitcode, delay)
                    self.servers[i], self.restart_at[i] = None, now + delay
                elif p is None and now >= self.restart_at[i]:
                    self._start_server(i)
        return 0

    def _stop_all(self) -> int:
        """API servers first (they drain), then the core. 0 when everything exited cleanly."""
        for sock in {self.sock, *self.socks} - {None}:  # self.sock is socks[0] once the core started
            sock.close()  # our copies: once the API servers close theirs, new connections are refused
        servers = {i: p for i, p in enumerate(self.servers) if p is not None and p.is_alive()}
        for i in range(len(self.servers)):
            self.drained[i] = i not in servers  # a server down (restarting) holds no request to wait for
        # API servers of cores that never came up hold no request and wait in their handshake: kill them
        stop = signal.SIGTERM if self.serving else signal.SIGKILL
        for p in servers.values():
            os.kill(p.pid, stop)
        clean = self._join_servers(servers, self.server_cfg.drain_timeout_s + 10, stop)
        cores = [core.proc for core in self.cores if core.alive()]  # not those that died
        for p in cores:
            p.terminate()  # a core still loading its model dies of it: that is clean too
        for p in cores:
            clean &= _join(p, 15) in (0, -signal.SIGTERM)
        if self.limiter is not None:
            self.limiter.stop()
        logger.info("stopped" if clean else "stopped, not cleanly")
        return 0 if clean else 1

    def _join_servers(self, servers: dict, grace_s: float, stop: int) -> bool:
        """Wait for the signalled API servers to exit (marking each one that did drained, so that the others stop
        waiting for it if it died mid-drain), killing those still up after grace_s -> whether all exited
        cleanly."""
        deadline, pending, clean = time.monotonic() + grace_s, dict(servers), True
        while pending and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in pending.values()], timeout=0.2)
            for i, p in list(pending.items()):
                if not p.is_alive():
                    self.drained[i] = 1
                    p.join()
                    clean &= pending.pop(i).exitcode in (0, -stop)
        for p in pending.values():
            _kill(p, grace_s)
        return clean and not pending


def _join(p, timeout_s: float) -> int | None:
    p.join(timeout_s)
    if p.is_alive():
        _kill(p, timeout_s)
    return p.exitcode


def _kill(p, waited_s: float) -> None:
    logger.error("%s (pid %d) did not stop in %.0f s: killing it", p.name, p.pid, waited_s)
    p.kill()
    p.join(5)
