"""The paged engine reproduces the reference's golden generations end to end (fp32, CPU)."""

import numpy as np
import pytest
from engine_testutil import GOLDEN, FrameRecorder, golden_json, make_engine, run_all

from ttsserve.params import SamplingParams, SynthesisRequest, Voice

GREEDY_CODE = SamplingParams(temperature=1e-30, greedy=True, repetition_penalty=1.05)
GREEDY_TEXT = SamplingParams(temperature=1e-30, greedy=True, repetition_penalty=1.0)


def _d_inputs():
    d = golden_json("d_greedy.json")
    a = golden_json("a_prompts.json")
    texts = {t["key"]: t for t in a["texts"]} if isinstance(a["texts"], list) else a["texts"]
    return d, texts


@pytest.mark.parametrize("batched", [False, True])
def test_greedy_code_stage_matches_golden(tiny_model, tiny_speaker, batched):
    """d_greedy: code stage on the normalized texts, 32 frames, single and batched, with chunked prefill."""
    d, texts = _d_inputs()
    npz = np.load(GOLDEN / "d_greedy.npz")
    keys = ["en_simple", "zh_ctrl", "mixed"]
    params = GREEDY_CODE.replace(min_new_tokens=32, max_new_tokens=32)
    voice = Voice(spk_emb=tiny_speaker)
    engines = [make_engine(tiny_model, max_num_batched_tokens=256 if batched else 4096, max_num_seqs=8)]
    if not batched:
        engines = [make_engine(tiny_model) for _ in keys]
    recs = [FrameRecorder(e) for e in engines]
    for i, key in enumerate(keys):
        e = engines[0 if batched else i]
        e.add_synthesis(
            SynthesisRequest(texts[key]["normalized"], voice=voice, code_params=params, raw_text=True, request_id=key)
        )
    for e in engines:
        run_all(e)
    for i, key in enumerate(keys):
        rec = recs[0 if batched else i]
        np.testing.assert_array_equal(rec.codes(f"{key}/0/code"), npz[f"{key}_code_ids"])
        want_h = npz[f"batch_{key}_code_hiddens"] if batched else npz[f"{key}_code_hiddens"]
        np.testing.assert_allclose(rec.hidden(f"{key}/0/code"), want_h, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_e2e_refine_code_decode_matches_golden(tiny_model, tiny_speaker, pipelined):
    """f_e2e e2e_en: refine (12 tokens) -> code (40 frames) -> Decoder + Vocos, streamed, vs the reference;
    also with asynchronous scheduling (the refine stage then waits for each token, the code stage does not)."""
    f = golden_json("f_e2e.json")["e2e_en"]
    wav_ref = np.load(GOLDEN / "f_e2e.npz")["e2e_en_decode_call0_wavs"][0]
    e = make_engine(tiny_model, async_scheduling=pipelined)
    rec = FrameRecorder(e)
    req = SynthesisRequest(
        f["text"],
        voice=Voice(spk_emb=tiny_speaker),
        code_params=GREEDY_CODE.replace(min_new_tokens=40, max_new_tokens=40),
        refine_text=True,
        refine_prompt="[oral_2][laugh_0][break_6]",
        refine_params=GREEDY_TEXT.replace(min_new_tokens=12, max_new_tokens=12),
        normalize=False,
        split=False,
        request_id="e2e",
    )
    e.add_synthesis(req)
    ((audio, final),) = run_all(e).values()
    refine = [t for t, _ in rec.frames["e2e/0/text"]]
    assert refine == f["refine_ids"][0][0]
    np.testing.assert_array_equal(rec.codes("e2e/0/code"), np.array(f["code_calls"][0]["code_ids"][0]))
    assert final.finish_reason == "length" and final.num_frames == 40
    assert audio.shape == wav_ref.shape
    np.testing.assert_allclose(audio, wav_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("prepared", [False, True], ids=["engine_tokenizes", "api_server_tokenized"])
def test_audio_prompt_voice_matches_golden(tiny_model, tiny_speaker, prepared, monkeypatch):
    """f_e2e e2e_zh_split call 1: code stage with spk_smp + txt_smp (the sample-audio speaker); also with the
    segments an API server prepares (text/segments.py, its tokenizer rebuilt from the engine's JSON)."""
    from ttsserve.text.segments import prepare_segments, tokenize_segments
    from ttsserve.text.speaker import decode_audio_prompt
    from ttsserve.text.tokenizer import TextTokenizer

    f = golden_json("f_e2e.json")["e2e_zh_split"]
    call = f["code_calls"][1]
    wavs = np.load(GOLDEN / "f_e2e.npz")["e2e_zh_split_decode_call1_wavs"]
    voice = Voice(spk_emb=tiny_speaker, spk_smp=decode_audio_prompt(call["spk_smp"]), txt_smp=call["txt_smp"])
    e = make_engine(tiny_model)
    rec = FrameRecorder(e)
    params = GREEDY_CODE.replace(min_new_tokens=40, max_new_tokens=40)
    api_tok = TextTokenizer.from_json(e.frontend.tokenizer.to_json())
    reqs = [
        SynthesisRequest(text, voice=voice, code_params=params, raw_text=True, request_id=f"s{i}")
        for i, text in enumerate(call["text"])
    ]
    segments = [tokenize_segments(r, prepare_segments(r), api_tok) if prepared else None for r in reqs]
    if prepared:
        monkeypatch.setattr(e.frontend.tokenizer, "encode", lambda s: pytest.fail("the engine tokenized again"))
    for req, segs in zip(reqs, segments):
        e.add_synthesis(req, segs)
    results = run_all(e)
    for i in range(len(call["text"])):
        np.testing.assert_array_equal(rec.codes(f"s{i}/0/code"), np.array(call["code_ids"][i]))
        np.testing.assert_allclose(results[f"s{i}"][0], wavs[i], atol=1e-5, rtol=0)
