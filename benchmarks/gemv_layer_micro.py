"""One stream's GPT linears, the GEMM path against layers/triton_gemv.py's fused GEMVs: device time a frame.

A frame of 20 layers, each with its own weights (378 MB in bf16: they stream from HBM as in a real step, not from
L2), the attention left out (its output stands in as qkv's first 768 values). The GEMM path is what the decode
graphs run for several rows (and for one with $TTSSERVE_DECODE_GEMV=0): add_rmsnorm, F.linear (cuBLAS) for qkv / o /
gate_up / down, silu_mul (layers/triton_fused.py). The GEMV path, the one-row graph's default: norm_linear, linear,
norm_linear(gated), linear. Each path's frame is
captured 10 times in one CUDA graph, as the engine replays its steps; ms a frame is the replay's device time / 10.
--sweep then times the GEMV path at each tile (triton_gemv's BLOCK_N, NORM_BLOCK_N, BLOCK_K, NUM_WARPS).

    python3 benchmarks/gemv_layer_micro.py [--sweep] [--json OUT]
    TRITON_INTERPRET=1 python3 benchmarks/gemv_layer_micro.py --device cpu --dtype float32 --check-only
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_engine import gpu_time_ms  # noqa: E402
from graph_timing import capture_reps  # noqa: E402

from ttsserve.layers import triton_fused, triton_gemv  # noqa: E402

LAYERS, HIDDEN, INTER, EPS = 20, 768, 3072, 1e-6


def _weights(dtype, dev, hidden: int, inter: int, layers: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

    return [
        {
            "nw1": rnd(hidden, scale=0.1) + 1,
            "nw2": rnd(hidden, scale=0.1) + 1,
            "qkv": rnd(3 * hidden, hidden, scale=hidden**-0.5),
            "o": rnd(hidden, hidden, scale=hidden**-0.5),
            "gate_up": rnd(2 * inter, hidden, scale=hidden**-0.5),
            "down": rnd(hidden, inter, scale=inter**-0.5),
        }
        for _ in range(layers)
    ]


def gemm_frame(h: torch.Tensor, ws: list[dict]) -> torch.Tensor:
    residual = torch.zeros_like(h)
    for w in ws:
        normed, residual = triton_fused.add_rmsnorm(h, residual, w["nw1"], EPS)
        qkv = F.linear(normed, w["qkv"])
        o = F.linear(qkv[:, : h.shape[1]], w["o"])
        normed, residual = triton_fused.add_rmsnorm(o, residual, w["nw2"], EPS)
        h = F.linear(triton_fused.silu_mul(F.linear(normed, w["gate_up"])), w["down"])
    return h + residual


def gemv_frame(h: torch.Tensor, ws: list[dict]) -> torch.Tensor:
    residual = torch.zeros_like(h)
    for w in ws:
        qkv, residual = triton_gemv.norm_linear(h, residual, w["nw1"], EPS, w["qkv"])
        o = triton_gemv.linear(qkv[:, : h.shape[1]], w["o"])
        act, residual = triton_gemv.norm_linear(o, residual, w["nw2"], EPS, w["gate_up"], gated=True)
        h = triton_gemv.linear(act, w["down"])
    return h + residual


def frame_ms(fn, reps: int = 10) -> float:
    graph = capture_reps(fn, reps)
    return gpu_time_ms(graph.replay, reps=20) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--check-only", action="store_true", help="compare the two paths' outputs, no timing")
    ap.add_argument("--sweep", action="store_true", help="time the GEMV path at every tile")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    small = dev.type == "cpu"  # the interpreter: a small frame
    hidden, inter, layers = (96, 200, 2) if small else (HIDDEN, INTER, LAYERS)
    ws = _weights(dtype, dev, hidden, inter, layers)
    h = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
    want, got = gemm_frame(h, ws), gemv_frame(h, ws)
    err = float((got.float() - want.float()).abs().amax() / want.float().abs().amax())
    print(f"GEMV path against the GEMM path: max error {err:.2e} of the largest value")
    if a.check_only:
        return 0 if err < (1e-4 if dtype == torch.float32 else 3e-2) else 1
    out = {"gemm_ms": frame_ms(lambda: gemm_frame(h, ws)), "gemv_ms": frame_ms(lambda: gemv_frame(h, ws))}
    gemm, gemv = out["gemm_ms"], out["gemv_ms"]
    print(f"{torch.cuda.get_device_name()}: a frame's linears {gemm:.3f} ms (GEMM path), {gemv:.3f} ms (GEMV)")
    if a.sweep:
        names = ("BLOCK_N", "NORM_BLOCK_N", "BLOCK_K", "NUM_WARPS")
        default = tuple(getattr(triton_gemv, n) for n in names)
        out["sweep"] = []
        for tile in itertools.product((1, 2, 4), (1, 2, 4), (256, 512, 1024), (1, 2, 4)):
            for n, v in zip(names, tile):
                setattr(triton_gemv, n, v)
            out["sweep"].append({"tile": dict(zip(names, tile)), "gemv_ms": frame_ms(lambda: gemv_frame(h, ws))})
            print(f"  {out['sweep'][-1]['tile']}: {out['sweep'][-1]['gemv_ms']:.3f} ms")
        for n, v in zip(names, default):
            setattr(triton_gemv, n, v)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
