"""Normalization: reference parity (a_prompts, MODEL.md §2.3 examples) and the verbalising front end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttsserve.text.expand import span_lang
from ttsserve.text.normalize import detect_language, normalize_text, reference_normalize

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
_VALID = re.compile(r"^[\u4e00-\u9fffA-Za-z，。、,. ]*$")
_TAG = re.compile(r"\[[\w_]+\]")


# ---- reference parity --------------------------------------------------------------------------------


def test_reference_normalize_matches_every_golden_text():
    texts = json.loads((GOLDEN / "a_prompts.json").read_text())["texts"]
    assert len(texts) == 10
    for t in texts:
        assert reference_normalize(t["text"]) == t["normalized"], t["key"]
        assert normalize_text(t["text"], expand_numbers=False).text == t["normalized"], t["key"]


@pytest.mark.parametrize("text,want", [
    ("Hello, world! 123 I'm fine? [uv_break]ok[laugh]", "Hello, world.  Im fine [uv_break]ok[laugh]"),
    ("你好!今天是2024年?", "你好。今天是年"),
    ("你好,今天天气很好!我们去公园散步吗?好的-走吧.", "你好，今天天气很好。我们去公园散步吗好的，走吧。"),
    ("a<b>c", "a,b,c"),  # half-width < > map to "," in English ...
    ("你好<世界>", "你好世界"),  # ... but become full-width ＜＞ in Chinese, which are deleted
    ("你好(世界)", "你好，世界，"),
    ("纯中文，没有问题。", "纯中文，没有问题。"),  # nothing invalid: the map of step 2 is not applied
    ("I said: no", "I said, no"),
    ("tabs\tand\nnewlines", "tabsandnewlines"),  # the reference deletes them (it splits on \n earlier)
])  # fmt: skip
def test_reference_rules(text, want):
    assert reference_normalize(text) == want


def test_homophone_step_only_with_a_table():
    text = "後來會說[uv_break]國語：對！"
    table = {"後": "后", "來": "来", "會": "会", "說": "说", "國": "国", "語": "雨", "對": "对"}
    assert reference_normalize(text, homophones=table) == "后来会说[uv_break]国雨，对。"
    assert reference_normalize(text) == "後來會說[uv_break]國語，對。"


def test_language_detection():
    assert detect_language("你好 world") == "zh"
    assert detect_language("hello 世界 again") == "en"
    assert detect_language("ChatTTS是一个模型") == "zh"
    assert detect_language("") == "en"
    assert reference_normalize("a,b", lang="zh") == "a，b"


# ---- verbalisation: English --------------------------------------------------------------------------

EN_CASES = [
    ("The price is 128 dollars and 5 cents, in 2024.",
     "The price is one hundred and twenty eight dollars and five cents, in twenty twenty four."),
    ("The meeting is on 2024-05-01 at 14:30.", "The meeting is on May first, twenty twenty four at fourteen thirty."),
    ("May 1, 2024 was a Wednesday.", "May first, twenty twenty four was a Wednesday."),
    ("Born on 4 July 1976.", "Born on the fourth of July nineteen seventy six."),
    ("Let's meet at 2:30 pm.", "Lets meet at two thirty p m."),
    ("The train leaves at 9:05 AM.", "The train leaves at nine oh five a m."),
    ("Wake me at 7:00.", "Wake me at seven o clock."),
    ("Open 10:00-12:00 daily.", "Open ten o clock to twelve o clock daily."),
    ("It costs $12.50 today.", "It costs twelve dollars and fifty cents today."),
    ("Only $1 and 99 cents.", "Only one dollar and ninety nine cents."),
    ("A €5 coffee and a £3.20 tea.", "A five euros coffee and a three pounds and twenty pence tea."),
    ("They raised $5 million.", "They raised five million dollars."),
    ("About 45% of users agreed.", "About forty five percent of users agreed."),
    ("Up from 30-35% last year.", "Up from thirty to thirty five percent last year."),
    ("It was -5°C outside.", "It was minus five degrees Celsius outside."),
    ("He ran 10 km in 45 min.", "He ran ten kilometers in forty five minutes."),
    ("A 1 km walk at 5.5 km/h.", "A one kilometer walk at five point five kilometers per hour."),
    ("Download 5GB at 100 Mbps.", "Download five gigabytes at one hundred megabits per second."),
    ("She sprinted 100m in 12s.", "She sprinted one hundred meters in twelve seconds."),
    ("Pi is about 3.14159.", "Pi is about three point one four one five nine."),
    ("Add 1/2 cup and 3/4 spoon, keep 2/3.", "Add one half cup and three quarters spoon, keep two thirds."),
    ("She finished 1st and he came 22nd.", "She finished first and he came twenty second."),
    ("Music of the 1990s and 80s.", "Music of the nineteen nineties and eighties."),
    ("It grew from 1,234,567 to 2,000,000.",
     "It grew from one million two hundred and thirty four thousand five hundred and sixty seven to two million."),
    ("The temperature fell by -3.5 degrees.", "The temperature fell by minus three point five degrees."),
    ("It fell by -0.5 degrees.", "It fell by minus zero point five degrees."),  # the sign of a zero whole part
    ("Call 555-123-4567 now.", "Call five five five, one two three, four five six seven now."),
    ("Dial +1 (555) 123-4567.", "Dial plus one, five five five, one two three, four five six seven."),
    ("Agent 007 is here.", "Agent zero zero seven is here."),
    ("Dr. Smith met Mr. Jones.", "Doctor Smith met Mister Jones."),
    ("Fruits, e.g. apples, etc.", "Fruits, for example apples, et cetera."),
    ("The U.S. team won.", "The U S team won."),
    ("COVID-19 changed 2020.", "COVID nineteen changed twenty twenty."),
    ("A text-to-speech model.", "A text to speech model."),
    ("Version 1.2.3 is out.", "Version one point two point three is out."),
    ("The IP is 192.168.0.1.", "The IP is one nine two dot one six eight dot zero dot one."),
    ("The score was 3:2.", "The score was three to two."),
    ("We need 2-3 days, maybe 3~5.", "We need two to three days, maybe three to five."),
    ("Room #12, No. 5 Main Street.", "Room number twelve, number five Main Street."),
    ("Tom & Jerry: 1 + 1 = 2", "Tom and Jerry, one plus one equals two"),
    ("Is it 5G? Yes!", "Is it five G. Yes."),
    ("I'm sure it's fine, don't worry.", "Im sure its fine, dont worry."),
]  # fmt: skip


@pytest.mark.parametrize("text,want", EN_CASES)
def test_english_verbalisation(text, want):
    out = normalize_text(text)
    assert out.lang == "en"
    assert out.text == want


# ---- verbalisation: Chinese --------------------------------------------------------------------------

ZH_CASES = [
    ("2024年3月15日，气温是25度。", "二零二四年三月十五日，气温是二十五度。"),
    ("会议定于2024年5月1日下午2:30举行。", "会议定于二零二四年五月一日下午两点三十分举行。"),
    ("会议在2024-05-01上午9:05开始。", "会议在二零二四年五月一日上午九点零五分开始。"),
    ("现在是14:00整。", "现在是十四点整。"),
    ("我的手机号是13812345678。", "我的手机号是幺三八幺二三四五六七八。"),
    ("座机是010-12345678。", "座机是零幺零，幺二三四五六七八。"),
    ("原价¥299，现在只要239.2元。", "原价两百九十九元，现在只要两百三十九点二元。"),
    ("这个包$12.50，那个€5。", "这个包十二点五美元，那个五欧元。"),
    ("今天最高气温25℃，最低-3℃。", "今天最高气温二十五摄氏度，最低零下三摄氏度。"),
    ("也就是60%的人同意。", "也就是百分之六十的人同意。"),
    ("增长了3.5%到10%之间。", "增长了百分之三点五到百分之十之间。"),
    ("涨幅为10-20%。", "涨幅为百分之十到百分之二十。"),
    ("这辆车时速120 km/h，油耗6.5L。", "这辆车时速一百二十公里每小时，油耗六点五升。"),
    ("我今年25岁，身高175cm，体重65kg。", "我今年二十五岁，身高一百七十五厘米，体重六十五公斤。"),
    ("圆周率约等于3.14。", "圆周率约等于三点一四。"),
    ("气温降了-0.5度。", "气温降了负零点五度。"),
    ("三分之一可以写成1/3。", "三分之一可以写成三分之一。"),
    ("第3章讲了2个故事，共2页。", "第三章讲了两个故事，共两页。"),
    ("支持2种语言，2月2号发布。", "支持两种语言，二月二号发布。"),
    ("一共有1,000,000人。", "一共有一百万人。"),
    ("在2020-2024年间做了3-5个项目。", "在二零二零到二零二四年间做了三到五个项目。"),
    ("90年代出生的人占2成。", "九零年代出生的人占两成。"),
    ("比分是3:2。", "比分是三比二。"),
    ("温度下降了-5度。", "温度下降了负五度。"),
    ("房间号是#12。", "房间号是十二号。"),
    ("你好吗？我很好！", "你好吗。我很好。"),
    ("Apple发布了iPhone15，售价5999元。", "Apple发布了iPhone fifteen，售价五千九百九十九元。"),
    ("ChatTTS 是一个 open source 的语音模型, 支持 2 种语言?",
     "ChatTTS 是一个 open source 的语音模型， 支持 两 种语言。"),
    ("今天真开心[laugh_0]，我们花了30元[uv_break]去吃饭吧[lbreak]",
     "今天真开心[laugh_0]，我们花了三十元[uv_break]去吃饭吧[lbreak]"),
]  # fmt: skip


@pytest.mark.parametrize("text,want", ZH_CASES)
def test_chinese_verbalisation(text, want):
    out = normalize_text(text)
    assert out.lang == "zh"
    assert out.text == want


def test_reading_language_follows_the_surrounding_script():
    # the same "3" is read in Chinese next to Chinese and in English next to English, in either document
    assert normalize_text("I bought 3 apples 和 3个梨。", lang="en").text == "I bought three apples 和 三个梨。"
    assert normalize_text("我买了3个苹果 and 3 pears.", lang="zh").text == "我买了三个苹果 and three pears。"
    assert span_lang("ab 12 cd", 3, 5, "zh") == "en"
    assert span_lang("你 12 好", 2, 4, "en") == "zh"
    assert span_lang("ab 12你", 3, 5, "en") == "zh"  # the closer script wins
    assert span_lang("ab12你", 2, 4, "en") == "en"  # a tie goes to the document language
    assert span_lang("ab12你", 2, 4, "zh") == "zh"
    assert span_lang("12", 0, 2, "zh") == "zh"


def test_expand_numbers_false_is_the_reference():
    text = "It costs $12.50 (about 90元) on 2024-05-01!"
    out = normalize_text(text, expand_numbers=False)
    assert out.text == reference_normalize(text) == "It costs . ,about 元, on ,,."
    assert out.dropped == ["$", "1", "2", "5", "0", "9", "4"]


def test_dropped_reports_what_is_still_deleted():
    out = normalize_text("Smile 😀 at 5 #hashtag ~tilde")
    assert out.text == "Smile  at five hashtag tilde"
    assert out.dropped == ["😀", "#", "~"]
    assert normalize_text("Nothing to drop here.").dropped == []


def test_newlines_and_full_width_input():
    assert normalize_text("Title\nThe body starts here.\nSecond line,\nthird").text == \
        "Title. The body starts here. Second line, third"  # fmt: skip
    assert normalize_text("标题\n正文开始了。").text == "标题。正文开始了。"
    assert normalize_text("价格是１２３元，占５０％。").text == "价格是一百二十三元，占百分之五十。"


def test_tags_are_never_touched():
    out = normalize_text("Wait [uv_break] 3 seconds [laugh] then [speed_5] go")
    assert out.text == "Wait [uv_break] three seconds [laugh] then [speed_5] go"


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="lang"):
        normalize_text("hi", lang="fr")
    with pytest.raises(ValueError, match="str"):
        normalize_text(b"hi")  # type: ignore[arg-type]


_ALPHABET = st.sampled_from(list("0123456789.,:-/%$¥ abcXYZ你好年月日元，。！？!?()[]_°℃+@#&") + ["[uv_break]"])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(_ALPHABET, max_size=40).map("".join), st.sampled_from([None, "zh", "en"]))
def test_output_is_clean_and_stable(text, lang):
    """Whatever the input: no digit survives, only characters the reference keeps remain (tags
    aside), and running the reference rules again changes nothing."""
    out = normalize_text(text, lang=lang)
    plain = _TAG.sub("", out.text)
    assert _VALID.match(plain), (text, out.text)
    assert reference_normalize(out.text, lang=out.lang) == out.text


def test_am_pm_with_dots_keeps_the_sentence_end():
    assert normalize_text("We left at 5 p.m. Then it rained.").text == "We left at five p m. Then it rained."
    assert normalize_text("We left at 5 p.m. and ate.").text == "We left at five p m and ate."


def test_warm_up_text_path_pays_the_normalizers_imports_in_a_fresh_process():
    """What a server runs before it reports ready: it must load what the first request would (cn2an and
    num2words, imported lazily by prepare_segments), and the texts must pass the real text path."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ttsserve.text.segments import warm_up_text_path\n"
        "before = {m: m in sys.modules for m in ('cn2an', 'num2words', 'ttsserve.text.normalize')}\n"
        "assert not any(before.values()), before\n"
        "seconds = warm_up_text_path()\n"
        "assert all(m in sys.modules for m in before), sys.modules.keys()\n"
        "assert seconds > 0\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# Pieces that the verbalising rules look for, digits among them and not: month names, "No.", units, currency,
