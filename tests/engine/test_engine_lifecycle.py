"""Engine request lifecycle defects: a rejected multi-segment request leaves nothing behind, an abort
touches only its own request, and a refused refine -> code hand-off fails one synthesis, not the step."""

import asyncio
import time

import pytest
from engine_testutil import run_all

from ttsserve.config import EngineConfig
from ttsserve.engine.core.async_engine import AsyncEngine
from ttsserve.engine.engine import Engine
from ttsserve.params import SamplingParams, SynthesisRequest

SHORT = "今天天气很好我们去公园散步吧。"  # one segment of 19 prompt positions on the tiny model
LONG = (
    "这是一个非常长的句子它包含了很多很多的汉字目的是让提示词的长度超过模型允许的最大长度从而触发错误但是前面的句子已经被加入了引擎之中所以需要回滚"
    * 2
    + "。"
)  # 124


def _engine(**overrides) -> Engine:
    cfg = dict(
        load_format="dummy", dummy_size="tiny", dtype="float32", device="cpu", kv_cache_memory=8 << 20, swap_space=0.01
    )
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg))


def _assert_empty(eng: Engine) -> None:
    assert not eng.has_unfinished()
    assert not eng.sequences and not eng.runner.states
    assert eng.audio.num_requests == 0


def test_rejected_later_segment_rolls_back_the_earlier_ones():
    eng = _engine(max_model_len=64)
    segments = eng.frontend.segments(SynthesisRequest(SHORT + LONG))
    assert len(segments) >= 2  # the first fits, the second does not
    with pytest.raises(ValueError, match="segment 1"):
        eng.add_synthesis(SynthesisRequest(SHORT + LONG, request_id="r"))
    _assert_empty(eng)
    eng.step()  # aborts are released by the scheduler's next step
    assert not eng.scheduler.has_unfinished_requests()
    assert eng.kv_manager.num_free_blocks == eng.kv_spec.num_blocks
    # the id is free again and the engine serves
    eng.add_synthesis(
        SynthesisRequest(SHORT, request_id="r", code_params=SamplingParams(seed=1, min_new_tokens=4, max_new_tokens=4))
    )
    assert run_all(eng)["r"][1].finish_reason == "length"


def test_rejected_request_does_not_keep_the_loop_spinning():
    async def main(eng: AsyncEngine):
        await eng.start()
        with pytest.raises(ValueError, match="segment 1"):
            async for _ in eng.generate(SynthesisRequest(SHORT + LONG)):
                pass
        await asyncio.sleep(0.2)
        before = eng.engine.counters.steps
        await asyncio.sleep(0.5)
        return before, eng.engine.counters.steps

    eng = AsyncEngine(_engine(max_model_len=64))
    before, after = asyncio.run(main(eng))
    assert after == before, "the engine kept stepping with nothing to do"
    _assert_empty(eng.engine)


def test_abort_leaves_a_request_whose_id_extends_the_aborted_one():
    eng = _engine()
    eng.audio.deferred = True  # final chunks leave one step after the sequence ends, as on CUDA
    params = SamplingParams(seed=3, min_new_tokens=6, max_new_tokens=6)
    eng.add_synthesis(SynthesisRequest("hello there", code_params=params, request_id="a"))
    eng.add_synthesis(
        SynthesisRequest(
            "hello there", code_params=params.replace(max_new_tokens=3, min_new_tokens=3), request_id="a/b"
        )
    )
    for _ in range(200):
        eng.step()
        if "a/b/0/code" in eng.sequences and eng.sequences["a/b/0/code"].finishing:
            break
    assert eng.sequences["a/b/0/code"].finishing  # a/b ended, its final chunk is still in flight
    eng.abort("a")
    result = run_all(eng, max_steps=200)
    assert result["a/b"][1].finish_reason == "length" and result["a/b"][1].num_frames == 3
    assert "a" not in result


def test_refine_handoff_too_long_fails_only_that_synthesis():
    eng = _engine(max_model_len=64)
    ok = SynthesisRequest(
        "hello there", request_id="ok", code_params=SamplingParams(seed=1, min_new_tokens=40, max_new_tokens=40)
    )
    # the refine prompt fits; the code prompt built from the refined text does not
    refine = SynthesisRequest(
        "hello there",
        request_id="refined",
        refine_text=True,
        refine_params=SamplingParams.refine_defaults(seed=2, min_new_tokens=60, max_new_tokens=60),
    )
    eng.add_synthesis(ok)
    eng.add_synthesis(refine)
    started = time.monotonic()
    result = run_all(eng, max_steps=2000)
    assert time.monotonic() - started < 120
    assert result["ok"][1].finish_reason == "length" and result["ok"][1].error is None
    assert result["refined"][1].finish_reason == "error" and "segment 0" in result["refined"][1].error


