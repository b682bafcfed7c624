"""Long-text splitting: coverage, order, boundaries, numbers kept whole; and the reference split."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttsserve.text.split import MAX_CHARS, TextSegment, reference_split, split_text, text_units

SENTENCES = [
    "ChatTTS is a text-to-speech model designed for dialogue scenarios such as chat assistants.",
    "它支持中文和英文两种语言，可以预测和控制细粒度的韵律特征，比如笑声、停顿和插入语。",
    "The model was trained on roughly 100,000 hours of Chinese and English audio, about 3.5 times more than v1.0!",
    "我们希望这个开源项目能够帮助更多的研究人员和开发者，一起推动语音合成技术的发展。",
    "Dr. Smith arrived at 14:30 on 2024-05-01, paid $1,299.99, and left at 5 p.m. sharp.",
    "今天最高气温25.5℃，最低-3℃；湿度为60%，风力3级，适合出门散步吗？当然适合！",
    "Is it fast enough? On one H200 it renders 1,000 requests in 12.5 seconds; that is 80 requests per second.",
    "如果一个引擎直接使用原始的分词库，却没有关闭填充和截断，那么这段文字就会被截断，生成的结果也会和参考实现不同。",
    "Please make sure that your tokenizer keeps every token of this long input: no padding, no truncation.",
    "谢谢大家的耐心[uv_break]，我们下次再见[laugh]。",
]
# One very long Chinese sentence with clause punctuation only, and a long English run-on sentence.
LONG_ZH = "，".join(["这是一个没有句号的很长的分句用来测试按逗号切分的逻辑是否正确"] * 8) + "。"
LONG_EN = " ".join(["this run on sentence has no punctuation at all and keeps going"] * 12) + "."
_SENTENCE_PUNCT = set("。！？!?；;.")
_CLAUSE_PUNCT = set("，,、：:…—")
_CLOSERS = set("”’\"'」』）)]】》")


def _long_text() -> str:
    rnd = random.Random(0)
    parts: list[str] = []
    while sum(map(len, parts)) < 2000:
        parts.append(rnd.choice(SENTENCES))
        parts.append(rnd.choice([" ", "", "\n", "  "]))
    parts[len(parts) // 2 : len(parts) // 2] = [LONG_ZH, LONG_EN, " "]
    return "".join(parts)


def _check_cover(text: str, segs: list[TextSegment]) -> None:
    assert segs
    pos = 0
    for seg in segs:
        assert seg.text == text[seg.start : seg.end]
        assert seg.text == seg.text.strip() and seg.text
        assert seg.start >= pos and not text[pos : seg.start].strip()  # only whitespace between segments
        pos = seg.end
    assert not text[pos:].strip()
    assert "".join(s.text for s in segs).replace(" ", "").replace("\n", "") == re.sub(r"\s", "", text)


def test_long_mixed_text():
    text = _long_text()
    assert 2900 <= len(text) <= 3400
    segs = split_text(text)
    _check_cover(text, segs)
    assert len(segs) >= 8
    for seg in segs:
        assert text_units(seg.text) <= MAX_CHARS
    en_start = text.index(LONG_EN)
    for seg in segs[:-1]:  # every boundary is at punctuation, except inside the unpunctuated LONG_EN
        if en_start < seg.end < en_start + len(LONG_EN):
            assert text[seg.end] == " " and text[seg.end - 1].isalpha()
            continue
        last = seg.text.rstrip("".join(_CLOSERS))[-1]
        assert last in _SENTENCE_PUNCT | _CLAUSE_PUNCT, seg.text[-20:]
    for m in re.finditer(r"\d+(?:[.,:]\d+)*", text):  # no number is cut: 3.5, 100,000, 14:30, 2024-05-01
        assert any(s.start <= m.start() and m.end() <= s.end for s in segs), m.group(0)
    for m in re.finditer(r"\[[\w_]+\]|[A-Za-z]+", text):  # no word or tag is cut
        assert any(s.start <= m.start() and m.end() <= s.end for s in segs), m.group(0)


def test_sentences_are_preferred_over_clauses():
    text = "第一句话很短。" + "第二句话，" * 6 + "结束了。" + "第三句。"
    segs = split_text(text, max_chars=20, min_chars=4)
    _check_cover(text, segs)
    assert segs[0].text == "第一句话很短。"
    assert segs[-1].text.endswith("第三句。")
    assert all(s.text[-1] in "。，" for s in segs)


def test_clauses_then_words_when_sentences_are_too_long():
    segs = split_text(LONG_ZH, max_chars=60, min_chars=5)
    _check_cover(LONG_ZH, segs)
    assert len(segs) > 1 and all(s.text[-1] in "，。" for s in segs)
    segs = split_text(LONG_EN, max_chars=40, min_chars=5)
    _check_cover(LONG_EN, segs)
    for a, b in zip(segs, segs[1:]):
        assert LONG_EN[a.end - 1].isalpha() and LONG_EN[a.end] == " " and LONG_EN[b.start].isalpha()


def test_no_split_inside_numbers_abbreviations_or_initials():
    text = "Pi is 3.14159. It costs 1,000 dollars. J. K. Rowling met Dr. Who at 10:30.Mr. X, e.g. me. 好的。"
    segs = split_text(text, max_chars=8, min_chars=0)
    _check_cover(text, segs)
    cuts = {s.end for s in segs}
    for bad in ("3.", "1,", "J.", "K.", "Dr.", "10:", "Mr.", "e.g."):
        assert text.index(bad) + len(bad) not in cuts, bad


def test_tiny_pieces_are_merged():
    text = "好。" + "这是一个比较长的句子，用来测试合并逻辑是否正确。" * 3 + "嗯。"
    segs = split_text(text, max_chars=30, min_chars=6)
    _check_cover(text, segs)
    assert all(text_units(s.text) >= 6 for s in segs)
    assert segs[0].text.startswith("好。这是") and segs[-1].text.endswith("嗯。")


def test_short_text_is_one_segment_and_empty_is_none():
    assert split_text("  Hello world.  ") == [TextSegment("Hello world.", 2, 14)]
    assert split_text("") == [] and split_text(" \n ") == []
    with pytest.raises(ValueError):
        split_text("x", max_chars=0)


def test_units_weigh_cjk_and_digits_as_one_and_latin_as_point_four():
    assert text_units("你好") == 2 and text_units("2024") == 4
    assert text_units("hello") == pytest.approx(2.0)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(list("ab 你好。，,.!?;:\n12") + ["3.14", "1,000", "Dr. ", "[uv_break]"]),
                max_size=120).map("".join),
       st.integers(3, 60))  # fmt: skip
def test_split_always_covers_the_input(text, max_chars):
    segs = split_text(text, max_chars=max_chars, min_chars=min(3, max_chars))
    if text.strip():
        _check_cover(text, segs)
    else:
        assert segs == []


def test_reference_split():
    assert reference_split("你好。世界。Hello. World.  Bye") == ["你好。", "世界。", "Hello.", " World.", "  Bye"]
    assert reference_split("a.b. c") == ["a.b.", " c"]  # "." not followed by whitespace does not split
    assert reference_split("第一行。\n第二行\n\n") == ["第一行。", "第二行", "", ""]  # newlines win, kept as is
    assert reference_split("") == []
