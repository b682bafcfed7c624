"""Does a Triton GEMV beat cuBLAS on a decode layer's four linears at 1-8 rows? (benchmarks/gemv_kernel.py)

Times, inside CUDA graphs (as the engine replays them), F.linear against the GEMV kernel at every tile in the
sweep, for the GPT's shapes (qkv 768 -> 2304, o 768 -> 768, gate_up 768 -> 6144, down 3072 -> 768), then a
layer's four linears back to back with each shape's best tile. Checks every output against F.linear first.
Prints microseconds per call and writes JSON. On an H100 (bf16) the GEMV won at one row for qkv, o and down
(1.11-1.61x) and lost for gate_up and from 4 rows; in the engine it did not shorten a 10-s utterance, so the
engine keeps cuBLAS (benchmarks/gemv_kernel.py says more; BENCHMARKS.md).

    python3 benchmarks/small_m_gemv.py [--rows 1 2 4 8] [--reps 40] [--out gemv.json]
    TRITON_INTERPRET=1 python3 benchmarks/small_m_gemv.py --device cpu --dtype float32 --check-only
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere
from gemv_kernel import gemv  # noqa: E402
from graph_timing import capture_reps  # noqa: E402

SHAPES = {"qkv": (2304, 768), "o": (768, 768), "gate_up": (6144, 768), "down": (768, 3072)}  # (N, K)
TILES = list(itertools.product((1, 2, 4, 8), (256, 512, 1024), (1, 2, 4)))  # (BLOCK_N, BLOCK_K, num_warps)


def graph_us(fn, reps: int) -> float:
    """Microseconds per call of fn, reps calls captured in one CUDA graph and replayed (median of 5)."""
    graph = capture_reps(fn, reps)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (10 * reps))
    return sorted(times)[2]


def dependent_chain(x: torch.Tensor, weights: dict, lin) -> torch.Tensor:
    """qkv -> o -> gate_up -> down, each linear reading the previous one's output (slices of it)."""
    y = lin(x, weights["qkv"])[:, :768]
    y = lin(y, weights["o"])
    y = lin(y, weights["gate_up"])[:, :3072]
    return lin(y, weights["down"])


def check_pdl_chain(m: int, weights: dict, dtype, dev) -> None:
    """The chain replayed in a CUDA graph with every GEMV launched dependent equals F.linear's: each waits for
    the previous kernel's writes."""
    x = torch.randn(m, 768, device=dev).to(dtype)
    ref = dependent_chain(x, weights, torch.nn.functional.linear).float()
    static = {}
    graph = torch.cuda.CUDAGraph()
    pdl = lambda a, w: gemv(a.contiguous(), w, 4, 512, 2, pdl=True)  # noqa: E731
    dependent_chain(x, weights, pdl)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static["y"] = dependent_chain(x, weights, pdl)
    for _ in range(3):
        graph.replay()
    err = ((static["y"].float() - ref).norm() / ref.norm()).item()
    print(f"rows {m}: the dependent chain with programmatic dependent launch, in a graph: relative L2 {err:.2e}")
    assert err < 2e-2, err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype, dev = getattr(torch, args.dtype), torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    weights = {s: (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(dev) for s, (n, k) in SHAPES.items()}
    tiles = TILES if not args.check_only else [(1, 256, 2), (8, 512, 4)]
    report = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "rows": {}}
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for m in args.rows:
        xs = {s: torch.randn(m, k, generator=g).to(dtype).to(dev) for s, (n, k) in SHAPES.items()}
        for s in SHAPES:  # every tile's output against F.linear
            ref = torch.nn.functional.linear(xs[s], weights[s]).float()
            for bn, bk, nw in tiles:
                err = ((gemv(xs[s], weights[s], bn, bk, nw).float() - ref).norm() / ref.norm()).item()
                assert err < tol, (m, s, bn, bk, nw, err)
        print(f"rows {m}: every tile matches F.linear (relative L2 < {tol})")
        if dev.type == "cuda":
            check_pdl_chain(m, weights, dtype, dev)
        if args.check_only:
            continue
        row = report["rows"][m] = {}
        best = {}
        for s in SHAPES:
            x, w = xs[s], weights[s]
            out = torch.empty(m, w.shape[0], dtype=dtype, device=dev)
            cublas = graph_us(lambda x=x, w=w: torch.nn.functional.linear(x, w), args.reps)
            times = {t: graph_us(lambda x=x, w=w, t=t: gemv(x, w, *t, out=out), args.reps) for t in tiles}
            best[s] = min(times, key=times.get)
            row[s] = {
                "cublas_us": cublas,
                "best_tile": best[s],
                "best_us": times[best[s]],
                "tiles_us": {"x".join(map(str, t)): v for t, v in times.items()},
            }
            print(
                f"rows {m} {s:8s} cuBLAS {cublas:6.2f} us, GEMV best {times[best[s]]:6.2f} us at (BLOCK_N, BLOCK_K, "
                f"warps) {best[s]}: {cublas / times[best[s]]:.2f}x"
            )
        layer_cublas = graph_us(lambda: [torch.nn.functional.linear(xs[s], weights[s]) for s in SHAPES], args.reps)
        layer_gemv = graph_us(lambda: [gemv(xs[s], weights[s], *best[s]) for s in SHAPES], args.reps)
        layer_pdl = graph_us(lambda: [gemv(xs[s], weights[s], *best[s], pdl=True) for s in SHAPES], args.reps)
        row["layer"] = {"cublas_us": layer_cublas, "gemv_us": layer_gemv, "gemv_pdl_us": layer_pdl}
        print(
            f"rows {m} layer's 4 linears: cuBLAS {layer_cublas:6.2f} us, GEMV {layer_gemv:6.2f} us "
            f"({layer_cublas / layer_gemv:.2f}x), GEMV with programmatic dependent launch {layer_pdl:6.2f} us "
            f"({layer_cublas / layer_pdl:.2f}x)"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
