"""A synthesis request's text -> its segments: control-prompt checks, sentence splitting, normalization, and
(without a refine pass) the code-stage prompt's token ids.

No torch and no model, so an API server process (engine/core/client.py) runs it before a request reaches the
engine core, and the core's step loop does not pay for it.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ttsserve.params import InvalidRequestError, SynthesisRequest

if TYPE_CHECKING:
    from ttsserve.text.tokenizer import TextTokenizer


@dataclass
class Segment:
    """One sentence-sized piece of a synthesis request (index = its place in the output)."""

    index: int
    text: str  # normalized text fed to the code stage (or to the refine stage first)
    dropped: list[str]  # characters normalization had to delete
    # int32 [P]: the code-stage prompt's text ids (text/prompt.code_prompt_ids), when an API server tokenized
    # it; None: the engine tokenizes (always with refine_text, whose code prompt is the refined text)
    code_ids: np.ndarray | None = None


_TAG_RE = re.compile(r"\[[\w_]+\]")


def _speakable(text: str) -> bool:
    """True when something besides tags, punctuation and spaces is left (letters, digits or CJK)."""
    return any(ch.isalnum() for ch in _TAG_RE.sub("", text))


def _check_control_prompt(req: SynthesisRequest, field: str, allowed: tuple[str, ...]) -> None:
    from ttsserve.text.prompt import validate_control_prompt

    try:
        validate_control_prompt(getattr(req, field), allowed=allowed)
    except ValueError as e:
        raise InvalidRequestError(str(e), field) from None


def prepare_segments(req: SynthesisRequest) -> list[Segment]:
    """Check the control prompts, split and normalize; InvalidRequestError (param: the field) for a bad
    control prompt or when nothing speakable is left. Text only (no tokenizer, no model): the engine
    client's input processor runs it before the request reaches the engine core."""
    from ttsserve.text.normalize import normalize_text
    from ttsserve.text.split import split_text

    _check_control_prompt(req, "code_prompt", ("speed",))
    if req.refine_text:
        _check_control_prompt(req, "refine_prompt", ("oral", "laugh", "break"))
    if req.raw_text:
        return [Segment(0, req.text, [])]
    pieces = [s.text for s in split_text(req.text)] if req.split else [req.text]
    out: list[Segment] = []
    for piece in pieces:
        norm = normalize_text(piece, expand_numbers=req.normalize)
        if _speakable(norm.text):
            out.append(Segment(len(out), norm.text.strip(), list(norm.dropped)))
    if not out:
        raise InvalidRequestError("text: nothing speakable is left after normalization", "text")
    return out


def tokenize_segments(req: SynthesisRequest, segments: list[Segment], tokenizer: TextTokenizer) -> list[Segment]:
    """`segments` with their code-stage prompt ids (int32 [P] each) filled in, exactly as the engine's
    FrontEnd.code_inputs would compute them. With `req.refine_text` they are returned unchanged: the code
    prompt is built from the refined text, known only after the refine pass."""
    from ttsserve.text.prompt import code_prompt_ids

    if req.refine_text:
        return segments
    out = []
    for s in segments:
        ids = code_prompt_ids(tokenizer, s.text, req.code_prompt, req.voice)
        out.append(dataclasses.replace(s, code_ids=np.asarray(ids, dtype=np.int32)))
    return out


# Touches every lazily built piece of the text path: the normalizer's imports (cn2an and num2words, whose
# regexes compile on import), English and Chinese numbers, dates, units, money and the sentence splitter.
_WARM_UP_TEXTS = (
    "Warm-up: on 3/4/2025 at 10:30 it cost $3.50 and weighed 12 kg. Is that 25% more?",
    "预热：2024年3月5日，气温25.5度，价格是100元。好的！",
)


def warm_up_text_path(tokenizer: TextTokenizer | None = None) -> float:
    """Run prepare_segments (and, given a tokenizer, tokenize_segments) on fixed sample texts; return the
    seconds it took. A server calls it before it reports ready: the first call of a fresh process pays
    the normalizer's imports and regex compiles (0.33 s on a 2-core CPU), which would otherwise stall the
    first requests' event loop, every one queued behind the first."""
    t0 = time.perf_counter()
    for text in _WARM_UP_TEXTS:
        req = SynthesisRequest(text)
        segments = prepare_segments(req)
        if tokenizer is not None:
            tokenize_segments(req, segments, tokenizer)
    return time.perf_counter() - t0
