"""Where the device's time goes under a served-like closed loop: the engine alone (no HTTP) at one concurrency,
warmed up, then a few seconds under torch.profiler (CUDA activity only, so the host's speed is barely touched).

Prints and writes (JSON): the steps and frames of the profiled window, the device's busy share of the wall time
(the union of kernel intervals: what nvidia-smi's utilization overstates), device ms per step, and the kernels by
total time, grouped (attention, GEMM, sampler, vocoder convolutions, copies, other).

Usage (one device call): python3 benchmarks/gpu_step_profile.py --out DIR --concurrency 256,512 [--seconds 3]
       [--frames 60,256] [--variant pipelined-k4]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_engine as be  # noqa: E402
import staggered as st  # noqa: E402

from ttsserve.model.chattts import load_model  # noqa: E402

GROUPS = (  # first match wins; kernel names of torch 2.11 / Triton 3.6 on Hopper
    ("attention", re.compile(r"paged|attn|attention|flash", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|sm90_xmma|cublas|matmul|_mm_", re.I)),
    ("sampler", re.compile(r"sort|topk|top_k|softmax|multinomial|cumsum|scan|argmax|exponential|philox", re.I)),
    ("vocoder (Triton)", re.compile(r"^_(front|back|buffer)_kernel")),  # audio/triton_convnext.py
    ("conv (vocoder)", re.compile(r"conv|cudnn|implicit|winograd|fft", re.I)),
    ("copy / fill", re.compile(r"copy|memcpy|memset|fill|cat|index|gather|scatter", re.I)),
    ("norm / elementwise", re.compile(r"norm|elementwise|vectorized|reduce|triton_|silu|_rope_kernel", re.I)),
)


def group_of(name: str) -> str:
    return next((g for g, rx in GROUPS if rx.search(name)), "other")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The union of [start, end) intervals (µs): time with at least one kernel running."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def profile_point(model, concurrency: int, seconds: float, variant: str) -> dict:
    overrides, _, _ = st.VARIANTS[variant]
    engine = be.make_engine(model, max_num_seqs=max(concurrency, 8), **overrides)
    st.closed_loop(engine, concurrency, 5.0, seed=1)  # warm: shapes, allocator, graphs' first replays
    cuda = torch.cuda.is_available()
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        t0 = time.perf_counter()
        result = st.closed_loop(engine, concurrency, seconds, seed=2)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU  # CPU: ops (a smoke run)
    kernels = [e for e in prof.events() if e.device_type == kind]
    by_name: dict[str, list[float]] = {}
    intervals = []
    for e in kernels:
        t = e.time_range
        intervals.append((t.start, t.end))
        by_name.setdefault(e.name, []).append(t.end - t.start)
    steps = max(result["steps"], 1)
    groups: dict[str, float] = {}
    for name, ds in by_name.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + sum(ds)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:40]
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "concurrency": concurrency,
        "variant": variant,
        "audio_s_per_s": result["audio_s_per_s"],
        "steps": result["steps"],
        "step_ms": result["step_ms"],
        "device_busy_share": busy_us(intervals) / wall_us,
        "profiled_wall_s": wall_us / 1e6,
        "device_ms_per_step": busy_us(intervals) / steps / 1e3,
        "kernels_per_step": len(kernels) / steps,
        "kernel_ms_per_step_by_group": {
            g: round(v / steps / 1e3, 3) for g, v in sorted(groups.items(), key=lambda x: -x[1])
        },
        "top_kernels": [
            {
                "name": n[:160],
                "group": group_of(n),
                "calls_per_step": len(ds) / steps,
                "ms_per_step": sum(ds) / steps / 1e3,
            }
            for n, ds in top
        ],
        "step_breakdown_ms": result["step_breakdown_ms"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", default="256,512")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--frames", default="60,256", help="utterance frames LO,HI, uniform (served lengths)")
    ap.add_argument("--variant", default="pipelined", help="a staggered.py variant (the CUDA defaults: pipelined)")
    ap.add_argument("--device", default="cuda", help="cpu --dummy-size tiny: a smoke run of the script (no kernels)")
    ap.add_argument("--dummy-size", default="real")
    a = ap.parse_args()
    st.FRAMES = tuple(int(x) for x in a.frames.split(","))
    st.SERVED_LIKE = True
    be.SETUP.update(device=a.device, dummy_size=a.dummy_size, dtype="bfloat16" if a.device == "cuda" else "float32")
    model = load_model(be.model_config())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    points = []
    for c in (int(x) for x in a.concurrency.split(",")):
        p = profile_point(model, c, a.seconds, a.variant)
        points.append(p)
        (out / "step_profile.json").write_text(json.dumps(points, indent=1))
        print(
            f"@{c}: {p['audio_s_per_s']:.0f} audio-s/s, {p['step_ms']:.2f} ms per step, device busy "
            f"{p['device_busy_share']:.0%} ({p['device_ms_per_step']:.2f} ms, {p['kernels_per_step']:.0f} kernels per "
            "step); by group " + ", ".join(f"{g} {v}" for g, v in p["kernel_ms_per_step_by_group"].items()),
            flush=True,
        )
        for k in p["top_kernels"][:15]:
            print(f"   {k['ms_per_step']:7.3f} ms  {k['calls_per_step']:6.1f}x  [{k['group']}] {k['name'][:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
