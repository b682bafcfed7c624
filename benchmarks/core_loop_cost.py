"""What the engine core's loop costs per step outside Engine.step (receiving, stats, outputs, flushing), with
N API servers (ZMQ DEALER sockets in this process, reading what the core sends) keeping C requests in flight.
CPU, tiny dummy model; the core's own phases are timed around its methods; steady state after a warm-up.

--served models the served H200 path's host work on the CPU: decode bursts of 8 (--burst), asynchronous
scheduling, vocoder and admissions every 8 // burst steps (the CUDA defaults), requests of --frames frames (200:
~4.3 s of audio), one thread for torch, the start-up heap frozen as the core does; the GPT forward, the sampler,
the vocoder networks and the audio crop (device work on the H200, not host work) are stubbed, so the step is the
host's bookkeeping. It also reports the garbage collector's time and longest pause per generation
(--gc-thresholds: try others than the core's).
--graphs: the decode rows take the CUDA path's DecodeGraphs.run (its pinned-buffer fill, copies and output
tensors; the replay itself stubbed) instead of the CPU's eager decode, whose torch ops are device work on a GPU.

Usage: python3 benchmarks/core_loop_cost.py [--concurrency 128] [--api-servers 8] [--steps 400]
       python3 benchmarks/core_loop_cost.py --served --graphs --concurrency 512 --api-servers 12 --warmup 200
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import zmq  # noqa: E402

from ttsserve.bench.corpus import select_texts  # noqa: E402
from ttsserve.config import EngineConfig  # noqa: E402
from ttsserve.engine.core.heap import freeze_startup_heap  # noqa: E402
from ttsserve.engine.core.messages import (  # noqa: E402
    AddRequest,
    CoreOutputs,
    Hello,
    SegmentMsg,
    SynthesisMsg,
    core_decoder,
    encoder,
)
from ttsserve.engine.core.proc import EngineCoreProc  # noqa: E402
from ttsserve.engine.engine import Engine  # noqa: E402
from ttsserve.params import SamplingParams, SynthesisRequest  # noqa: E402
from ttsserve.text.segments import prepare_segments, tokenize_segments  # noqa: E402
from ttsserve.text.tokenizer import TextTokenizer  # noqa: E402


def _timed(times: dict, name: str, fn):
    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            times[name] += time.perf_counter() - t0

    return wrapper


def _served_engine(concurrency: int, graphs: bool = False, burst: int = 8, block_size: int = 16) -> Engine:
    """The served path's scheduling on the CPU, its device work stubbed (see the module docstring)."""
    import torch

    import ttsserve.audio.incremental_stage as incremental_stage
    import ttsserve.runner.model_runner as model_runner

    cfg = EngineConfig(
        load_format="dummy",
        dummy_size="tiny",
        device="cpu",
        kv_cache_memory=1024 << 20,
        swap_space=0,
        max_num_seqs=concurrency,
        num_scheduler_steps=burst,
        block_size=block_size,
        async_scheduling=True,
        vocoder_cadence=max(1, 8 // burst),  # the CUDA defaults (EngineConfig.step_intervals)
        admission_interval=max(1, 8 // burst),
        cpu_threads=1,
    )
    engine = Engine(cfg)
    hidden, hop = engine.model.gpt_config.hidden_size, engine.audio.vocos.hop_length

    def sample(logits, batch):  # never EOS: the lengths are the requests' min_new_tokens
        return torch.randint(0, logits.shape[-1] - 1, logits.shape[:2])

    engine.runner._forward = lambda x, md, positions: x.new_zeros(x.shape[0], hidden)
    # the CPU's own decode paths (a compiled step graph, the fused C kernels) would run the GPT instead
    engine.runner.cpu_graph = engine.runner.cpu_fused = None
    num_vq, vocab = engine.model.gpt_config.num_vq, engine.model.gpt_config.num_audio_tokens
    engine.model.embed.code_logits = lambda h: h.new_zeros(h.shape[0], num_vq, vocab)
    model_runner.sample = sample
    engine.runner.sample_rows.__func__.__defaults__ = (sample,)
    engine.audio.pipeline = lambda kind, x, info, n: torch.empty(x.shape[0], hop * 2 * n)
    incremental_stage.crop_rows = lambda wav, starts, sizes: torch.empty(sum(sizes))
    if graphs:
        from ttsserve.runner.cuda_graphs import DecodeGraphs, default_capture_sizes

        g = DecodeGraphs(engine.runner, default_capture_sizes(concurrency), fused=False, max_steps=burst)
        g.capture()  # off CUDA: the buckets' bookkeeping, no graph
        g._replay = lambda bs: None
        engine.runner.graphs = g
    return engine


class _GcPauses:
    """Every collection's duration by generation, while on."""

    def __init__(self) -> None:
        self.on, self._t0, self.pauses = False, 0.0, {0: [], 1: [], 2: []}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.on:
            self.pauses[info["generation"]].append(time.perf_counter() - self._t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--api-servers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--served", action="store_true", help="the served path's host work (module docstring)")
    ap.add_argument("--frames", type=int, default=200, help="--served: frames per request")
    ap.add_argument("--graphs", action="store_true", help="--served: the decode graphs' host path (docstring)")
    ap.add_argument("--burst", type=int, default=8, help="--served: frames a decode burst (num_scheduler_steps)")
    ap.add_argument("--block-size", type=int, default=16, help="--served: KV block size")
    ap.add_argument("--gc-thresholds", default=None, help="--served: e.g. 700,10,10 (default: the core's)")
    a = ap.parse_args()
    if a.served:
        engine = _served_engine(a.concurrency, a.graphs, a.burst, a.block_size)
        freeze_startup_heap("benchmark", step_loop=True)
        if a.gc_thresholds:
            gc.set_threshold(*map(int, a.gc_thresholds.split(",")))
        params = {"max_new_tokens": a.frames, "min_new_tokens": a.frames}
    else:
        engine = Engine(
            EngineConfig(
                load_format="dummy",
                dummy_size="tiny",
                device="cpu",
                kv_cache_memory=512 << 20,
                swap_space=0,
                max_num_seqs=2 * a.concurrency,
            )
        )
        params = {"max_new_tokens": 96}
    address = f"ipc://{tempfile.mkdtemp()}/core"
    core = EngineCoreProc(engine, address)
    ctx = zmq.Context.instance()
    clients = []
    for i in range(a.api_servers):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, f"api-{i}".encode())
        s.connect(address)
        s.send(encoder.encode(Hello(i, 0)))
        clients.append(s)
    while len(core.batches) < a.api_servers:  # every Hello in (connecting is asynchronous)
        core._receive(100)
    tok = TextTokenizer.from_json(engine.model.tokenizer.to_json())
    texts = [s.text for s in select_texts(256, seed=0)]
    in_flight: set[str] = set()
    counter = [0]

    def add_one() -> None:
        k = counter[0]
        counter[0] += 1
        req = SynthesisRequest(texts[k % len(texts)], code_params=SamplingParams(seed=k, **params))
        segs = tokenize_segments(req, prepare_segments(req), tok)
        clients[k % len(clients)].send(
            encoder.encode(
                AddRequest(f"r{k}", msgspec.Raw(encoder.encode(SynthesisMsg.of(req))), [SegmentMsg.of(s) for s in segs])
            )
        )
        in_flight.add(f"r{k}")

    def drain_clients() -> None:
        for s in clients:
            while s.poll(0):
                msg = core_decoder.decode(s.recv())
                if isinstance(msg, CoreOutputs):
                    for r in msg.rejected:
                        raise SystemExit(f"rejected {r.request_id}: {r.error.message}")
                    for o in msg.outputs:
                        if o.finished:
                            in_flight.discard(o.request_id)

    times: dict[str, float] = defaultdict(float)
    engine.step = _timed(times, "engine.step", engine.step)
    engine.stats = _timed(times, "engine.stats", engine.stats)
    for name in ("_receive", "_step", "_flush"):
        setattr(core, name, _timed(times, name, getattr(core, name)))
    pauses = _GcPauses()
    for k in range(a.warmup + a.steps):
        if k == a.warmup:
            times.clear()
            engine.reset_stats()  # the step's phase timings below cover the measured steps only
            pauses.on = True
            vocoder0 = (engine.audio.calls_total, engine.audio.frames_decoded_total)
            frames0 = engine.counters.frames
            t_start = time.perf_counter()
        # --served: arrivals ramp up over ~40 steps, so that the streams' ends spread as under served load
        target = min(a.concurrency, (k + 1) * max(1, a.concurrency // 40)) if a.served else a.concurrency
        while len(in_flight) < target:
            add_one()
        core._receive(0 if engine.has_unfinished() else 100)
        core._flush()
        core._step()
        core._flush()
        drain_clients()
    wall = time.perf_counter() - t_start
    n = a.steps
    step_only = times["_step"] - times["engine.step"] - times["engine.stats"]
    print(
        f"concurrency {a.concurrency}, {a.api_servers} API servers, {n} steps, {wall / n * 1e3:.2f} ms per step "
        f"(tiny model on the CPU{', served path, device work stubbed' if a.served else ''}), per step:"
    )
    for name, t in [
        ("engine.step", times["engine.step"]),
        ("engine.stats", times["engine.stats"]),
        ("_step rest (outputs -> RequestOutput, stats encode)", step_only),
        ("_receive (adds included)", times["_receive"]),
        ("_flush x2", times["_flush"]),
    ]:
        print(f"  {name:52s} {t / n * 1e3:7.3f} ms")
    for name, ms in engine.timings.as_dict(engine.counters.steps).items():  # inside engine.step
        print(f"    step phase {name:45s} {ms:7.3f} ms")
    calls, frames = engine.audio.calls_total - vocoder0[0], engine.audio.frames_decoded_total - vocoder0[1]
    print(f"  vocoder calls per step {calls / n:.2f}, {frames / max(calls, 1):.0f} frames a call")
    sampled = engine.counters.frames - frames0
    print(f"  frames sampled per step {sampled / n:.0f}: {wall / max(sampled, 1) * 1e6:.2f} us of the loop a frame")
    gc_ms = [sum(pauses.pauses[g]) / n * 1e3 for g in range(3)]
    longest = [max(pauses.pauses[g], default=0.0) * 1e3 for g in range(3)]
    print(
        f"  garbage collector (thresholds {gc.get_threshold()}): {sum(gc_ms):.3f} ms per step, by generation "
        f"{[round(x, 3) for x in gc_ms]} ms, {[len(pauses.pauses[g]) for g in range(3)]} collections, longest "
        f"{[round(x, 2) for x in longest]} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
