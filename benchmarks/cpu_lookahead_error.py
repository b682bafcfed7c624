"""What a short vocoder lookahead costs in fidelity: the streamed audio with `--lookahead-frames R` (the windowed
stage, first audio after first_chunk + R frames) against the exact stream (first audio after first_chunk + 52).

One engine per setting, one thread (the same GPT results in every run), the same seeded request; the exact
stream is the reference (it equals the one-shot decode to fp32 rounding). Prints per lookahead: max abs
difference, SNR, and the worst difference in 16-bit PCM steps (what the server sends). In fp32 this is the
approximation alone; with a bf16 vocoder (the CPU default with --dtype bfloat16) the two stages' bf16
rounding differs too, and that difference is what the figures show.

    python3 benchmarks/cpu_lookahead_error.py --dtype float32 --lookaheads 8,12,16,24 --frames 300 [--model DIR]
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from ttsserve.config import EngineConfig  # noqa: E402
from ttsserve.params import SamplingParams, SynthesisRequest  # noqa: E402

TEXT = "This is a test sentence of medium length, spoken clearly for the benchmark."


def stream(args: argparse.Namespace, lookahead: int | None) -> np.ndarray:
    from ttsserve.engine.engine import Engine

    cfg = EngineConfig(
        model=args.model,
        load_format="dummy" if args.model is None else "auto",
        dummy_size=args.dummy_size,
        device="cpu",
        dtype=args.dtype,
        quantization=args.quantization,
        swap_space=0,
        kv_cache_memory=1 << 29,
        cpu_threads=1,
        lookahead_frames=lookahead,
        first_chunk_frames=args.first_chunk_frames,
    )
    engine = Engine(cfg)
    p = SamplingParams(seed=7, min_new_tokens=args.frames, max_new_tokens=args.frames)
    engine.add_synthesis(SynthesisRequest(TEXT, code_params=p, split=False))
    pieces = []
    while engine.has_unfinished():
        pieces += [o.samples for o in engine.step()]
    return np.concatenate(pieces).astype(np.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--model", default=None, help="a checkpoint (default: random weights of --dummy-size)")
    ap.add_argument("--dummy-size", default="real", choices=("real", "tiny"))
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--first-chunk-frames", type=int, default=8)
    ap.add_argument("--lookaheads", default="8,12,16,24")
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    ref = stream(a, None)
    peak, rms = np.abs(ref).max(), math.sqrt(float(np.mean(ref**2)))
    print(f"{a.dtype} vocoder, {a.frames} frames ({len(ref)} samples), first chunk {a.first_chunk_frames}: exact")
    print(f"stream peak {peak:.3f}, rms {rms:.3f}")
    for r in (int(x) for x in a.lookaheads.split(",")):
        got = stream(a, r)
        n = min(len(got), len(ref))
        err = np.abs(got[:n] - ref[:n])
        snr = 10 * math.log10(float(np.sum(ref[:n] ** 2)) / max(float(np.sum(err**2)), 1e-300))
        lsb = err.max() * 32767
        print(
            f"lookahead {r:2d}: first audio after {a.first_chunk_frames + r} frames (exact: "
            f"{a.first_chunk_frames + 52}); max abs diff {err.max():.2e} ({lsb:.2f} int16 steps), "
            f"SNR {snr:.1f} dB, samples differing by >= 1 int16 step: {int((err * 32767 >= 1).sum())}"
        )


if __name__ == "__main__":
    main()
