"""Host cost of Engine._append_frames for one decode burst's hidden states [4, 128, H] (tiny engine, CPU):
every row accepted, against one row dropped (a pipelined step's row that the previous step ended; at 128
streams of ~300 frames in bursts of 4, ~1.7 streams end per step, so most served steps hold one). Best of 5
rounds of 50 calls; the pool positions are rewound after each call so it never grows.

    python benchmarks/append_frames_cost.py

2-core CPU machine, 2026-12-02, tree 0290764 plus the grouped append: all accepted 141-152 us, one row dropped
210-255 us; before it (frame by frame for every row of such a batch) 190 / 587 us.
2026-12-03, one append per batch with the rows' counts (FramePool.put gathers the kept frames), 3 runs interleaved
with 4c38626: all accepted 92-94 us (before 86-89), one row dropped 117-131 us (before 172-179; the runner's own
split of EOS rows, gone too, is not in this figure).
"""

from __future__ import annotations

import time

import torch

from ttsserve.config import EngineConfig
from ttsserve.engine.engine import Engine
from ttsserve.engine.outputs import RequestUpdate
from ttsserve.params import SamplingParams, SynthesisRequest


def decoding_engine(num_streams: int = 128) -> tuple[Engine, list[str]]:
    e = Engine(
        EngineConfig(
            load_format="dummy",
            dummy_size="tiny",
            device="cpu",
            swap_space=0,
            max_num_seqs=num_streams,
            kv_cache_memory=256 << 20,
        )
    )
    for n in range(num_streams):
        params = SamplingParams(seed=n, max_new_tokens=100000, min_new_tokens=100000)
        e.add_synthesis(SynthesisRequest("hello world", request_id=f"r{n}", code_params=params))
    for _ in range(30):  # every stream past its prefill
        e.step()
    return e, [s for s, seq in e.sequences.items() if seq.mode == "code"]


def best_us(e: Engine, ids: list[str], hidden: torch.Tensor, updates: list, rounds: int = 5, calls: int = 50) -> float:
    base = {s: e.audio._streams[s].num_frames for s in ids}
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            e._append_frames([(ids, hidden)], updates)
            for s in ids:  # rewind: the same pool positions again, no growth
                e.audio._streams[s].num_frames = base[s]
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main() -> None:
    e, ids = decoding_engine()
    hidden = torch.randn(4, len(ids), e.audio._pools[False].data.shape[2])
    full = [RequestUpdate(s, None, False, None, 4) for s in ids]
    one_dropped = [RequestUpdate(s, None, False, None, 0 if i == 5 else 4) for i, s in enumerate(ids)]
    for name, updates in (("all accepted", full), ("one row dropped", one_dropped)):
        print(f"{name}: {best_us(e, ids, hidden, updates):.0f} us per call ({len(ids)} streams)")


if __name__ == "__main__":
    main()
