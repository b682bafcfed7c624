"""Per-step cost of the CPU engine for B concurrent requests: wall and CPU time, RTF, and the engine's phases.

One Engine (real-size dummy weights unless --model), an untimed 8-frame warm-up, then B requests of exactly
--frames frames (4-second utterances by default) submitted at once and stepped to completion. Prints wall ms
per step (prefill and the final audio included), the per-stream RTF that implies, audio-seconds per second,
the process CPU time (wall >> cpu / threads means the threads waited for cores that other work held) and
Engine.timings per step. Use it for A/B runs of thread settings, e.g.

    OMP_WAIT_POLICY=PASSIVE python3 benchmarks/cpu_step.py --dtype bfloat16 --batch 1
    OMP_NUM_THREADS=1 python3 benchmarks/cpu_step.py --dtype bfloat16 --quantization int8 --batch 8

and interleave the variants: other work on the same cores moves every figure (the load is printed).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from ttsserve.config import EngineConfig  # noqa: E402
from ttsserve.params import SamplingParams, SynthesisRequest  # noqa: E402

TEXT = "This is a test sentence of medium length, spoken clearly for the benchmark."
FRAMES_PER_SECOND = 24000 / 512


def submit(engine, batch: int, frames: int, seed: int) -> None:
    for i in range(batch):
        params = SamplingParams(min_new_tokens=frames, max_new_tokens=frames, seed=seed + i)
        engine.add_synthesis(SynthesisRequest(TEXT, code_params=params, split=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--frames", type=int, default=188)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dummy-size", default="real", choices=("real", "tiny"), help="random weights' size (no --model)")
    ap.add_argument("--threads", type=int, default=None, help="EngineConfig.cpu_threads when it has that field")
    ap.add_argument(
        "--lookahead-frames",
        type=int,
        default=None,
        help="the windowed vocoder stage with this right context (52 = exact); default: incremental",
    )
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    from ttsserve.engine.engine import Engine

    kw = dict(
        model=a.model,
        load_format="dummy" if a.model is None else "auto",
        dummy_size=a.dummy_size,
        device="cpu",
        dtype=a.dtype,
        quantization=a.quantization,
        swap_space=0,
        kv_cache_memory=1 << 30,
        lookahead_frames=a.lookahead_frames,
    )
    if a.threads is not None:
        if "cpu_threads" in EngineConfig.__dataclass_fields__:
            kw["cpu_threads"] = a.threads
        else:
            torch.set_num_threads(a.threads)
    engine = Engine(EngineConfig(**kw))
    engine.wait_warm()  # the CPU attention compile (TTSSERVE_CPU_COMPILE=1) runs in the background
    submit(engine, a.batch, 8, seed=1000)
    while engine.has_unfinished():
        engine.step()
    t0 = dict(engine.timings.__dict__)
    steps0, load0 = engine.counters.steps, os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    submit(engine, a.batch, a.frames, seed=0)
    while engine.has_unfinished():
        engine.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    steps = engine.counters.steps - steps0
    audio_s = a.frames / FRAMES_PER_SECOND
    phases = {k: round((v - t0[k]) / steps, 2) for k, v in engine.timings.__dict__.items()}
    print(
        f"{a.dtype} quantization={a.quantization} batch={a.batch} frames={a.frames} "
        f"vocoder={type(engine.audio).__name__}(lookahead={a.lookahead_frames}) threads="
        f"{torch.get_num_threads()} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}: "
        f"{wall * 1e3 / steps:.1f} ms/step wall, RTF {wall / audio_s:.2f} per stream, "
        f"{a.batch * audio_s / wall:.2f} audio-s/s; cpu {cpu:.2f} s for {wall:.2f} s wall; "
        f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    print("engine phases, ms per step:", phases)
    g = engine.runner.cpu_graph
    print(
        "compiled decode step:",
        "off"
        if g is None
        else f"ready (compiled in {g.compile_s:.0f} s)"
        if g.ready
        else "failed or not ready (eager)",
    )


if __name__ == "__main__":
    main()
