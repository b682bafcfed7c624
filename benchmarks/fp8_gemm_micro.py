"""The GPT's GEMMs in bf16 against fp8 (e4m3 weights per output channel, activations per row, torch._scaled_mm with
row-wise scales) on a GPU: one decode frame's 20 layers x (qkv, o, gate_up, down) in a CUDA graph, at several row
counts. What `--quantization fp8` could save a step before it exists; the activation quantization is timed both
apart (torch ops, what an unfused linear pays) and not at all (what a norm kernel that writes fp8 would leave).

    python3 benchmarks/fp8_gemm_micro.py [--rows 1,64,256,512] [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from bench_engine import gpu_time_ms

HIDDEN, INTER, LAYERS = 768, 3072, 20
SHAPES = {"qkv": (3 * HIDDEN, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
E4M3_MAX = 448.0


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]): per-row absmax / 448."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def timed(fn, reps: int = 50) -> float:
    """ms per replay of fn captured in a CUDA graph."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return gpu_time_ms(g.replay, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,128,256,512")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    weights = [
        {k: torch.randn(n, k_, device=dev, dtype=torch.bfloat16) * 0.02 for k, (n, k_) in SHAPES.items()}
        for _ in range(LAYERS)
    ]
    q_weights = []
    for layer in weights:
        q = {}
        for k, w in layer.items():
            wq, ws = quant_rows(w)  # per output channel: the weight's rows
            q[k] = (wq, ws.t().contiguous())  # scale_b [1, N]
        q_weights.append(q)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    print(f"{out['device']}, torch {out['torch']}; ms per frame (20 layers x 4 GEMMs in one graph)")
    print(f"{'rows':>5} {'bf16':>8} {'fp8':>8} {'fp8 fast':>9} {'fp8+quant':>10} {'rel err':>8}")
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k_, device=dev, dtype=torch.bfloat16) for k, (_, k_) in SHAPES.items()}
        xq = {k: quant_rows(x) for k, x in xs.items()}

        def bf16() -> None:
            for layer in weights:
                for k, w in layer.items():
                    F.linear(xs[k], w)

        def fp8(fast: bool = False, quant: bool = False):
            def run() -> None:
                for layer in q_weights:
                    for k, (wq, ws) in layer.items():
                        a, sa = quant_rows(xs[k]) if quant else xq[k]
                        torch._scaled_mm(a, wq.t(), sa, ws, out_dtype=torch.bfloat16, use_fast_accum=fast)

            return run

        row = {}
        for name, fn in (("bf16", bf16), ("fp8", fp8()), ("fp8_fast", fp8(fast=True)), ("fp8_quant", fp8(quant=True))):
            try:
                row[name] = timed(fn)
            except RuntimeError as exc:
                row[name] = None
                print(f"  {name} at {m} rows: {str(exc).splitlines()[0]}")
        ref = F.linear(xs["gate_up"], weights[0]["gate_up"]).float()
        a, sa = xq["gate_up"]
        wq, ws = q_weights[0]["gate_up"]
        got = torch._scaled_mm(a, wq.t(), sa, ws, out_dtype=torch.bfloat16).float()
        row["rel_err"] = ((got - ref).norm() / ref.norm()).item()
        out["rows"][m] = row
        fmt = lambda v: f"{v:8.3f}" if v is not None else "       -"  # noqa: E731
        print(
            f"{m:5d} {fmt(row['bf16'])} {fmt(row['fp8'])} {fmt(row['fp8_fast']):>9} {fmt(row['fp8_quant']):>10} "
            f"{row['rel_err']:8.2e}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