# separators, CJK, letters (hypothesis joins them into segments; as normalize_text hands them over, with every
# digit ASCII).
_PIECES = [*"0123456789", *" .,:;-/~%$#&@+='", "No.", "Jan", "March", "pm", "a.m.", "km", "kg", "°C",
           "st", "th", "s", "年", "年代", "至", "万", "元", "A.", "B.", "Dr.", "abc", "中文", "，"]  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=14).map("".join), st.sampled_from(["en", "zh"]))
def test_rules_skipped_on_digit_free_text_would_not_have_matched(text: str, lang: str) -> None:
    """A rule marked `digits` is not run over text without a digit: on any text, digits or not, the segment
    reads as with every rule run."""
    from ttsserve.text.expand import RULES, apply_rule, expand_segment

    every_rule = text
    for rule in RULES:
        every_rule = apply_rule(rule, every_rule, lang)
    assert expand_segment(text, lang) == every_rule
    if not re.search(r"\d", text):
        assert not [r.name for r in RULES if r.digits and r.pattern.search(text)]


def test_other_scripts_digits_read_as_numbers() -> None:
    """Arabic-Indic, Devanagari and full-width digits are numbers like 0-9 (the Chinese readings once raised on
    them)."""
    assert normalize_text("I have ٣ apples and ३ pears", "en").text == "I have three apples and three pears"
    assert normalize_text("我有٣个苹果，１２个梨", "zh").text == "我有三个苹果，十二个梨"


# digits of every kind the number rules may meet: ASCII, full-width, other scripts' (\d), and look-alikes that are
# not decimal (superscripts, circled, fractions)
_ODD_DIGITS = list("0123456789０１٣३۳໓߂௫ᠣ𝟙²³½①") + list(".,:-/%$€£¥ abc你好年月日号点万亿，。!?")


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.text(st.characters(codec="utf-8"), max_size=30)
    | st.lists(st.sampled_from(_ODD_DIGITS), max_size=25).map("".join),
    st.sampled_from([None, "zh", "en"]),
)
def test_any_text_normalizes_without_raising(text: str, lang: str | None) -> None:
    """Any string is read or dropped, never an exception from the readers (cn2an raised on other scripts'
    digits)."""
    out = normalize_text(text, lang=lang)
    assert isinstance(out.text, str)
