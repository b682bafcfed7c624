"""One incremental ConvNeXt block of the vocoder on CUDA (audio/triton_convnext.py), its parts timed apart: the
whole block, its kernels' device time (torch.profiler: the front and back Triton kernels, the torch rest), and its
torch parts alone (Linear1, the GELU, Linear2), with
and without the front kernel's interior-tile path (INTERIOR_TILES); and Linear1 + GELU as one Triton kernel
(benchmarks/linear_gelu_kernel.py) in a few tile shapes, with its largest error relative to the torch pair's; and
Linear1 + bias + GELU in cuBLASLt's epilogue as the block runs it (linear_gelu), the whole block with it, and
its error and the separate pair's against fp32 erf GELU (relative Frobenius). fp16,
the real model's blocks (the Decoder's 512 -> 2048, dilation 2; the Vocos' 512 -> 1536, dilation 1),
channels-contiguous input as every block after the first sees.

    python3 benchmarks/convnext_micro.py [--shapes 128x16 128x48 512x24] [--json PATH]

Shapes are rows x new mel frames per row. Figures: triton.testing.do_bench medians, us a call, launched eagerly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402
from linear_gelu_kernel import linear_gelu  # noqa: E402

from ttsserve.audio import triton_convnext  # noqa: E402
from ttsserve.audio.decoder_net import ConvNeXtBlock  # noqa: E402
from ttsserve.audio.incremental import NOT_FINISHED, ConvState, Rows  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of linear_gelu_kernel.linear_gelu, against Linear1 + GELU in torch
LINEAR_GELU_CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3)]
BLOCKS = {"decoder": (512, 2048, 2, "weight"), "vocos": (512, 1536, 1, "gamma")}


def _inputs(name: str, rows: int, width: int):
    dim, inter, dil, scale = BLOCKS[name]
    block = ConvNeXtBlock(dim, inter, 7, dil, scale).cuda().half().eval()
    state = ConvState(block.dwconv, lag=9)
    state.resize(rows)
    state.cache.normal_()
    t = lambda v: torch.tensor(v, dtype=torch.int64, device="cuda")  # noqa: E731
    start = [100 + 7 * i for i in range(rows)]
    r = Rows(t(list(range(rows))), t(start), t([width] * rows), t([NOT_FINISHED] * rows), width, 9 + 2 * state.r + 3)
    x = torch.randn(rows, width, dim, device="cuda", dtype=torch.float16).transpose(1, 2)  # channels contiguous
    return block, state, r, x


def _epilogue(h: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    """Linear1 + bias + GELU as the block runs it in fp16 / bf16 with GELU_EPILOGUE (cuBLASLt's epilogue)."""
    triton_convnext.GELU_EPILOGUE = True
    return triton_convnext.linear_gelu(h, lin)


def _kernel_us(call, reps: int = 20) -> dict[str, float]:
    """Device us a call of each of call()'s kernels (torch.profiler): the front and back kernels by name, the
    rest as "torch" (the GEMMs and the GELU)."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    out = {"front": 0.0, "back": 0.0, "torch": 0.0}
    for e in prof.key_averages():
        us = e.device_time_total / reps  # device_time_total: us over all reps
        if us > 0:
            name = "front" if "_front_kernel" in e.key else "back" if "_back_kernel" in e.key else "torch"
            out[name] += us
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["128x16", "128x48", "512x24"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = []
    defaults = triton_convnext.INTERIOR_TILES, triton_convnext.GELU_EPILOGUE
    with torch.no_grad():
        for name in BLOCKS:
            for shape in args.shapes:
                rows, width = (int(v) for v in shape.split("x"))
                block, state, r, x = _inputs(name, rows, width)
                row = {"block": name, "rows": rows, "width": width}
                for interior, epilogue in ((False, False), (True, False), (True, True)):
                    triton_convnext.INTERIOR_TILES, triton_convnext.GELU_EPILOGUE = interior, epilogue
                    tag = ("interior" if interior else "picked") + ("_epilogue" if epilogue else "")
                    call = lambda: triton_convnext.convnext_block(block, state, x, r)  # noqa: E731
                    row[f"block_{tag}_us"] = 1e3 * triton.testing.do_bench(call)
                    for kernel, us in _kernel_us(call).items():
                        row[f"{kernel}_{tag}_us"] = us
                h = torch.randn(rows * width, block.pwconv1.in_features, device="cuda", dtype=torch.float16)
                lin1, lin2 = block.pwconv1, block.pwconv2
                y1 = F.linear(h, lin1.weight, lin1.bias)
                row["linear1_us"] = 1e3 * triton.testing.do_bench(lambda: F.linear(h, lin1.weight, lin1.bias))
                row["gelu_us"] = 1e3 * triton.testing.do_bench(lambda: torch.ops.aten.gelu_(y1))
                row["linear2_us"] = 1e3 * triton.testing.do_bench(lambda: F.linear(y1, lin2.weight, lin2.bias))
                torch_us = row["linear1_us"] + row["gelu_us"] + row["linear2_us"]
                row["linear1_gelu_epilogue_us"] = 1e3 * triton.testing.do_bench(lambda: _epilogue(h, lin1))
                exact = F.gelu(F.linear(h.double(), lin1.weight.double(), lin1.bias.double()))
                rel = lambda y: float((y.double() - exact).norm() / exact.norm())  # noqa: E731
                row["linear1_gelu_separate_rel_err"] = rel(torch.ops.aten.gelu_(F.linear(h, lin1.weight, lin1.bias)))
                row["linear1_gelu_epilogue_rel_err"] = rel(_epilogue(h, lin1))
                ref = torch.ops.aten.gelu_(F.linear(h, lin1.weight, lin1.bias)).float()
                for bm, bn, bk, warps, stages in LINEAR_GELU_CONFIGS:
                    run = lambda: linear_gelu(h, lin1, (bm, bn, bk), warps, stages)  # noqa: E731
                    tag = f"linear1_gelu_triton_{bm}x{bn}x{bk}_w{warps}s{stages}"
                    row[f"{tag}_us"] = 1e3 * triton.testing.do_bench(run)
                    row[f"{tag}_err"] = float((run().float() - ref).abs().max() / ref.abs().max())
                for tag in ("picked", "interior"):  # the block less its torch parts: the front and back kernels
                    # (torch parts timed with the separate GELU: the epilogue runs are the whole block, below)
                    row[f"kernels_{tag}_us"] = row[f"block_{tag}_us"] - torch_us
                out.append(row)
                print(
                    json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in row.items()}),
                    flush=True,
                )
    triton_convnext.INTERIOR_TILES, triton_convnext.GELU_EPILOGUE = defaults
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
