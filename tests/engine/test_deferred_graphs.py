"""Deferred graph captures on the CPU, where the graph families run their captured bodies eagerly on the static
buffers: with only the largest bucket of each family "captured", steps replay it (padded) and give the eager
engine's codes; capturing the rest between steps changes no code; the engine-core loops (AsyncEngine, the ZMQ
core) run the deferred work while idle; the flag's default is on for serving only."""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time

import numpy as np
import pytest
from engine_testutil import FrameRecorder, make_engine

from ttsserve.config import EngineConfig
from ttsserve.engine.args import add_engine_args, engine_kwargs
from ttsserve.engine.core.async_engine import AsyncEngine
from ttsserve.engine.core.engine_core import EngineCore
from ttsserve.engine.core.proc import EngineCoreProc
from ttsserve.engine.deferred_capture import DeferredCapture
from ttsserve.params import SamplingParams, SynthesisRequest
from ttsserve.runner.cuda_graphs import DecodeGraphs
from ttsserve.runner.decode_ops import DecodeOps
from ttsserve.runner.prefill_graphs import PrefillGraphs
from ttsserve.runner.sampler_graphs import SamplerGraphs


def _requests(n: int, frames: int = 30) -> list[SynthesisRequest]:
    rng = random.Random(7)
    words = ["hello", "world", "this", "is", "a", "test", "of", "the", "speech", "model"]
    return [
        SynthesisRequest(
            " ".join(rng.choice(words) for _ in range(rng.randint(2, 12))),
            code_params=SamplingParams(seed=80 + i, temperature=0.7, max_new_tokens=frames, min_new_tokens=frames),
            raw_text=True,
            request_id=f"d{i}",
        )
        for i in range(n)
    ]


