"""A launched step's sampled tokens, back on the host, into the RunnerOutput the scheduler and the audio stage
read (pure numpy plus device indexing of the hidden states; no sync)."""

from __future__ import annotations

import numpy as np
import torch

from ttsserve.h2d import async_h2d
from ttsserve.runner.step_types import RunnerOutput, StepGroup


def runner_output(groups: list[StepGroup], host: np.ndarray, audio_eos_id: int, text_eos_id: int) -> RunnerOutput:
    """host: every group's tokens back to back (flattened, in group order)."""
    out = RunnerOutput()
    frames: dict[tuple[int, int], list[tuple[list[str], torch.Tensor]]] = {}  # (j, m) -> batches
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
        eos = (rows == audio_eos_id).any(axis=2)  # [n, k]
        # one tuple per frame and one tuple of frames per row, all by C-level maps: no Python work per row
        frame_tuples = zip(*rows.reshape(n * k, width).T.tolist())
        if k == 1:
            out.sampled.update(zip(ids, frame_tuples))
            out.stopped.update(zip(ids, eos[:, 0].tolist()))
            num_frames = np.where(eos[:, 0], 0, 1)
        else:  # a burst's frames end before its first EOS
            num_frames = np.where(eos.any(axis=1), eos.argmax(axis=1), k)
            bursts = list(zip(*[frame_tuples] * k))  # [n] tuples of k frames
            for i in np.flatnonzero(num_frames < k).tolist():  # rows cut by an EOS
                bursts[i] = bursts[i][: num_frames[i]]
            out.sampled.update(zip(ids, bursts))
            out.stopped.update(zip(ids, (num_frames < k).tolist()))
        _add_frames(frames, ids, g.hidden, num_frames)
    for (j, _), batches in sorted(frames.items()):  # a mixed step's code groups: one batch per (j, m)
        if len(batches) == 1:
            out.frames.append((j, *batches[0]))
        else:
            out.frames.append((j, [r for ids, _ in batches for r in ids], torch.cat([h for _, h in batches], dim=1)))
    return out


def _add_frames(frames: dict, ids: list[str], hidden: torch.Tensor, num_frames: np.ndarray) -> None:
    """Rows whose k frames are all real as one batch [k, n, H]; rows cut by EOS frame by frame."""
    k = hidden.shape[0]
    full = num_frames == k
    if full.all():
        frames.setdefault((0, k), []).append((ids, hidden))
        return
    if full.any():
        idx = np.flatnonzero(full)
        frames.setdefault((0, k), []).append(([ids[i] for i in idx], hidden[:, _to(idx, hidden)]))
    for j in range(int(num_frames.max(initial=0))):
        idx = np.flatnonzero((num_frames > j) & ~full)
        if len(idx):
            frames.setdefault((j, 1), []).append(([ids[i] for i in idx], hidden[j : j + 1, _to(idx, hidden)]))


def _to(idx: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    # async: a pageable copy would wait for the step already queued behind this one (pipelined)
    return async_h2d(torch.from_numpy(idx), like.device)
