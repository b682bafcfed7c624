"""How far from fp32 erf GELU the vocoder's two 16-bit GELU paths land, simulated on the CPU (no GPU needed):

- separate: the GEMM's fp32 accumulator rounded to the 16-bit dtype, erf GELU in fp32, rounded again (cuBLAS then
  torch's GELU, the default);
- epilogue: tanh GELU on the fp32 accumulator, rounded once (cuBLASLt's GELU epilogue,
  audio/triton_convnext.py `linear_gelu` with GELU_EPILOGUE).

Pre-activations are normal with the given standard deviations. Errors against erf GELU in float64: relative
Frobenius, mean and max absolute.

    python3 benchmarks/gelu_epilogue_error.py [--n 400000] [--std 0.5 1 2 4]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=400_000)
    ap.add_argument("--std", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    xs = torch.linspace(-8, 8, 200_001, dtype=torch.float64)
    gap = (F.gelu(xs) - F.gelu(xs, approximate="tanh")).abs()
    print(f"max |erf GELU - tanh GELU| = {gap.max():.3g} at x = {xs[gap.argmax()]:.3g}")
    print("| dtype | std | separate: rel / mean / max | epilogue: rel / mean / max |")
    print("|---|---|---|---|")
    for dtype in (torch.float16, torch.bfloat16):
        for std in args.std:
            acc = torch.randn(args.n, generator=g, dtype=torch.float64) * std
            exact = F.gelu(acc)
            separate = F.gelu(acc.to(dtype).float()).to(dtype).double()
            epilogue = F.gelu(acc.float(), approximate="tanh").to(dtype).double()
            cells = []
            for y in (separate, epilogue):
                e = (y - exact).abs()
                cells.append(f"{float((y - exact).norm() / exact.norm()):.2e} / {e.mean():.2e} / {e.max():.2e}")
            print(f"| {str(dtype).removeprefix('torch.')} | {std} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
