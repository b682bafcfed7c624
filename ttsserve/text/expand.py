"""Verbalise what the reference normalizer would delete: numbers, dates, times, money, units, phone
numbers, symbols and abbreviations (used by `normalize.normalize_text`).

Each rule is a regex plus a handler `(match, lang) -> spoken text`. Rules run in order over one plain
(tag-free) segment; every handler returns letters/CJK/spaces only, so a later rule never re-reads an
earlier rule's output. The reading language of a match is decided by its surroundings (`span_lang`):
the nearest CJK character or Latin letter on each side, the closer one winning, the document language on
a tie. Rules tied to one language (English month names, `2024年`) ignore the surroundings.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ttsserve.text import numbers as nb
from ttsserve.text.units import UNITS_ATTACHED, UNITS_SPACED, unit_words

NUM = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
SNUM = r"(?:(?<![A-Za-z0-9_.])-)?" + NUM  # a minus sign only where it cannot be a hyphen or a range dash
_CONTEXT_WINDOW = 32  # characters scanned on each side to decide the language of a span
_DIGIT = re.compile(r"\d")


def _script(ch: str) -> str | None:
    if "\u4e00" <= ch <= "\u9fff":
        return "zh"
    if ch.isascii() and ch.isalpha():
        return "en"
    return None


def _nearest(text: str, start: int, step: int) -> tuple[str | None, int]:
    i, dist = start, 0
    while 0 <= i < len(text) and dist < _CONTEXT_WINDOW:
        s = _script(text[i])
        if s is not None:
            return s, dist
        i += step
        dist += 1
    return None, dist


def span_lang(text: str, start: int, end: int, default: str) -> str:
    """Reading language ("zh"/"en") of text[start:end] from the nearest script character on each side."""
    left, dl = _nearest(text, start - 1, -1)
    right, dr = _nearest(text, end, 1)
    if left is None or right is None or left == right:
        return left or right or default
    if dl != dr:
        return left if dl < dr else right
    return default


Handler = Callable[[re.Match, str], "str | None"]


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern
    handler: Handler
    lang: str | None = None  # fixed reading language; None = decided by the surroundings
    # matches only where the text holds a digit (in the match or its lookarounds): not run over text without one
    # (most segments; 26 of the 30 rules, 0.16 -> 0.06 ms a sentence of the bench corpus)
    digits: bool = True


def _months_re() -> str:
    names = [m for m in nb.EN_MONTHS] + [m[:3] for m in nb.EN_MONTHS if m != "May"] + ["Sept"]
    return "(" + "|".join(sorted(names, key=len, reverse=True)) + r")\.?"


def _month_index(name: str) -> int:
    return next(i for i, m in enumerate(nb.EN_MONTHS) if m.startswith(name[:3])) + 1


def _valid_date(month: int, day: int | None) -> bool:
    return 1 <= month <= 12 and (day is None or 1 <= day <= 31)


# ---- handlers -------------------------------------------------------------------------------------


def _iso_date(m: re.Match, lang: str) -> str | None:
    year, month, day = m.group(1), int(m.group(3)), int(m.group(4))
    if not _valid_date(month, day):
        return None
    return nb.zh_date(year, month, day) if lang == "zh" else nb.en_date(int(year), month, day)


def _month_day(m: re.Match, lang: str) -> str | None:
    month, day, year = _month_index(m.group(1)), int(m.group(2)), m.group(3)
    if not _valid_date(month, day):
        return None
    return nb.en_date(int(year) if year else None, month, day)


def _day_month(m: re.Match, lang: str) -> str | None:
    day, month, year = int(m.group(1)), _month_index(m.group(2)), m.group(3)
    if not _valid_date(month, day):
        return None
    words = f"the {nb.en_ordinal(day)} of {nb.EN_MONTHS[month - 1]}"
    return f"{words} {nb.en_year(int(year))}" if year else words


def _ampm(mark: str | None, lang: str, hour: int) -> tuple[int, str]:
    if not mark:
        return hour, ""
    pm = mark.lower() == "p"
    if lang == "zh":
        return hour, "下午" if pm else "上午"
    return hour, "p m" if pm else "a m"  # letters, spoken "pee em"


def _ends_sentence(m: re.Match) -> bool:
    """A "p.m." whose final dot also ends the sentence."""
    return m.group(0).endswith(".") and re.match(r"\s*(?:$|\n|[A-Z])", m.string[m.end() :]) is not None


def _clock(m: re.Match, lang: str) -> str | None:
    hour, minute = int(m.group(1)), int(m.group(2))
    second = int(m.group(3)) if m.group(3) else None
    hour, suffix = _ampm(m.group(4), lang, hour)
    if lang == "zh":
        return nb.zh_time(hour, minute, second, suffix)
    return nb.en_time(hour, minute, second, suffix) + ("." if _ends_sentence(m) else "")


def _hour_ampm(m: re.Match, lang: str) -> str:
    hour, suffix = _ampm(m.group(2), lang, int(m.group(1)))
    if lang == "zh":
        return nb.zh_time(hour, 0, None, suffix)
    return f"{nb.en_cardinal(str(hour))} {suffix}" + ("." if _ends_sentence(m) else "")


def _ratio(m: re.Match, lang: str) -> str:
    a, b = m.group(1), m.group(2)
    if lang == "zh":
        return f"{nb.zh_cardinal(a)}比{nb.zh_cardinal(b)}"
    return f"{nb.en_cardinal(a)} to {nb.en_cardinal(b)}"


_CURRENCY = {  # symbol: (zh word, en singular, en plural, en cents)
    "$": ("美元", "dollar", "dollars", "cents"),
    "€": ("欧元", "euro", "euros", "cents"),
    "£": ("英镑", "pound", "pounds", "pence"),
    "¥": ("元", "yuan", "yuan", None),
    "￥": ("元", "yuan", "yuan", None),
}
_SCALES = {"k": "thousand", "K": "thousand", "M": "million", "B": "billion", "bn": "billion"}
_ZH_SCALES = {"thousand": "千", "million": "百万", "billion": "十亿", "trillion": "万亿"}


def _money(m: re.Match, lang: str) -> str:
    zh_word, one, many, cents = _CURRENCY[m.group(1)]
    amount, scale = m.group(2), m.group(3)
    scale = _SCALES.get(scale, scale) if scale else None
    if lang == "zh":
        value = amount.replace(",", "")
        value = value.rstrip("0").rstrip(".") if "." in value else value
        words = nb.zh_decimal(value)
        return words + (_ZH_SCALES.get(scale, scale or "")) + zh_word
    if scale in ("万", "亿"):
        return f"{nb.en_decimal(amount)} {'ten thousand' if scale == '万' else 'hundred million'} {many}"
    if scale:
        return f"{nb.en_decimal(amount)} {scale} {many}"
    return nb.en_money(amount, one, many, cents)


def _percent_range(m: re.Match, lang: str) -> str:
    a, b = m.group(1), m.group(2)
    if lang == "zh":
        return f"{nb.zh_percent(a)}到{nb.zh_percent(b)}"
    return f"{nb.en_decimal(a)} to {nb.en_decimal(b)} percent"


def _percent(m: re.Match, lang: str) -> str:
    a = m.group(1)
    return nb.zh_percent(a) if lang == "zh" else f"{nb.en_decimal(a)} percent"


def _unit(m: re.Match, lang: str) -> str:
    value, unit = m.group(1), m.group(2)
    zh, one, many = unit_words(unit)
    if lang == "zh":
        if unit in ("°C", "℃", "°F", "℉") and value.startswith("-"):
            return "零下" + nb.zh_decimal(value[1:]) + zh
        return nb.zh_decimal(value) + zh
    return f"{nb.en_decimal(value)} {one if value == '1' else many}"


def _fraction(m: re.Match, lang: str) -> str | None:
    num, den = int(m.group(1)), int(m.group(2))
    if den == 0:
        return None
    return nb.zh_fraction(num, den) if lang == "zh" else nb.en_fraction(num, den)


def _ordinal(m: re.Match, lang: str) -> str:
    return nb.en_ordinal(int(m.group(1)))


def _decade(m: re.Match, lang: str) -> str:
    digits = m.group(1)
    if lang == "zh":
        return nb.zh_digits(digits) + "年代"
    words = nb.en_year(int(digits)) if len(digits) == 4 else nb.en_cardinal(digits)
    return words[:-1] + "ies" if words.endswith("y") else words + "s"


def _phone(m: re.Match, lang: str) -> str:
    """Digit by digit, a pause between groups; a leading + is read with the country code."""
    plus, groups = m.group(0).lstrip().startswith("+"), re.findall(r"\d+", m.group(0))
    if lang == "zh":
        words = [nb.zh_digits(g, phone=True) for g in groups]
        return ("加" if plus else "") + "，".join(words)
    words = [nb.en_digits(g) for g in groups]
    return ("plus " if plus else "") + ", ".join(words)


def _range(m: re.Match, lang: str) -> str:
    a, b = m.group(1), m.group(2)
    if lang == "zh":
        return f"{nb.zh_decimal(a)}到{nb.zh_decimal(b)}"
    is_math = re.match(r"\s*=", m.string[m.end() :]) is not None and " " in m.group(0)
    return f"{nb.en_number(a)} {'minus' if is_math else 'to'} {nb.en_number(b)}"


# Chinese measure words: a bare 2 before one of them is read 两 (两种, 两个), not 二 (but 二月, 二号).
_ZH_MEASURE = set("个种次位件天只本条张块辆台名家岁倍遍趟双对份句首间层项颗根杯瓶碗周年分秒成页斤元米")


def _number(m: re.Match, lang: str) -> str:
    if lang != "zh":
        return nb.en_number(m.group(0))
    rest = m.string[m.end() :].lstrip(" ")
    if m.group(0) == "2" and rest[:1] in _ZH_MEASURE and not rest.startswith("分之"):
        return "两"
    return nb.zh_decimal(m.group(0))


def _dotted(m: re.Match, lang: str) -> str:
    """Versions and addresses such as 1.2.3 or 192.168.0.1: each part read, joined by "point"."""
    parts = m.group(0).split(".")
    if len(parts) == 4:  # an IPv4 address: digits, "dot"
        if lang == "zh":
            return "点".join(nb.zh_digits(p) for p in parts)
        return " dot ".join(nb.en_digits(p) for p in parts)
    if lang == "zh":
        return "点".join(nb.zh_cardinal(p) for p in parts)
    return " point ".join(nb.en_cardinal(p) for p in parts)


def _hash_number(m: re.Match, lang: str) -> str:
    n = m.group(1)
    return nb.zh_cardinal(n) + "号" if lang == "zh" else f"number {nb.en_cardinal(n)}"


_SYMBOLS = {"&": ("和", "and"), "@": ("艾特", "at"), "+": ("加", "plus"), "=": ("等于", "equals"),
            "×": ("乘", "times"), "÷": ("除以", "divided by"), "°": ("度", "degrees")}  # fmt: skip


def _symbol(m: re.Match, lang: str) -> str:
    zh, en = _SYMBOLS[m.group(0)]
    return zh if lang == "zh" else en


_ABBREVIATIONS = {
    "Dr.": "Doctor", "Mr.": "Mister", "Mrs.": "Missus", "Ms.": "Miz", "Prof.": "Professor",
    "Jr.": "Junior", "Sr.": "Senior", "Mt.": "Mount", "vs.": "versus", "etc.": "et cetera",
    "e.g.": "for example", "i.e.": "that is", "approx.": "approximately", "Inc.": "Incorporated",
    "Ltd.": "Limited", "Fig.": "figure", "Dept.": "Department", "a.m.": "a m", "p.m.": "p m",
}  # fmt: skip


_CAN_END_SENTENCE = frozenset({"etc.", "a.m.", "p.m.", "Inc.", "Ltd."})


def _abbreviation(m: re.Match, lang: str) -> str:
    words = _ABBREVIATIONS[m.group(1)]
    # An abbreviation that also ends the sentence keeps its full stop (the pause relies on it); titles
    # such as "Dr." never end one.
    rest = m.string[m.end() :]
    ends = m.group(1) in _CAN_END_SENTENCE and re.match(r"\s*(?:$|\n)|\s+[A-Z]", rest) is not None
    return words + ("." if ends else "")


def _acronym(m: re.Match, lang: str) -> str:
    return " ".join(m.group(0).replace(".", ""))


def _number_sign(m: re.Match, lang: str) -> str:
    return f"number {nb.en_cardinal(m.group(1))}"


# ---- the rules, in order --------------------------------------------------------------------------

_MONTH = _months_re()
_ABBR = "|".join(re.escape(k) for k in sorted(_ABBREVIATIONS, key=len, reverse=True))
_UNITS_SP = "|".join(re.escape(u) for u in sorted(UNITS_SPACED, key=len, reverse=True))
_UNITS_AT = "|".join(re.escape(u) for u in sorted(UNITS_ATTACHED, key=len, reverse=True))
_AMPM = r"(?:\s?([AaPp])(?:\.[Mm]\.?|[Mm])(?![A-Za-z]))"  # "pm" / "p.m." (a dot after "pm" is left alone)


def _r(name: str, pattern: str, handler: Handler, lang: str | None = None, digits: bool = True) -> Rule:
    return Rule(name, re.compile(pattern), handler, lang, digits)


RULES: tuple[Rule, ...] = (
    _r("abbreviation", r"(?<![A-Za-z.])(" + _ABBR + r")(?![A-Za-z])", _abbreviation, "en", digits=False),
    _r("number_sign", r"(?<![A-Za-z])No\.\s?(\d+)", _number_sign, "en"),
    _r("acronym", r"(?<![A-Za-z.])(?:[A-Z]\.){2,}(?![A-Za-z])", _acronym, "en", digits=False),
    # "COVID-19", "text-to-speech": a hyphen after a letter joins words; the reference would turn it into
    # a comma (a pause).
    _r("word_hyphen", r"(?<=[A-Za-z])-(?=[A-Za-z\d])", lambda m, lang: " ", digits=False),
    _r("iso_date", r"(?<![\d.])(\d{4})([-/.])(\d{1,2})\2(\d{1,2})(?!\d|\.\d)", _iso_date),
    _r(
        "zh_year_range",
        r"(?<![\d.])(\d{4})\s?[-~～–—至到]\s?(\d{4})(?=年)",
        lambda m, lang: nb.zh_digits(m.group(1)) + "到" + nb.zh_digits(m.group(2)),
        "zh",
    ),  # fmt: skip
    _r("zh_year", r"(?<![\d.])(\d{4}|\d{2}(?=年代))(?=年)", lambda m, lang: nb.zh_digits(m.group(1)), "zh"),
    _r(
        "month_day",
        r"(?<![A-Za-z])" + _MONTH + r"\s+(\d{1,2})(?:st|nd|rd|th)?(?![\d:])(?:,?\s+(\d{4})(?!\d))?",
        _month_day,
        "en",
    ),  # fmt: skip
    _r(
        "day_month",
        r"(?<![\d.])(\d{1,2})(?:st|nd|rd|th)?\s+" + _MONTH + r"(?![a-z])(?:,?\s+(\d{4})(?!\d))?",
        _day_month,
        "en",
    ),  # fmt: skip
    _r(
        "clock_range",
        r"(?<=:\d\d)\s?[-~～–—]\s?(?=[01]?\d:\d\d|2[0-4]:\d\d)",
        lambda m, lang: "到" if lang == "zh" else "to",
    ),  # fmt: skip
    _r("clock", r"(?<![\d:.])([01]?\d|2[0-4]):([0-5]\d)(?::([0-5]\d))?(?![\d:])" + _AMPM + "?", _clock),
    _r("hour_ampm", r"(?<![\d.:])(1[0-2]|0?[1-9])" + _AMPM, _hour_ampm),
    _r("ratio", r"(?<![\d:.])(\d+):(\d+)(?![\d:])", _ratio),
    _r(
        "money",
        r"([$€£¥￥])\s?(" + NUM + r")(?:\s?(thousand|million|billion|trillion|bn|[kKMB]|万|亿)"
        r"(?![A-Za-z]))?",
        _money,
    ),  # fmt: skip
    _r("percent_range", r"(" + SNUM + r")\s?%?\s?[-~～–—]\s?(" + NUM + r")\s?%", _percent_range),
    _r("percent", r"(" + SNUM + r")\s?%", _percent),
    _r("phone_intl", r"(?<![A-Za-z0-9_+])\+\d{1,3}(?:[\s-]?\(?\d{1,4}\)?)?(?:[\s-]?\d{2,4}){2,4}(?!\d)", _phone),
    _r("phone_parens", r"(?<![A-Za-z0-9_.])\(\d{2,4}\)\s?\d{3,4}[\s-]?\d{3,4}(?!\d|\.\d)", _phone),
    _r("phone_dashed", r"(?<![A-Za-z0-9_.,-])(?:\d{3}-\d{3,4}-\d{4}|0\d{2,3}-\d{7,8})(?![\d-])", _phone),
    _r("digit_string", r"(?<![A-Za-z0-9_.,])(?:0\d{2,}|1\d{10}|\d{12,})(?!\d|[.,]\d)", _phone),
    _r("ordinal", r"(?<![\d.])(\d+)(?:st|nd|rd|th)(?![A-Za-z])", _ordinal, "en"),
    _r("decade", r"(?<![\d.])(\d0|\d{3}0)'?s(?![A-Za-z])", _decade),
    _r("unit_spaced", r"(" + SNUM + r")\s?(" + _UNITS_SP + r")(?![A-Za-z0-9²³])", _unit),
    _r("unit_attached", r"(" + SNUM + r")(" + _UNITS_AT + r")(?![A-Za-z0-9²³])", _unit),
    _r("fraction", r"(?<![\d/.])(\d+)/(\d+)(?!\d|/|\.\d)", _fraction),
    _r("hash_number", r"#(\d+)(?!\d|\.\d)", _hash_number),
    _r("dotted", r"(?<![\d.])\d+(?:\.\d+){2,}(?![\d])", _dotted),
    _r("range", r"(" + SNUM + r")(?:\s?[~～–—]\s?|-|\s-\s)(" + NUM + r")(?![\d])", _range),
    _r("number", SNUM, _number),
    _r("symbol", r"[&@+=×÷°]", _symbol, digits=False),
)
_DIGIT_FREE_RULES = tuple(r for r in RULES if not r.digits)


def _pad(out: str, text: str, start: int, end: int) -> str:
    """Keep English words apart from neighbouring letters/digits ("5G" -> "five G")."""

    def alnum(ch: str) -> bool:
        return ch.isascii() and ch.isalnum()

    if out and start > 0 and alnum(out[0]) and alnum(text[start - 1]):
        out = " " + out
    if out and end < len(text) and alnum(out[-1]) and alnum(text[end]):
        out = out + " "
    return out


def apply_rule(rule: Rule, text: str, default_lang: str) -> str:
    def replace(m: re.Match) -> str:
        lang = rule.lang or span_lang(m.string, m.start(), m.end(), default_lang)
        out = rule.handler(m, lang)
        return m.group(0) if out is None else _pad(out, m.string, m.start(), m.end())

    return rule.pattern.sub(replace, text)


def expand_segment(text: str, default_lang: str) -> str:
    """Verbalise one tag-free segment; `default_lang` decides ties between scripts."""
    for rule in RULES if _DIGIT.search(text) else _DIGIT_FREE_RULES:  # no handler writes a digit
        text = apply_rule(rule, text, default_lang)
    return text
