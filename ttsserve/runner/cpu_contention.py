"""The engine thread's OpenMP team, adapted to what else runs on its cores.

With OpenMP threads that spin briefly between parallel regions (runner/cpu_threads.py, GOMP_SPINCOUNT), 2
threads on 2 free cores run a decode step's 80 GEMMs at twice the memory bandwidth of one (real-size int8 GEMMs
10 ms against 19 ms at batch 1); sleeping threads (OMP_WAIT_POLICY=PASSIVE) pay a wake-up per GEMM and were no
faster than 1 thread. But when another process keeps one of the 2 cores busy, every parallel region waits for
the thread the scheduler put off its core: spinning 2-thread steps took 44-72 ms against 24 ms with 1 thread
(benchmarks/cpu_breakdown.py, docs/benchmarks-history.md). So the engine thread watches its cores: from
/proc/stat, the CPU time of its cores not spent by this process (other processes, and the hypervisor's steal)
over the last half second; above CONTENDED CPUs of it, it runs 1 thread, below FREE again the full team.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CONTENDED, FREE = 0.3, 0.15  # CPUs' worth of others' time on our cores (hysteresis between the two)
INTERVAL_S = 0.5
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system (idle iowait) irq softirq steal, in /proc/stat's order


def busy_seconds(cpus: set[int], proc_stat: str | Path = "/proc/stat") -> float | None:
    """Busy seconds of `cpus` since boot (None if /proc/stat cannot be read)."""
    try:
        lines = Path(proc_stat).read_text().splitlines()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return total / ticks


class ThreadMonitor:
    """threads: the policy's team size; tick() once per engine step, from the thread that runs the steps.
    Inactive (tick() does nothing) for a team of 1, an explicit thread count (the user decided), or more
    cores in the affinity mask than twice the team (a share of a big host: others' work elsewhere is not ours)."""

    def __init__(self, threads: int, explicit: bool, proc_stat: str | Path = "/proc/stat") -> None:
        self.full, self.current = threads, threads
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.cpus, self.proc_stat = cpus, proc_stat
        self.active = threads > 1 and not explicit and 0 < len(cpus) <= 2 * threads
        self._last: tuple[float, float, float] | None = None  # (monotonic, busy s, own CPU s)
        self._next = 0.0
        self.switches = 0
        self.tick()  # the first reading: the start-up's work (seconds of it) is the first window

    def tick(self) -> None:
        if not self.active:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + INTERVAL_S
        busy, own = busy_seconds(self.cpus, self.proc_stat), time.process_time()
        if busy is None:
            self.active = False
            return
        last, self._last = self._last, (now, busy, own)
        if last is None or now - last[0] <= 0:
            return
        others = max(0.0, (busy - last[1]) - (own - last[2])) / (now - last[0])  # CPUs' worth
        want = 1 if others > CONTENDED else self.full if others < FREE else self.current
        if want != self.current:
            self._apply(want, others)

    def _apply(self, threads: int, others: float) -> None:
        import torch

        torch.set_num_threads(threads)
        self.current = threads
        self.switches += 1
        logger.info(
            "CPU: other work takes %.2f CPUs of this engine's %d cores: %d intra-op thread%s",
            others,
            len(self.cpus),
            threads,
            "" if threads == 1 else "s",
        )
