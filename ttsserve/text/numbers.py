"""Spoken forms of numbers, dates, times and money in English and Chinese.

Number spelling itself comes from `num2words` (English) and `cn2an` (Chinese); this module only
combines them. Every function returns text made of letters/CJK characters and spaces only (no digits,
hyphens or apostrophes), so the reference normalizer (MODEL.md §2.3) keeps all of it.
"""

from __future__ import annotations

import re

import cn2an
from num2words import num2words

EN_DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ZH_DIGITS = "零一二三四五六七八九"
ZH_PHONE_DIGITS = "零幺二三四五六七八九"  # 1 is read 幺 in phone numbers

EN_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
             "October", "November", "December")  # fmt: skip

_ZH_LIANG = re.compile(r"(^|[万亿零])二(?=[百千万亿])")


def _clean_en(words: str) -> str:
    # num2words writes "twenty-four" and "one million, two hundred": hyphens would become pauses
    # (the reference maps "-" to ",") and commas inside a number are pauses too.
    return re.sub(r"\s+", " ", words.replace("-", " ").replace(",", " ")).strip()


def _digits_only(s: str) -> str:
    return s.replace(",", "").replace("_", "")


# ---- English -------------------------------------------------------------------------------------


def en_digits(s: str) -> str:
    """Read each digit: "0755" -> "zero seven five five"."""
    return " ".join(EN_DIGITS[int(c)] for c in s if c.isdigit())


def en_cardinal(s: str) -> str:
    """Integer string (may have thousands commas, a leading minus) -> words."""
    s = _digits_only(s)
    neg = s.startswith("-")
    n = int(s.lstrip("+-"))
    words = _clean_en(num2words(n))
    return f"minus {words}" if neg and n else words


def _decimal(s: str, cardinal, digits, point: str, minus: str) -> str:
    """A decimal string read as cardinal(whole part) + point + digits(fraction); integers as cardinal. The
    sign is read here, not by cardinal: "-0.5" has a whole part of "0", whose sign a cardinal drops."""
    s = _digits_only(s)
    if "." not in s:
        return cardinal(s)
    body = s.lstrip("+-")
    whole, frac = body.split(".", 1)
    words = cardinal(whole or "0") + (f"{point}{digits(frac)}" if frac else "")
    return minus + words if s.startswith("-") and body.strip("0.") else words


def en_decimal(s: str) -> str:
    """ "3.14" -> "three point one four"; integers go to en_cardinal. Trailing zeros are read."""
    return _decimal(s, en_cardinal, en_digits, " point ", "minus ")


def en_ordinal(n: int) -> str:
    return _clean_en(num2words(n, to="ordinal"))


def en_year(n: int) -> str:
    """1990 -> "nineteen ninety", 2024 -> "twenty twenty four", 2005 -> "two thousand and five"."""
    return _clean_en(num2words(n, to="year"))


def en_number(s: str) -> str:
    """A bare number in running English: 4-digit integers 1100..2099 read as years, else cardinal/decimal."""
    plain = _digits_only(s)
    if re.fullmatch(r"\d{4}", plain) and 1100 <= int(plain) <= 2099 and "," not in s:
        return en_year(int(plain))
    return en_decimal(s)


def en_fraction(num: int, den: int) -> str:
    """3/4 -> "three quarters", 1/2 -> "one half", 2/3 -> "two thirds"."""
    head = en_cardinal(str(num))
    if den == 2:
        return f"{head} {'half' if num == 1 else 'halves'}"
    if den == 4:
        return f"{head} {'quarter' if num == 1 else 'quarters'}"
    return f"{head} {en_ordinal(den)}{'' if num == 1 else 's'}"


def en_time(hour: int, minute: int, second: int | None = None, suffix: str = "") -> str:
    """14:30 -> "fourteen thirty", 2:05 -> "two oh five", 3:00 -> "three o clock"; suffix "a m"/"p m"."""
    h = en_cardinal(str(hour))
    if minute == 0:
        words = h if suffix else f"{h} o clock"
    elif minute < 10:
        words = f"{h} oh {EN_DIGITS[minute]}"
    else:
        words = f"{h} {en_cardinal(str(minute))}"
    if second:
        words += f" and {en_cardinal(str(second))} second{'s' if second != 1 else ''}"
    return f"{words} {suffix}".strip()