def _staggered(model, reqs, graphs: bool, defer: bool = False, capture_every: int = 0):
    """Request i arrives at step 4 * i with a small token budget (mixed and chunked steps); with `defer` only
    the largest bucket of each family is captured first, and one more every `capture_every` steps."""
    e = make_engine(model, max_model_len=512, max_num_batched_tokens=24)
    if graphs:
        e.runner.graphs = DecodeGraphs(e.runner, [1, 2, 4, 8])
        e.runner.prefill_graphs = PrefillGraphs(e.runner, [5, 16, 24], DecodeOps(compile=False))
        e.runner.sampler_graphs = SamplerGraphs(e.runner, [2, 8], DecodeOps(compile=False))
        for family in e.runner.graph_families():
            family.capture(defer=defer)
        e.deferred = DeferredCapture(e.runner.graph_families())
    rec = FrameRecorder(e)
    for step in range(5000):
        if step % 4 == 0 and step // 4 < len(reqs):
            e.add_synthesis(reqs[step // 4])
        e.step()
        if capture_every and step % capture_every == capture_every - 1:
            e.run_deferred(busy=False)
        if step // 4 >= len(reqs) and not e.has_unfinished():
            break
    return e, rec


def _assert_same(rec, ref, reqs) -> None:
    for r in reqs:
        seq = f"{r.request_id}/0/code"
        assert rec.frames[seq] == ref.frames[seq], seq
        np.testing.assert_allclose(rec.hidden(seq), ref.hidden(seq), atol=1e-5, rtol=0)


def test_only_the_largest_and_smallest_buckets_are_captured_first(tiny_model):
    e, _ = _staggered(tiny_model, [], graphs=True, defer=True)
    g, pg, sg = e.runner.graphs, e.runner.prefill_graphs, e.runner.sampler_graphs
    assert list(g.graphs) == [8, 1] and list(pg.graphs) == [24, 5] and list(sg.graphs) == [8, 2]
    assert (g.bucket(2), pg.bucket(6), sg.bucket(2)) == (8, 24, 2)  # the sampler's sizes: 2 and 8
    assert g.pending == [4, 2] and pg.pending == [16] and sg.pending == []
    assert e.graphs_pending == 3 and not e.wait_warm(0) and not e.stats()["warm"]
    g.capture_next()
    assert g.bucket(1) == 1 and g.bucket(2) == 4 and g.bucket(5) == 8 and g.pending == [2]
    assert e.wait_warm() and e.graphs_pending == 0 and e.stats()["cuda_graphs_pending"] == 0
    assert (g.bucket(2), pg.bucket(6), sg.bucket(2)) == (2, 16, 2)


@pytest.mark.parametrize("capture_every", [0, 3])
def test_padded_buckets_and_captures_between_steps_give_the_eager_codes(tiny_model, capture_every):
    """Never capturing the rest (every step padded to the largest buckets), or capturing one bucket every 3
    steps while requests run: the codes and hiddens of the eager engine."""
    reqs = _requests(5)
    _, ref = _staggered(tiny_model, reqs, graphs=False)
    e, rec = _staggered(tiny_model, reqs, graphs=True, defer=True, capture_every=capture_every)
    _assert_same(rec, ref, reqs)
    t = e.runner.timings
    assert t.graph_steps > 10 and t.prefill_graph_steps >= len(reqs) and t.sampler_graph_steps >= len(reqs)
    assert e.graphs_pending == (3 if capture_every == 0 else 0)


class _Pending:
    """A graph family of `n` fake buckets."""

    def __init__(self, n: int) -> None:
        self.num_pending, self.captured = n, 0

    def capture_next(self) -> None:
        self.num_pending -= 1
        self.captured += 1


def _with_fake_deferred(engine, n: int) -> _Pending:
    family = _Pending(n)
    engine.deferred = DeferredCapture([family])
    return family


def test_engine_core_skips_a_capture_while_another_thread_encodes(tiny_model):
    core = EngineCore(make_engine(tiny_model))
    family = _with_fake_deferred(core.engine, 2)
    assert core.warming and core.background_work(busy=False) and family.captured == 1
    with core._device_side_work:  # encode_reference_audio holds it on its thread
        assert not core.background_work(busy=False)
    assert core.background_work(busy=False) and not core.warming and not core.background_work(busy=False)


def _wait(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_async_engine_runs_the_deferred_captures_while_idle(tiny_model):
    engine = make_engine(tiny_model)
    family = _with_fake_deferred(engine, 5)

    async def main():
        client = AsyncEngine(engine)
        await client.start()
        ok = await asyncio.get_running_loop().run_in_executor(None, _wait, lambda: family.num_pending == 0)
        await asyncio.sleep(0.2)  # the idle loop refreshes its stats
        stats = client.stats()
        await client.shutdown(1)
        return ok, stats

    ok, stats = asyncio.run(main())
    assert ok and family.captured == 5 and stats["cuda_graphs_pending"] == 0 and stats["warm"]


def test_engine_core_process_loop_runs_the_deferred_captures_while_idle(tiny_model, tmp_path):
    engine = make_engine(tiny_model)
    family = _with_fake_deferred(engine, 5)
    core = EngineCoreProc(engine, f"ipc://{tmp_path}/core.sock", drain_timeout_s=1)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    try:
        assert _wait(lambda: family.num_pending == 0) and family.captured == 5
    finally:
        core.request_stop()
        loop.join(10)
    assert not loop.is_alive()


def test_background_graph_capture_is_the_servers_default():
    """`ttsserve serve` defers the captures unless told not to; an Engine built directly captures up front."""
    from ttsserve.server.args import add_serve_arguments, build_configs

    assert not EngineConfig(device="cpu").background_graph_capture
    parser = argparse.ArgumentParser()
    add_engine_args(parser, env=True)
    assert "background_graph_capture" not in engine_kwargs(parser.parse_args([]), env={})
    args = parser.parse_args(["--no-background-graph-capture"])
    assert engine_kwargs(args, env={})["background_graph_capture"] is False
    env = {"TTSSERVE_BACKGROUND_GRAPH_CAPTURE": "1"}
    assert engine_kwargs(parser.parse_args([]), env=env)["background_graph_capture"] is True
    serve = argparse.ArgumentParser()
    add_serve_arguments(serve)
    assert build_configs(serve.parse_args([]), env={})[0].background_graph_capture is True
    off = serve.parse_args(["--no-background-graph-capture"])
    assert build_configs(off, env={})[0].background_graph_capture is False
    assert (
        build_configs(serve.parse_args([]), env={"TTSSERVE_BACKGROUND_GRAPH_CAPTURE": "0"})[0].background_graph_capture
        is False
    )


def test_the_precompile_body_reads_no_kv_cache(tiny_model):
    """DecodeGraphs.precompile runs the body with zeros for attention before the runner's KV cache exists (on
    CUDA, while it is being allocated): the body must not touch it."""
    import torch

    e = make_engine(tiny_model)
    g = DecodeGraphs(e.runner, [1, 4])
    g.capture()
    kv, e.runner.kv = e.runner.kv, None
    try:
        g.load_padding(4)
        g._body(4, zero_attention=True)
    finally:
        e.runner.kv = kv
    assert torch.isfinite(g.hidden[:4]).all() and g.tokens[:4].shape == (4, tiny_model.gpt_config.num_vq)


@pytest.mark.parametrize("mode", ["Full", "eager", ""])
def test_an_unknown_prefill_graph_mode_is_an_error(tiny_model, monkeypatch, mode):
    """A typo in $TTSSERVE_PREFILL_GRAPHS stops the engine's set-up with the variable's name, not a silent default."""
    monkeypatch.setenv("TTSSERVE_PREFILL_GRAPHS", mode)
    e = make_engine(tiny_model)
    with pytest.raises(ValueError, match=f"TTSSERVE_PREFILL_GRAPHS must be full or piecewise, got '{mode}'"):
        PrefillGraphs(e.runner, [16], DecodeOps(compile=False))
    monkeypatch.setenv("TTSSERVE_PREFILL_GRAPHS", "piecewise")
    assert not PrefillGraphs(e.runner, [16], DecodeOps(compile=False)).full  # valid; off CUDA nothing is full
