"""Text normalization: the reference rules (MODEL.md §2.3) and our verbalising front end on top of them.

`reference_normalize` reproduces the reference exactly (no registered language normalizer): language
detection, the zh half-width -> full-width map, the invalid-character map and deletion (digits and most
symbols are deleted!), optional homophone replacement. `normalize_text` first verbalises numbers, dates,
money, units, ... (expand.py) so that nothing meaningful is left for the deletion step.

English contractions: like the reference, the apostrophe is deleted and the letters are kept
("I'm" -> "Im", "don't" -> "dont"); the model only ever sees this form through the reference
pipeline, so we keep it rather than feeding it apostrophe tokens.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

from ttsserve.text.expand import expand_segment

# Step 1.3: zh half-width -> full-width (29 entries). `"` `'` map to the *left* curly quotes, `.` to `。`.
_HALF = "!\"#$%&'()*+,-./:;<=>?@\\^`{|}~"
_FULL = "！“＃＄％＆‘（）＊＋，－。／：；＜＝＞？＠＼＾｀｛｜｝～"
ZH_HALF_TO_FULL = str.maketrans(_HALF, _FULL)

# Step 2: applied (to the whole string) only when invalid characters are present.
INVALID_CHAR_MAP = str.maketrans(
    {**{c: "，" for c in "：；（）【】『』「」《》－"}, "！": "。", **{c: "," for c in ":;()><-"}, "!": "."}
)

TAG_RE = re.compile(r"\[[\w_]+\]")  # control tags such as [uv_break], [laugh_0]
_INVALID_RE = re.compile(r"[^\u4e00-\u9fffA-Za-z，。、,. ]")
_CJK_RE = re.compile(r"[\u4e00-\u9fff]")
_EN_WORD_RE = re.compile(r"\b[A-Za-z]+\b")

# Expansion-mode pre-cleaning: full-width digits/letters/percent to ASCII, other whitespace to a space.
_FULLWIDTH_ALNUM = str.maketrans(
    {**{chr(0xFF10 + i): str(i) for i in range(10)},
     **{chr(0xFF21 + i): chr(0x41 + i) for i in range(26)},
     **{chr(0xFF41 + i): chr(0x61 + i) for i in range(26)}, "％": "%"}
)  # fmt: skip
# Other scripts' decimal digits (Arabic-Indic ٣, Devanagari ३, ...: what \d matches beyond 0-9) read as their ASCII
# digit: the number rules match them, and the Chinese readings (cn2an) reject them.
_OTHER_DIGIT_RE = re.compile(r"(?![0-9])\d")
_WHITESPACE_RE = re.compile(r"[\t\n\r\f\v\u3000\u00a0]")
# A line break after a word (no punctuation) ends a sentence: it becomes a full stop, not a mere space.
_BARE_NEWLINE_RE = re.compile(r"(?<=[^\s,.!?;:，。！？；：、\]])[ \t\u3000]*(?:\r?\n)+")
# Expansion-mode punctuation the reference would delete but that marks a pause: question marks end a
# sentence, dashes and ellipses are clause breaks.
_PAUSES = {
    "en": str.maketrans({"?": ".", "？": ".", "…": ",", "—": ",", "–": ","}),
    "zh": str.maketrans({"?": "。", "？": "。", "…": "，", "—": "，", "–": "，"}),
}


def detect_language(text: str) -> str:
    """ "zh" if there are more CJK characters than ASCII words, else "en" (MODEL.md §2.3 step 1.1)."""
    return "zh" if len(_CJK_RE.findall(text)) > len(_EN_WORD_RE.findall(text)) else "en"


def split_tags(text: str) -> list[tuple[str, bool]]:
    """Split into (piece, is_tag) pieces in order; tags match `\\[[\\w_]+\\]`."""
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for m in TAG_RE.finditer(text):
        if m.start() > pos:
            pieces.append((text[pos : m.start()], False))
        pieces.append((m.group(0), True))
        pos = m.end()
    if pos < len(text):
        pieces.append((text[pos:], False))
    return pieces


def invalid_chars(text: str) -> list[str]:
    """Characters the reference would delete (outside tags), in order of appearance, with repeats."""
    return _INVALID_RE.findall(TAG_RE.sub("", text))


@dataclass(frozen=True)
class NormalizedText:
    """text: what goes into the prompt; lang: "zh"/"en" as used by the rules; dropped: distinct
    characters that still had to be deleted, in order of first appearance."""

    text: str
    lang: str
    dropped: list[str] = field(default_factory=list)


def _reference(text: str, lang: str | None, homophones: dict[str, str] | None) -> NormalizedText:
    lang = lang or detect_language(text)
    if lang == "zh":
        text = text.translate(ZH_HALF_TO_FULL)
    found = invalid_chars(text)
    if found:
        text = text.translate(INVALID_CHAR_MAP)
    if homophones:
        text = text.translate(str.maketrans(homophones))
    dropped: list[str] = []
    if found:
        dropped = list(dict.fromkeys(invalid_chars(text)))
        text = "".join(p if is_tag else _INVALID_RE.sub("", p) for p, is_tag in split_tags(text))
    return NormalizedText(text=text, lang=lang, dropped=dropped)


def reference_normalize(text: str, lang: str | None = None, homophones: dict[str, str] | None = None) -> str:
    """The reference normalizer with no registered language normalizer (MODEL.md §2.3), bit-exact.

    lang: "zh"/"en" or None to detect. homophones: a 1:1 character map (the reference ships one we do
    not; see MODEL.md §2.3 step 3); None skips the step, which is exact for text without any of its keys.
    """
    return _reference(text, lang, homophones).text


def normalize_text(
    text: str, lang: str | None = None, expand_numbers: bool = True, homophones: dict[str, str] | None = None
) -> NormalizedText:
    """Normalize for the model: verbalise numbers/dates/times/money/units/phones/abbreviations (Chinese
    readings in Chinese surroundings, English in English ones), then apply the reference rules.

    The document language is `lang` or detected on the input as the reference does; it decides the
    reference rules and breaks ties between scripts. `expand_numbers=False` gives exactly
    `reference_normalize` (plus the `dropped` report).
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    if lang not in (None, "zh", "en"):
        raise ValueError(f"lang must be 'zh', 'en' or None, got {lang!r}")
    if not expand_numbers:
        return _reference(text, lang, homophones)
    text = _OTHER_DIGIT_RE.sub(lambda m: str(unicodedata.decimal(m.group())), text.translate(_FULLWIDTH_ALNUM))
    lang = lang or detect_language(text)
    text = _WHITESPACE_RE.sub(" ", _BARE_NEWLINE_RE.sub(". " if lang == "en" else "。", text))
    expanded = "".join(
        p if is_tag else expand_segment(p, lang).translate(_PAUSES[lang]) for p, is_tag in split_tags(text)
    )
    return _reference(expanded, lang, homophones)
