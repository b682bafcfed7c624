"""Every Triton kernel of the streaming vocoder compiles for sm_90 through the code that launches it, on a machine
without a GPU (tests/sm90_compile.py): the real model's ConvNeXt blocks (Decoder 512 -> 2048, dilation 2; Vocos
512 -> 1536), the conv buffers of kernels 3 and 7, the ISTFT head's kernels, in fp16 as the engine runs them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sm90_compile import compile_only_for_sm90  # noqa: E402

from ttsserve.audio import triton_convnext, triton_istft  # noqa: E402
from ttsserve.audio.decoder_net import ConvNeXtBlock  # noqa: E402
from ttsserve.audio.incremental import NOT_FINISHED, ConvState, Rows  # noqa: E402
from ttsserve.audio.vocos import ISTFTHead  # noqa: E402


def _rows(n: int, width: int, reach: int) -> Rows:
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return Rows(t(range(n)), t([100] * n), t([width] * n), t([NOT_FINISHED] * n), width, reach)


@pytest.mark.parametrize("width", [16, 48])
@torch.no_grad()
def test_vocoder_kernels_compile_for_sm90(width: int) -> None:
    n = 3
    with compile_only_for_sm90() as compiled:
        for dim, inter, dil, scale in ((512, 2048, 2, "weight"), (512, 1536, 1, "gamma")):
            block = ConvNeXtBlock(dim, inter, 7, dil, scale).half().eval()
            state = ConvState(block.dwconv, lag=9)
            state.resize(n)
            x = torch.zeros(n, width, dim, dtype=torch.float16).transpose(1, 2)  # channels contiguous
            triton_convnext.convnext_block(block, state, x, _rows(n, width, 9 + 2 * state.r + 3))
        for kernel in (3, 7):
            conv = torch.nn.Conv1d(512, 512, kernel, padding=kernel // 2).half()
            state = ConvState(conv, lag=4)
            state.resize(n)
            x = torch.zeros(n, 512, width, dtype=torch.float16)
            triton_convnext.masked_buffer(state, x, _rows(n, width, 4 + 2 * state.r))
        head = ISTFTHead(512, 1024).half()
        tails = torch.zeros(n, 2, 1024 - 256)
        triton_istft.istft_overlap_add(
            head, torch.zeros(n, width, 512, dtype=torch.float16), _rows(n, width, 8), tails, 4
        )
    names = {name for name, _ in compiled}
    assert names == {"_front_kernel", "_back_kernel", "_buffer_kernel", "_spectrum_kernel", "_overlap_add_kernel"}
