"""Would fusing a decode layer's small ops into its linears pay at small batch? Measured: no, so the engine runs
the pairs.

At one stream a decode step is kernel-count bound: per layer the GPT runs add_rmsnorm, the qkv linear, attention,
o_proj, add_rmsnorm, the gate_up linear, silu_mul and the down linear (layers/triton_fused.py, cuBLAS). This
script times, inside CUDA graphs (as the engine replays them), each pair the issue names against one Triton
kernel that does both:
- add_rmsnorm + qkv linear (768 -> 2304) and add_rmsnorm + gate_up linear (768 -> 6144): a linear whose
  prologue adds the residual and normalizes its input rows (every program recomputes the rows' RMS, 768 values);
- silu_mul + down linear (3072 -> 768): a linear whose prologue is SiLU(gate) * up.
It checks the fused outputs against the pair's first, then prints microseconds per layer-equivalent call for each
batch size and tile size. The kernels are benchmarks/fused_linear_kernels.py's. On an H100 (bf16, 1-16 rows)
the norm fusions ran at 0.58-0.95x the pair's speed at their best tiles and the SiLU one at 0.08-0.26x; wired
into the engine they made a 10-s utterance take 0.65 s instead of 0.37 s (BENCHMARKS.md).

    python3 benchmarks/small_batch_fusion.py [--batches 1 4 16] [--dtype bfloat16] [--reps 20]
    TRITON_INTERPRET=1 python3 benchmarks/small_batch_fusion.py --device cpu --dtype float32 --check-only
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from fused_linear_kernels import ADD_RMSNORM, SILU_MUL, prologue_linear  # noqa: E402
from graph_timing import capture_reps  # noqa: E402

from ttsserve.layers import triton_fused  # noqa: E402


def _cases(m: int, dtype, dev, block_n: int = 32, block_k: int = 128, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)

    h, res, nw = rnd(m, 768), rnd(m, 768), rnd(768, scale=0.1) + 1
    gu = rnd(m, 6144)
    w_qkv, w_gu, w_down = rnd(2304, 768, scale=0.03), rnd(6144, 768, scale=0.03), rnd(768, 3072, scale=0.02)
    lin, norm = torch.nn.functional.linear, triton_fused.add_rmsnorm
    unfused = {
        "add_rmsnorm + qkv": lambda: lin(norm(h, res, nw, 1e-6)[0], w_qkv),
        "add_rmsnorm + gate_up": lambda: lin(norm(h, res, nw, 1e-6)[0], w_gu),
        "silu_mul + down": lambda: lin(triton_fused.silu_mul(gu), w_down),
    }
    fuse = functools.partial(prologue_linear, block_n=block_n, block_k=block_k)
    fused = {
        "add_rmsnorm + qkv": lambda: fuse(h, w_qkv, ADD_RMSNORM, res, nw)[0],
        "add_rmsnorm + gate_up": lambda: fuse(h, w_gu, ADD_RMSNORM, res, nw)[0],
        "silu_mul + down": lambda: fuse(gu, w_down, SILU_MUL)[0],
    }
    sums = (lambda: norm(h, res, nw, 1e-6)[1], lambda: prologue_linear(h, w_qkv, ADD_RMSNORM, res, nw)[1])
    return unfused, fused, sums


def check(m: int, dtype, dev, blocks: list[tuple[int, int]]) -> None:
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for bn, bk in blocks:
        unfused, fused, (sum_ref, sum_fused) = _cases(m, dtype, dev, bn, bk)
        assert torch.equal(sum_ref(), sum_fused()), "the residual stream h + res"
        for name in unfused:
            a, b = unfused[name]().float(), fused[name]().float()
            err = ((a - b).norm() / a.norm()).item()
            print(f"batch {m:2d} {name} (BLOCK_N {bn}, BLOCK_K {bk}): relative L2 difference {err:.2e}")
            assert err < tol, (name, err)


def graph_us(fn, reps: int) -> float:
    """Microseconds per call of fn, reps calls captured in one CUDA graph and replayed."""
    graph = capture_reps(fn, reps)
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (20 * reps) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--reps", type=int, default=20, help="calls per graph (one per layer of the GPT)")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--block-k", type=int, nargs="+", default=[128, 256])
    a = p.parse_args()
    dtype, dev = getattr(torch, a.dtype), torch.device(a.device)
    for m in a.batches:
        check(m, dtype, dev, [(bn, bk) for bn in a.block_n for bk in a.block_k])
    if a.check_only:
        return
    for m in a.batches:
        unfused = _cases(m, dtype, dev)[0]
        for name in unfused:
            u = graph_us(unfused[name], a.reps)
            for bn in a.block_n:
                for bk in a.block_k:
                    f = graph_us(_cases(m, dtype, dev, bn, bk)[1][name], a.reps)
                    print(
                        f"batch {m:2d} {name}: unfused {u:.2f} us, fused (BLOCK_N {bn}, BLOCK_K {bk}) {f:.2f} us "
                        f"({u / f:.2f}x)"
                    )


if __name__ == "__main__":
    main()
