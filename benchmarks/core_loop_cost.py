"""What the engine core's loop costs per step outside Engine.step (receiving, stats, outputs, flushing), with
N API servers (ZMQ DEALER sockets in this process, reading what the core sends) keeping C requests in flight.
CPU, tiny dummy model; the core's own phases are timed around its methods; steady state after a warm-up.

Usage: python3 benchmarks/core_loop_cost.py [--concurrency 128] [--api-servers 8] [--steps 400]
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--api-servers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=100)
    a = ap.parse_args()
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
        req = SynthesisRequest(texts[k % len(texts)], code_params=SamplingParams(seed=k, max_new_tokens=96))
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
    for k in range(a.warmup + a.steps):
        if k == a.warmup:
            times.clear()
            engine.reset_stats()  # the step's phase timings below cover the measured steps only
            t_start = time.perf_counter()
        while len(in_flight) < a.concurrency:
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
        f"(tiny model on the CPU), per step:"
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
