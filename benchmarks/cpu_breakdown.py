"""Where one CPU decode step goes, by part: GEMMs, attention, the rest of the GPT, heads + sampler, the runner's
host work, the vocoder, the engine's bookkeeping. Wall ms per step, timed in place (perf_counter around each
part of the real engine's steady decode), so the parts add up to the step.

    OMP_WAIT_POLICY=PASSIVE python3 benchmarks/cpu_breakdown.py --dtype bfloat16 --quantization int8 --batch 1

The GEMMs are every linear of the GPT (packed bf16 / fp32, fbgemm W8A8 or int4); "gpt other" is the GPT's forward
less its linears and attention (norms, RoPE, residuals, casts, Python); "runner host" is the runner's step less
the GPT and the sampler (input packing, metadata, embedding); "engine" is the step less the runner and the vocoder.
Other work on the same cores moves every figure: the load average is printed, interleave A/B runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from ttsserve.config import EngineConfig  # noqa: E402
from ttsserve.params import SamplingParams, SynthesisRequest  # noqa: E402

TEXT = "This is a test sentence of medium length, spoken clearly for the benchmark."
TOTALS: dict[str, float] = defaultdict(float)
CLOCK = [time.perf_counter]  # --clock thread: this thread's CPU time (robust to other processes, 1 thread only)


def timed(name: str, fn):
    """fn wrapped to add its wall time to TOTALS[name] (nested parts are subtracted in report())."""

    def wrapper(*args, **kwargs):
        clock = CLOCK[0]
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += clock() - t0

    return wrapper


def instrument(engine) -> None:
    from ttsserve.model import cpu_linear

    for cls in (cpu_linear.PackedLinear, cpu_linear.DynamicInt8Linear, cpu_linear.PackedInt4Linear):
        cls.forward = timed("gemm", cls.forward)
    runner = engine.runner
    runner.backend.forward = timed("attention", runner.backend.forward)
    runner._forward = timed("gpt", runner._forward)
    if runner.cpu_graph is not None:
        runner.cpu_graph.run = timed("gpt", runner.cpu_graph.run)
    fused = getattr(runner, "cpu_fused", None)
    if fused is not None:  # runner/cpu_decode.py calls the packed GEMMs directly
        fused.run = timed("gpt", fused.run)
        fused.k.decode_attention = timed("attention", fused.k.decode_attention)
        fused.layers = [
            tuple((timed("gemm", p[0]), p[1]) if isinstance(p, tuple) else p for p in layer) for layer in fused.layers
        ]
    runner.sample_rows = timed("sampler", runner.sample_rows)
    runner.launch = timed("runner", runner.launch)
    runner.wait = timed("runner", runner.wait)
    engine.audio.step = timed("vocoder", engine.audio.step)
    engine.step = timed("step", engine.step)


def report(steps: int, frames: int) -> dict[str, float]:
    ms = {k: v * 1e3 / steps for k, v in TOTALS.items()}
    parts = {
        "gemm": ms.get("gemm", 0.0),
        "attention": ms.get("attention", 0.0),
        "gpt other": ms.get("gpt", 0.0) - ms.get("gemm", 0.0) - ms.get("attention", 0.0),
        "heads+sampler": ms.get("sampler", 0.0),
        "runner host": ms.get("runner", 0.0) - ms.get("gpt", 0.0) - ms.get("sampler", 0.0),
        "vocoder": ms.get("vocoder", 0.0),
        "engine": ms.get("step", 0.0) - ms.get("runner", 0.0) - ms.get("vocoder", 0.0),
    }
    parts["step"] = ms.get("step", 0.0)
    return {k: round(v, 2) for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--frames", type=int, default=188)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dummy-size", default="real", choices=("real", "tiny"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall", help="thread: CPU time of the engine thread")
    a = ap.parse_args()
    if a.clock == "thread":
        CLOCK[0] = time.thread_time
    logging.disable(logging.WARNING)
    from ttsserve.engine.engine import Engine

    cfg = EngineConfig(
        load_format="dummy",
        dummy_size=a.dummy_size,
        device="cpu",
        dtype=a.dtype,
        quantization=a.quantization,
        swap_space=0,
        kv_cache_memory=1 << 30,
        cpu_threads=a.threads,
    )
    engine = Engine(cfg)
    engine.wait_warm()
    instrument(engine)
    for _ in range(2):  # the first round warms up
        TOTALS.clear()
        for i in range(a.batch):
            params = SamplingParams(min_new_tokens=a.frames, max_new_tokens=a.frames, seed=i)
            engine.add_synthesis(SynthesisRequest(TEXT, code_params=params, split=False))
        load0, steps0, wall, cpu = os.getloadavg()[0], engine.counters.steps, time.perf_counter(), time.thread_time()
        while engine.has_unfinished():
            engine.step()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        steps = engine.counters.steps - steps0
    print(
        f"{a.dtype} quantization={a.quantization} batch={a.batch} frames={a.frames} threads={torch.get_num_threads()}"
        f" OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} load {load0:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{steps} steps, {wall * 1e3 / steps:.1f} ms per step wall ({cpu * 1e3 / steps:.1f} ms engine-thread CPU),"
        f" RTF {wall / (a.frames / 46.875):.2f}"
    )
    print(f"ms per step ({a.clock} clock):", report(steps, a.frames))
    mon = getattr(engine, "_threads", None)
    if mon is not None and mon.active:
        print(f"thread monitor: {mon.current} of {mon.full} threads now, {mon.switches} switches")


if __name__ == "__main__":
    main()
