"""The decode attention kernel launched a few times at one shape, for Nsight Compute to read (CUDA only).

    ncu --kernel-name regex:paged_decode --launch-skip 2 --launch-count 1 --set full \
        python3 benchmarks/decode_ncu.py --rows 512 --ctx 300 --kv fp8 --path lanes --heads 4

What attention_micro.py times in graphs, here one launch at a time on one layer's cache (random pages, random
contents; fp8: values and scales of served magnitude), so the profiler's counters (DRAM throughput, issue
slots, warp stall reasons, occupancy) describe one launch of the kernel the engine replays.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention_micro import PagedSetup  # noqa: E402

from ttsserve.attention.triton_paged import TritonPagedAttention, TritonTuning  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--ctx", type=int, default=300, help="context frames of every row")
    parser.add_argument("--kv", choices=("auto", "fp8"), default="auto", help="the cache dtype")
    parser.add_argument("--path", choices=("dots", "lanes"), default="dots")
    parser.add_argument("--heads", type=int, default=1, help="lanes: KV heads a program (decode_lanes_heads)")
    parser.add_argument("--tile", type=int, default=32, help="lanes: a tile's lanes, tokens x heads")
    parser.add_argument("--launches", type=int, default=4)
    args = parser.parse_args()
    setup = PagedSetup([1] * args.rows, [args.ctx] * args.rows, torch.Generator().manual_seed(0), args.kv)
    lanes = "all" if args.path == "lanes" else "none"
    tuning = TritonTuning(
        decode_lanes=lanes, decode_lanes_rows=args.tile, decode_lanes_heads=args.heads, decode_lanes_programs_per_sm=0
    )
    backend = TritonPagedAttention(tuning=tuning)
    for _ in range(args.launches):
        backend.forward(setup.q, setup.k, setup.v, setup.caches[0], setup.md, 0.125)
    torch.cuda.synchronize()
    print(f"{args.launches} launches: {args.rows} rows x {args.ctx} frames, {args.kv} cache, {args.path}")


if __name__ == "__main__":
    main()
