"""CPU micro-benchmark of the decode step's two kernels: the GPT linears and paged decode attention.

Linears: the 80 linears of the real-size GPT (20 layers x qkv / o / gate_up / down, each with its OWN
weight, so the 189 M parameters stream from DRAM as in a real step and nothing is an L3-cache effect), for
M = number of tokens in the step (the batch size at decode), in each weight format:
  f32 / bf16         F.linear on plain [N, K] weights (MKL sgemm / oneDNN matmul with a per-call reorder)
  f32pack / bf16pack oneDNN linear on weights reordered ONCE into oneDNN's blocked layout
  int8               torch._weight_int8pack_mm (int8 weights, per-channel scales, bf16 activations)
  w8a8               DynamicInt8Linear (model/cpu_linear.py): fbgemm's dynamic int8 x int8 GEMM, the CPU
                     engine's int8 kernel on VNNI / AMX machines (fp32 in and out)
  int4               PackedInt4Linear (model/cpu_linear.py): awq-int4 weights (group 128) through
                     torch._weight_int4pack_mm_for_cpu, bf16 activations
Attention: 20 layers of one-token decode over B sequences of `ctx` tokens in a paged cache (block 16,
12 x 64 heads, shuffled blocks), TorchPagedAttention (attention/torch_ref.py) in fp32 and bf16 KV, with the
torch.compile'd decode kernel and with the eager gather + SDPA path (KV write included in both).

    python3 benchmarks/cpu_kernels.py [--threads N] [--ms 1,4,8,16] [--kinds f32,bf16,bf16pack,int8,w8a8,int4]

Times are the minimum over --reps repetitions of one whole 20-layer pass (min: other work on the machine
only ever adds time); the load average is printed with every line.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from ttsserve.attention.torch_ref import TorchPagedAttention, make_metadata  # noqa: E402

LAYERS, HIDDEN, INTER, HEADS, HEAD_DIM, BLOCK = 20, 768, 3072, 12, 64, 16
SHAPES = [(3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # (N, K) per layer


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def linear_fn(kind: str, n: int, k: int, m: int):
    """One linear of `kind` with a fresh random weight; returns a no-argument callable."""
    w = torch.randn(n, k) * 0.02
    if kind in ("f32", "bf16"):
        dt = torch.float32 if kind == "f32" else torch.bfloat16
        x, wd = torch.randn(m, k, dtype=dt), w.to(dt)
        return lambda: F.linear(x, wd)
    if kind in ("f32pack", "bf16pack"):
        dt = torch.float32 if kind == "f32pack" else torch.bfloat16
        x, wp = torch.randn(m, k, dtype=dt), torch.ops.mkldnn._reorder_linear_weight(w.to(dt))
        return lambda: torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")
    if kind == "int8":
        x = torch.randn(m, k, dtype=torch.bfloat16)
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        s = torch.rand(n, dtype=torch.bfloat16) * 1e-3
        return lambda: torch._weight_int8pack_mm(x, q, s)
    if kind == "w8a8":
        from ttsserve.layers.quant.linear import QuantLinear
        from ttsserve.layers.quant.quantize import QuantConfig
        from ttsserve.model.cpu_linear import DynamicInt8Linear

        x, layer = torch.randn(m, k), DynamicInt8Linear(QuantLinear.from_weight(w, QuantConfig.for_method("int8")))
        return lambda: layer(x)
    if kind == "int4":
        from ttsserve.layers.quant.linear import QuantLinear
        from ttsserve.layers.quant.quantize import QuantConfig
        from ttsserve.model.cpu_linear import PackedInt4Linear

        x = torch.randn(m, k, dtype=torch.bfloat16)
        layer = PackedInt4Linear(QuantLinear.from_weight(w, QuantConfig.for_method("awq-int4")))
        return lambda: layer(x)
    raise ValueError(f"unknown kind {kind!r}")


def bench_linears(kinds: list[str], ms: list[int], reps: int) -> None:
    weight_bytes = {"f32": 4, "f32pack": 4, "bf16": 2, "bf16pack": 2, "int8": 1, "w8a8": 1, "int4": 0.5}
    params = LAYERS * sum(n * k for n, k in SHAPES)
    for m in ms:
        cells = []
        for kind in kinds:
            fns = [linear_fn(kind, n, k, m) for _ in range(LAYERS) for n, k in SHAPES]
            t = best_ms(lambda: [f() for f in fns], reps)  # noqa: F821 (ruff misreads the del below)
            gbs = params * weight_bytes[kind] / t / 1e6
            cells.append(f"{kind} {t:6.1f} ms ({gbs:4.1f} GB/s)")
            del fns
        print(f"linears, M={m:2d}: " + " | ".join(cells) + f"   [load {os.getloadavg()[0]:.1f}]", flush=True)


def bench_attention(cases: list[tuple[int, int]], reps: int) -> None:
    backends = {
        "compiled": TorchPagedAttention(compile_decode=True),
        "eager": TorchPagedAttention(compile_decode=False),
    }
    for b, ctx in cases:
        cells = []
        for (name, backend), dt in itertools.product(backends.items(), (torch.float32, torch.bfloat16)):
            nb = -(-ctx // BLOCK)
            num_blocks = b * nb + 4
            caches = [torch.randn(2, num_blocks, BLOCK, HEADS, HEAD_DIM).to(dt) for _ in range(LAYERS)]
            tables = torch.randperm(num_blocks)[: b * nb].view(b, nb).tolist()
            md = make_metadata(tables, [ctx - 1] * b, [1] * b, BLOCK)
            q, k = torch.randn(b, HEADS, HEAD_DIM).to(dt), torch.randn(b, HEADS, HEAD_DIM).to(dt)
            t = best_ms(lambda: [backend.forward(q, k, k, c, md, HEAD_DIM**-0.5) for c in caches], reps)
            cells.append(f"{name} {str(dt)[6:]} KV {t:6.2f} ms")
        print(
            f"attention x20 layers, B={b:2d} ctx={ctx:4d}: "
            + " | ".join(cells)
            + f"   [load {os.getloadavg()[0]:.1f}]",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ms", default="1,4,8,16")
    ap.add_argument("--kinds", default="f32,f32pack,bf16,bf16pack,int8,w8a8,int4")
    ap.add_argument("--attention", default="1x200,1x1000,8x200,16x200", help="BxCTX cases; empty: skip")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, cpu capability "
        f"{torch.backends.cpu.get_cpu_capability()}"
    )
    if a.kinds:
        bench_linears(a.kinds.split(","), [int(x) for x in a.ms.split(",")], a.reps)
    if a.attention:
        cases = [tuple(int(v) for v in c.split("x")) for c in a.attention.split(",")]
        bench_attention(cases, a.reps)


if __name__ == "__main__":
    main()