def test_warm_up_serves_and_leaves_a_clean_engine():
    eng = _engine(max_num_seqs=16)  # on CUDA the constructor runs it; here it is called by hand
    widest, step = [0], eng.step

    def counting_step():
        widest[0] = max(widest[0], len(eng.scheduler.running))
        return step()

    eng.step = counting_step
    eng.warm_up()
    assert widest[0] == 16  # the wide wave: a full batch at once, as a burst of real traffic runs
    _assert_empty(eng)
    assert eng.counters.steps == 0 and eng.runner.timings.steps == 0 and eng.audio.calls_total == 0
    assert eng.kv_manager.num_free_blocks == eng.kv_spec.num_blocks
    eng.add_synthesis(
        SynthesisRequest(
            "hello there", request_id="after", code_params=SamplingParams(seed=1, min_new_tokens=5, max_new_tokens=5)
        )
    )
    assert run_all(eng)["after"][1].num_frames == 5


def test_prepared_segments_are_used_as_given(monkeypatch):
    """An API server splits and normalizes (text/segments.prepare_segments); the engine then skips that work
    and serves exactly those segments. Misnumbered segments are a ValueError."""
    from ttsserve.text.segments import Segment, prepare_segments

    eng = _engine()
    params = SamplingParams(seed=2, min_new_tokens=6, max_new_tokens=6)
    req = SynthesisRequest("Hello there. It is 3 o'clock.", code_params=params, request_id="p")
    segments = prepare_segments(req)
    assert [s.index for s in segments] == [0] and "three" in segments[0].text
    want = run_all_one(_engine(), req)
    monkeypatch.setattr(eng.frontend, "segments", lambda r: pytest.fail("the engine normalized again"))
    eng.add_synthesis(req, segments)
    got = run_all(eng)["p"]
    assert got[1].finish_reason == "length" and got[0].tolist() == want[0].tolist()
    with pytest.raises(ValueError, match="numbered"):
        eng.add_synthesis(SynthesisRequest("x", request_id="q"), [Segment(1, "x", [])])
    with pytest.raises(ValueError, match="numbered"):
        eng.add_synthesis(SynthesisRequest("x", request_id="q"), [])


def run_all_one(eng: Engine, req: SynthesisRequest):
    eng.add_synthesis(req)
    return run_all(eng)[req.request_id]


def test_synthesis_failing_mid_step_drops_its_siblings_results():
    """A segment the KV pool can never hold fails its synthesis in the step that admits its sibling, and two
    refine segments whose hand-offs are both refused end in one step: the released siblings' results are
    dropped, the step does not fail, and nothing is left behind."""
    from ttsserve.text.segments import Segment

    eng = _engine(kv_cache_memory=48 << 10, swap_space=0)  # 3 blocks of 16 positions
    long = "hello there " * 30  # 64 prompt positions
    params = SamplingParams(seed=1, min_new_tokens=4, max_new_tokens=4)
    eng.add_synthesis(
        SynthesisRequest("x", request_id="s", code_params=params), [Segment(0, "hello there", []), Segment(1, long, [])]
    )
    code_inputs = eng.frontend.code_inputs

    def refusing_code_inputs(text, code_prompt, *args):
        if code_prompt == "[speed_4]":
            raise ValueError("refused")
        return code_inputs(text, code_prompt, *args)

    eng.frontend.code_inputs = refusing_code_inputs
    refine = SamplingParams.refine_defaults(seed=2, min_new_tokens=2, max_new_tokens=2)
    eng.add_synthesis(
        SynthesisRequest("x", request_id="t", refine_text=True, refine_params=refine, code_prompt="[speed_4]"),
        [Segment(0, "hello there", []), Segment(1, "how are you", [])],
    )
    result = run_all(eng, max_steps=50)
    assert result["s"][1].finish_reason == "error" and "segment 1" in result["s"][1].error
    assert result["t"][1].finish_reason == "error" and "refused" in result["t"][1].error
    for _ in range(2):
        eng.step()
    _assert_empty(eng)
    assert not eng.scheduler.has_unfinished_requests()
    assert eng.kv_manager.num_free_blocks == eng.kv_spec.num_blocks
