"""`ttsserve serve --data-parallel-size N`: N engine-core processes (one per GPU) behind one set of API servers.

Every API server holds a client to every core (engine/core/dp_client.py) and sends each request to the core
with the least outstanding work; the launcher (api_servers.py) supervises each core on its own. This module
plans the cores: which GPU each sees (CUDA_VISIBLE_DEVICES=<gpu i>, so memory profiling and CUDA graphs
only ever touch that GPU), or on the CPU how many threads each gets (the cores split the CPUs evenly).
No engine state is shared between cores and nothing needs NCCL: a crash or a CUDA error takes one core
down, not the server. nginx in front of whole machines remains the way to spread traffic over machines.
"""

from __future__ import annotations

import argparse
import os

ENV_SIZE = "TTSSERVE_DATA_PARALLEL_SIZE"


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data parallel (one engine core per GPU behind the API servers)")
    g.add_argument(
        "--data-parallel-size",
        dest="data_parallel_size",
        default=None,
        metavar="N",
        help=f"number of engine-core processes, one per GPU; N > 1 runs at least one API server "
        f"[env {ENV_SIZE}; default 1]",
    )


def data_parallel_size(args: argparse.Namespace, env: dict[str, str] | None = None) -> int:
    """The flag, else $TTSSERVE_DATA_PARALLEL_SIZE, else 1 (ValueError if not a positive integer)."""
    env = os.environ if env is None else env
    raw = getattr(args, "data_parallel_size", None)
    source = "--data-parallel-size"
    if raw is None:
        raw, source = env.get(ENV_SIZE) or "1", ENV_SIZE
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{source} must be a positive integer, got {raw!r}")
    return n


def plan_cores(n: int, device: str, gpus: list[str], cpu_count: int | None = None) -> list[dict[str, str]]:
    """The environment of each of `n` engine cores. `gpus`: the GPU ids this process may use
    (CUDA_VISIBLE_DEVICES order). On the CPU (device "cpu", or "auto" without a GPU) each core gets an even
    share of the CPUs as its OpenMP threads; otherwise core i sees gpus[i] only. ValueError for too few GPUs
    or a device that pins one GPU."""
    if n == 1:
        return [{}]
    if device.startswith("cuda:"):
        raise ValueError(
            f"--device {device} pins one GPU; with --data-parallel-size {n} use --device cuda (or auto): "
            f"core i gets GPU i"
        )
    if device == "cpu" or (device == "auto" and not gpus):
        threads = str(max(1, (cpu_count or os.cpu_count() or 1) // n))
        return [{"OMP_NUM_THREADS": threads} for _ in range(n)]
    if len(gpus) < n:
        raise ValueError(f"--data-parallel-size {n} needs {n} GPUs, {len(gpus)} visible ({','.join(gpus) or 'none'})")
    return [{"CUDA_VISIBLE_DEVICES": gpus[i]} for i in range(n)]


def visible_gpus(device: str, env: dict[str, str] | None = None) -> list[str]:
    """GPU ids this process may use: none for --device cpu, else $CUDA_VISIBLE_DEVICES if set, else
    0..device_count-1 (torch; only imported when GPUs may be used)."""
    env = os.environ if env is None else env
    if device == "cpu":
        return []
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip() and g.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]
