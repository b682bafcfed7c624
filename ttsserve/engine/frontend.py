"""Text front end of the engine: SynthesisRequest -> segments -> prompt inputs for refine and code sequences."""

from __future__ import annotations

import numpy as np
import torch

from ttsserve.params import SynthesisRequest, Voice
from ttsserve.text.segments import Segment, prepare_segments

__all__ = ["FrontEnd", "Segment", "prepare_segments"]


class FrontEnd:
    """Normalization, splitting and prompt building, bound to one tokenizer."""

    def __init__(self, tokenizer, num_vq: int = 4) -> None:
        self.tokenizer = tokenizer
        self.num_vq = num_vq

    def segments(self, req: SynthesisRequest) -> list[Segment]:
        return prepare_segments(req)

    def refine_inputs(self, text: str, refine_prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        from ttsserve.text.prompt import build_refine_prompt

        ids = self.tokenizer.encode(build_refine_prompt(text, refine_prompt))
        return self._text_rows(ids), torch.ones(len(ids), dtype=torch.bool)

    def code_inputs(self, text: str, code_prompt: str, voice: Voice) -> tuple[torch.Tensor, torch.Tensor]:
        """ids int64 [P, num_vq] and text_mask bool [P] for `[Stts][spk]{txt_smp}{prompt}{text}[Ptts]{codes}`."""
        from ttsserve.text.prompt import build_code_prompt

        prompt = build_code_prompt(text, code_prompt, has_speaker=voice.spk_emb is not None, txt_smp=voice.txt_smp)
        ids = self.tokenizer.encode(prompt)
        rows, mask = self._text_rows(ids), torch.ones(len(ids), dtype=torch.bool)
        if voice.spk_smp is not None:
            codes = torch.as_tensor(np.asarray(voice.spk_smp), dtype=torch.int64).T  # [P_audio, num_vq]
            rows = torch.cat([rows, codes])
            mask = torch.cat([mask, torch.zeros(codes.shape[0], dtype=torch.bool)])
        return rows, mask

    def _text_rows(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64)[:, None].repeat(1, self.num_vq)

    def decode_refined(self, ids: list[int]) -> str:
        return self.tokenizer.decode_refined(ids)