def en_date(year: int | None, month: int, day: int | None) -> str:
    """(2024, 5, 1) -> "May first, twenty twenty four"."""
    words = EN_MONTHS[month - 1]
    if day is not None:
        words += " " + en_ordinal(day)
    if year is not None:
        words += (", " if day is not None else " ") + en_year(year)
    return words


def en_money(amount: str, unit: str, unit_plural: str, cents_unit: str | None) -> str:
    """("12.50", "dollar", "dollars", "cents") -> "twelve dollars and fifty cents"."""
    amount = _digits_only(amount)
    whole, _, frac = amount.partition(".")
    whole_n = int(whole or "0")
    if cents_unit is not None and len(frac) == 2:
        cents = int(frac)
        head = f"{en_cardinal(str(whole_n))} {unit if whole_n == 1 else unit_plural}"
        if cents == 0:
            return head
        tail = f"{en_cardinal(str(cents))} {cents_unit if cents != 1 else cents_unit.rstrip('s')}"
        return tail if whole_n == 0 else f"{head} and {tail}"
    value = en_decimal(amount)
    return f"{value} {unit if amount == '1' else unit_plural}"


# ---- Chinese -------------------------------------------------------------------------------------


def zh_digits(s: str, phone: bool = False) -> str:
    """Read each digit: "2024" -> "二零二四"; phone=True reads 1 as 幺."""
    table = ZH_PHONE_DIGITS if phone else ZH_DIGITS
    return "".join(table[int(c)] for c in s if c.isdigit())


def zh_cardinal(s: str) -> str:
    """Integer string -> Chinese: "2024" -> "两千零二十四", "-5" -> "负五". Over 16 digits: digit by digit."""
    s = _digits_only(s)
    neg = s.startswith("-")
    body = s.lstrip("+-").lstrip("0") or "0"
    if len(body) > 16:
        words = zh_digits(body)
    else:
        words = _ZH_LIANG.sub(r"\1两", cn2an.an2cn(body))
    return "负" + words if neg and body != "0" else words


def zh_decimal(s: str) -> str:
    """ "3.14" -> "三点一四" (trailing zeros read); integers go to zh_cardinal."""
    return _decimal(s, zh_cardinal, zh_digits, "点", "负")


def zh_fraction(num: int, den: int) -> str:
    """3/4 -> "四分之三"."""
    return f"{zh_cardinal(str(den))}分之{zh_cardinal(str(num))}"


def zh_percent(s: str) -> str:
    """ "50" -> "百分之五十", "-3.5" -> "负百分之三点五"."""
    neg = s.startswith("-")
    words = zh_decimal(s.lstrip("+-"))
    return ("负" if neg else "") + "百分之" + words


def zh_hour(hour: int) -> str:
    """Clock hour: 2 is 两 (两点), otherwise the cardinal."""
    return "两" if hour == 2 else zh_cardinal(str(hour))


def zh_time(hour: int, minute: int, second: int | None = None, suffix: str = "") -> str:
    """14:30 -> "十四点三十分", 9:05 -> "九点零五分", 12:00 -> "十二点"; suffix "上午"/"下午" first."""
    words = suffix + zh_hour(hour) + "点"
    if minute:
        words += ("零" if minute < 10 else "") + zh_cardinal(str(minute)) + "分"
    if second:
        if not minute:
            words += "零"
        words += zh_cardinal(str(second)) + "秒"
    return words


def zh_date(year: str | None, month: int | None, day: int | None, day_char: str = "日") -> str:
    """("2024", 5, 1) -> "二零二四年五月一日" (years digit by digit)."""
    words = ""
    if year is not None:
        words += zh_digits(year) + "年"
    if month is not None:
        words += zh_cardinal(str(month)) + "月"
    if day is not None:
        words += zh_cardinal(str(day)) + day_char
    return words
