"""runner/step_inputs.py: which id feeds each row of a general step (pure numpy, no model)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ttsserve.params import SamplingParams
from ttsserve.runner.step_inputs import gather_input_rows
from ttsserve.runner.step_types import SequenceState

Q, SPK = 4, 7


def _state(text: list[int], codes: list[list[int]], spk: bool, mode: str = "code") -> SequenceState:
    ids = np.array([[t] * Q for t in text] + codes, dtype=np.int64)
    mask = np.array([True] * len(text) + [False] * len(codes))
    vec = torch.full((3,), 0.5) if spk else None
    rows = np.flatnonzero(ids[:, 0] == SPK) if spk else np.empty(0, dtype=np.int64)
    return SequenceState(ids, mask, vec, rows, mode, SamplingParams(), 0)


def _decode(rows):
    """InputRows -> {row: ("text", id) | ("code", codes) | ("spk", None)} in write order (speaker last)."""
    f, n_t, n_c = rows.flat, rows.num_text, rows.num_code
    t_ids, t_dst = f[:n_t], f[n_t : 2 * n_t]
    c_ids = f[2 * n_t : 2 * n_t + n_c * Q].reshape(n_c, Q)
    c_dst = f[2 * n_t + n_c * Q : 2 * n_t + n_c * Q + n_c]
    s_dst = f[2 * n_t + n_c * Q + n_c :]
    out = {int(r): ("text", int(i)) for r, i in zip(t_dst, t_ids)}
    out.update({int(r): ("code", tuple(c)) for r, c in zip(c_dst, c_ids)})
    out.update({int(r): ("spk", None) for r in s_dst})
    return out


def test_a_chunked_prompt_a_speaker_row_and_a_recompute_row():
    states = {
        "a": _state([1, SPK, 3, 4], [[10, 11, 12, 13], [20, 21, 22, 23]], spk=True),
        "b": _state([5, 6], [], spk=False),
    }
    requests = {
        "a": SimpleNamespace(output_token_ids=[]),
        "b": SimpleNamespace(output_token_ids=[(30, 31, 32, 33), (40, 41, 42, 43)]),
    }
    # a: its prompt's positions 1..4 (the speaker row, two text rows, the first code row); b: recomputing
    # its last prompt position and both outputs after preemption
    sched = [
        SimpleNamespace(request_id="a", num_computed_tokens=1, num_new_tokens=4),
        SimpleNamespace(request_id="b", num_computed_tokens=1, num_new_tokens=3),
    ]
    rows = gather_input_rows(sched, np.array([0, 4, 7]), states, requests, Q)
    assert rows.num_rows == 7 and len(rows.spk_vecs) == 1 and rows.spk_vecs[0] is states["a"].spk
    assert _decode(rows) == {
        0: ("spk", None),
        1: ("text", 3),
        2: ("text", 4),
        3: ("code", (10, 11, 12, 13)),
        4: ("text", 6),
        5: ("code", (30, 31, 32, 33)),
        6: ("code", (40, 41, 42, 43)),
    }
    assert rows.split_sizes(Q) == [4, 4, 12, 3, 1]  # the speaker row is also a text row, overwritten after


def test_text_mode_outputs_are_text_rows():
    states = {"t": _state([1, 2], [], spk=False, mode="text")}
    requests = {"t": SimpleNamespace(output_token_ids=[8, 9])}
    sched = [SimpleNamespace(request_id="t", num_computed_tokens=0, num_new_tokens=4)]
    rows = gather_input_rows(sched, np.array([0, 4]), states, requests, Q)
    assert _decode(rows) == {0: ("text", 1), 1: ("text", 2), 2: ("text", 8), 3: ("text", 9)}
