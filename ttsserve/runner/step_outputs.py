"""A launched step's sampled tokens, back on the host, into the RunnerOutput the scheduler and the audio stage
read (pure numpy; the hidden states stay on the device as they are; no sync)."""

from __future__ import annotations

import struct

import numpy as np

from ttsserve.runner.step_types import RunnerOutput, StepGroup


def runner_output(groups: list[StepGroup], host: np.ndarray, audio_eos_id: int, text_eos_id: int) -> RunnerOutput:
    """host: every group's tokens back to back (flattened, in group order)."""
    out = RunnerOutput()
    offset = 0
    for g in groups:
        n, k, width = g.tokens.shape
        rows = host[offset : offset + n * k * width].reshape(n, k, width)
        offset += n * k * width
        ids = g.req_ids
        if g.mode == "text":
            toks = rows[:, 0, 0].tolist()
            out.sampled.update(zip(ids, toks))
            out.stopped.update(zip(ids, (rows[:, 0, 0] == text_eos_id).tolist()))
            continue
        eos = _any_codebook(rows == audio_eos_id)  # [n, k]
        # one tuple per frame, unpacked from the buffer in C, and one tuple of frames per row by a C-level map: no
        # Python work per row (runner_output at 512 rows x 8 frames: 658 against 792 us zipping tolist's columns)
        frame_tuples = struct.iter_unpack(f"={width}q", rows.astype(np.int64, copy=False))
        if k == 1:
            out.sampled.update(zip(ids, frame_tuples))
            out.stopped.update(zip(ids, eos[:, 0].tolist()))
        else:  # a burst's frames end before its first EOS
            num_frames = np.where(eos.any(axis=1), eos.argmax(axis=1), k)
            bursts = list(zip(*[frame_tuples] * k))  # [n] tuples of k frames
            for i in np.flatnonzero(num_frames < k).tolist():  # rows cut by an EOS
                bursts[i] = bursts[i][: num_frames[i]]
            out.sampled.update(zip(ids, bursts))
            out.stopped.update(zip(ids, (num_frames < k).tolist()))
        out.frames.append((ids, g.hidden))  # every sampled frame; the scheduler's updates say which are real
    return out


def _any_codebook(eq: np.ndarray) -> np.ndarray:
    """bool [n, k, width] -> [n, k]: any along width. A frame's width flags read as one unsigned int where they fit
    one (ChatTTS's 4 codebooks): 4 against 58 us at 512 rows x 8 frames, where any() reduces a 4-wide axis."""
    n, k, width = eq.shape
    if width in (1, 2, 4, 8):
        return eq.view(f"u{width}").reshape(n, k) != 0
    return eq.any(axis=2)
