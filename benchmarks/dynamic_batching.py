"""Effect of the dynamic-batching latency goal (EngineConfig.target_step_latency_ms) on step time, batch size,
throughput and time to first audio. Usage:
    python3 benchmarks/dynamic_batching.py --dummy-size tiny --requests 64 --frames 48 --targets 0,8
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ttsserve.config import EngineConfig
from ttsserve.engine.engine import Engine
from ttsserve.params import SamplingParams, SynthesisRequest


def run(target_ms: float, a: argparse.Namespace) -> dict:
    e = Engine(
        EngineConfig(
            load_format="dummy",
            dummy_size=a.dummy_size,
            device="cpu",
            swap_space=0,
            kv_cache_memory=a.kv_mib << 20,
            target_step_latency_ms=target_ms,
            first_chunk_frames=4,
            lookahead_frames=4,
        )
    )
    e.wait_warm()  # the CPU attention compile (TTSSERVE_CPU_COMPILE=1) runs in the background
    params = SamplingParams(seed=0, min_new_tokens=a.frames, max_new_tokens=a.frames)
    t0 = time.perf_counter()
    for i in range(a.requests):
        e.add_synthesis(
            SynthesisRequest(
                f"request number {i} of the batch",
                code_params=params.replace(seed=i),
                raw_text=True,
                request_id=f"r{i}",
            )
        )
    first, steps, batches, samples = {}, [], [], 0
    while e.has_unfinished():
        s = time.perf_counter()
        outs = e.step()
        steps.append((time.perf_counter() - s) * 1e3)
        batches.append(e.counters.last_batch_size)
        for o in outs:
            samples += o.samples.size
            if o.samples.size and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    ttfa = np.array(list(first.values()))
    return {
        "target_ms": target_ms,
        "step_ms_p50": np.percentile(steps, 50),
        "step_ms_p99": np.percentile(steps, 99),
        "mean_batch": float(np.mean(batches)),
        "audio_s_per_s": samples / 24000 / wall,
        "ttfa_p50_s": np.percentile(ttfa, 50),
        "ttfa_p99_s": np.percentile(ttfa, 99),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dummy-size", default="tiny", choices=["tiny", "real"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--frames", type=int, default=48)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--targets", default="0,8")
    a = ap.parse_args()
    print("| target step ms | step p50 / p99 ms | mean batch | audio-s/s | TTFA p50 / p99 s | wall s |")
    print("|---|---|---|---|---|---|")
    run(0.0, argparse.Namespace(**{**vars(a), "requests": 4, "frames": 8}))  # warm-up: first-call costs
    for t in (float(x) for x in a.targets.split(",")):
        r = run(t, a)
        print(
            f"| {t:g} | {r['step_ms_p50']:.1f} / {r['step_ms_p99']:.1f} | {r['mean_batch']:.1f} | "
            f"{r['audio_s_per_s']:.2f} | {r['ttfa_p50_s']:.2f} / {r['ttfa_p99_s']:.2f} | {r['wall_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
