"""The engine-driving helpers the GPU benchmarks share (gpu_bench.py, staggered.py, first_wave.py,
gpu_step_profile.py): engines on the seeded dummy model, requests of fixed length, a lockstep driver that records
each request's chunk arrivals, and the stream statistics computed from them.

SETUP is the model every helper builds (real size, bf16, CUDA by default); a script updates it in place from its
command line (--device cpu --dummy-size tiny: a smoke run) before loading the model.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ttsserve.config import EngineConfig
from ttsserve.engine.engine import Engine
from ttsserve.params import SamplingParams, SynthesisRequest

FRAMES_10S = 469  # 10 s of audio at 46.875 frames/s
SR = 24000
TEXTS = [
    "The quick brown fox jumps over the lazy dog while the band plays a slow song in the park.",
    "Please remember to bring your umbrella tomorrow because the forecast says it will rain all day.",
    "Our meeting has moved to three o'clock, so there is still time to finish the report before then.",
    "She opened the window, listened to the birds, and decided that today would be a very good day.",
]

SETUP = {"device": "cuda", "dummy_size": "real", "dtype": "bfloat16"}  # --device cpu --dummy-size tiny: smoke run


def model_config(**kw) -> EngineConfig:
    base = dict(load_format="dummy", seed=0, **SETUP)
    base.update(kw)
    return EngineConfig(**base)


def kv_bytes(gib: float) -> int:
    return int(gib * 2**30) if SETUP["device"] == "cuda" else 64 << 20


def make_engine(model, **kw) -> Engine:
    kw.setdefault("kv_cache_memory", kv_bytes(16))
    return Engine(model_config(**kw), model=model)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def submit(engine: Engine, n: int, frames: int, seed: int = 0) -> list[str]:
    ids = []
    for i in range(n):
        p = SamplingParams(seed=seed + i, min_new_tokens=frames, max_new_tokens=frames)
        ids.append(engine.add_synthesis(SynthesisRequest(TEXTS[i % len(TEXTS)], code_params=p, raw_text=True)))
    return ids


def drive(engine: Engine, ids: list[str], t0: float, sample_memory: bool = False) -> dict:
    """Step until every id finished; per request: first/last audio time, samples, chunk arrival times."""
    recs = {rid: {"chunks": [], "samples": 0, "ttfa": None, "done": None} for rid in ids}
    pending, peak_used = set(ids), 0
    while pending:
        outs = engine.step()
        now = time.perf_counter() - t0
        if sample_memory and engine.counters.steps % 8 == 0 and torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            peak_used = max(peak_used, total - free)
        for o in outs:
            r = recs.get(o.request_id)
            if r is None:
                continue
            if o.samples.size:
                r["samples"] += int(o.samples.size)
                r["chunks"].append((now, int(o.samples.size)))
                r["ttfa"] = now if r["ttfa"] is None else r["ttfa"]
            if o.finished:
                r["done"] = now
                pending.discard(o.request_id)
    if sample_memory:
        recs["_peak_used"] = peak_used
    return recs


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def stream_stats(recs: dict) -> dict:
    """TTFA percentiles; per-stream speed (audio seconds / generation seconds); playback stalls when each
    stream starts playing at its first audio."""
    ttfa = [r["ttfa"] for r in recs.values() if isinstance(r, dict)]
    speeds, stalls, stall_s = [], 0, 0.0
    for r in recs.values():
        if not isinstance(r, dict):
            continue
        audio_s = r["samples"] / SR
        speeds.append(audio_s / max(r["done"] - r["ttfa"], 1e-9))
        played, clock = 0.0, r["ttfa"]  # playback clock: audio position vs wall time
        for t, n in r["chunks"]:
            if t > clock + played:  # the chunk came after the buffer ran dry
                stalls += 1
                stall_s += t - (clock + played)
                clock = t - played
            played += n / SR
    return {
        "ttfa_p50_s": pct(ttfa, 50),
        "ttfa_p99_s": pct(ttfa, 99),
        "ttfa_max_s": max(ttfa),
        "min_stream_speed_x_realtime": min(speeds),
        "median_stream_speed_x_realtime": statistics.median(speeds),
        "playback_stalls": stalls,
        "playback_stall_s": stall_s,
    }


def finish(engine: Engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort(rid)
    for _ in range(3):
        engine.step()


def gpu_time_ms(fn, reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps
