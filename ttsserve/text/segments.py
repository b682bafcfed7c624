"""A synthesis request's text -> its segments: control-prompt checks, sentence splitting, normalization.

Text only, no torch and no tokenizer, so an API server process (engine/core/client.py) runs it before a
request reaches the engine core, and the core's step loop does not pay for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ttsserve.params import SynthesisRequest


@dataclass
class Segment:
    """One sentence-sized piece of a synthesis request (index = its place in the output)."""

    index: int
    text: str  # normalized text fed to the code stage (or to the refine stage first)
    dropped: list[str]  # characters normalization had to delete


_TAG_RE = re.compile(r"\[[\w_]+\]")


def _speakable(text: str) -> bool:
    """True when something besides tags, punctuation and spaces is left (letters, digits or CJK)."""
    return any(ch.isalnum() for ch in _TAG_RE.sub("", text))


def prepare_segments(req: SynthesisRequest) -> list[Segment]:
    """Check the control prompts, split and normalize; ValueError when nothing speakable is left. Text only
    (no tokenizer, no model): an API server runs it before the request reaches the engine core."""
    from ttsserve.text.normalize import normalize_text
    from ttsserve.text.prompt import validate_control_prompt
    from ttsserve.text.split import split_text

    validate_control_prompt(req.code_prompt, allowed=("speed",))
    if req.refine_text:
        validate_control_prompt(req.refine_prompt, allowed=("oral", "laugh", "break"))
    if req.raw_text:
        return [Segment(0, req.text, [])]
    pieces = [s.text for s in split_text(req.text)] if req.split else [req.text]
    out: list[Segment] = []
    for piece in pieces:
        norm = normalize_text(piece, expand_numbers=req.normalize)
        if _speakable(norm.text):
            out.append(Segment(len(out), norm.text.strip(), list(norm.dropped)))
    if not out:
        raise ValueError("text: nothing speakable is left after normalization")
    return out
