"""The first-wave penalty of the engine alone: after Engine.__init__ (on CUDA: graph capture and
warm_up), waves of N simultaneous requests of F frames; per wave TTFA min/p50/p99, step times and the step's
phases per step. The plan is a list of items: w (a wave) or sN (sleep N seconds, an idle server).

Usage: python3 benchmarks/first_wave.py DEVICE SIZE N FRAMES "w w s10 w w" [nowide]
  e.g. python3 benchmarks/first_wave.py cuda real 128 200 "w w s10 w w"
  nowide: warm up without warm_up.py's wide wave (on the H200: wave 1 waited 325 ms for first audio, wave 2 168 ms)
  (cpu tiny 16 60 "w w": a smoke run; on the CPU the engine is warmed up here by hand)
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_engine as be  # noqa: E402

import ttsserve.engine.warm_up as wu  # noqa: E402
from ttsserve.engine.core.heap import freeze_startup_heap  # noqa: E402
from ttsserve.model.chattts import load_model  # noqa: E402


def build_engine(dev: str, size: str, n: int):
    be.SETUP.update(device=dev, dummy_size=size, dtype="bfloat16" if dev == "cuda" else "float32")
    model = load_model(be.model_config(max_num_seqs=max(n, 8)))
    engine = be.make_engine(model, max_num_seqs=max(n, 8))  # on CUDA the constructor warms up
    if dev != "cuda":
        wu.warm_up(engine)
    freeze_startup_heap("probe")  # as the served engine core does: no full GC pass over start-up objects
    return engine


def per_step(after: dict, before: dict, steps: int, keys) -> str:
    return " ".join(f"{k} {(after[k] - before[k]) / steps:.2f}" for k in keys)


def run_wave(e, w: int, n: int, frames: int) -> str:
    be.sync()
    t0 = time.perf_counter()
    a0, r0, s0 = dataclasses.asdict(e.timings), dataclasses.asdict(e.runner.timings), e.counters.steps
    ids = be.submit(e, n, frames, seed=100 * w)
    step_ms, first, pending = [], dict.fromkeys(ids), set(ids)
    while pending:
        a = time.perf_counter()
        outs = e.step()
        step_ms.append((time.perf_counter() - a) * 1e3)
        now = time.perf_counter() - t0
        for o in outs:
            if o.request_id in first and o.samples.size and first[o.request_id] is None:
                first[o.request_id] = now
            if o.finished:
                pending.discard(o.request_id)
    a1, r1, ns = dataclasses.asdict(e.timings), dataclasses.asdict(e.runner.timings), max(1, e.counters.steps - s0)
    t = sorted(v * 1e3 for v in first.values() if v is not None)
    return (
        f"wave {w}: ttfa min {t[0]:.0f} p50 {t[len(t) // 2]:.0f} p99 {t[int(len(t) * 0.99)]:.0f} ms; "
        f"steps {len(step_ms)}; first-20 {[round(x, 1) for x in step_ms[:20]]}; "
        f"mean {statistics.mean(step_ms):.2f} max {max(step_ms):.1f} ms; total {time.perf_counter() - t0:.2f} s\n"
        f"   phases/step: {per_step(a1, a0, ns, [k for k in a1 if k.endswith('_ms')])}\n"
        f"   runner/step: {per_step(r1, r0, ns, [k for k in r1 if isinstance(r1[k], float)])}"
    )


def main(argv: list[str]) -> int:
    dev, size, n, frames, plan = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4].split()
    if "nowide" in argv:
        wu.WIDE_WAVE_CAP = 0
    engine, w = build_engine(dev, size, n), 0
    for item in plan:
        if item.startswith("s"):
            time.sleep(float(item[1:]))
            print("slept", item[1:], flush=True)
            continue
        w += 1
        print(run_wave(engine, w, n, frames), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
