"""Prompt strings of both stages and the per-position model inputs of one sequence (MODEL.md §2.5, §2.6)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ttsserve.params import Voice
    from ttsserve.text.tokenizer import TextTokenizer

NUM_VQ = 4
DEFAULT_CODE_PROMPT = "[speed_5]"

# Sentence-level control tags and their valid levels (MODEL.md §2.2): refine prompt [oral_N][laugh_N][break_N],
# code prompt [speed_N].
CONTROL_LEVELS: dict[str, int] = {"speed": 10, "oral": 10, "laugh": 3, "break": 8}

_TAG = re.compile(r"\[([A-Za-z]+)_(\d+)\]")
_CODE_STRUCTURE_TAGS = ("[Stts]", "[spk_emb]", "[empty_spk]")


def build_refine_prompt(text: str, prompt: str = "") -> str:
    """Refine-stage prompt: `[Sbreak]{text}[Pbreak]{prompt}` (EOS of this stage is [Ebreak])."""
    return "[Sbreak]" + text + "[Pbreak]" + prompt


def build_code_prompt(
    text: str, prompt: str = DEFAULT_CODE_PROMPT, has_speaker: bool = True, txt_smp: str | None = None
) -> str:
    """Code-stage prompt `[Stts][spk_emb|empty_spk]{txt_smp}{prompt}{text}[Ptts]` (MODEL.md §2.5).

    As in the reference, [Stts]/[spk_emb]/[empty_spk] already in `text` are removed and the text is
    stripped before the prompt is prepended. `txt_smp` is the transcript of an audio prompt.
    """
    for tag in _CODE_STRUCTURE_TAGS:
        text = text.replace(tag, "")
    text = text.strip()
    if prompt:
        text = prompt + text
    speaker = "[spk_emb]" if has_speaker else "[empty_spk]"
    return "[Stts]" + speaker + (txt_smp or "") + text + "[Ptts]"


def code_prompt_ids(tokenizer: TextTokenizer, text: str, code_prompt: str, voice: Voice) -> list[int]:
    """Text ids of one segment's code-stage prompt: build_code_prompt for `voice` (its spk_emb decides
    [spk_emb] or [empty_spk], its txt_smp goes first), then `tokenizer.encode`. The one definition the engine
    (engine/frontend.py) and the API servers (text/segments.py) share, so ids an API server sends are the
    ones the engine would build. `voice.spk_smp` is not in them: its codes follow as audio positions."""
    prompt = build_code_prompt(text, code_prompt, has_speaker=voice.spk_emb is not None, txt_smp=voice.txt_smp)
    return tokenizer.encode(prompt)


def validate_control_prompt(prompt: str, allowed: Iterable[str] | None = None) -> str:
    """Check a control prompt such as "[oral_2][laugh_0][break_6]" or "[speed_5]"; return it unchanged.

    It may hold only `[kind_N]` tags (whitespace between them is ignored by the tokenizer), with kind in
    `allowed` (default: speed, oral, laugh, break) and N in range (speed/oral 0-9, laugh 0-2, break 0-7).
    ValueError names the offending part.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"control prompt must be a string, got {type(prompt).__name__}")
    kinds = set(CONTROL_LEVELS if allowed is None else allowed)
    pos = 0
    for m in _TAG.finditer(prompt):
        _check_gap(prompt[pos : m.start()], prompt)
        kind, level = m.group(1), int(m.group(2))
        if kind not in kinds or kind not in CONTROL_LEVELS:
            raise ValueError(f"control prompt {prompt!r}: tag {m.group(0)} is not allowed here "
                             f"(allowed: {', '.join(sorted(kinds))})")  # fmt: skip
        if level >= CONTROL_LEVELS[kind] or m.group(2) != str(level):
            raise ValueError(f"control prompt {prompt!r}: {m.group(0)} is out of range "
                             f"[{kind}_0]..[{kind}_{CONTROL_LEVELS[kind] - 1}]")  # fmt: skip
        pos = m.end()
    _check_gap(prompt[pos:], prompt)
    return prompt


def _check_gap(gap: str, prompt: str) -> None:
    if gap.strip():
        raise ValueError(f"control prompt {prompt!r}: unexpected text {gap.strip()!r} (only [kind_N] tags)")


@dataclass(frozen=True)
class PromptInputs:
    """Model inputs of one sequence, one row per position (= one KV slot).

    ids: [T][num_vq]: a text position repeats its text id in every codebook column; an audio-prompt
        position holds its num_vq codes.
    text_mask: [T]: True on text positions (embedded with the text table), False on audio-prompt
        positions (embedded as the sum of the codebook tables).
    """

    ids: list[list[int]]
    text_mask: list[bool]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_text_tokens(self) -> int:
        return sum(self.text_mask)


def build_prompt_inputs(
    token_ids: list[int], audio_prompt: np.ndarray | None = None, num_vq: int = NUM_VQ
) -> PromptInputs:
    """Prompt token ids (+ optional audio prompt codes int [num_vq, P], appended after the text, as the
    reference does for `spk_smp`) -> PromptInputs with T = len(token_ids) + P rows."""
    if not token_ids:
        raise ValueError("prompt has no tokens")
    ids = [[int(t)] * num_vq for t in token_ids]
    mask = [True] * len(ids)
    if audio_prompt is not None:
        codes = np.asarray(audio_prompt)
        if codes.ndim != 2 or codes.shape[0] != num_vq:
            raise ValueError(f"audio prompt must be [num_vq={num_vq}, P], got shape {codes.shape}")
        ids.extend(codes.T.astype(int).tolist())
        mask.extend([False] * codes.shape[1])
    return PromptInputs(ids=ids, text_mask=mask)


def left_pad_batch(seqs: list[list[int]], pad_id: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """The reference's padded batch layout (MODEL.md §2.6): left-pad with `pad_id` to the longest sequence.

    Returns (ids [B][L], attention_mask [B][L]). The engine itself runs unpadded; this exists for
    baselines and parity checks.
    """
    width = max((len(s) for s in seqs), default=0)
    ids = [[pad_id] * (width - len(s)) + list(s) for s in seqs]
    mask = [[0] * (width - len(s)) + [1] * len(s) for s in seqs]
    return ids, mask
