"""`ttsserve serve --data-parallel-size N`: N independent engines (one per GPU) behind one port.

Design: the launcher starts N ordinary `ttsserve serve` processes on 127.0.0.1, consecutive ports from
`--data-parallel-base-port` (default --port + 1), each seeing exactly one GPU (CUDA_VISIBLE_DEVICES=<gpu i>,
--device cuda, so memory profiling and CUDA graphs only ever touch that GPU), and serves --host:--port
itself through a small layer-4 least-connections load balancer (proxy.py) that only routes to replicas whose
/ready answers 200. A replica that exits is restarted with backoff; the balancer keeps it out of rotation
until it is ready again. No engine state is shared: replicas are separate processes (a crash or a CUDA error
takes one GPU down, not the server) and nothing needs NCCL.

On CPU (--device cpu, or auto without CUDA) every replica runs on the CPU with cores split between them
(OMP_NUM_THREADS), which is what the tests use.

Mount: `add_data_parallel_args(parser)` on the serve parser; in run_serve,
`if data_parallel_size(args) > 1: return run_data_parallel(args)`. Standalone (until then):
`python -m ttsserve.entrypoints.data_parallel --data-parallel-size 2 --load-format dummy --dummy-size tiny`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass, field

from ttsserve.deploy.proxy import Backend, LoadBalancer

logger = logging.getLogger("ttsserve.deploy")
ENV_SIZE = "TTSSERVE_DATA_PARALLEL_SIZE"
_DROPPED_FLAGS = ("--host", "--port", "--device", "--data-parallel-size", "--data-parallel-base-port")
REPLICA_HOST = "127.0.0.1"  # replicas listen on loopback only; the balancer is the public endpoint
EXIT_USAGE = 2  # a replica exiting with this code has a configuration error: restarting cannot help


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data parallel (one engine per GPU behind a built-in load balancer)")
    g.add_argument(
        "--data-parallel-size",
        dest="data_parallel_size",
        type=int,
        default=None,
        help=f"number of engine replicas, one per GPU [env {ENV_SIZE}; default 1]",
    )
    g.add_argument(
        "--data-parallel-base-port",
        dest="data_parallel_base_port",
        type=int,
        default=None,
        help="port of replica 0; replica i listens on base + i (default: --port + 1)",
    )


def data_parallel_size(args: argparse.Namespace, env: dict[str, str] | None = None) -> int:
    """The flag, else $TTSSERVE_DATA_PARALLEL_SIZE, else 1 (ValueError if not a positive integer)."""
    env = os.environ if env is None else env
    raw = getattr(args, "data_parallel_size", None)
    raw = raw if raw is not None else env.get(ENV_SIZE) or 1
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--data-parallel-size must be a positive integer, got {raw!r}")
    return n


@dataclass
class ReplicaSpec:
    """How to start replica `index`: `argv` after `python -m ttsserve.entrypoints.serve`, plus `env` overrides."""

    index: int
    port: int
    device: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def child_argv(argv: list[str]) -> list[str]:
    """The parent's serve arguments minus those each replica gets its own value for."""
    out: list[str] = []
    skip = False
    for tok in argv:
        if skip:
            skip = False
        elif tok in _DROPPED_FLAGS:
            skip = True
        elif not tok.startswith(tuple(f + "=" for f in _DROPPED_FLAGS)):
            out.append(tok)
    return out[1:] if out[:1] == ["serve"] else out


