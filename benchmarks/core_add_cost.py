"""What admitting one request costs the engine's thread (the engine core's step loop with --api-server-count):
Engine.add_synthesis over the bench corpus, normalizing and tokenizing itself, against taking segments an API
server prepared (text/segments.py): split and normalized only, then also with their code-prompt ids
(tokenize_segments, the tokenizer rebuilt from its JSON as an API server does). CPU, tiny dummy model; steady
state after a first (lazy-init) round.

Usage: python3 benchmarks/core_add_cost.py [--requests 300] [--rounds 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ttsserve.bench.corpus import select_texts  # noqa: E402
from ttsserve.config import EngineConfig  # noqa: E402
from ttsserve.engine.engine import Engine  # noqa: E402
from ttsserve.params import SamplingParams, SynthesisRequest  # noqa: E402
from ttsserve.text.segments import prepare_segments, tokenize_segments  # noqa: E402
from ttsserve.text.tokenizer import TextTokenizer  # noqa: E402


def _timed_adds(engine: Engine, reqs: list, segments: list | None) -> float:
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.add_synthesis(r, None if segments is None else segments[i])
    dt = (time.perf_counter() - t0) / len(reqs) * 1e3
    for rid in list(engine.syntheses):
        engine.abort(rid)
    engine.step()  # releases the aborted requests
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    engine = Engine(
        EngineConfig(
            load_format="dummy",
            dummy_size="tiny",
            device="cpu",
            kv_cache_memory=256 << 20,
            swap_space=0,
            max_num_seqs=2 * a.requests,
        )
    )
    texts = [s.text for s in select_texts(a.requests, seed=0)]
    api_tok = TextTokenizer.from_json(engine.model.tokenizer.to_json())
    for k in range(a.rounds):
        reqs = [SynthesisRequest(t, code_params=SamplingParams(seed=i, max_new_tokens=8)) for i, t in enumerate(texts)]
        itself = _timed_adds(engine, reqs, None)
        segments = [prepare_segments(r) for r in reqs]
        prepared = _timed_adds(engine, reqs, segments)
        with_ids = _timed_adds(engine, reqs, [tokenize_segments(r, s, api_tok) for r, s in zip(reqs, segments)])
        print(
            f"round {k}: {itself:.3f} ms per request normalizing itself, {prepared:.3f} ms with prepared segments, "
            f"{with_ids:.3f} ms with prepared segments and code ids"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
