"""Offline entry point: TTS(model).generate(texts, ...) -> one float32 waveform per text, all texts batched
through the engine at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ttsserve.config import EngineConfig
from ttsserve.constants import SAMPLE_RATE, speaker_stats
from ttsserve.engine.engine import Engine
from ttsserve.params import SamplingParams, SynthesisRequest, Voice

TYPICAL_UNITS_PER_SECOND = 4.0  # speaking rate in text units (text/split.py) for the progress estimate


def expected_frames(texts: Sequence[str]) -> int:
    """Frames the texts will likely take: their length at a typical speaking rate (an estimate for progress)."""
    from ttsserve.constants import FRAMES_PER_SECOND
    from ttsserve.text.split import text_units

    return max(1, round(sum(text_units(t) for t in texts) / TYPICAL_UNITS_PER_SECOND * FRAMES_PER_SECOND))


class TTS:
    """`TTS("path/to/ChatTTS")`, `TTS(load_format="dummy", dummy_size="tiny")`, or `TTS(config=EngineConfig(...))`."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **config_overrides) -> None:
        if config is None:
            config = EngineConfig(model=model, **config_overrides)
        self.engine = Engine(config)

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    def speaker(self, seed: int) -> np.ndarray:
        from ttsserve.text.speaker import sample_random_speaker

        std, mean = speaker_stats(self.engine.model.spk_stat, self.engine.model.hidden_size)
        return sample_random_speaker(std, mean, seed)

    def generate(
        self,
        texts: str | Sequence[str],
        params: SamplingParams | None = None,
        *,
        voice: Voice | None = None,
        refine_text: bool = False,
        code_prompt: str = "[speed_5]",
        normalize: bool = True,
        split: bool = True,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[np.ndarray]:
        """Synthesize every text; returns float32 [n_i] waveforms at 24 kHz, in input order.

        progress(frames_done, frames_expected) is called after each engine step: the expected frames come
        from the text's length at a typical speaking rate (at least the frames done, at most every segment's
        cap) and, after the last step, are the frames done.
        """
        if isinstance(texts, str):
            texts = [texts]
        params = params or SamplingParams()
        voice = voice or Voice()
        ids = [
            self.engine.add_synthesis(
                SynthesisRequest(
                    t,
                    voice=voice,
                    code_params=params,
                    refine_text=refine_text,
                    code_prompt=code_prompt,
                    normalize=normalize,
                    split=split,
                )
            )
            for t in texts
        ]
        self.last_results: dict[str, object] = {}
        chunks: dict[str, list[np.ndarray]] = {i: [] for i in ids}
        budget = sum(len(self.engine.syntheses[i].segments) for i in ids) * params.max_new_tokens
        expected = min(budget, expected_frames(texts))
        pending = set(ids)
        while pending:
            for out in self.engine.step():
                chunks[out.request_id].append(out.samples)
                if out.finished:
                    pending.discard(out.request_id)
                    self.last_results[out.request_id] = out
                    if out.finish_reason == "error":
                        raise RuntimeError(f"synthesis failed: {out.error}")
            if progress is not None:
                done = self.engine.counters.frames
                progress(done, min(budget, max(expected, done)) if pending else done)
        return [np.concatenate(chunks[i]) if chunks[i] else np.zeros(0, np.float32) for i in ids]
