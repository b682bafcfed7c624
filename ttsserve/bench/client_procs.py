"""The serve bench's load spread over several client processes (`bench serve --client-procs N`).

One Python client process stops keeping up before the server does: at 128 PCM streams on an H200 it set the
figure (TTFA p99 7.3 s, against 0.73 s with four processes on the same server) while using 0.76 of a core.
Here N spawned processes each drive a share of the point (a closed loop's clients or an open
loop's arrival rate, and every N-th request of the texts, with the request indices of a one-process run so
ids and seeds stay the same); they start together behind a barrier and send back their records and CPU use.
The wall time is from that start to the last process's end.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

from ttsserve.bench.results import RequestRecord

START_TIMEOUT_S = 120.0  # spawning and importing httpx; far beyond what it takes


def spread(load_kind: str, load: float, items: list, procs: int) -> list[tuple[float, list]]:
    """-> (load share, items) per process that has work. A closed loop's clients split as evenly as integers
    allow (never a process with none); an open loop's rate splits evenly. Items go round robin."""
    if load_kind == "concurrency":
        n = min(procs, int(load))
        loads = [float(int(load) // n + (k < int(load) % n)) for k in range(n)]
    else:
        n = procs
        loads = [load / n] * n
    return [(loads[k], items[k::n]) for k in range(n) if items[k::n]]


async def drive_in_processes(
    spec, load_kind: str, load: float, items: list, procs: int
) -> tuple[list[RequestRecord], list[float], list[float], float]:
    """Run the point over `procs` processes -> (every record, each process's CPU per wall second, each one's
    longest event-loop stall, wall seconds). RuntimeError if a process fails to start or report."""
    ctx = mp.get_context("spawn")  # fork would copy this process's event loop and open sockets
    shares = spread(load_kind, load, items, procs)
    barrier, results = ctx.Barrier(len(shares) + 1), ctx.Queue()
    workers = [
        ctx.Process(
            target=_client_main, daemon=True, args=(spec, load_kind, share, chunk, spec.seed + k, barrier, results)
        )
        for k, (share, chunk) in enumerate(shares)
    ]
    for p in workers:
        p.start()
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, barrier.wait, START_TIMEOUT_S)
        t0 = time.perf_counter()
        timeout = spec.duration + spec.timeout + 60
        replies = [await loop.run_in_executor(None, results.get, True, timeout) for _ in workers]
        wall = time.perf_counter() - t0
    except Exception as e:
        raise RuntimeError(f"a bench client process failed: {type(e).__name__}: {e}") from e
    finally:
        for p in workers:
            p.join(5)
            if p.is_alive():
                p.kill()
    failed = [r for r in replies if isinstance(r, str)]
    if failed:
        raise RuntimeError(f"a bench client process failed: {failed[0]}")
    records = [RequestRecord(**r) for recs, _, _ in replies for r in recs]
    return records, [cpu for _, cpu, _ in replies], [stall for _, _, stall in replies], wall


def _client_main(spec, load_kind: str, load: float, items: list, seed: int, barrier, results) -> None:
    """One client process: wait for the others, drive its share, report (records as dicts, cpu) or an error
    string; never leave the parent waiting on the queue."""
    import logging
    from dataclasses import asdict

    from ttsserve.bench.serving import drive_load

    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        barrier.wait(START_TIMEOUT_S)
        records, cpu, stall = asyncio.run(drive_load(spec, load_kind, load, items, seed))
        results.put(([asdict(r) for r in records], cpu, stall))
    except BaseException as e:  # the parent must hear of it, whatever it is
        results.put(f"{type(e).__name__}: {e}")
