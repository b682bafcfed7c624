"""Long text through the engine: split into segments that run concurrently, joined in order with a crossfade,
each segment equal to its solo synthesis with the same seed schedule (seed + segment index)."""

import numpy as np

from ttsserve.config import EngineConfig
from ttsserve.engine.engine import Engine
from ttsserve.engine.synthesis import CROSSFADE_SAMPLES
from ttsserve.params import SamplingParams, SynthesisRequest

TEXT = (
    "今天的天气非常好，我们一起去公园散步吧。公园里有很多人在跑步，也有人在湖边钓鱼。"
    "After lunch we walked along the river and talked about the new project for almost two hours. "
    "晚上回家以后，我给妈妈打了一个电话，告诉她这个周末我会回去看她。"
    "The meeting on Monday starts at 9:30 am, so please send me the report before Friday evening. "
    "这本书一共有三百二十页，我已经读完了一半，剩下的部分打算下个月读完。"
    "Thank you for listening, and have a wonderful weekend with your family and friends!"
) * 3
FRAMES = 6


def _engine() -> Engine:
    return Engine(
        EngineConfig(
            load_format="dummy",
            dummy_size="tiny",
            dtype="float32",
            device="cpu",
            kv_cache_memory=16 << 20,
            swap_space=0.01,
        )
    )


def _run(engine: Engine) -> tuple[dict[str, np.ndarray], dict, int]:
    audio, finals, max_running = {}, {}, 0
    while engine.has_unfinished():
        outs = engine.step()
        max_running = max(max_running, engine.scheduler.num_running)
        for o in outs:
            audio.setdefault(o.request_id, []).append(o.samples)
            if o.finished:
                finals[o.request_id] = o
    return {k: np.concatenate(v) for k, v in audio.items()}, finals, max_running


def _crossfade_join(pieces: list[np.ndarray]) -> np.ndarray:
    out = pieces[0]
    ramp = np.linspace(0.0, 1.0, CROSSFADE_SAMPLES, dtype=np.float32)
    for p in pieces[1:]:
        n = CROSSFADE_SAMPLES
        mixed = out[-n:] * (1 - ramp) + p[:n] * ramp
        out = np.concatenate([out[:-n], mixed, p[n:]])
    return out


def test_long_text_segments_concurrent_and_in_order():
    params = SamplingParams(seed=11, min_new_tokens=FRAMES, max_new_tokens=FRAMES)
    e = _engine()
    rid = e.add_synthesis(SynthesisRequest(TEXT, code_params=params, request_id="long"))
    segments = list(e.syntheses[rid].segments)
    assert len(segments) >= 4
    audio, finals, max_running = _run(e)
    assert max_running >= len(segments)  # all segments were in the batch together
    assert finals[rid].finish_reason == "length" and finals[rid].truncated_segments == list(range(len(segments)))
    assert finals[rid].num_frames == FRAMES * len(segments)

    solo = _engine()
    for seg in segments:  # each segment alone, with the seed schedule seed + index
        solo.add_synthesis(
            SynthesisRequest(
                seg.text, code_params=params.replace(seed=11 + seg.index), raw_text=True, request_id=f"s{seg.index}"
            )
        )
    solo_audio, _, _ = _run(solo)
    want = _crossfade_join([solo_audio[f"s{i}"] for i in range(len(segments))])
    assert audio[rid].shape == want.shape
    np.testing.assert_allclose(audio[rid], want, atol=1e-5, rtol=0)


def test_natural_end_is_not_reported_as_truncated():
    e = _engine()
    rid = e.add_synthesis(SynthesisRequest("hello world", code_params=SamplingParams(seed=3, max_new_tokens=400)))
    _, finals, _ = _run(e)
    f = finals[rid]
    assert (f.finish_reason == "stop") == (f.truncated_segments == [])
