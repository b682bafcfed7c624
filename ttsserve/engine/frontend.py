"""Text front end of the engine: SynthesisRequest -> segments -> prompt inputs for refine and code sequences."""

from __future__ import annotations

import numpy as np
import torch

from ttsserve.params import SynthesisRequest, Voice
from ttsserve.text.segments import Segment, prepare_segments, warm_up_text_path

__all__ = ["FrontEnd", "Segment", "check_room", "prepare_segments", "prompt_items"]


def check_room(seg: int, positions: int, max_model_len: int) -> int:
    """Positions left for generation after segment `seg`'s prompt of `positions`; ValueError when none are."""
    room = max_model_len - positions
    if room < 1:
        raise ValueError(
            f"segment {seg}: the prompt has {positions} positions, more than the model's "
            f"{max_model_len}; shorten the text or enable splitting"
        )
    return room


def prompt_items(ids: np.ndarray, mask: np.ndarray) -> list:
    """The scheduler's items of a prompt (ids [P, num_vq], text_mask [P]): a text position's id (an int), an
    audio-prompt position's codes (a tuple); by columns, a Python step per audio position only."""
    items = ids[:, 0].tolist()
    if not mask.all():
        audio = np.flatnonzero(~mask)
        for i, codes in zip(audio.tolist(), map(tuple, ids[audio].tolist())):
            items[i] = codes
    return items


class FrontEnd:
    """Normalization, splitting and prompt building, bound to one tokenizer."""

    def __init__(self, tokenizer, num_vq: int = 4) -> None:
        self.tokenizer = tokenizer
        self.num_vq = num_vq
        warm_up_text_path(tokenizer)  # the first request must not pay the normalizer's imports

    def segments(self, req: SynthesisRequest) -> list[Segment]:
        return prepare_segments(req)

    def check_code_ids(self, req: SynthesisRequest, segments: list[Segment], max_model_len: int) -> None:
        """Prepared prompt ids come from another process: ValueError (naming the segment) unless each is a
        non-empty 1-D integer array of text-vocabulary ids whose prompt fits max_model_len, and none come
        with refine_text. Segments without code_ids pass."""
        vocab = self.tokenizer.vocab_size
        audio = 0 if req.voice.spk_smp is None else np.asarray(req.voice.spk_smp).shape[-1]
        for seg in segments:
            ids = seg.code_ids
            if ids is None:
                continue
            if req.refine_text:
                raise ValueError(f"segment {seg.index}: code_ids with refine_text (the refined text is the prompt)")
            if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.size == 0:
                raise ValueError(f"segment {seg.index}: code_ids must be a non-empty 1-D integer array")
            if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                raise ValueError(f"segment {seg.index}: code_ids hold ids outside the text vocabulary [0, {vocab})")
            check_room(seg.index, ids.size + audio, max_model_len)

    def refine_inputs(self, text: str, refine_prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        from ttsserve.text.prompt import build_refine_prompt

        ids = self.tokenizer.encode(build_refine_prompt(text, refine_prompt))
        return self._rows(np.asarray(ids, dtype=np.int64), None)

    def code_inputs(
        self, text: str, code_prompt: str, voice: Voice, code_ids: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids int64 [P, num_vq] and text_mask bool [P] for `[Stts][spk]{txt_smp}{prompt}{text}[Ptts]{codes}`.

        code_ids: int [P_text], the prompt's text ids already made by text/prompt.code_prompt_ids (an API
        server did it; the caller checked them); None: tokenized here, by the same function.
        """
        if code_ids is None:
            from ttsserve.text.prompt import code_prompt_ids

            code_ids = np.asarray(code_prompt_ids(self.tokenizer, text, code_prompt, voice), dtype=np.int64)
        return self._rows(code_ids, voice.spk_smp)

    def _rows(self, text_ids: np.ndarray, spk_smp) -> tuple[torch.Tensor, torch.Tensor]:
        """Text ids [P_text] (+ audio codes [num_vq, P_audio]) -> ids int64 [P, num_vq], text_mask bool [P]:
        a text position repeats its id in every column; numpy throughout, one tensor view at the end."""
        n = len(text_ids)
        codes = None if spk_smp is None else np.asarray(spk_smp)
        total = n + (0 if codes is None else codes.shape[1])
        rows = np.empty((total, self.num_vq), dtype=np.int64)
        rows[:n] = np.asarray(text_ids)[:, None]
        mask = np.zeros(total, dtype=bool)
        mask[:n] = True
        if codes is not None:
            rows[n:] = codes.T
        return torch.from_numpy(rows), torch.from_numpy(mask)

    def decode_refined(self, ids: list[int]) -> str:
        return self.tokenizer.decode_refined(ids)
