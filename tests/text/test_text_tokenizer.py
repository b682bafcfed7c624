"""Tokenizer + prompt construction: golden parity with the reference (a_prompts, d_greedy, f_e2e)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ttsserve.text.prompt import (
    PromptInputs,
    build_code_prompt,
    build_prompt_inputs,
    build_refine_prompt,
    left_pad_batch,
    validate_control_prompt,
)
from ttsserve.text.speaker import decode_audio_prompt
from ttsserve.text.tokenizer import TextTokenizer, clean_up_tokenization

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
TOKENIZER_DIR = GOLDEN / "assets-tiny" / "asset" / "tokenizer"


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_dir(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def prompts() -> dict:
    return json.loads((GOLDEN / "a_prompts.json").read_text())


def _text(prompts: dict, key: str) -> dict:
    return next(t for t in prompts["texts"] if t["key"] == key)


# ---- prompt strings and ids ----------------------------------------------------------------------


def test_prompt_strings_ids_and_tokens(tok, prompts):
    assert len(prompts["texts"]) == 10
    for t in prompts["texts"]:
        norm = t["normalized"]
        cases = {
            "refine": build_refine_prompt(norm, prompts["refine_prompt"]),
            "code": build_code_prompt(norm, prompts["code_prompt"], has_speaker=True),
            "code_no_spk": build_code_prompt(norm, prompts["code_prompt"], has_speaker=False),
        }
        for kind, prompt in cases.items():
            want = t[kind]
            assert prompt == want["prompt_string"], (t["key"], kind)
            assert tok.encode(prompt) == want["ids"], (t["key"], kind)
            if "tokens" in want:
                assert tok.tokens(prompt) == want["tokens"], (t["key"], kind)


def test_long_prompt_is_neither_padded_nor_truncated(tok, prompts):
    t = _text(prompts, "long_mixed")
    ids = tok.encode(build_code_prompt(t["normalized"]))
    assert len(ids) == len(t["code"]["ids"]) == 411 > 256
    assert ids[-1] == tok.token_id("[Ptts]") and tok.pad_id not in ids
    assert len(tok.encode("hello")) == 1  # no [CLS]/[SEP], no padding to 256


def test_batched_left_padding(tok, prompts):
    b = prompts["batched"]
    texts = [_text(prompts, k)["normalized"] for k in b["order"]]
    refine = [tok.encode(build_refine_prompt(x, prompts["refine_prompt"])) for x in texts]
    code = [tok.encode(build_code_prompt(x, prompts["code_prompt"])) for x in texts]
    assert left_pad_batch(refine, tok.pad_id) == (b["refine_ids"], b["refine_attention_mask"])
    assert left_pad_batch(code, tok.pad_id) == (b["code_ids"], b["code_attention_mask"])


def test_code_prompt_with_audio_prompt(tok, prompts):
    c = prompts["code_with_spk_smp"]
    text = _text(prompts, c["text_key"])["normalized"]
    prompt = build_code_prompt(text, prompts["code_prompt"], has_speaker=True, txt_smp=c["txt_smp"])
    assert prompt == c["prompt_string"]
    codes = decode_audio_prompt(c["spk_smp"])
    assert list(codes.shape) == list(c["spk_smp_codes_shape"]) == [4, 32]
    inputs = build_prompt_inputs(tok.encode(prompt), codes)
    assert inputs.ids == c["input_ids"]
    assert [int(m) for m in inputs.text_mask] == c["text_mask"]
    assert len(inputs) == len(c["attention_mask"]) and all(c["attention_mask"])
    assert inputs.num_text_tokens == len(inputs) - codes.shape[1]


def test_prompt_inputs_without_audio_prompt():
    inputs = build_prompt_inputs([5, 6, 7])
    assert inputs == PromptInputs(ids=[[5] * 4, [6] * 4, [7] * 4], text_mask=[True] * 3)
    with pytest.raises(ValueError, match="audio prompt"):
        build_prompt_inputs([5], np.zeros((3, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="no tokens"):
        build_prompt_inputs([])


def test_code_prompt_strips_structure_tags():
    assert build_code_prompt("  [Stts][spk_emb]hi[empty_spk] ", "[speed_2]") == "[Stts][spk_emb][speed_2]hi[Ptts]"
    assert build_code_prompt("hi", "", has_speaker=False) == "[Stts][empty_spk]hi[Ptts]"
    assert build_refine_prompt("hi") == "[Sbreak]hi[Pbreak]"


@pytest.mark.parametrize("prompt", ["", "[speed_5]", "[oral_2][laugh_0][break_6]", " [speed_0] [oral_9] ",
                                    "[laugh_2][break_7]"])  # fmt: skip
def test_valid_control_prompts(prompt):
    assert validate_control_prompt(prompt) == prompt


@pytest.mark.parametrize("prompt,msg", [
    ("[speed_10]", "out of range"), ("[laugh_3]", "out of range"), ("[break_8]", "out of range"),
    ("[oral_01]", "out of range"), ("[shout_1]", "not allowed"), ("[speed_5]hello", "unexpected text"),
    ("[uv_break]", "unexpected text"), ("speed_5", "unexpected text"),
])  # fmt: skip
def test_invalid_control_prompts(prompt, msg):
    with pytest.raises(ValueError, match=msg):
        validate_control_prompt(prompt)


def test_control_prompt_kinds_can_be_restricted():
    validate_control_prompt("[speed_3]", allowed=["speed"])
    with pytest.raises(ValueError, match="not allowed"):
        validate_control_prompt("[oral_3]", allowed=["speed"])


# ---- specials and decoding -------------------------------------------------------------------------


def test_special_ids(tok, prompts):
    for name, tid in prompts["special_ids"].items():
        assert tok.token_id(name) == tid, name
    assert tok.vocab_size == prompts["tokenizer_len"] == 1024
    assert (tok.spk_emb_id, tok.empty_spk_id, tok.break_0_id, tok.ebreak_id, tok.pad_id) == (989, 990, 993, 982, 0)
    with pytest.raises(ValueError, match="unknown token"):
        tok.token_id("[no_such_token]")


def test_decode_examples_exact(tok, prompts):
    assert len(prompts["decode_examples"]) == 3
    for ex in prompts["decode_examples"]:
        assert [tok.id_to_token(i) for i in ex["ids"]] == ex["tokens"]
        assert tok.decode(ex["ids"]) == ex["decoded"]
        assert tok.decode_refined(ex["ids"]) == ex["decoded"]  # all ids < [break_0]


def test_decode_refined_drops_sentence_level_controls(tok):
    ids = tok.encode("[oral_2]hello[uv_break][laugh_0]world[speed_5][break_3][lbreak]")
    assert tok.decode_refined(ids) == "hello [uv_break] world [lbreak]"


def test_cleanup_replacements_in_order():
    assert clean_up_tokenization("i can ' t do it , ok ?") == "i can't do it, ok?"
    assert clean_up_tokenization("we 're here n't") == "we're heren't"


def test_refine_to_code_handoff_goldens(tok):
    d = json.loads((GOLDEN / "d_greedy.json").read_text())
    for key, single in d["single"].items():
        kept = [i for i in single["refine_ids"] if i < tok.break_0_id]
        assert kept == single["refine_kept_ids"], key
        assert tok.decode_refined(single["refine_ids"]) == single["refine_decoded_text"], key
    f = json.loads((GOLDEN / "f_e2e.json").read_text())
    for key, case in f.items():
        refined = [tok.decode_refined(ids) for batch in case["refine_ids"] for ids in batch]
        for call in case["code_calls"]:
            assert call["text"] == refined[: len(call["text"])], key
            if call["txt_smp"] is not None:
                assert call["txt_smp"] == refined[0]


def test_missing_special_token_is_rejected(tmp_path):
    data = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "[spk_emb]"]
    data["model"]["vocab"].pop("[spk_emb]", None)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"\[spk_emb\]"):
        TextTokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        TextTokenizer.from_dir(tmp_path / "missing")


def test_raw_file_padding_is_disabled(tmp_path):
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = TextTokenizer.from_file(tmp_path / "tokenizer.json")
    ids = tok.encode("[Stts]" + "a " * 300 + "[Ptts]")
    assert len(ids) == 302


def test_json_round_trip_is_the_same_tokenizer(tok, prompts):
    """What the engine core sends its API servers (CoreInfo.tokenizer_json) rebuilds the same tokenizer:
    the golden ids of every prompt (the long one too: padding and truncation stay off), the same code-prompt
    ids for a voice with an audio prompt, and the same vocabulary."""
    from ttsserve.params import Voice
    from ttsserve.text.prompt import code_prompt_ids

    back = TextTokenizer.from_json(tok.to_json())
    assert back.vocab_size == tok.vocab_size and back.spk_emb_id == tok.spk_emb_id
    for t in prompts["texts"]:
        prompt = build_code_prompt(t["normalized"], prompts["code_prompt"], has_speaker=True)
        assert back.encode(prompt) == t["code"]["ids"], t["key"]
    c = prompts["code_with_spk_smp"]
    voice = Voice(spk_emb=np.zeros(8, np.float16), txt_smp=c["txt_smp"])
    text = _text(prompts, c["text_key"])["normalized"]
    assert code_prompt_ids(back, text, prompts["code_prompt"], voice) == tok.encode(c["prompt_string"])
    with pytest.raises(ValueError, match="not a tokenizer JSON"):
        TextTokenizer.from_json("{not json")
    data = json.loads(tok.to_json())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "[Ptts]"]
    data["model"]["vocab"].pop("[Ptts]", None)
    with pytest.raises(ValueError, match=r"\[Ptts\]"):
        TextTokenizer.from_json(json.dumps(data))
