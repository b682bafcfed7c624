import json
from pathlib import Path

import numpy as np

from ttsserve.config import EngineConfig
from ttsserve.engine.engine import Engine

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
TINY = GOLDEN / "assets-tiny"


def make_engine(model, **overrides) -> Engine:
    cfg = dict(model=str(TINY), device="cpu", dtype="float32", kv_cache_memory=16 << 20, swap_space=0.01)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg), model=model)


def run_all(engine: Engine, request_ids=None, max_steps: int = 100000):
    """Step until every synthesis finished; returns {rid: (audio, final_output)}."""
    audio: dict[str, list] = {}
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            audio.setdefault(out.request_id, []).append(out.samples)
            if out.finished:
                finals[out.request_id] = out
    assert not engine.has_unfinished(), "engine did not finish"
    return {rid: (np.concatenate(audio.get(rid) or [np.zeros(0, np.float32)]), finals[rid]) for rid in finals}


class FrameRecorder:
    """Records every (hidden, frame) the engine hands to the audio stage, per sequence."""

    def __init__(self, engine: Engine) -> None:
        self.hiddens: dict[str, list] = {}
        self.frames: dict[str, list] = {}
        orig_append, orig_update = engine.audio.append_batch, engine.scheduler.update_from_output

        def append_batch(seq_ids, h, counts=None, ready=None):
            for j, frames in enumerate(h if h.dim() == 3 else h[None]):  # [m, n, H]: m frames each, step-major
                for i, seq_id in enumerate(seq_ids):
                    if counts is None or j < counts[i]:  # counts: how many of its m frames request i keeps
                        self.hiddens.setdefault(seq_id, []).append(frames[i : i + 1].detach().cpu().numpy().copy())
            return orig_append(seq_ids, h, counts, ready)

        def update(sched, sampled, stopped):
            updates = orig_update(sched, sampled, stopped)
            bursts = {s.request_id for s in sched.scheduled if s.num_steps > 1}
            for u in updates:  # the accepted samples only: a pipelined step's dropped rows are not frames
                got, stop = sampled.get(u.request_id), stopped.get(u.request_id, False)
                if u.request_id in bursts:  # (frame, False) per appended frame; a burst's EOS row is not returned
                    items = [(t, False) for t in got[: u.num_new_tokens]] + [(None, True)] * (u.finish_reason == "stop")
                else:
                    items = [(got, stop)]
                self.frames.setdefault(u.request_id, []).extend(items)
            return updates

        engine.audio.append_batch = append_batch
        engine.scheduler.update_from_output = update

    def codes(self, seq_id: str) -> np.ndarray:
        return np.array([t for t, stop in self.frames.get(seq_id, []) if not stop])

    def hidden(self, seq_id: str) -> np.ndarray:
        return np.concatenate(self.hiddens[seq_id])


def golden_json(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text())
