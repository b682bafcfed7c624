"""The CPU thread policy: how many threads the engine's torch ops use, and how idle OpenMP threads wait.

A CPU decode step is ~200 small parallel regions (80 linears, 20 attention gathers and SDPAs, norms,
softmaxes). Each region needs EVERY thread of the OpenMP team to run, so a thread more than the cores
that are really free turns each region into a wait for the scheduler: 2 threads on 2 cores that other
processes also use made a bf16 step 30x slower than 1 thread (benchmarks/cpu_profile.py, docs/benchmarks-history.md).
Hence:
- intra-op threads = the physical cores this process may run on (affinity mask, SMT siblings counted
  once, capped by a cgroup CPU quota), unless OMP_NUM_THREADS or an explicit number says otherwise;
- one inter-op thread: the engine never uses inter-op parallelism (no torch.jit.fork);
- the engine thread runs the GPT and the audio stage one after the other, so they share one team and
  never oversubscribe each other; other threads of the process should not run heavy torch ops;
- `openmp_env_defaults()` sets GOMP_SPINCOUNT=20000 (and KMP_BLOCKTIME=1 for Intel's runtime) before torch
  is imported when the engine will run on the CPU (OMP_WAIT_POLICY=PASSIVE for a GPU engine), unless
  OMP_WAIT_POLICY or those are set: a thread done with a parallel region spins ~0.25 ms
  (20,000 pause loops of ~12 ns on the development VM) for the next one, then sleeps. The GEMMs of a decode
  step come tens of microseconds apart, so the team stays awake through the GPT and sleeps between steps;
  waking a sleeping thread cost ~100 us per GEMM on that VM (PASSIVE: 2 threads no faster than 1), spinning
  forever (ACTIVE, or libgomp's default of ~4 ms there) starves other processes. On a machine whose cores
  other work also uses, spinning teams stall each other: runner/cpu_contention.py then drops to 1 thread.
  It must run before `import torch` (the OpenMP runtime reads it once, when it loads).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

OPENMP_ENV_DEFAULTS = {"GOMP_SPINCOUNT": "20000", "KMP_BLOCKTIME": "1"}  # a CPU engine's process
# a GPU engine's process: its torch work is on the GPU, and a team of one thread per core spinning after the
# rare host-side parallel op would only take cycles from the API servers
GPU_OPENMP_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
# a user's choice of any of these keeps all of the defaults out
WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


@dataclass(frozen=True)
class CpuThreadPolicy:
    """intra_op_threads: torch.set_num_threads; inter_op_threads: torch.set_num_interop_threads;
    source: what decided the count ("argument", "OMP_NUM_THREADS" or "physical cores")."""

    intra_op_threads: int
    inter_op_threads: int
    source: str
    physical_cores: int
    cpu_quota: float | None = None

    def describe(self) -> str:
        quota = "" if self.cpu_quota is None else f", cgroup quota {self.cpu_quota:g} CPUs"
        return (
            f"CPU threads: {self.intra_op_threads} intra-op ({self.source}), {self.inter_op_threads} "
            f"inter-op; {self.physical_cores} physical cores available{quota}; "
            + ", ".join(f"{k}={os.environ.get(k, 'unset')}" for k in WAIT_ENV[:2])
        )


def physical_cores(cpus: set[int] | None = None, sys_cpu: str | Path = "/sys/devices/system/cpu") -> int:
    """Distinct physical cores among `cpus` (default: this process's affinity mask). SMT siblings share
    (package id, core id); without sysfs topology every logical CPU counts as a core."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topo = Path(sys_cpu) / f"cpu{cpu}" / "topology"
        try:
            cores.add(
                (topo.joinpath("physical_package_id").read_text().strip(), topo.joinpath("core_id").read_text().strip())
            )
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(len(cores), 1)


def cgroup_cpu_quota(cpu_max: str | Path = "/sys/fs/cgroup/cpu.max") -> float | None:
    """CPUs' worth of time a cgroup v2 quota allows (`docker --cpus`), or None when unlimited / unknown."""
    try:
        quota, period = Path(cpu_max).read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def plan_cpu_threads(
    num_threads: int | None = None,
    environ: MutableMapping[str, str] | None = None,
    cores: int | None = None,
    quota: float | None = None,
) -> CpuThreadPolicy:
    """The policy, computed without touching torch. num_threads (e.g. a --threads flag) beats
    OMP_NUM_THREADS, which beats the physical cores (capped by the cgroup quota, rounded up)."""
    env = os.environ if environ is None else environ
    cores = physical_cores() if cores is None else cores
    quota = cgroup_cpu_quota() if quota is None else quota
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        return CpuThreadPolicy(num_threads, 1, "argument", cores, quota)
    omp = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if omp:
        try:
            n = int(omp)
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {omp!r}") from None
        if n < 1:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {omp!r}")
        return CpuThreadPolicy(n, 1, "OMP_NUM_THREADS", cores, quota)
    n = cores if quota is None else max(1, min(cores, math.ceil(quota)))
    return CpuThreadPolicy(n, 1, "physical cores", cores, quota)


def configure_cpu_threads(num_threads: int | None = None) -> CpuThreadPolicy:
    """Apply the policy to torch (call once, from the thread that will run the engine or before it starts
    any torch op: torch gives each thread its team size when the thread first runs a parallel op)."""
    import torch

    policy = plan_cpu_threads(num_threads)
    if torch.get_num_threads() != policy.intra_op_threads:
        torch.set_num_threads(policy.intra_op_threads)
    if torch.get_num_interop_threads() != policy.inter_op_threads:
        try:
            torch.set_num_interop_threads(policy.inter_op_threads)
        except RuntimeError:  # only possible before the first inter-op task; harmless to keep the pool
            logger.debug("inter-op thread pool already started; left at %d", torch.get_num_interop_threads())
    logger.info(policy.describe())
    return policy


def runs_on_cpu(argv: list[str] | None = None, environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether this process's engine will run on the CPU, decided before torch loads (so without asking it):
    `--device cpu` (or $TTSSERVE_DEVICE), else `--device cuda...`, else whether an NVIDIA device is visible."""
    argv, env = sys.argv if argv is None else argv, os.environ if environ is None else environ
    device = env.get("TTSSERVE_DEVICE", "auto")
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            device = argv[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    if device != "auto":
        return device == "cpu"
    if env.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return True
    return not Path("/dev/nvidiactl").exists()


def openmp_env_defaults(environ: MutableMapping[str, str] | None = None, on_cpu: bool | None = None) -> dict[str, str]:
    """Set OPENMP_ENV_DEFAULTS (GPU_OPENMP_ENV_DEFAULTS when the engine runs on a GPU: runs_on_cpu) unless the
    user has set a wait policy (WAIT_ENV); returns what was set. A no-op (with a warning) once torch is
    imported: the OpenMP runtime has read its environment by then."""
    env = os.environ if environ is None else environ
    cpu = runs_on_cpu(environ=env) if on_cpu is None else on_cpu
    todo = {} if any(k in env for k in WAIT_ENV) else dict(OPENMP_ENV_DEFAULTS if cpu else GPU_OPENMP_ENV_DEFAULTS)
    if not todo:
        return {}
    if environ is None and "torch" in sys.modules:
        logger.warning("openmp_env_defaults() called after `import torch`: %s not applied", todo)
        return {}
    env.update(todo)
    return todo


_OPENMP_LIBS = ("libgomp.so.1", "libiomp5.so")  # the runtimes torch builds link; only an already loaded one is used


def release_openmp_pool() -> bool:
    """Free the calling thread's idle OpenMP worker threads (OpenMP 5's omp_pause_resource_all); the thread
    gets a new team if it runs parallel work again. Call it on a thread that is done with torch work when
    another thread takes the engine over: libgomp lets waiting threads spin only while the process holds no
    more OpenMP threads than it has CPUs, so the start-up thread's idle team put the engine thread's to sleep
    after every region (a batch-1 step 25 ms on the engine thread against 15 ms on the start-up thread, 2 cores).
    Returns whether a runtime took the call (False without a loaded OpenMP runtime that has it)."""
    import ctypes

    for name in _OPENMP_LIBS:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        fn = getattr(lib, "omp_pause_resource_all", None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn(1) == 0  # omp_pause_soft: libgomp frees the pool either way
    return False


def log_cpu_step_mode(engine_cfg) -> None:
    """A CPU server runs its decode step eagerly unless $TTSSERVE_CPU_COMPILE says otherwise ("1": the decode
    attention, then the whole decode step, compiled with torch.compile before /ready; "attention": the
    attention only). On the real-size model at one stream the compiled step is no faster than the eager one
    and the compile takes about a minute on 2 cores (BENCHMARKS.md, CPU first requests); it pays off with many
    streams. Logs the choice in one line."""
    import torch

    from ttsserve.config import COMPILE_ENV, compile_level

    log = logging.getLogger("ttsserve.server")
    on_cpu = engine_cfg.device == "cpu" or (engine_cfg.device == "auto" and not torch.cuda.is_available())
    if not on_cpu:
        return
    if compile_level() == "0":
        log.info(
            "CPU: the decode step runs eager (%s=1 compiles it before /ready: about a minute, faster with many "
            "streams)",
            COMPILE_ENV,
        )
    else:
        logging.getLogger("ttsserve.server").info(
            "CPU: %s=%s: compiling before /ready (about a minute on 2 cores)", COMPILE_ENV, compile_level()
        )
