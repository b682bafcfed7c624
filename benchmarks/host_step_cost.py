"""Host cost of one engine step's bookkeeping, per call, on CPU: the pieces of the engine core's step loop a
py-spy profile of served load shows (Scheduler.schedule / update_from_output with the KVCacheManager,
InputBatch.sync_block_table + flush_block_tables, StreamingStage.append_batch, ModelRunner.launch / wait with the
decode graph's replay stubbed out), driven with the real objects and N running code decode sequences, as the
pipelined (async-scheduling) engine calls them.

Usage: python3 benchmarks/host_step_cost.py [--seqs 128 256] [--steps 2000] [--rounds 5] [--width 64]
                                           [--device cpu|cuda] [--burst 4]

Each number is the best of `rounds` rounds of steps / rounds calls (the machine is shared: the minimum is the
least disturbed round).

On CPU the device copies are free (the device block table is the host array; to_device is a view), so the
numbers are the Python cost. With --device cuda the input batch and the audio stage live on the GPU (the host
time of their launches is measured, the GPU is synchronised between rounds only) and the pin_memory staging
copies per call are counted (`<name>_pins`). That mode has not been run on a GPU yet: the CUDA figures below
come from inline H200 micro-benchmarks of the same torch op sequences.

Results (branch host, 2 shared CPU cores, best of 3 x 7 rounds; before = 4441ebd), us per call, N = 128 / 256:
  Scheduler.schedule            360 / 736  ->  220 / 465
  Scheduler.update_from_output  119 / 249  ->   75 / 162
  StreamingStage.append_batch   155 / 290  ->   98 / 153  (width 64; ~14 us of it is the CPU index_copy_)
  InputBatch.flush_block_tables   no copy on CPU either way
Scheduler steady decode rows (engine/steady.py; 2 shared CPU cores, --steps 1000, 2 runs interleaved with one of
main; before = 1b1f7d0), us per call, N = 128 / 256 / 512: schedule 117 / 242 / 521 -> 86 / 161 / 319-328,
update_from_output 43 / 89 / 225 -> 38 / 70 / 182-187.
ModelRunner (--burst 4, pipelined; 2 shared CPU cores, best of 5 rounds, 3 interleaved runs; before = a313be2),
us per call, N = 128 / 256 / 512: launch 193-197 / 306-320 / 520-540 -> 215-227 / 318-321 / 486-504; wait
212-214 / 381-392 / 2458-2556 -> 114-117 / 282-298 / 550-586 (runner_output's per-row lists and tuples, and
the collections they set off, were most of it).
CUDA host cost per call on an H200 (inline torch sequences): flush_block_tables 44-81 us (2 pin_memory staging
copies + index_copy_) -> ~12 us (one copy from the pinned host table + an event record on a cached stream);
append_batch's device write 33 us either way (1 staging copy + one index kernel), its Python loop as above.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ttsserve.audio.decoder_net import ConvNeXtStack, HiddenDecoder  # noqa: E402
from ttsserve.audio.incremental_stage import IncrementalAudioStage  # noqa: E402
from ttsserve.audio.vocos import ISTFTHead, Vocos, VocosBackbone  # noqa: E402
from ttsserve.engine.block_manager import KVCacheManager  # noqa: E402
from ttsserve.engine.request import Request  # noqa: E402
from ttsserve.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from ttsserve.runner.input_batch import InputBatch  # noqa: E402

BLOCK_SIZE, PROMPT_LEN, MAX_MODEL_LEN = 16, 64, 4096  # the engine defaults: 256 blocks per sequence


def _us(total_s: float, calls: int) -> float:
    return total_s / max(calls, 1) * 1e6


class _PinCounter:
    """Counts Tensor.pin_memory calls: the staging copy of every async_h2d / to_device (a copy from memory
    that is already pinned, as the InputBatch flush now does, is not counted)."""

    def __init__(self) -> None:
        self.count, self._real = 0, torch.Tensor.pin_memory

    def __enter__(self) -> _PinCounter:
        real = self._real

        def counting(t, *args, **kwargs):
            self.count += 1
            return real(t, *args, **kwargs)

        torch.Tensor.pin_memory = counting
        return self

    def __exit__(self, *exc) -> None:
        torch.Tensor.pin_memory = self._real


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- scheduler + block manager ---------------------------------------------------------------------------
def _scheduler(n: int) -> Scheduler:
    bm = KVCacheManager(n * MAX_MODEL_LEN // BLOCK_SIZE, BLOCK_SIZE)
    cfg = SchedulerConfig(
        max_num_seqs=max(n, 256), max_num_batched_tokens=max(4096, n * PROMPT_LEN), max_model_len=MAX_MODEL_LEN
    )
    s = Scheduler(cfg, bm)
    for i in range(n):  # distinct prompts: no prefix sharing; code items are 4-tuples as in the engine
        prompt = [(i, j, j + 1, j + 2) for j in range(PROMPT_LEN)]
        s.add_request(Request(f"r{i}", prompt, mode="code", max_new_tokens=MAX_MODEL_LEN, first_audio_frames=60))
    return s


def _step(s: Scheduler, inflight, t: list[float]):
    """One pipelined engine step: schedule n + 1, then commit step n. t: [schedule_s, update_s] accumulators."""
    t0 = time.perf_counter()
    out = s.schedule()
    t1 = time.perf_counter()
    if inflight is not None:
        sampled = {r.request_id: (1, 2, 3, 4) for r in inflight.scheduled if r.will_sample}
        t2 = time.perf_counter()
        s.update_from_output(inflight, sampled, {})
        t[1] += time.perf_counter() - t2
    t[0] += t1 - t0
    return out


def bench_scheduler(n: int, steps: int) -> dict[str, float]:
    s = _scheduler(n)
    inflight, t = None, [0.0, 0.0]
    for _ in range(3):  # prefill, then every sequence decodes
        inflight = _step(s, inflight, t)
    assert all(len(r.scheduled) == n and all(x.num_new_tokens == 1 for x in r.scheduled) for r in [inflight])
    t = [0.0, 0.0]
    for _ in range(steps):
        inflight = _step(s, inflight, t)
    assert s.num_running == n and s.num_preemptions == 0
    return {"schedule": _us(t[0], steps), "update_from_output": _us(t[1], steps)}


# ---- input batch -----------------------------------------------------------------------------------------
def bench_input_batch(n: int, steps: int, device: torch.device) -> dict[str, float]:
    """Decode rows whose tables grow by a block every BLOCK_SIZE steps, staggered (n / 16 rows a step), synced
    as ModelRunner._assign_rows does (only rows whose length changed), then one flush."""
    ib = InputBatch(n, MAX_MODEL_LEN // BLOCK_SIZE, BLOCK_SIZE, device)
    tables = [list(range(i * 512, i * 512 + 4)) for i in range(n)]
    rows = [ib.assign(f"r{i}")[0] for i in range(n)]
    for r, tb in zip(rows, tables):
        ib.sync_block_table(r, tb)
    ib.flush_block_tables()
    _sync(device)
    t_sync = t_flush = 0.0
    pins = _PinCounter()
    for k in range(steps):
        t0 = time.perf_counter()
        nb = ib.num_blocks_np
        for i, r in enumerate(rows):
            tb = tables[i]
            if (k + i) % BLOCK_SIZE == 0:
                tb.append(tb[-1] + 1)
            if len(tb) != nb[r]:
                ib.sync_block_table(r, tb)
        t1 = time.perf_counter()
        with pins:
            ib.flush_block_tables()
        t_flush += time.perf_counter() - t1
        t_sync += t1 - t0
    _sync(device)
    return {
        "assign_rows_sync_loop": _us(t_sync, steps),
        "flush_block_tables": _us(t_flush, steps),
        "flush_block_tables_pins": pins.count / steps,
    }


# ---- model runner -----------------------------------------------------------------------------------------
def _runner_engine(n: int, burst: int):
    """A CPU engine (tiny dummy model) holding n code streams in steady decode, pipelined with decode bursts of
    `burst` frames as on CUDA, whose decode graph (DecodeGraphs on CPU, every host step of run()) replays
    nothing: the runner's host work without the device's."""
    from ttsserve.config import EngineConfig
    from ttsserve.engine.engine import Engine
    from ttsserve.params import SamplingParams, SynthesisRequest
    from ttsserve.runner.cuda_graphs import DecodeGraphs

    e = Engine(
        EngineConfig(
            load_format="dummy",
            dummy_size="tiny",
            device="cpu",
            kv_cache_memory=256 << 20,
            swap_space=0,
            max_num_seqs=n,
            max_num_batched_tokens=max(4096, 64 * n),
            async_scheduling=True,
            num_scheduler_steps=burst,
        )
    )
    graphs = DecodeGraphs(e.runner, [n], fused=False, max_steps=burst)
    graphs.capture()
    graphs._replay = lambda bs: None
    e.runner.graphs = graphs
    for i in range(n):
        params = SamplingParams(seed=i, max_new_tokens=MAX_MODEL_LEN // 2)
        e.add_synthesis(SynthesisRequest("host work per step.", code_params=params))
    return e


def _runner_steps(e, steps: int, t: list[float]) -> None:
    """Pipelined steps as Engine.step runs them (schedule n + 1, launch it, wait for n, commit n); t:
    [launch_s, wait_s] accumulators."""
    s, r = e.scheduler, e.runner
    for _ in range(steps):
        sched = s.schedule()
        t0 = time.perf_counter()
        launched = r.launch(sched, s.requests)
        t1 = time.perf_counter()
        done, e._in_flight = e._in_flight, (sched, launched)
        out = r.wait(done[1]) if done else None
        t[0], t[1] = t[0] + t1 - t0, t[1] + time.perf_counter() - t1
        if done:
            s.update_from_output(done[0], out.sampled, out.stopped)


def bench_runner(n: int, steps: int, burst: int, engines: dict) -> dict[str, float]:
    e = engines.get((n, burst)) or engines.setdefault((n, burst), _runner_engine(n, burst))
    _runner_steps(e, 4, [0.0, 0.0])  # prefill, then every stream decodes
    steps = min(steps, 80)  # the rounds share the engine: its streams must not reach max_new_tokens
    t = [0.0, 0.0]
    _runner_steps(e, steps, t)
    return {"runner_launch": _us(t[0], steps), "runner_wait": _us(t[1], steps)}


# ---- audio stage -----------------------------------------------------------------------------------------
def _stage(width: int, device: torch.device) -> IncrementalAudioStage:
    torch.manual_seed(0)
    dec = HiddenDecoder(ConvNeXtStack(width // 2, width // 2, 32, 100, 2, 64), 100).to(device)
    voc = Vocos(VocosBackbone(100, 32, 64, 2), ISTFTHead(32, 1024)).to(device)
    return IncrementalAudioStage(dec, None, voc, device=device)


def bench_append_batch(n: int, steps: int, width: int, device: torch.device) -> dict[str, float]:
    """append_batch of one frame for each of n streams per step; the vocoder's consumption of frames is
    simulated (num_emitted_frames catches up every 64 steps) so the pool shifts as it does in service."""
    stage = _stage(width, device)
    ids = [f"r{i}" for i in range(n)]
    for r in ids:
        stage.add_request(r)
    frames = torch.randn(n, width, device=device)
    total, pins = 0.0, _PinCounter()
    _sync(device)
    for k in range(steps):
        batch = list(ids)  # the engine passes a fresh list every step
        t0 = time.perf_counter()
        with pins:
            stage.append_batch(batch, frames)
        total += time.perf_counter() - t0
        if k % 64 == 63:
            for st in stage._streams.values():
                st.num_emitted_frames = st.num_frames
    _sync(device)
    return {"append_batch": _us(total, steps), "append_batch_pins": pins.count / steps}


def _best(fn, rounds: int) -> dict[str, float]:
    """Per key, the minimum over rounds of fn()'s per-call means."""
    runs = [fn() for _ in range(rounds)]
    return {k: min(r[k] for r in runs) for k in runs[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=int, default=64, help="frame width (the real model: 768)")
    ap.add_argument("--device", default="cpu", help="where the input batch and the audio stage live")
    ap.add_argument("--burst", type=int, default=4, help="decode burst of the runner's steps (CUDA's default: 4)")
    a = ap.parse_args()
    engines: dict = {}
    torch.set_num_threads(1)
    dev = torch.device(a.device)
    for n in a.seqs:
        k = max(a.steps // a.rounds, 1)
        res = {
            **_best(lambda: bench_scheduler(n, k), a.rounds),
            **_best(lambda: bench_input_batch(n, k, dev), a.rounds),
            **_best(lambda: bench_append_batch(n, k, a.width, dev), a.rounds),
            **_best(lambda: bench_runner(n, k, a.burst, engines), a.rounds),
        }
        print(
            f"N={n} {dev.type}: "
            + ", ".join(f"{k} {v:.2f}" if k.endswith("_pins") else f"{k} {v:.1f} us" for k, v in res.items()),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
