"""Voice mixes: "alloy+nova" or "alloy(0.7)+nova(0.3)" -> the named voices and their weights.

Voice names cannot contain '+', '(' or ')' (VOICE_NAME_PATTERN), so a spec with any of them is a mix and a
plain name never is.
"""

from __future__ import annotations

import math
import re

import numpy as np

# One term: a name, then an optional weight in parentheses (a plain decimal or exponent number).
_TERM_RE = re.compile(r"\s*([^+()]+?)\s*(?:\(\s*([^()]*?)\s*\))?\s*")
MIX_CHARS = frozenset("+()")


class VoiceMixError(ValueError):
    """A malformed mix, a weight that is not a positive number, or a voice that cannot be mixed."""


def is_mix(spec: str) -> bool:
    return any(ch in MIX_CHARS for ch in spec)


def parse_voice_mix(spec: str) -> list[tuple[str, float]]:
    """'a(0.7)+b(0.3)' -> [("a", 0.7), ("b", 0.3)] with the weights normalized to sum to 1; a term without a
    weight weighs 1. VoiceMixError for bad syntax or a weight that is not a finite number > 0."""
    terms: list[tuple[str, float]] = []
    for part in spec.split("+"):
        m = _TERM_RE.fullmatch(part)
        if m is None or not m.group(1):
            raise VoiceMixError(f"bad voice mix {spec!r}: write name+name or name(weight)+name(weight)")
        name, raw = m.group(1), m.group(2)
        if raw is None:
            weight = 1.0
        else:
            try:
                weight = float(raw)
            except ValueError:
                raise VoiceMixError(f"bad weight {raw!r} for voice {name!r} in {spec!r}") from None
            if not math.isfinite(weight) or weight <= 0:
                raise VoiceMixError(f"weight of voice {name!r} must be a number > 0, got {raw!r}")
        terms.append((name, weight))
    total = sum(w for _, w in terms)
    return [(name, w / total) for name, w in terms]


def mix_speakers(vectors: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """The weighted mean of L2-normalized speaker vectors, as float16 [hidden].

    Why this rule: the model uses only the direction of a speaker vector (it L2-normalizes it before it replaces
    the [spk_emb] position, model/embed.py), so each voice is normalized first and then contributes exactly its
    weight, whatever its stored norm; the mean of unit vectors points between them, the linear blend that
    Kokoro's voice-pack mixing uses too. Weights sum to 1, so fp16 cannot overflow. Computed in fp32.
    """
    acc = np.zeros(np.asarray(vectors[0]).shape, np.float32)
    for vec, w in zip(vectors, weights, strict=True):
        v = np.asarray(vec, np.float32)
        acc += w * v / max(float(np.linalg.norm(v)), 1e-12)
    return acc.astype(np.float16)