def plan_replicas(
    n: int, base_port: int, device: str, gpus: list[str], argv: list[str], cpu_count: int | None = None
) -> list[ReplicaSpec]:
    """One ReplicaSpec per replica. `gpus`: the GPU ids this process may use (CUDA_VISIBLE_DEVICES order).

    device "cpu" (or "auto" with no GPU): CPU replicas, cores split evenly. "auto"/"cuda": replica i gets
    gpus[i] as its only visible GPU. ValueError for too few GPUs, a pinned cuda:N, or ports past 65535.
    """
    if base_port < 1 or base_port + n - 1 > 65535:
        raise ValueError(f"--data-parallel-base-port {base_port}: replica ports must stay within 1..65535")
    if device.startswith("cuda:"):
        raise ValueError(
            f"--device {device} pins one GPU; with --data-parallel-size > 1 use --device cuda "
            f"(or auto): replica i gets GPU i"
        )
    use_cpu = device == "cpu" or (device == "auto" and not gpus)
    if not use_cpu and len(gpus) < n:
        raise ValueError(f"--data-parallel-size {n} needs {n} GPUs, {len(gpus)} visible ({','.join(gpus) or 'none'})")
    base = child_argv(argv)
    threads = str(max(1, (cpu_count or os.cpu_count() or 1) // n))
    specs = []
    for i in range(n):
        port = base_port + i
        dev = "cpu" if use_cpu else "cuda"
        # ENV_SIZE=1: a replica that inherited TTSSERVE_DATA_PARALLEL_SIZE must not launch replicas itself.
        env = {ENV_SIZE: "1", **({"OMP_NUM_THREADS": threads} if use_cpu else {"CUDA_VISIBLE_DEVICES": gpus[i]})}
        argv_i = base + ["--host", REPLICA_HOST, "--port", str(port), "--device", dev]
        specs.append(ReplicaSpec(i, port, dev, argv_i, env))
    return specs


def visible_gpus(env: dict[str, str] | None = None) -> list[str]:
    """GPU ids this process may use: $CUDA_VISIBLE_DEVICES if set, else 0..device_count-1 (torch)."""
    env = os.environ if env is None else env
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip() and g.strip() != "-1"]
    import torch  # only when GPUs may be used: the count needs the CUDA driver

    return [str(i) for i in range(torch.cuda.device_count())]


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the launcher dies, even by SIGKILL, so no replica is
    left holding a GPU."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Supervisor:
    """Runs the replicas, restarts any that exits (backoff 1 s doubling to 30 s, reset once it was up for a
    minute), stops them all with SIGTERM (SIGKILL after `grace_s`). A replica exiting with code 2 (bad
    configuration) stops everything: every replica would fail the same way."""

    def __init__(self, specs: list[ReplicaSpec], grace_s: float = 35.0) -> None:
        self.specs, self.grace_s = specs, grace_s
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.stopping = False
        self.fatal = asyncio.Event()
        self.restarts = [0] * len(specs)
        self._relays: set[asyncio.Task] = set()

    async def _spawn(self, spec: ReplicaSpec) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "ttsserve.entrypoints.serve",
            *spec.argv,
            env={**os.environ, **spec.env},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        logger.info(
            "replica %d: pid %d, %s, port %d",
            spec.index,
            proc.pid,
            spec.env.get("CUDA_VISIBLE_DEVICES", "cpu") if spec.device == "cuda" else "cpu",
            spec.port,
        )
        relay = asyncio.create_task(self._relay(spec.index, proc))
        self._relays.add(relay)
        relay.add_done_callback(self._relays.discard)
        return proc

    @staticmethod
    async def _relay(index: int, proc: asyncio.subprocess.Process) -> None:
        """Prefix the replica's log lines (drains the pipe so the child never blocks on it)."""
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            sys.stderr.write(f"[replica {index}] {line.decode(errors='replace')}")

    async def _watch(self, spec: ReplicaSpec) -> None:
        backoff = 1.0
        loop = asyncio.get_running_loop()
        while not self.stopping:
            started = loop.time()
            proc = self.procs[spec.index] = await self._spawn(spec)
            rc = await proc.wait()
            if self.stopping:
                return
            if rc == EXIT_USAGE:
                logger.error("replica %d exited with a configuration error (code %d): stopping", spec.index, rc)
                self.fatal.set()
                return
            if loop.time() - started > 60:  # it was up for a while: a fresh failure, not a crash loop
                backoff = 1.0
            self.restarts[spec.index] += 1
            logger.warning("replica %d exited (code %s); restarting in %.0f s", spec.index, rc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    def start(self) -> list[asyncio.Task]:
        return [asyncio.create_task(self._watch(s)) for s in self.specs]

    async def stop(self) -> None:
        self.stopping = True
        live = [p for p in self.procs.values() if p.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in live)), self.grace_s)
        except TimeoutError:
            for p in live:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
            await asyncio.gather(*(p.wait() for p in live))


async def serve_data_parallel(host: str, port: int, specs: list[ReplicaSpec], grace_s: float = 35.0) -> int:
    """Run replicas + balancer until SIGINT/SIGTERM (-> 0) or a replica's configuration error (-> 2)."""
    sup = Supervisor(specs, grace_s)
    lb = LoadBalancer(host, port, [Backend(REPLICA_HOST, s.port) for s in specs])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watchers = sup.start()
    await lb.start()
    logger.info("data parallel: %d replicas behind http://%s:%d", len(specs), host, port)
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(sup.fatal.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    logger.info("shutting down: draining replicas")
    await lb.stop()
    await sup.stop()
    for t in watchers + waits:
        t.cancel()
    return EXIT_USAGE if sup.fatal.is_set() else 0


def run_data_parallel(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Entry point for `ttsserve serve --data-parallel-size N` (N >= 1). `argv`: the serve arguments as
    typed (default sys.argv[1:]), forwarded to every replica minus host/port/device. Returns the exit code."""
    from ttsserve.server.args import build_configs

    try:
        n = data_parallel_size(args)
        engine_cfg, server_cfg, host, port, log_level = build_configs(args)
        base_port = getattr(args, "data_parallel_base_port", None) or port + 1
        device = engine_cfg.device
        gpus = [] if device == "cpu" else visible_gpus()
        specs = plan_replicas(n, base_port, device, gpus, sys.argv[1:] if argv is None else argv)
        if port in range(base_port, base_port + n):
            raise ValueError(f"--port {port} collides with the replica ports {base_port}..{base_port + n - 1}")
        for spec in specs:  # one voices file for all replicas: the front port's (a --voices-db flag still wins)
            spec.env.setdefault("TTSSERVE_VOICES_DB", server_cfg.voices_db)
    except ValueError as e:
        print(f"ttsserve serve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve_data_parallel(host, port, specs, grace_s=server_cfg.drain_timeout_s + 5))


def main(argv: list[str] | None = None) -> int:
    from ttsserve.server.args import add_serve_arguments

    parser = argparse.ArgumentParser(
        prog="python -m ttsserve.entrypoints.data_parallel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(parser)
    add_data_parallel_args(parser)
    argv = sys.argv[1:] if argv is None else argv
    return run_data_parallel(parser.parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
