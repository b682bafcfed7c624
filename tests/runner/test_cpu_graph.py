"""The compiled CPU decode step (runner/cpu_graph.py): the eager engine's codes and hidden states, one graph for
every batch size (no recompilation inside requests), and the eager path whenever it cannot be used.

One real compilation (the tiny model, ~30 s on 2 cores) is shared by the module's tests."""

from __future__ import annotations

import numpy as np
import pytest
from engine.engine_testutil import TINY, make_engine
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import ttsserve.attention.torch_ref as ref
from ttsserve.config import COMPILE_ENV, EngineConfig
from ttsserve.model.chattts import load_model
from ttsserve.params import SamplingParams, SynthesisRequest
from ttsserve.runner.cpu_graph import CpuDecodeGraph

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "one two three", "a b", "tiny model test"]


def _run(engine, n: int, frames: int = 24) -> dict[str, np.ndarray]:
    """n seeded requests of `frames` frames, submitted together -> {request id: the audio}."""
    ids = []
    for i in range(n):
        p = SamplingParams(min_new_tokens=frames, max_new_tokens=frames, seed=100 + i)
        ids.append(engine.add_synthesis(SynthesisRequest(TEXTS[i % len(TEXTS)], code_params=p, split=False)))
    audio: dict[str, list] = {r: [] for r in ids}
    while engine.has_unfinished():
        for out in engine.step():
            audio[out.request_id].append(out.samples)
    return {r: np.concatenate(a) for r, a in audio.items()}


def _step_graphs() -> int:
    """Graphs dynamo holds for CpuDecodeGraph._step, every instance's (each is guarded on its own modules)."""
    return len(_debug_get_cache_entry_list(CpuDecodeGraph._step.__code__))


@pytest.fixture(scope="module")
def model():
    return load_model(EngineConfig(model=str(TINY), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def compiled_engine(model):
    mp = pytest.MonkeyPatch()
    mp.setenv(COMPILE_ENV, "1")
    graphs = _step_graphs()  # other engines' graphs in this process
    try:
        engine = make_engine(model)
    finally:
        mp.undo()
    assert engine.runner.cpu_graph is not None
    assert engine.wait_warm(timeout=600) and engine.runner.cpu_graph.ready
    # one graph for the compile and the engine's warm-up steps, and one more for a single OpenMP thread (the team
    # under contention) where the team is larger
    assert _step_graphs() == graphs + 1 + (engine._threads.full > 1)  # the team's size, not its current one
    yield engine
    engine.runner.cpu_graph.close()


@pytest.mark.parametrize("n", [1, 3, 5])
def test_compiled_step_gives_the_eager_engines_audio(model, compiled_engine, n, monkeypatch) -> None:
    graph = compiled_engine.runner.cpu_graph
    calls = {"hit": 0}
    run = graph.run

    def counting_run(*args, **kwargs):
        out = run(*args, **kwargs)
        calls["hit"] += out is not None
        return out

    monkeypatch.setattr(graph, "run", counting_run)
    # after the warm-up the step compiles nothing more: one graph serves every batch (1 runs as 2 rows). Counted
    # on the step's own code: the engine's other compiled code (the eager path's attention) may compile anew.
    graphs = _step_graphs()
    got = _run(compiled_engine, n)
    assert _step_graphs() == graphs
    assert calls["hit"] >= 20  # the decode steps went through the graph
    want = _run(make_engine(model), n)  # TTSSERVE_CPU_COMPILE=0 (conftest): the eager engine
    assert len(got) == len(want) == n
    for g, w in zip(got.values(), want.values()):
        assert g.shape == w.shape
        assert np.abs(g - w).max() < 1e-3 * max(1.0, float(np.abs(w).max()))


def test_compiled_hidden_states_match_the_eager_forward(compiled_engine, monkeypatch) -> None:
    runner, graph = compiled_engine.runner, compiled_engine.runner.cpu_graph
    real_run, diffs = graph.run, []

    def run_both(x, positions, md):  # the eager forward first, then the graph on the same caches
        saved = [c.clone() for c in runner.kv.layers]
        eager = runner._forward(x, md, positions)
        for c, s in zip(runner.kv.layers, saved):
            c.copy_(s)
        compiled = real_run(x, positions, md)
        diffs.append(float((eager - compiled).abs().max()))
        return compiled

    monkeypatch.setattr(graph, "run", run_both)
    _run(compiled_engine, 3, frames=12)
    assert len(diffs) >= 8 and max(diffs) < 1e-4


def test_failures_leave_the_eager_path(compiled_engine, monkeypatch) -> None:
    graph = compiled_engine.runner.cpu_graph

    def broken(*args, **kwargs):
        raise RuntimeError("inductor broke")

    compiled = graph._compiled
    monkeypatch.setattr(graph, "_compiled", broken)
    audio = _run(compiled_engine, 2, frames=10)
    assert all(a.size > 0 for a in audio.values()) and not graph.ready  # eager for good, nothing lost
    graph._compiled = compiled


def test_compile_level_is_checked(monkeypatch) -> None:
    monkeypatch.setenv(COMPILE_ENV, "attention")
    assert ref.TorchPagedAttention().compile_decode is True
    monkeypatch.setenv(COMPILE_ENV, "yes")
    with pytest.raises(ValueError, match="TTSSERVE_CPU_COMPILE must be one of 0, attention, 1, got 'yes'"):
        ref.TorchPagedAttention()
