"""The engine's step statistics: the step-time histogram, slow steps (counted, one a while logged with what
the step held) and the process's GC pauses inside steps."""

import gc
import logging

from engine_testutil import make_engine

from ttsserve.engine.step_stats import EngineCounters, gc_pauses
from ttsserve.params import SamplingParams, SynthesisRequest

PHASES = {"schedule_ms": 0.001, "runner_ms": 0.004}


def test_a_slow_step_is_counted_and_logged_once_a_while(caplog):
    caplog.set_level(logging.INFO, logger="ttsserve.engine.engine")
    c = EngineCounters()
    for _ in range(30):
        c.observe_step(10.0, PHASES, rows=8, tokens=8, gc_ms=0.0)
    c.observe_step(30.0, PHASES, rows=8, tokens=8, gc_ms=0.0)  # 3x the average: not slow
    assert c.slow_steps == 0 and not caplog.records
    c.observe_step(95.0, {"schedule_ms": 0.09, "runner_ms": 0.005}, rows=12, tokens=400, gc_ms=61.5, vocoder=(2, 348))
    assert c.slow_steps == 1
    (rec,) = caplog.records
    msg = rec.getMessage()
    assert "slow engine step: 95.0 ms" in msg and "schedule 90.0, runner 5.0" in msg
    assert "12 rows, 400 tokens" in msg and "vocoder 2 calls, 348 frames" in msg and "GC 61.5 ms, " in msg
    assert "objects in generation 2" in msg  # what the full pass had to walk
    for _ in range(3):
        c.observe_step(200.0, PHASES, rows=8, tokens=8, gc_ms=0.0)
    assert c.slow_steps >= 2 and len(caplog.records) == 1  # counted, not logged again within the interval
    c.slow_step_logged_at = float("-inf")  # the interval over
    c.observe_step(300.0, PHASES, rows=8, tokens=8, gc_ms=1.0)
    msg = caplog.records[-1].getMessage()
    assert "GC 1.0 ms" in msg and "generation 2" not in msg  # a young pass: the objects are not walked
    hist = c.step_times.as_dict()
    assert sum(hist["counts"]) == c.steps == 36 and hist["max_s"] == 0.3
    assert hist["counts"][hist["le_s"].index(0.01)] == 30  # a bound is inclusive, as Prometheus' le


def test_gc_pauses_inside_steps_reach_the_stats(tiny_model):
    e = make_engine(tiny_model)
    before = list(gc_pauses().counts)
    step = e.audio.step

    def collecting_step():
        gc.collect()  # a full pass inside the step, as the collector may start on any allocation
        return step()

    e.audio.step = collecting_step
    p = SamplingParams(seed=1, min_new_tokens=12, max_new_tokens=12)
    e.add_synthesis(SynthesisRequest("hello world", code_params=p, raw_text=True))
    steps = 0
    while e.has_unfinished():
        e.step()
        steps += 1
    stats = e.stats()
    assert stats["gc_collections_total"][2] - before[2] >= steps
    assert stats["gc_pause_seconds_total"][2] > 0 and stats["steps_total"] == steps
    first = stats["first_audio_histogram"]  # its first audio was heard once, after at least one step
    assert sum(first["counts"]) == 1 and first["sum_s"] == first["max_s"] > 0
