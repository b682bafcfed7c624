"""`ttsserve serve --data-parallel-size N`: N engine-core processes (one per GPU, or `--cores-per-gpu K` on
each GPU) behind one set of API servers.

Every API server holds a client to every core (engine/core/dp_client.py) and sends each request to the core
with the least outstanding work; the launcher (api_servers.py) supervises each core on its own. This module
plans the cores: which GPU each sees (CUDA_VISIBLE_DEVICES=<gpu i>, so memory profiling and CUDA graphs
only ever touch that GPU), or on the CPU how many threads each gets (the cores split the CPUs evenly).
No engine state is shared between cores and nothing needs NCCL: a crash or a CUDA error takes one core
down, not the server. nginx in front of whole machines remains the way to spread traffic over machines.

Several cores on one GPU (`--cores-per-gpu K`): where one core's host work (Python: scheduling, inputs,
outputs, audio bookkeeping) rather than the GPU sets the pace, K processes bring K host threads to the same
GPU; each takes 1/K of its memory (EngineConfig.gpu_share) and the GPU time-slices their work.
"""

from __future__ import annotations

import argparse
import os

ENV_SIZE = "TTSSERVE_DATA_PARALLEL_SIZE"
ENV_PER_GPU = "TTSSERVE_CORES_PER_GPU"


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
    g.add_argument(
        "--cores-per-gpu",
        dest="cores_per_gpu",
        default=None,
        metavar="K",
        help=f"place up to K of the N cores on each GPU (each takes 1/K of its memory): more host threads for "
        f"one GPU where the engine core's host work is the wall [env {ENV_PER_GPU}; default 1]",
    )


def data_parallel_size(args: argparse.Namespace, env: dict[str, str] | None = None) -> int:
    """The flag, else $TTSSERVE_DATA_PARALLEL_SIZE, else 1 (ValueError if not a positive integer)."""
    return _positive(args, "data_parallel_size", ENV_SIZE, env)


def cores_per_gpu(args: argparse.Namespace, env: dict[str, str] | None = None) -> int:
    """The flag, else $TTSSERVE_CORES_PER_GPU, else 1 (ValueError if not a positive integer)."""
    return _positive(args, "cores_per_gpu", ENV_PER_GPU, env)


def _positive(args: argparse.Namespace, dest: str, env_name: str, env: dict[str, str] | None) -> int:
    env = os.environ if env is None else env
    raw = getattr(args, dest, None)
    source = "--" + dest.replace("_", "-")
    if raw is None:
        raw, source = env.get(env_name) or "1", env_name
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{source} must be a positive integer, got {raw!r}")
    return n


def plan_cores(
    n: int, device: str, gpus: list[str], cpu_count: int | None = None, per_gpu: int = 1
) -> list[dict[str, str]]:
    """The environment of each of `n` engine cores. `gpus`: the GPU ids this process may use
    (CUDA_VISIBLE_DEVICES order). On the CPU (device "cpu", or "auto" without a GPU) each core gets an even
    share of the CPUs as its OpenMP threads; otherwise the cores go round the first ceil(n / per_gpu) GPUs, core
    i seeing gpus[i % that] only. ValueError for too few GPUs, a device that pins one GPU, or per_gpu > 1 on
    the CPU."""
    if per_gpu > 1 and (device == "cpu" or (device == "auto" and not gpus)):
        raise ValueError("--cores-per-gpu applies to GPUs: on the CPU the cores split its threads")
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
    used = -(-n // per_gpu)
    if len(gpus) < used:
        each = f" at {per_gpu} cores a GPU" if per_gpu > 1 else ""
        raise ValueError(
            f"--data-parallel-size {n} needs {used} GPUs{each}, {len(gpus)} visible ({','.join(gpus) or 'none'})"
        )
    return [{"CUDA_VISIBLE_DEVICES": gpus[i % used]} for i in range(n)]


def gpu_share(core_envs: list[dict[str, str]]) -> int:
    """The most cores plan_cores put on one GPU (each of them sizes itself to that share of its memory)."""
    gpus = [env["CUDA_VISIBLE_DEVICES"] for env in core_envs if "CUDA_VISIBLE_DEVICES" in env]
    return max((gpus.count(g) for g in gpus), default=1)


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
