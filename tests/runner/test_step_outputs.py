"""runner_output: a launched step's tokens into the scheduler's samples (frames as tuples, a burst cut before its
first EOS in any codebook)."""

from __future__ import annotations

import numpy as np
import torch

from ttsserve.runner.step_outputs import _any_codebook, runner_output
from ttsserve.runner.step_types import StepGroup

EOS = 9


def test_a_burst_ends_before_the_first_eos_in_any_codebook():
    tokens = torch.arange(3 * 4 * 4).reshape(3, 4, 4) % 8  # 3 rows, bursts of 4 frames, 4 codebooks; no EOS
    tokens[0, 1, 2] = EOS  # row a: EOS in its third codebook at frame 1
    tokens[2, 0, 3] = EOS  # row c: at frame 0, in the last codebook
    group = StepGroup("code", ["a", "b", "c"], tokens, torch.zeros(4, 3, 8))
    out = runner_output([group], tokens.reshape(-1).numpy().copy(), EOS, text_eos_id=0)
    assert out.sampled["a"] == (tuple(tokens[0, 0].tolist()),)
    assert out.sampled["b"] == tuple(tuple(f) for f in tokens[1].tolist())
    assert out.sampled["c"] == ()
    assert out.stopped == {"a": True, "b": False, "c": True}


def test_any_codebook_equals_any_for_every_width():
    rng = np.random.default_rng(0)
    for width in range(1, 10):
        eq = rng.integers(0, 4, (5, 3, width)) == 3
        np.testing.assert_array_equal(_any_codebook(eq), eq.any(axis=2))
