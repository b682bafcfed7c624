"""InputProcessor: what every EngineClient does to a request on the caller's side, before it reaches the
EngineCore: text checks, split, normalize and (without a refine pass) tokenize the code prompts, then assign
the engine's request id. Both clients run it on their event loop, so in-process and multiprocess serving
refuse the same inputs with the same errors, and the step loop never pays for text work.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

from ttsserve.params import SynthesisRequest
from ttsserve.text.segments import (
    Segment,
    prepare_segments,
    tokenize_segments,
    warm_up_text_path,
)

if TYPE_CHECKING:
    from ttsserve.text.tokenizer import TextTokenizer


class InputProcessor:
    """client_index: the client's place among the engine's clients (an API server's index; 0 in-process).
    tokenizer: the engine's (None: the engine core tokenizes)."""

    def __init__(self, tokenizer: TextTokenizer | None, client_index: int = 0) -> None:
        self.tokenizer = tokenizer
        self.client_index = client_index
        self._ids = itertools.count()

    def warm_up(self) -> float:
        """Run the text path once (seconds taken): a fresh process's first call pays the normalizer's
        imports and regex compiles, which would stall the first requests."""
        return warm_up_text_path(self.tokenizer)

    def process(self, req: SynthesisRequest) -> tuple[SynthesisRequest, list[Segment]]:
        """-> (req with the engine's request id, its segments). InvalidRequestError (param: the field)
        for input the text path refuses; nothing is queued then."""
        segments = self.segments(req)
        return dataclasses.replace(req, request_id=self.engine_request_id(req.request_id)), segments

    def segments(self, req: SynthesisRequest) -> list[Segment]:
        segments = prepare_segments(req)
        if self.tokenizer is not None:
            segments = tokenize_segments(req, segments, self.tokenizer)
        return segments

    def engine_request_id(self, request_id: str | None) -> str:
        """The engine's key for a request: namespaced by client, since two API servers may well be handed
        the same X-Request-ID; a fresh one when the caller gave none."""
        if request_id:
            return f"{request_id}@api{self.client_index}"
        return f"api{self.client_index}-{next(self._ids)}"
