"""Which embedding feeds each row of a general (prefill / recompute / text) step, as host index arrays.

A step's rows are prompt positions (text ids or audio-prompt codes, kept on the host by SequenceState) and
earlier outputs (recompute after preemption, text decode rows). The runner embeds each kind in one call and
scatters it to its rows; this module only says which ids go where, with numpy (no torch, no device).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class InputRows:
    """flat: int64 [text ids | text rows | code ids (num_code x num_vq) | code rows | speaker rows], one
    array so that it reaches the device in one copy; spk_vecs: the speaker vector of each speaker row."""

    flat: np.ndarray
    num_text: int
    num_code: int
    spk_vecs: list[torch.Tensor]

    @property
    def num_rows(self) -> int:
        return self.num_text + self.num_code

    def split_sizes(self, num_vq: int) -> list[int]:
        return [self.num_text, self.num_text, self.num_code * num_vq, self.num_code, len(self.spk_vecs)]


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def gather_input_rows(
    scheduled: list, cu_seqlens_q: np.ndarray, states: dict, requests: dict, num_vq: int
) -> InputRows:
    """scheduled[b] fills rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) with its positions
    [num_computed_tokens, + num_new_tokens): prompt positions from states[id] (SequenceState), later ones
    from requests[id].output_token_ids. Every row is exactly one text or one code row."""
    text_ids, text_dst, code_ids, code_dst, spk_vecs, spk_dst = [], [], [], [], [], []
    for b, s in enumerate(scheduled):
        st = states[s.request_id]
        num_prompt = st.num_prompt_tokens
        start, end, off = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens, int(cu_seqlens_q[b])
        if start < num_prompt:
            stop = min(end, num_prompt)
            mask, dst = st.prompt_text_mask[start:stop], np.arange(off, off + stop - start)
            text_ids.append(st.prompt_ids[start:stop, 0][mask])
            text_dst.append(dst[mask])
            code_ids.append(st.prompt_ids[start:stop][~mask])
            code_dst.append(dst[~mask])
            rows = st.spk_rows[(st.spk_rows >= start) & (st.spk_rows < stop)]
            if len(rows):
                spk_dst.append(off + rows - start)
                spk_vecs += [st.spk] * len(rows)
        if end > num_prompt:
            first = max(start, num_prompt)
            items = requests[s.request_id].output_token_ids[first - num_prompt : end - num_prompt]
            dst = np.arange(off + first - start, off + end - start)
            if st.mode == "code":
                code_ids.append(np.asarray(items, dtype=np.int64).reshape(-1, num_vq))
                code_dst.append(dst)
            else:
                text_ids.append(np.asarray(items, dtype=np.int64))
                text_dst.append(dst)
    parts = [_cat(text_ids), _cat(text_dst), _cat(code_ids).reshape(-1), _cat(code_dst), _cat(spk_dst)]
    rows = InputRows(np.concatenate(parts), len(parts[1]), len(parts[3]), spk_vecs)
    assert rows.num_rows == int(cu_seqlens_q[-1]), "every row is a text or a code row"
    return rows
