"""Where does a CPU decode step go? Engine step timings plus a torch-profiler table of the steady decode.

Runs the real Engine (real-size dummy weights unless --model) for B concurrent fixed-length requests and
reports, per decode step: the engine's phase timings (schedule / runner / audio ...), and the top torch ops
by self CPU time over `--profile-steps` steady-state steps (GPT matmuls, attention, sampler, audio stage).

    python3 benchmarks/cpu_profile.py --batch 1 --dtype bfloat16 [--quantization int8] [--frames 96]

Print the load average next to every figure: other work on the same cores inflates CPU times.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from ttsserve.config import EngineConfig  # noqa: E402
from ttsserve.params import SamplingParams, SynthesisRequest  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."


def build_engine(a: argparse.Namespace):
    from ttsserve.engine.engine import Engine

    cfg = EngineConfig(
        model=a.model,
        load_format="dummy" if a.model is None else "auto",
        dummy_size=a.dummy_size,
        device="cpu",
        dtype=a.dtype,
        quantization=a.quantization,
        swap_space=0,
        kv_cache_memory=a.kv_cache_memory,
    )
    engine = Engine(cfg)
    engine.wait_warm()  # the CPU attention compile (TTSSERVE_CPU_COMPILE=1) runs in the background
    return engine


def submit(engine, batch: int, frames: int, seed: int = 0) -> None:
    for i in range(batch):
        p = SamplingParams(min_new_tokens=frames, max_new_tokens=frames, seed=seed + i)
        engine.add_synthesis(SynthesisRequest(TEXT, code_params=p, split=False))


def run_to_completion(engine) -> int:
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--frames", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dummy-size", default="real")
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 29)
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, default=25)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    engine = build_engine(a)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()} (interop {torch.get_num_interop_threads()})"
        f", dtype {engine.model.dtype}, quantization {engine.model.quantization}, batch {a.batch}"
    )
    submit(engine, a.batch, 8, seed=1000)  # warm-up
    run_to_completion(engine)
    submit(engine, a.batch, a.frames)
    load0 = os.getloadavg()[0]
    # the prefill and first frames run unprofiled; then profile a window of steady decode steps
    for _ in range(4):
        engine.step()
    base = (engine.counters.steps, dict(engine.timings.__dict__))
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(a.profile_steps):
            engine.step()
    prof_ms = (time.perf_counter() - t0) * 1e3 / a.profile_steps
    t1 = time.perf_counter()
    n_plain = 0
    while engine.has_unfinished() and n_plain < a.frames - a.profile_steps - 12:
        engine.step()
        n_plain += 1
    plain_ms = (time.perf_counter() - t1) * 1e3 / max(n_plain, 1)
    run_to_completion(engine)
    steps = engine.counters.steps - base[0]
    print(f"load average (1 min) at start: {load0:.2f}, at end: {os.getloadavg()[0]:.2f}")
    print(
        f"decode step (batch {a.batch}): {plain_ms:.1f} ms unprofiled ({n_plain} steps), "
        f"{prof_ms:.1f} ms profiled; per frame {plain_ms / a.batch:.2f} ms; "
        f"RTF {plain_ms / a.batch * 46.875 / 1e3:.3f} per stream if steps were all decode"
    )
    print(
        "engine phases, ms per step:",
        {k: round((v - base[1][k]) / steps, 2) for k, v in engine.timings.__dict__.items()},
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))


if __name__ == "__main__":
    main()
