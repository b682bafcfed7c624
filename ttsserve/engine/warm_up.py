"""The engine's warm-up before /ready: the first real requests must not pay one-time costs."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ttsserve.params import SamplingParams, SynthesisRequest

if TYPE_CHECKING:
    from ttsserve.engine.engine import Engine

logger = logging.getLogger("ttsserve.engine.engine")

WIDE_WAVE_CAP = 256  # rows of the wide wave at most: max_num_seqs may be set far above any served concurrency


def warm_up(engine: Engine) -> None:
    """Serve a few staggered synthetic requests to the end, then zero every counter: the first real requests
    must not pay one-time costs (the prefill path's kernel choices and compiled shapes, the allocator's first
    blocks; on an H200 a cold engine's first pass ran 2.5x slower than its second)."""
    t0 = time.perf_counter()
    frames = engine.first_audio_frames + 2 * engine.cfg.max_chunk_frames
    # prompts of ~10, ~30 and ~130 positions: every query tile of the prefill attention kernel run eagerly
    # (piecewise prefill graphs: runner/prefill_graphs.py; triton_paged.py picks 16, 32 or 64 rows) compiles
    # here, not in a request; the full graphs compile theirs at capture
    long = "and a fourth, long enough that its prefill runs the attention kernel's largest query tile, " * 2
    texts = ["warm up", "warm up the engine with a longer prompt than the first one", "and a third", long]
    for i, text in enumerate(texts):
        p = SamplingParams(seed=i, min_new_tokens=frames + 7 * i, max_new_tokens=frames + 7 * i)
        engine.add_synthesis(SynthesisRequest(text, code_params=p, raw_text=True, request_id=f"__warmup{i}"))
        for _ in range(3):  # the next one's prefill shares a step with these decodes
            engine.step()
    _run_to_end(engine)
    # one first chunk and one full chunk per row: every pool grows to a full batch of both
    _wide_wave(
        engine,
        min(engine.scheduler.config.max_num_seqs, WIDE_WAVE_CAP),
        engine.first_audio_frames + engine.cfg.max_chunk_frames,
    )
    engine.reset_stats()
    logger.info("warmed up in %.1f s", time.perf_counter() - t0)


CPU_WARM_ROWS = (1, 4)  # the batches of streams started together whose shapes the CPU warm-up runs


def warm_up_cpu(engine: Engine) -> None:
    """The CPU engine's one-time costs (fbgemm's and oneDNN's first call of each shape), paid before /ready:
    for each batch in CPU_WARM_ROWS, that many short requests together through their prefill, a few decode
    steps and their last audio, then one vocoder call per chunk size of that many rows. Without it, the
    first request after /ready heard its first audio ~0.1 s later than the next ones (real-size int8, 2 cores:
    its first vocoder call took 72 ms against ~40), and the first 4 streams at once took 2.29 s against 2.02."""
    t0 = time.perf_counter()
    warm = getattr(engine.audio, "warm_chunk_shapes", None)
    for rows in CPU_WARM_ROWS:
        for i in range(rows):
            p = SamplingParams(seed=i, min_new_tokens=4, max_new_tokens=4)
            text = "warm up" + " the engine" * i  # prompts of different lengths
            engine.add_synthesis(SynthesisRequest(text, code_params=p, raw_text=True, request_id=f"__warm{rows}_{i}"))
        _run_to_end(engine)
        if warm is not None:
            warm(rows)
    engine.reset_stats()
    logger.info("warmed up in %.1f s", time.perf_counter() - t0)


def _run_to_end(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def _wide_wave(engine: Engine, rows: int, frames: int) -> None:
    """`rows` short requests at once, as a burst of real traffic sends them: the host-side pools (pinned
    staging memory, the caching allocators' blocks) grow to a full batch's sizes here, not in the first burst
    (on an H200, after a warm-up without this wave, the engine's first wave of 128 requests waited
    325 ms for first audio and its second 168 ms: benchmarks/first_wave.py)."""
    if rows <= 0:
        return
    for i in range(rows):
        p = SamplingParams(seed=1000 + i, min_new_tokens=frames, max_new_tokens=frames)
        engine.add_synthesis(
            SynthesisRequest("warm up a full batch", code_params=p, raw_text=True, request_id=f"__warmup_wide{i}")
        )
    _run_to_end(engine)
