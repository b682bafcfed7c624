"""The benchmark corpus: ~60 realistic Chinese / English / mixed sentences of three lengths, kept in the repo
(ttsserve/data/bench_corpus.jsonl) so every run and every commit draws the same texts."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "bench_corpus.jsonl"
LANGS = ("en", "zh", "mixed")
LENGTHS = ("short", "medium", "long")


@dataclass(frozen=True)
class Sentence:
    id: str
    lang: str  # "en" | "zh" | "mixed"
    length: str  # "short" | "medium" | "long"
    text: str


def load_corpus(path: str | Path | None = None) -> list[Sentence]:
    """Every sentence of the JSONL corpus, in file order (ValueError naming a bad line)."""
    path = Path(path) if path is not None else CORPUS_PATH
    out: list[Sentence] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            s = Sentence(str(row["id"]), str(row["lang"]), str(row["length"]), str(row["text"]))
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{path}:{n}: bad corpus line ({e})") from None
        if s.lang not in LANGS or s.length not in LENGTHS or not s.text.strip():
            raise ValueError(f"{path}:{n}: lang must be {LANGS}, length {LENGTHS}, text non-empty")
        out.append(s)
    if not out:
        raise ValueError(f"{path}: the corpus is empty")
    return out


def select_texts(
    n: int,
    seed: int = 0,
    langs: tuple[str, ...] = LANGS,
    lengths: tuple[str, ...] = LENGTHS,
    corpus: list[Sentence] | None = None,
) -> list[Sentence]:
    """n sentences drawn without replacement from a seeded shuffle (cycling through reshuffles when n exceeds
    the filtered corpus). The same (n, seed, filters) always gives the same list."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pool = [s for s in (corpus or load_corpus()) if s.lang in langs and s.length in lengths]
    if not pool:
        raise ValueError(f"no corpus sentence matches langs={langs} lengths={lengths}")
    rng = random.Random(seed)
    out: list[Sentence] = []
    while len(out) < n:
        batch = pool[:]
        rng.shuffle(batch)
        out.extend(batch[: n - len(out)])
    return out
