"""Closed-loop engine benchmark with staggered arrivals: N clients, each sends its next request as
soon as the last one finished, natural lengths, no HTTP. Unlike gpu_bench's lockstep sections the streams reach
their chunk boundaries at different steps, as under real traffic.

Per variant: audio-seconds per second, time to first audio p50/p99, streams that underran (playback from the
first audio at 1x), and per step: host ms of the runner and of the audio stage, vocoder calls, mixed steps.

Usage: python3 benchmarks/staggered.py --out DIR [--concurrency 128] [--seconds 20]
       [--variants eager-vocoder,graphs,graphs-cadence4] [--frames 140,600]
       (--device cpu --dummy-size tiny: a smoke run)
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_engine as be  # noqa: E402

from ttsserve.model.chattts import load_model  # noqa: E402
from ttsserve.params import SamplingParams, SynthesisRequest  # noqa: E402

VARIANTS = {  # name -> (EngineConfig overrides, vocoder graphs on, piecewise prefill graphs on)
    "eager-vocoder": ({}, False, True),
    "graphs": ({}, True, True),
    "graphs-cadence2": ({"vocoder_cadence": 2}, True, True),
    "graphs-cadence4": ({"vocoder_cadence": 4}, True, True),
    "graphs-cadence4-admit4": ({"vocoder_cadence": 4, "admission_interval": 4}, True, True),
    "graphs-cadence8-admit8": ({"vocoder_cadence": 8, "admission_interval": 8}, True, True),
    "sync": ({"async_scheduling": False}, True, True),  # the CUDA defaults (cadence 8, admission 8), not pipelined
    "pipelined": ({"async_scheduling": True}, True, True),
    "pipelined-fp8": ({"async_scheduling": True, "kv_cache_dtype": "fp8"}, True, True),  # the served targets' cache
    "pipelined-k2": ({"async_scheduling": True, "num_scheduler_steps": 2}, True, True),  # decode bursts
    "pipelined-k3": ({"async_scheduling": True, "num_scheduler_steps": 3}, True, True),
    "pipelined-k4": ({"async_scheduling": True, "num_scheduler_steps": 4}, True, True),
    "pipelined-k8": ({"async_scheduling": True, "num_scheduler_steps": 8}, True, True),
    "pipelined-fc4": ({"async_scheduling": True, "first_chunk_frames": 4}, True, True),  # first chunk of 4 frames
    "pipelined-eager-prefill": ({"async_scheduling": True}, True, False),
    "sync-eager-prefill": ({"async_scheduling": False}, True, False),
}


FRAMES = (140, 600)  # --frames: 3-13 s utterances (the corpus' sentence lengths at 46.9 frames/s), uniform


def natural_frames(rng: random.Random) -> int:
    return rng.randint(*FRAMES)


SERVED_LIKE = False  # --workload served: a speaker voice, normalized text, lengths ended by EOS (capped)


def _request(engine, k: int, n: int, seed: int) -> SynthesisRequest:
    """Request k: `n` frames exactly, raw text, no speaker; or served-like: a random speaker (as the
    server's built-in voices), normalized text, EOS when the model samples it (at most n frames)."""
    text = be.TEXTS[k % len(be.TEXTS)]
    if not SERVED_LIKE:
        return SynthesisRequest(
            text, code_params=SamplingParams(seed=seed + k, min_new_tokens=n, max_new_tokens=n), raw_text=True
        )
    from ttsserve.params import Voice
    from ttsserve.text.speaker import sample_random_speaker

    std, mean = engine.model.spk_stat
    voice = Voice(spk_emb=sample_random_speaker(np.asarray(std), np.asarray(mean), k % 8))
    return SynthesisRequest(text, voice=voice, code_params=SamplingParams(seed=seed + k, max_new_tokens=n))


def closed_loop(engine, concurrency: int, seconds: float, seed: int) -> dict:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    recs, live, k = {}, {}, 0

    def submit() -> None:
        nonlocal k
        rid = engine.add_synthesis(_request(engine, k, natural_frames(rng), seed))
        live[rid] = {
            "t_submit": time.perf_counter() - t0,
            "chunks": [],
            "samples": 0,
            "ttfa": None,
            "done": None,
            "step_submit": engine.counters.steps,
            "ttfa_steps": None,
        }
        k += 1

    for _ in range(concurrency):
        submit()
    base = (
        dict(engine.timings.__dict__),
        engine.counters.steps,
        engine.audio.calls_total,
        dict(engine.runner.timings.__dict__),
    )
    mixed0 = engine.runner.timings.mixed_graph_steps

    def handle(outputs) -> None:
        now = time.perf_counter() - t0
        for o in outputs:
            r = live.get(o.request_id)
            if r is None:
                continue
            if o.samples.size:
                r["samples"] += int(o.samples.size)
                r["chunks"].append((now, int(o.samples.size)))
                if r["ttfa"] is None:  # in steps too: the pipeline's latency, free of the host's speed
                    r["ttfa"], r["ttfa_steps"] = now, engine.counters.steps - r["step_submit"]
            if o.finished:
                r["done"] = now
                recs[o.request_id] = live.pop(o.request_id)
                submit()

    # audio the device finished early leaves in mid-step, as in the engine core (older trees: no emit)
    emits = "emit" in inspect.signature(engine.step).parameters
    while time.perf_counter() - t0 < seconds:
        handle(engine.step(emit=handle) if emits else engine.step())
    elapsed = time.perf_counter() - t0
    steps = engine.counters.steps - base[1]
    result = summarize({**recs, **live}, elapsed, steps, engine, base, mixed0)  # live streams' audio counts too
    result["finished_requests"] = len(recs)
    for rid in list(live):
        engine.abort(rid)
    for _ in range(3):
        engine.step()
    return result


def summarize(recs: dict, elapsed: float, steps: int, engine, base, mixed0: int) -> dict:
    done = [r for r in recs.values() if r["ttfa"] is not None]
    for r in done:  # TTFA from submission, and the playback model of bench_engine.stream_stats per stream
        r["ttfa"] -= r["t_submit"]
        r["chunks"] = [(t - r["t_submit"], n) for t, n in r["chunks"]]
        r["done"] = (r["done"] if r["done"] is not None else elapsed) - r["t_submit"]
    stalled = 0
    for r in done:
        if be.stream_stats({"x": r})["playback_stalls"]:
            stalled += 1
    ttfa, ttfa_steps = [r["ttfa"] for r in done], [r["ttfa_steps"] for r in done]
    tm = {k: (v - base[0][k]) / max(steps, 1) for k, v in engine.timings.__dict__.items()}
    rt = {k: (v - base[3][k]) / max(steps, 1) for k, v in engine.runner.timings.__dict__.items() if k.endswith("_ms")}
    return {
        "requests": len(done),
        "seconds": elapsed,
        "steps": steps,
        "audio_s_per_s": sum(r["samples"] for r in done) / be.SR / elapsed,
        "ttfa_p50_s": be.pct(ttfa, 50) if ttfa else None,
        "ttfa_p99_s": be.pct(ttfa, 99) if ttfa else None,
        "ttfa_steps_p50": be.pct(ttfa_steps, 50) if ttfa else None,
        "ttfa_steps_p99": be.pct(ttfa_steps, 99) if ttfa else None,
        "stalled_streams": stalled,
        "step_ms": elapsed * 1e3 / max(steps, 1),
        "vocoder_calls_per_step": (engine.audio.calls_total - base[2]) / max(steps, 1),
        "mixed_graph_steps": engine.runner.timings.mixed_graph_steps - mixed0,
        "step_breakdown_ms": tm,
        "runner_breakdown_ms": rt,
        "async_scheduling": engine.pipelined,
    }


def run_variant(model, name: str, concurrency: int, seconds: float) -> dict:
    overrides, graphs, prefill_graphs = VARIANTS[name]
    engine = be.make_engine(model, max_num_seqs=max(concurrency, 8), **overrides)
    if not graphs:
        engine.audio.graphs.clear()  # the decode graphs stay: only the vocoder runs eagerly
    if not prefill_graphs:
        engine.runner.prefill_graphs = None  # prefill rows op by op, as before the piecewise graphs
    closed_loop(engine, concurrency, min(5.0, seconds / 2), seed=1)  # warm: first-call shapes, allocator
    result = closed_loop(engine, concurrency, seconds, seed=2)
    result["vocoder_graph_capture_s"] = sum(g.capture_s for g in engine.audio.graphs.values())
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", default="128")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--variants", default="eager-vocoder,graphs,graphs-cadence4")
    ap.add_argument(
        "--frames",
        default="140,600",
        help="utterance frames LO,HI, uniform (bench serve's capped natural lengths are closer to 60,256)",
    )
    ap.add_argument(
        "--workload",
        choices=("staggered", "served"),
        default="staggered",
        help="served: a speaker voice, normalized text, lengths ended by EOS (capped by --frames HI)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dummy-size", default="real")
    a = ap.parse_args()
    global FRAMES, SERVED_LIKE
    FRAMES = tuple(int(x) for x in a.frames.split(","))
    SERVED_LIKE = a.workload == "served"
    be.SETUP.update(device=a.device, dummy_size=a.dummy_size, dtype="bfloat16" if a.device == "cuda" else "float32")
    model = load_model(be.model_config())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "setup": dict(be.SETUP),
        "workload": a.workload,
        "concurrency": a.concurrency,
        "seconds": a.seconds,
        "frames": FRAMES,
        "runs": {},
    }
    for c in (int(x) for x in a.concurrency.split(",")):
        for name in a.variants.split(","):
            r = run_variant(model, name, c, a.seconds)
            results["runs"][f"{name}@{c}"] = r
            print(
                f"{name:>18} @{c:<4} {r['audio_s_per_s']:8.1f} audio-s/s  ttfa p50 {r['ttfa_p50_s']:.3f} "
                f"p99 {r['ttfa_p99_s']:.3f} s ({r['ttfa_steps_p50']:.0f} / {r['ttfa_steps_p99']:.0f} steps)  "
                f"stalled {r['stalled_streams']}/{r['requests']}  step "
                f"{r['step_ms']:.2f} ms (runner {r['step_breakdown_ms']['runner_ms']:.2f}, audio "
                f"{r['step_breakdown_ms']['audio_step_ms']:.2f}, device wait "
                f"{r['runner_breakdown_ms']['forward_ms']:.2f})  voc calls/step "
                f"{r['vocoder_calls_per_step']:.2f}  mixed {r['mixed_graph_steps']}",
                flush=True,
            )
            (out / "staggered.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
