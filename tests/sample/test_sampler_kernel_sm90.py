"""The code sampler's Triton kernel (sample/triton_sampler.py) compiles for sm_90 through `sample`, on a machine
without a GPU (tests/sm90_compile.py): ChatTTS's 4 codebooks of 626 codes, with the top-k window and without."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sm90_compile import compile_only_for_sm90  # noqa: E402

from ttsserve.params import SamplingParams  # noqa: E402
from ttsserve.sample import triton_sampler  # noqa: E402
from ttsserve.sample.sampler import make_sampling_batch  # noqa: E402

R, V, EOS = 4, 626, 625


@pytest.mark.parametrize("top_window", [triton_sampler.TOP_WINDOW, 0])
def test_sampler_kernel_compiles_for_sm90(top_window: int) -> None:
    params = [SamplingParams(top_k=20, top_p=0.7, temperature=0.3)] * 3
    hist = [torch.zeros(2, R, dtype=torch.int64)] * 3
    batch = make_sampling_batch(params, [1, 2, 3], [0, 1, 2], hist, R, EOS)
    with compile_only_for_sm90() as compiled:
        triton_sampler.sample(torch.zeros(3, R, V), batch, top_window=top_window)
    assert [name for name, _ in compiled] == ["_sample_kernel"]
    assert compiled[0][1]["TOP_WINDOW"] == top_window
