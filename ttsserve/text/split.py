"""Split long input text into segments of about 15-30 s of speech (and the reference's own split).

Length is measured in CJK-equivalent characters ("units"): a CJK character or a digit weighs 1, any
other character (Latin letters, spaces, punctuation) weighs 0.4. Why: ChatTTS speaks about 4-5 CJK
characters per second and about 12-15 Latin characters (spaces included) per second, so 120 units is
~25-30 s of Chinese or 300 Latin characters (~20-25 s of English). The model's own cap is 2048 frames
(~43.7 s) per sequence, so a 30 s target leaves room for slow speakers and [speed_*] prompts. Digits
weigh 1 because they expand when spoken ("2024" -> "二零二四" / "twenty twenty four").

Boundaries, strongest first: sentence ends (。！？!?；; a `.` followed by whitespace, newlines), then
clause punctuation (，,、：:…—) when a sentence is too long, then word boundaries (spaces, between CJK
characters). Never inside a number (3.14, 1,000, 14:30), a Latin word or a [tag]. Whole sentences are
packed greedily up to `max_chars`; an over-long sentence is cut into clause chunks (packed among
themselves) that never share a segment with another sentence; finally a piece shorter than `min_chars`
is merged into a neighbour.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_CHARS = 120  # CJK-equivalent units, ~15-30 s of speech
MIN_CHARS = 12  # pieces shorter than this are merged into a neighbour
LATIN_WEIGHT = 0.4  # = 120 / 300: a Latin character is 0.4 of a CJK character in speaking time
# The fastest speaking rate above, in units per second (15 Latin characters = 6 units; 5 CJK characters = 5),
# so text_units(text) / MAX_UNITS_PER_SECOND is a lower bound on the speech's length at speed 1.
MAX_UNITS_PER_SECOND = 6.0

_CLOSERS = "”’\"'」』）)\\]】》"
_SENTENCE_END = re.compile(rf"(?:[。！？!?；;]+|\.+(?=[{_CLOSERS}]*(?:\s|$))|…+(?=\s*\n))[{_CLOSERS}]*|\n+")
_CLAUSE_END = re.compile(rf"(?:[，、：,:—…]+)[{_CLOSERS}]*")
_ATOM = re.compile(r"[\u4e00-\u9fff]|\[[\w_]+\]|[^\s\u4e00-\u9fff]+")
_CJK = re.compile(r"[\u4e00-\u9fff]")
# A "." after these words is not a sentence end.
_ABBREVIATIONS = frozenset({"Dr", "Mr", "Mrs", "Ms", "Prof", "St", "Jr", "Sr", "Mt", "vs", "No", "Fig", "approx",
                            "e.g", "i.e", "Inc", "Ltd", "Co", "Dept", "a.m", "p.m"})  # fmt: skip


@dataclass(frozen=True)
class TextSegment:
    """One segment: `text == source[start:end]`, with no leading or trailing whitespace."""

    text: str
    start: int
    end: int


def text_units(text: str) -> float:
    """Weighted length in CJK-equivalent characters (see module docstring)."""
    # CJK ideographs plus digits (str.isdigit: no ideograph is one), counted by C loops, not a Python one a character
    n_heavy = len(_CJK.findall(text)) + sum(map(str.isdigit, text))
    return n_heavy + LATIN_WEIGHT * (len(text) - n_heavy)


def min_speech_seconds(text: str) -> float:
    """A lower bound on how long `text` takes to speak at speed 1 (its units at the fastest rate)."""
    return text_units(text) / MAX_UNITS_PER_SECOND


def _is_sentence_end(text: str, m: re.Match) -> bool:
    if m.group(0).startswith("."):
        word = re.search(r"(?<![A-Za-z])((?:[A-Za-z]\.)*[A-Za-z]+)$", text[: m.start()])
        if word and (word.group(1) in _ABBREVIATIONS or re.fullmatch(r"[A-Z]", word.group(1))):
            return False  # "Dr. Smith", "J. K. Rowling"
    return True


def _is_clause_end(text: str, m: re.Match) -> bool:
    s = m.group(0)
    if s in (",", ":") and 0 < m.start() and m.end() < len(text):
        return not (text[m.start() - 1].isdigit() and text[m.end()].isdigit())  # 1,000 / 14:30
    return True


def _cut(text: str, start: int, end: int, pattern: re.Pattern, keep) -> list[tuple[int, int]]:
    """Split text[start:end] after each accepted match of `pattern`; spans are trimmed, never empty."""
    cuts = [m.end() for m in pattern.finditer(text, start, end) if keep(text, m)]
    spans, pos = [], start
    for c in [*cuts, end]:
        span = _trim(text, pos, c)
        if span:
            spans.append(span)
        pos = c
    return spans


def _trim(text: str, start: int, end: int) -> tuple[int, int] | None:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if start < end else None


def _hard_split(text: str, start: int, end: int, max_chars: float) -> list[tuple[int, int]]:
    """Last resort for an over-long clause: pack atoms (a CJK character, a [tag], a run of other
    non-space characters); an atom longer than max_chars on its own is cut by characters."""
    spans: list[tuple[int, int]] = []
    for m in _ATOM.finditer(text, start, end):
        a, b = m.start(), m.end()
        while text_units(text[a:b]) > max_chars:  # e.g. a 1000-character URL: nothing better exists
            k = a + 1
            while k < b and text_units(text[a : k + 1]) <= max_chars:
                k += 1
            spans.append((a, k))
            a = k
        spans.append((a, b))
    return _pack(text, spans, max_chars)


def _pack(text: str, spans: list[tuple[int, int]], max_chars: float) -> list[tuple[int, int]]:
    """Greedily join consecutive spans while the joined text stays within max_chars."""
    out: list[tuple[int, int]] = []
    for s, e in spans:
        if out and text_units(text[out[-1][0] : e]) <= max_chars:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _merge_tiny(text: str, spans: list[tuple[int, int]], min_chars: float) -> list[tuple[int, int]]:
    """Merge each span shorter than min_chars into the neighbour that gives the shorter result."""
    spans = list(spans)
    i = 0
    while len(spans) > 1 and i < len(spans):
        s, e = spans[i]
        if text_units(text[s:e]) >= min_chars:
            i += 1
            continue
        left = text_units(text[spans[i - 1][0] : e]) if i > 0 else float("inf")
        right = text_units(text[s : spans[i + 1][1]]) if i + 1 < len(spans) else float("inf")
        if left <= right:
            spans[i - 1 : i + 1] = [(spans[i - 1][0], e)]
            i -= 1  # the merged span may still be tiny
        else:
            spans[i : i + 2] = [(s, spans[i + 1][1])]
    return spans


def split_text(text: str, max_chars: float = MAX_CHARS, min_chars: float = MIN_CHARS) -> list[TextSegment]:
    """Split `text` into segments of at most ~max_chars units (see module docstring).

    Every non-whitespace character of `text` lies in exactly one segment, in order. A segment exceeds
    max_chars only when a piece shorter than min_chars could not be placed anywhere else.
    """
    if max_chars <= 0 or min_chars < 0 or min_chars > max_chars:
        raise ValueError(f"need 0 <= min_chars <= max_chars and max_chars > 0, got {min_chars}, {max_chars}")
    spans: list[tuple[int, int]] = []
    run: list[tuple[int, int]] = []  # consecutive whole sentences, packed together
    for s, e in _cut(text, 0, len(text), _SENTENCE_END, _is_sentence_end):
        if text_units(text[s:e]) <= max_chars:
            run.append((s, e))
            continue
        # An over-long sentence becomes segments of its own, cut at clauses (then words).
        spans += _pack(text, run, max_chars)
        run = []
        pieces: list[tuple[int, int]] = []
        for cs, ce in _cut(text, s, e, _CLAUSE_END, _is_clause_end):
            if text_units(text[cs:ce]) <= max_chars:
                pieces.append((cs, ce))
            else:
                pieces.extend(_hard_split(text, cs, ce, max_chars))
        spans += _pack(text, pieces, max_chars)
    spans = _merge_tiny(text, spans + _pack(text, run, max_chars), min_chars)
    return [TextSegment(text[s:e], s, e) for s, e in spans]


_REFERENCE_SPLIT = re.compile(r"(?<=。)|(?<=\.)(?=\s)")


def reference_split(text: str) -> list[str]:
    """The reference's split of one input string (MODEL.md §2.4): on "\\n" if there is one (pieces kept as
    they are, empty ones included [Q]); otherwise after every "。" and every "." followed by whitespace,
    dropping empty pieces. (Where the whitespace after "." goes does not change the tokens.)"""
    if "\n" in text:
        return text.split("\n")
    return [p for p in _REFERENCE_SPLIT.split(text) if p]
