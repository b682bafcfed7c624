"""How much mp3 this host can encode: ttsserve's StreamingEncoder (libmp3lame via PyAV, 96 kb/s, 24 kHz mono)
fed in served-size writes, in 1..N processes at once (each times its own encoding, the signal made
before; the aggregate is the sum of the processes' speeds, all running together). The aggregate is the ceiling
of any server's mp3
throughput on the host (each streamed response is one encoder; HTTP and the engine come on top).

Usage: python3 benchmarks/mp3_encode_speed.py [--procs 1,8,16] [--seconds 20] [--write-samples 8192]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import numpy as np


def _signal(kind: str, seconds: float, rate: int = 24000) -> np.ndarray:
    """ "noise": what dummy weights produce; "voiced": harmonics of a 110-170 Hz gliding pitch with 4-Hz syllables."""
    n = int(seconds * rate)
    if kind == "noise":
        return (np.random.default_rng(0).standard_normal(n) * 0.3).astype(np.float32)
    t = np.arange(n) / rate
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    x = sum(np.sin(k * phase) / k for k in range(1, 12)) * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t)) ** 2
    return (0.2 * x / np.abs(x).max()).astype(np.float32)


def _encode(args: tuple[str, float, int]) -> float:
    """Audio seconds per wall second for one process."""
    from ttsserve.audio.encode import StreamingEncoder

    kind, seconds, write = args
    x = _signal(kind, seconds)
    enc = StreamingEncoder("mp3")
    t0 = time.perf_counter()
    for i in range(0, x.size, write):
        enc.write(x[i : i + write])
    enc.close()
    return seconds / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", default=f"1,{os.cpu_count() // 2},{os.cpu_count()}")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--write-samples", type=int, default=8192, help="samples per write (8 frames: a served chunk)")
    a = p.parse_args()
    print(f"{os.cpu_count()} CPUs; {a.seconds:.0f} s of audio per process, writes of {a.write_samples} samples")
    for kind in ("noise", "voiced"):
        for n in sorted({int(v) for v in a.procs.split(",")}):
            with mp.get_context("spawn").Pool(n) as pool:
                pool.map(_encode, [(kind, 1.0, a.write_samples)] * n)  # imports and codec set-up
                speeds = pool.map(_encode, [(kind, a.seconds, a.write_samples)] * n)
            print(
                f"{kind:6s} procs {n:3d}: per process {np.median(speeds):6.1f}x real time (min {min(speeds):.1f}), "
                f"aggregate {sum(speeds):7.1f} audio-s/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
