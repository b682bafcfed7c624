"""The engine's streaming vocoder stage alone under a served-like load, timed per step and profiled.

S streams run at once, each appending --frames-per-step frames a step (as the engine's decode bursts do) until it
has --frames frames, then finishing and being replaced by a new stream; the streams start staggered, so chunk
boundaries spread over steps as in a served run. The stage is built as the engine builds it
(engine/audio_setup.py: deferred on CUDA, fp16 networks with a 16-bit GPT, the exact stage's CUDA graphs), with
--lookahead-frames picking the windowed stage. Prints step wall-time percentiles, audio-s/s the stage emitted,
and torch.profiler's top operators over --profile-steps steps; --shape-sweep first times the windowed stage's
first and second call at shapes it has not seen; --bucket-costs times a replay of each graph bucket of the exact
stage afterwards (CUDA).

  python3 benchmarks/vocoder_stage_profile.py --device cuda --streams 128 [--lookahead-frames 16]
  python3 benchmarks/vocoder_stage_profile.py --device cpu --dummy-size tiny --streams 4 --steps 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from ttsserve.config import EngineConfig
from ttsserve.engine.audio_setup import build_audio_stage
from ttsserve.model.chattts import load_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(args) -> None:
    cfg = EngineConfig(
        load_format="dummy",
        dummy_size=args.dummy_size,
        device=args.device,
        dtype=args.dtype,
        lookahead_frames=args.lookahead_frames,
        first_chunk_lookahead_frames=args.first_chunk_lookahead_frames,
        max_num_seqs=max(args.streams, 1),
    )
    model = load_model(cfg)
    dev = model.device
    stage = build_audio_stage(cfg, model, cadence=1, cuda_graphs=dev.type == "cuda", defer=False)
    hidden = model.decoder.hidden_size
    if args.shape_sweep and hasattr(stage, "_bucketed"):
        _shape_sweep(stage, dev)
    frames = torch.randn(args.frames_per_step * args.streams, hidden, device=dev, dtype=model.dtype)
    live: dict[str, int] = {}  # stream -> frames appended
    started = 0

    def one_step() -> int:
        nonlocal started
        while len(live) < args.streams:
            rid = f"s{started}"
            stage.add_request(rid)
            # staggered: the first wave starts part-way through its utterance
            live[rid] = (started * 7) % args.frames if started < args.streams else 0
            if live[rid]:
                stage.append(rid, torch.randn(live[rid], hidden, device=dev, dtype=model.dtype))
            started += 1
        ids = list(live)
        stage.append_batch(ids, frames[: len(ids) * args.frames_per_step].view(args.frames_per_step, len(ids), -1))
        for rid in ids:
            live[rid] += args.frames_per_step
            if live[rid] >= args.frames:
                stage.finish(rid)
                del live[rid]
        chunks = stage.step()
        return sum(len(c.samples) for c in chunks)

    for _ in range(args.warm_steps):
        one_step()
    _sync(dev)
    times, samples = [], 0
    t_all = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        samples += one_step()
        times.append((time.perf_counter() - t0) * 1e3)
    _sync(dev)
    wall = time.perf_counter() - t_all
    q = statistics.quantiles(times, n=100, method="inclusive")
    print(
        f"{type(stage).__name__}, lookahead {args.lookahead_frames}, first chunk's "
        f"{args.first_chunk_lookahead_frames}, {args.streams} streams, "
        f"{args.frames_per_step} frames a step: step ms p50 {q[49]:.2f} p90 {q[89]:.2f} p99 {q[98]:.2f} "
        f"max {max(times):.2f}; {samples / 24000 / wall:.0f} audio-s/s emitted; "
        f"{stage.calls_total} calls, {stage.frames_decoded_total} frames decoded, "
        f"{stage.frames_padded_total} padded to the calls' widest rows"
    )
    if args.bucket_costs and getattr(stage, "graphs", None):
        _bucket_costs(stage.graphs[False])
    if args.profile_steps:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(args.profile_steps):
                one_step()
            _sync(dev)
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=args.top))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


def _bucket_costs(graphs) -> None:
    """Device ms a replay of each captured (rows, frames) bucket, its static buffers as the last call left them;
    and the least-squares line ms = a + b * cells: a / b is the fixed cost of a replay in cells (REPLAY_CELLS in
    audio/incremental_stage.py)."""
    from bench_engine import gpu_time_ms

    rows = [(key[0] * key[1], gpu_time_ms(graph.replay, 20), key) for key, graph in sorted(graphs.graphs.items())]
    for cells, ms, key in rows:
        print(f"bucket {key}: {cells} cells, {ms:.3f} ms a replay")
    n = len(rows)
    mx, my = sum(c for c, _, _ in rows) / n, sum(m for _, m, _ in rows) / n
    b = sum((c - mx) * (m - my) for c, m, _ in rows) / sum((c - mx) ** 2 for c, _, _ in rows)
    a = my - b * mx
    print(f"fit: ms = {a:.4f} + {b * 1e3:.4f} us * cells; a replay's fixed cost = {a / b:.0f} cells")


def _shape_sweep(stage, dev: torch.device) -> None:
    """The windowed stage's networks at shapes not seen before, each called twice: the first call's extra time
    is what a new (rows, width) costs, which shape buckets pay once per bucket."""
    for b, n in [(1, 24), (3, 37), (5, 52), (7, 69), (12, 85), (17, 101), (23, 117), (33, 131), (64, 144)]:
        ms = []
        for _ in range(2):
            _sync(dev)
            t0 = time.perf_counter()
            stage._scratch_call(b, n)
            _sync(dev)
            ms.append((time.perf_counter() - t0) * 1e3)
        print(f"shape ({b} rows, {n} frames): first call {ms[0]:.1f} ms, second {ms[1]:.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dummy-size", default="real")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--frames", type=int, default=300, help="frames per stream before it finishes")
    p.add_argument("--frames-per-step", type=int, default=4)
    p.add_argument("--lookahead-frames", type=int, default=None)
    p.add_argument("--first-chunk-lookahead-frames", type=int, default=None)
    p.add_argument("--warm-steps", type=int, default=100)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--shape-sweep", action="store_true", help="time the windowed stage's first call of new shapes")
    p.add_argument("--bucket-costs", action="store_true", help="time a replay of each vocoder graph bucket (CUDA)")
    run(p.parse_args())


if __name__ == "__main__":
    main()
