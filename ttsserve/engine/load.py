"""A synthesis' work in frames: what data-parallel routing weighs (engine/core/dp_client.py).

TTS requests differ a hundredfold in length, so a core's load is not its request count but the frames it
still has to produce: queued requests' estimated frames plus what running ones have left. The estimate
comes from the text before any model work, the same function on both sides of the wire: the engine core
reports the sum (`outstanding_frames` in its stats), the API server adds the requests it sent since.
"""

from __future__ import annotations

import re

from ttsserve.constants import FRAMES_PER_SECOND, SAMPLES_PER_FRAME
from ttsserve.params import SynthesisRequest

# Speaking rates of ChatTTS-like speech: about 4.5 CJK characters and 14 other characters a second.
_FRAMES_PER_CJK_CHAR = FRAMES_PER_SECOND / 4.5
_FRAMES_PER_OTHER_CHAR = FRAMES_PER_SECOND / 14.0
_SENTENCE_ENDS = ".!?;。！？；\n"
# Counted by C-level scans (str.count, regex), not a Python step per character: the engine core estimates every
# request it admits. Each character counts once, as the first of: sentence end, CJK, space, other. "。" is a
# sentence end in the CJK range, U+3000 a space in it, "\n" a sentence end and a space; \s is str.isspace.
_CJK = re.compile("[\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_SPACE = re.compile(r"\s")


def estimate_frames(req: SynthesisRequest) -> int:
    """The frames `req` will take: the text's speaking time, at least min_new_tokens (one segment's floor),
    at most max_new_tokens per sentence (each segment stops at its cap). >= 1."""
    text = req.text
    ends = sum(map(text.count, _SENTENCE_ENDS))
    cjk = _CJK.subn("", text)[1] - text.count("。")
    spaces = _SPACE.subn("", text)[1] - text.count("\n") - text.count("\u3000")
    other = len(text) - ends - cjk - spaces
    text_frames = cjk * _FRAMES_PER_CJK_CHAR + other * _FRAMES_PER_OTHER_CHAR
    p = req.code_params
    return max(1, p.min_new_tokens, min(int(text_frames), p.max_new_tokens * (1 + ends)))


class OutstandingWork:
    """Frames each admitted synthesis has yet to deliver (estimate minus the audio it sent), and their sum.
    An output that finishes a synthesis, or an abort, takes it out. O(1) per update."""

    def __init__(self) -> None:
        self._left: dict[str, int] = {}
        self.total = 0

    def add(self, request_id: str, frames: int) -> None:
        self.remove(request_id)
        self._left[request_id] = frames
        self.total += frames

    def delivered(self, request_id: str, num_samples: int, finished: bool) -> None:
        left = self._left.get(request_id)
        if left is None:
            return
        if finished:
            self.remove(request_id)
            return
        # audio beyond the estimate: the request is longer than guessed; it keeps a floor of one frame
        done = min(num_samples // SAMPLES_PER_FRAME, left - 1)
        self._left[request_id] = left - done
        self.total -= done

    def remove(self, request_id: str) -> None:
        self.total -= self._left.pop(request_id, 0)

    def __len__(self) -> int:
        return len(self._left)
