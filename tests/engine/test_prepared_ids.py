"""Code-prompt token ids an API server computes (text/segments.tokenize_segments, with the engine's tokenizer
rebuilt from its JSON) are the ones the engine computes itself; the engine serves them without tokenizing
again, and rejects malformed ones with a ValueError that names the segment, leaving nothing behind."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_testutil import run_all

from ttsserve.config import EngineConfig
from ttsserve.engine.engine import Engine
from ttsserve.params import SamplingParams, SynthesisRequest, Voice
from ttsserve.text.segments import Segment, prepare_segments, tokenize_segments
from ttsserve.text.tokenizer import TextTokenizer

PARAMS = SamplingParams(seed=4, min_new_tokens=6, max_new_tokens=6)
# two segments: the second one's ids are checked too
TEXT = (
    "Hello there. It is 3 o'clock, time for tea [uv_break] 好的。"
    + "这是一个非常长的句子它包含了很多很多的汉字目的是让提示词的长度变长一些然后再分开。" * 3
)
MAX_LEN = 256


@pytest.fixture(scope="module")
def eng() -> Engine:
    return Engine(
        EngineConfig(
            load_format="dummy",
            dummy_size="tiny",
            dtype="float32",
            device="cpu",
            kv_cache_memory=8 << 20,
            swap_space=0.01,
            max_model_len=MAX_LEN,
        )
    )


@pytest.fixture(scope="module")
def api_tok(eng) -> TextTokenizer:
    """What an API server builds from the core's CoreInfo."""
    return TextTokenizer.from_json(eng.frontend.tokenizer.to_json())


def _voices(eng: Engine) -> dict[str, Voice]:
    hidden = eng.model.hidden_size
    spk = np.random.default_rng(0).standard_normal(hidden).astype(np.float16)
    codes = np.random.default_rng(1).integers(0, 100, (4, 5)).astype(np.int32)
    return {
        "none": Voice(),
        "spk_emb": Voice(spk_emb=spk),
        "reference": Voice(spk_emb=spk, spk_smp=codes, txt_smp="the reference transcript"),
    }


@pytest.mark.parametrize("voice_name", ["none", "spk_emb", "reference"])
@pytest.mark.parametrize("raw_text", [False, True])
def test_api_server_ids_are_the_engines(eng, api_tok, voice_name, raw_text):
    voice = _voices(eng)[voice_name]
    req = SynthesisRequest(TEXT, voice=voice, code_params=PARAMS, code_prompt="[speed_3]", raw_text=raw_text)
    segments = tokenize_segments(req, prepare_segments(req), api_tok)
    assert len(segments) == (1 if raw_text else 2)  # ids of a later segment too
    for seg in segments:
        assert seg.code_ids.dtype == np.int32 and seg.code_ids.ndim == 1
        ids, mask = eng.frontend.code_inputs(seg.text, req.code_prompt, voice)  # the engine tokenizing itself
        n = int(mask.sum())
        assert seg.code_ids.tolist() == ids[:n, 0].tolist()
        got_ids, got_mask = eng.frontend.code_inputs(seg.text, req.code_prompt, voice, seg.code_ids)
        assert got_ids.dtype == ids.dtype and got_ids.tolist() == ids.tolist()
        assert got_mask.tolist() == mask.tolist()
    speaker = eng.frontend.tokenizer.spk_emb_id if voice.spk_emb is not None else eng.frontend.tokenizer.empty_spk_id
    assert segments[0].code_ids[1] == speaker


def test_refine_text_sends_no_ids(eng, api_tok):
    req = SynthesisRequest(TEXT, code_params=PARAMS, refine_text=True)
    segments = tokenize_segments(req, prepare_segments(req), api_tok)
    assert segments and all(s.code_ids is None for s in segments)


def test_engine_serves_prepared_ids_without_tokenizing(eng, api_tok, monkeypatch):
    voice = _voices(eng)["reference"]
    req = SynthesisRequest(TEXT, voice=voice, code_params=PARAMS, request_id="own")
    eng.add_synthesis(req)
    want = run_all(eng)["own"]
    segments = tokenize_segments(req, prepare_segments(req), api_tok)
    monkeypatch.setattr(eng.frontend.tokenizer, "encode", lambda s: pytest.fail("the engine tokenized again"))
    eng.add_synthesis(dataclasses.replace(req, request_id="sent"), segments)
    assert len(segments) == 2
    got = run_all(eng)["sent"]
    assert got[1].finish_reason == "length" and got[1].num_frames == want[1].num_frames
    assert np.array_equal(got[0], want[0])  # same prompt, same seed: the same bits


def _bad_cases(eng: Engine) -> list[tuple[dict, list, str]]:
    vocab = eng.frontend.tokenizer.vocab_size
    ok = np.array([1, 2, 3], np.int32)
    return [
        ({}, [np.zeros(0, np.int32)], "segment 0: code_ids must be a non-empty 1-D integer array"),
        ({}, [np.ones((2, 2), np.int32)], "non-empty 1-D integer array"),
        ({}, [np.ones(3, np.float32)], "non-empty 1-D integer array"),
        ({}, [[1, 2, 3]], "non-empty 1-D integer array"),
        (
            {},
            [ok, np.array([5, vocab], np.int32)],
            rf"segment 1: code_ids hold ids outside the text vocabulary \[0, {vocab}\)",
        ),
        ({}, [np.array([-1, 5], np.int32)], "outside the text vocabulary"),
        (
            {},
            [ok, np.ones(MAX_LEN, np.int32)],
            f"segment 1: the prompt has {MAX_LEN} positions, more than the model's {MAX_LEN}; shorten",
        ),
        (
            {"voice": Voice(spk_smp=np.zeros((4, MAX_LEN - 2), np.int32))},
            [ok],
            f"segment 0: the prompt has {MAX_LEN + 1} positions",
        ),
        ({"refine_text": True}, [ok], "segment 0: code_ids with refine_text"),
    ]


def test_bad_ids_are_a_value_error_and_leave_nothing(eng):
    for i, (fields, ids, match) in enumerate(_bad_cases(eng)):
        req = SynthesisRequest("x", code_params=PARAMS, request_id=f"bad{i}", **fields)
        segments = [Segment(k, "x", [], a) for k, a in enumerate(ids)]
        with pytest.raises(ValueError, match=match):
            eng.add_synthesis(req, segments)
        assert not eng.has_unfinished() and not eng.sequences and eng.audio.num_requests == 0, match
    fine = SynthesisRequest("x", code_params=PARAMS, request_id="fine")
    eng.add_synthesis(fine, [Segment(0, "x", [], np.array([1, 2]))])
    assert run_all(eng)["fine"][1].num_frames == 6  # the engine keeps serving
