"""GPU fast-path benchmarks on the real-size dummy ChatTTS in bf16: one seeded script, one JSON.

Sections (each independent; a failure is recorded and the rest still run):
  ceilings   device-to-device copy bandwidth and bf16 matmul rate (the floors below are computed from them)
  memory     64 concurrent 10-s utterances: whole-GPU and torch memory at the peak (runs first, clean process)
  step       decode step time per batch size, CUDA graphs vs eager: engine step wall, runner wall, graph GPU time
  single     one 10-s utterance end to end (first audio, last audio), graphs and eager
  saturation 256 (and 512) simultaneous 10-s utterances with the vocoder: audio-seconds per second
  streams    128 concurrent streams: time to first audio p50/p99, per-stream speed, playback stalls
  vocoder    Decoder+Vocos per batched call, fp32 vs bf16 networks: time and error
  startup    the default engine's memory report (profiling, gpu_memory_utilization 0.9)
Usage: python3 benchmarks/gpu_bench.py --out DIR [--sections a,b] [--quick]

The engine helpers (SETUP, make_engine, submit, drive, stream_stats, ...) live in benchmarks/bench_engine.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import (
    FRAMES_10S,
    SETUP,
    SR,
    drive,
    finish,
    gpu_time_ms,
    kv_bytes,
    make_engine,
    model_config,
    stream_stats,
    submit,
    sync,
)
from gpu_bench_vocoder import sec_vocoder

from ttsserve.engine.engine import Engine
from ttsserve.model.chattts import load_model

LOG = logging.getLogger("gpu_bench")


# ---- sections ------------------------------------------------------------------------------------------------
def sec_ceilings(ctx: dict) -> dict:
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB fp32
    dst = torch.empty_like(src)
    copy_ms = gpu_time_ms(lambda: dst.copy_(src), 10)
    xs = [torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    mm_ms = gpu_time_ms(lambda: xs[0] @ xs[1], 10)
    src = dst = xs = None
    torch.cuda.empty_cache()
    out = {"copy_GBps": 2 * (1 << 30) / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}
    ctx["bw"], ctx["flops"] = out["copy_GBps"] * 1e9, out["bf16_matmul_TFLOPs"] * 1e12
    gpt = ctx["model"].gpt
    ctx["gpt_bytes"] = sum(p.numel() * p.element_size() for p in gpt.parameters())
    out["gpt_weight_MB"] = ctx["gpt_bytes"] / 1e6
    out["floor_batch1_step_us"] = ctx["gpt_bytes"] / ctx["bw"] * 1e6
    return out


def sec_memory(ctx: dict) -> dict:
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    # 64 streams x (prompt <= 80 + 469 frames) -> 35 blocks of 16 frames each, 60 KiB per frame in bf16
    kv = 64 * 35 * 16 * 60 * 1024
    torch.cuda.reset_peak_memory_stats()
    e = make_engine(ctx["model"], kv_cache_memory=kv, max_num_seqs=64, swap_space=0.0)
    ids = submit(e, 64, FRAMES_10S, seed=100)
    t0 = time.perf_counter()
    recs = drive(e, ids, t0, sample_memory=True)
    wall = time.perf_counter() - t0
    free1, _ = torch.cuda.mem_get_info()
    out = {
        "kv_cache_GiB": kv / 2**30,
        "gpu_used_before_engine_GiB": (total - free0) / 2**30,
        "gpu_used_peak_GiB": max(recs.pop("_peak_used"), total - free1) / 2**30,
        "torch_max_allocated_GiB": torch.cuda.max_memory_allocated() / 2**30,
        "torch_max_reserved_GiB": torch.cuda.max_memory_reserved() / 2**30,
        "preemptions": e.counters.preemptions,
        "wall_s": wall,
        "audio_s": sum(r["samples"] for r in recs.values()) / SR,
        "memory_report": e.memory_report(),
    }
    del e
    gc.collect()
    torch.cuda.empty_cache()
    return out


def sec_step(ctx: dict) -> dict:
    model, out = ctx["model"], {}
    sizes = [1, 8, 32, 64, 128, 256] if not ctx["quick"] else [1, 64]
    engines = {
        "graph": ctx.setdefault("e_graph", make_engine(model, max_num_seqs=256)),
        "graph_uncompiled": make_engine(model, max_num_seqs=256),
        "eager": make_engine(model, max_num_seqs=256, enforce_eager=True),
    }
    if SETUP["device"] == "cuda":  # the same graphs without torch.compile's fusion, for the comparison
        from ttsserve.runner.cuda_graphs import DecodeGraphs

        g = engines["graph_uncompiled"].runner.graphs
        engines["graph_uncompiled"].runner.graphs = DecodeGraphs(g.runner, g.sizes, compile=False)
        engines["graph_uncompiled"].runner.graphs.capture()
        out["graph_compiled"] = engines["graph"].runner.graphs.ops.compiled
    for name, e in engines.items():
        for b in sizes if name == "graph" else [1, 256] if not ctx["quick"] else [1]:
            ids = submit(e, b, 1000, seed=b)
            for _ in range(100 if not ctx["quick"] else 30):  # prefill, then decode to a context of ~150
                e.step()
            tm0, rt0, n = dict(e.timings.__dict__), dict(e.runner.timings.__dict__), 30
            t0 = time.perf_counter()
            for _ in range(n):
                e.step()
            sync()
            wall = (time.perf_counter() - t0) / n * 1e3
            row = {
                "engine_step_ms": wall,
                "runner_ms": (
                    e.runner.timings.prepare_ms
                    + e.runner.timings.forward_ms
                    + e.runner.timings.output_ms
                    - rt0["prepare_ms"]
                    - rt0["forward_ms"]
                    - rt0["output_ms"]
                )
                / n,
                "breakdown_ms": {k: (v - tm0[k]) / n for k, v in e.timings.__dict__.items()},
                "frames_per_s": b / wall * 1e3,
            }
            g = e.runner.graphs
            if g is not None:
                bucket = g.bucket(b)
                row["graph_gpu_ms"] = gpu_time_ms(g.graphs[bucket].replay, 20)
                row["graph_bucket"] = bucket
            out[f"{name}_b{b}"] = row
            LOG.info("step %s b=%d: %s", name, b, json.dumps(row))
            finish(e, ids)
    del engines
    return out


def _one(e: Engine, frames: int, seed: int) -> dict:
    ids = submit(e, 1, frames, seed=seed)
    t0 = time.perf_counter()
    r = drive(e, ids, t0)[ids[0]]
    return {"latency_s": r["done"], "ttfa_s": r["ttfa"], "audio_s": r["samples"] / SR}


def sec_single(ctx: dict) -> dict:
    e = ctx.setdefault("e_graph", make_engine(ctx["model"], max_num_seqs=256))
    runs = [_one(e, FRAMES_10S, seed=7 + i) for i in range(3)]
    return {
        "graph_runs": runs,
        "graph_latency_median_s": statistics.median(r["latency_s"] for r in runs),
        "graph_ttfa_median_s": statistics.median(r["ttfa_s"] for r in runs),
    }


def _saturate(e: Engine, n: int) -> dict:
    ids = submit(e, n, FRAMES_10S, seed=1000)
    tm0 = dict(e.timings.__dict__)
    s0 = e.counters.steps
    t0 = time.perf_counter()
    recs = drive(e, ids, t0)
    wall = time.perf_counter() - t0
    steps = e.counters.steps - s0
    audio = sum(r["samples"] for r in recs.values()) / SR
    return {
        "streams": n,
        "wall_s": wall,
        "audio_s": audio,
        "audio_s_per_s": audio / wall,
        "steps": steps,
        "step_ms_mean": wall / steps * 1e3,
        "preemptions": e.counters.preemptions,
        "breakdown_ms_per_step": {k: (v - tm0[k]) / steps for k, v in e.timings.__dict__.items()},
        **stream_stats(recs),
    }


def sec_saturation(ctx: dict) -> dict:
    e = ctx.setdefault("e_graph", make_engine(ctx["model"], max_num_seqs=256))
    out = {"n256_first_pass": _saturate(e, 256), "n256": _saturate(e, 256)}
    # the same 256 streams with the windowed stage at the exact context (A/B of the incremental vocoder); each
    # engine's first pass pays one-time costs (allocator growth, pinned buffers, first kernels), so it warms
    windowed = make_engine(ctx["model"], max_num_seqs=256, lookahead_frames=e.audio.right_context_frames)
    out["n256_windowed_exact_first_pass"] = _saturate(windowed, 256)
    out["n256_windowed_exact"] = _saturate(windowed, 256)
    del windowed
    if not ctx["quick"]:
        e512 = make_engine(ctx["model"], max_num_seqs=512, kv_cache_memory=kv_bytes(24))
        out["n512_first_pass"] = _saturate(e512, 512)
        out["n512"] = _saturate(e512, 512)
        del e512
    return out


def sec_vocoder_rows(ctx: dict) -> dict:
    """512 streams with the incremental vocoder at 128 (the default) and 512 rows per call: at chunk boundaries
    every stream is ready at once, and each call is ~2,300 host-side ops, so fewer calls cost less host time."""
    out = {}
    for rows in (128, 512):
        e = make_engine(ctx["model"], max_num_seqs=512, kv_cache_memory=kv_bytes(24))
        e.audio.max_windows_per_call = rows
        out[f"rows{rows}_first_pass"] = _saturate(e, 512)
        out[f"rows{rows}"] = _saturate(e, 512)
        del e
        gc.collect()
        torch.cuda.empty_cache()
    return out


def sec_streams(ctx: dict) -> dict:
    e = ctx.setdefault("e_graph", make_engine(ctx["model"], max_num_seqs=256))
    out = {"exact_lookahead": _saturate(e, 128)}
    e8 = make_engine(ctx["model"], max_num_seqs=256, lookahead_frames=8)
    out["lookahead_8"] = _saturate(e8, 128)
    out["right_context_frames_exact"] = e.audio.right_context_frames
    del e8
    return out


def sec_startup(ctx: dict) -> dict:
    for k in [k for k in ctx if k.startswith("e_")]:
        del ctx[k]
    gc.collect()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    e = Engine(model_config(max_num_seqs=256), model=ctx["model"])
    out = {
        "startup_s": time.perf_counter() - t0,
        "memory_report": e.memory_report(),
        "graph_capture_s": e.runner.graphs.capture_s if e.runner.graphs else None,
        "concurrent_30s": e.kv_spec.concurrent_utterances(30.0),
        "concurrent_10s": e.kv_spec.concurrent_utterances(10.0),
    }
    del e
    gc.collect()
    torch.cuda.empty_cache()
    return out


SECTIONS = {
    "memory": sec_memory,
    "ceilings": sec_ceilings,
    "vocoder": sec_vocoder,
    "vocoder_rows": sec_vocoder_rows,
    "single": sec_single,
    "step": sec_step,
    "saturation": sec_saturation,
    "streams": sec_streams,
    "startup": sec_startup,
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/gpu")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dummy-size", default="real")
    a = ap.parse_args()
    SETUP.update(device=a.device, dummy_size=a.dummy_size, dtype="bfloat16" if a.device == "cuda" else "float32")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = load_model(model_config())
    results = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else a.device,
        "torch": torch.__version__,
        "model_load_s": time.perf_counter() - t0,
        "command": " ".join(sys.argv),
    }
    ctx = {"model": model, "quick": a.quick}
    for name in a.sections.split(","):
        t = time.perf_counter()
        try:
            results[name] = SECTIONS[name](ctx)
        except Exception as exc:  # noqa: BLE001 -- one broken section must not lose the others' numbers
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            LOG.error("section %s failed:\n%s", name, traceback.format_exc())
        results[name + "_section_s"] = time.perf_counter() - t
        (out_dir / "gpu_bench.json").write_text(json.dumps(results, indent=1, default=str))
        LOG.info("section %s done in %.1f s", name, time.perf_counter() - t)
    print(
        json.dumps(
            {k: v for k, v in results.items() if not isinstance(v, dict) or "error" not in v}, indent=1, default=str
        )[:6000]
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
