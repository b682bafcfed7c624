"""The host's cost of launching a CUDA graph, by the graph's kernel count: what a decode burst pays per frame.

A served step replays the decode graph once per frame of its burst (runner/cuda_graphs.py: k replays and 3k
small copies for a burst of k), each graph about 160 kernels. If cudaGraphLaunch's host time grows with the
graph's node count, one graph of a whole burst would launch no cheaper than k graphs; if it is constant, it would
replace k launches and the copies between them with one. This prints, for graphs of N tiny kernels, the host
microseconds a replay() takes (its launch) and the device's per replay, and the host cost of one small pinned
host-to-device copy (a burst's per-frame copies cost about that each).

Usage (a GPU): python3 benchmarks/graph_replay_cost.py [--kernels 20,200,800] [--reps 200]
"""

from __future__ import annotations

import argparse
import time

import torch


def replay_cost(n: int, reps: int) -> tuple[float, float]:
    """(host us per replay, device us per replay) of a graph of n in-place adds on a 1,024-float tensor."""
    x = torch.zeros(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    x.add_(1)  # the kernel loaded before the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(n):
            x.add_(1)
    for _ in range(20):  # the first launches upload the graph
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / reps * 1e6, (t2 - t0) / reps * 1e6


def copy_cost(reps: int) -> float:
    """Host us of one non-blocking [512, 4] int64 copy from pinned memory (a burst's metadata)."""
    dst = torch.zeros(512, 4, dtype=torch.int64, device="cuda")
    src = torch.zeros(512, 4, dtype=torch.int64, pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / reps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="20,200,800", help="graph sizes (kernels per graph)")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    for n in (int(k) for k in a.kernels.split(",")):
        host, device = replay_cost(n, a.reps)
        print(f"graph of {n:4d} kernels: host {host:8.1f} us per replay, device {device:8.1f} us per replay")
    print(f"pinned host-to-device copy [512, 4] int64: host {copy_cost(1000):.1f} us per copy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
