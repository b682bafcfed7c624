"""How many engine steps a request waits for its first frames under the real scheduler: a closed loop of C
clients (a finished request is replaced at the next step, as `bench serve --concurrency C` does) on
engine/scheduler.py with a fake runner (tests/engine/scheduler_testutil.py: no model, no torch), every request
with a prompt of P positions and F frames. Prints, for requests that arrived after the first wave and for the
first wave (all C at step 0), the steps from arrival to the step that samples their N-th frame (24: the first
early chunk with --first-chunk-lookahead-frames 16; 60: the exact vocoder's first chunk). Multiply by the step
time of a served run to read a time to first audio; pure Python, so it runs anywhere.

    python3 benchmarks/admission_steps.py [--budget 4096] [--burst 8] [--clients 512] [--prompt 40]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "engine")]

from scheduler_testutil import FakeRunner, create_scheduler  # noqa: E402

from ttsserve.engine.request import Request  # noqa: E402


def _pct(xs: list[int], q: float) -> int:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * q))]


def run(budget: int, burst: int, clients: int, prompt: int, frames: int, nth: int, steps: int) -> dict:
    sched = create_scheduler(
        num_gpu_blocks=clients * (-(-(prompt + frames + burst) // 16) + 1),
        block_size=16,
        max_num_seqs=clients,
        max_num_batched_tokens=budget,
        max_model_len=2048,
        num_scheduler_steps=burst,
    )
    reqs: dict[str, Request] = {}
    born: dict[str, int] = {}
    reached: dict[str, int] = {}
    runner = FakeRunner(sched, reqs)

    def add(step: int) -> None:
        rid = f"r{len(reqs)}"
        reqs[rid] = Request(rid, [(len(reqs), p, 0, 0) for p in range(prompt)], max_new_tokens=frames, mode="code")
        sched.add_request(reqs[rid])
        born[rid] = step

    for _ in range(clients):
        add(0)
    for t in range(steps):
        out = sched.schedule()
        updates = sched.update_from_output(out, *runner.execute(out))
        for s in out.scheduled:
            if s.request_id not in reached and len(reqs[s.request_id].output_token_ids) >= nth:
                reached[s.request_id] = t
        for u in updates:
            if u.finished:
                add(t + 1)
    later = [reached[r] - born[r] for r in reached if born[r] > 0]
    wave = [reached[r] - born[r] for r in reached if born[r] == 0]
    return {"later": (_pct(later, 0.5), _pct(later, 0.99)), "wave": (_pct(wave, 0.5), _pct(wave, 0.99), max(wave))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, nargs="+", default=[4096], help="max_num_batched_tokens")
    ap.add_argument("--burst", type=int, nargs="+", default=[8], help="num_scheduler_steps")
    ap.add_argument("--clients", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=40, help="prompt positions a request")
    ap.add_argument("--frames", type=int, default=200, help="frames a request (200: 4.3 s of audio)")
    ap.add_argument("--nth", type=int, default=24, help="the frame whose step is counted")
    ap.add_argument("--steps", type=int, default=400)
    a = ap.parse_args()
    for burst in a.burst:
        for budget in a.budget:
            r = run(budget, burst, a.clients, a.prompt, a.frames, a.nth, a.steps)
            print(
                f"burst {burst}, budget {budget}: steps from arrival to frame {a.nth}: later arrivals p50 / p99 "
                f"{r['later'][0]} / {r['later'][1]}; the first wave of {a.clients} p50 / p99 / max "
                f"{r['wave'][0]} / {r['wave'][1]} / {r['wave'][2]}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
