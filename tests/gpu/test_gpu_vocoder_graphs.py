"""Captured vocoder graphs (audio/vocoder_graphs.py) on CUDA against the eager incremental stage: real-size
random Decoder + Vocos, fp16 networks as the engine runs them, staggered streams that fill odd buckets."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "audio"))
from audio_stage_testutil import random_nets  # noqa: E402
from audio_stage_testutil import run_schedule as _run  # noqa: E402

from ttsserve.audio.incremental_stage import IncrementalAudioStage  # noqa: E402

SPECS = [(200, 0, 1), (61, 3, 1), (140, 5, 2), (90, 9, 1), (33, 14, 3), (170, 20, 1)]  # (frames, start, burst)


@pytest.fixture(scope="module")
def nets():
    dec, _, vocos = random_nets(11, hidden=768, dec_dim=512, dec_layers=12, voc_dim=512, voc_layers=8)
    return dec.cuda(), vocos.cuda()


def _stage(nets, graphs: bool, max_streams: int = 8, **kw) -> IncrementalAudioStage:
    stage = IncrementalAudioStage(*nets[:1], None, nets[1], net_dtype=torch.float16, deferred=True, **kw)
    if graphs:
        stage.enable_cuda_graphs(max_streams=max_streams)
    return stage


def test_graph_replays_equal_the_eager_stage(nets):
    eager = _run(_stage(nets, False), SPECS, seed=4, width=768)
    stage = _stage(nets, True)
    graphed = _run(stage, SPECS, seed=4, width=768)
    assert stage.graphs[False].replays == stage.calls_total > 5
    for i in eager:
        a, b = eager[i][0], graphed[i][0]
        assert a.shape == b.shape
        # same fp16 arithmetic, other conv algorithms for the padded shapes: rounding-level differences only
        assert np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-9) < 2e-3, f"stream {i}"


def test_graphs_with_cadence_equal_the_eager_stage(nets):
    eager = _run(_stage(nets, False), SPECS, seed=5, width=768)
    graphed = _run(_stage(nets, True, cadence=4), SPECS, seed=5, width=768)
    for i in eager:
        a, b = eager[i][0], graphed[i][0]
        assert np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-9) < 2e-3, f"stream {i}"


def test_a_replay_is_one_launch_on_the_host(nets):
    """Host time of a 64-row call: the graph replays in far less than the eager call's launches."""
    import time

    times = {}
    for graphs in (False, True):
        stage = _stage(nets, graphs, max_streams=64)  # no slot growth (and re-capture) in the timed call
        for i in range(64):
            stage.add_request(str(i))
            stage.append(str(i), torch.randn(stage.first_chunk_frames + stage.right_context_frames, 768))
        stage.step()  # the first chunk of every stream (deferred: launched only)
        for i in range(64):
            stage.append(str(i), torch.randn(16, 768))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stage.step()
        times[graphs] = time.perf_counter() - t0
        stage.flush()
    assert times[True] < 0.5 * times[False], times
