"""The streaming ISTFT head's Triton kernels (audio/triton_istft.py) against the torch path of
`IncrementalVocos._overlap_add`: the samples and the slots' tails after the call.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 with triton installed (a development aid, not CI); else
skipped. fp32 throughout, as the head runs: the two paths differ by fp32 rounding only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

from triton_env import require_cuda_or_interpreter  # noqa: E402

require_cuda_or_interpreter()

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "audio"))
from audio_stage_testutil import random_nets  # noqa: E402

from ttsserve.audio import incremental  # noqa: E402
from ttsserve.audio.incremental import NOT_FINISHED, IncrementalVocos, Rows  # noqa: E402
from ttsserve.audio.triton_istft import istft_overlap_add, spectrum  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rows(spec, width: int, reach: int) -> Rows:
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=DEVICE)  # noqa: E731
    slots, starts, counts, limits = (list(v) for v in zip(*spec))
    return Rows(t(slots), t(starts), t(counts), t(limits), width, reach)


@pytest.fixture(scope="module", params=[torch.float32, torch.float16], ids=["fp32", "fp16"])
def vocos(request) -> IncrementalVocos:
    """The nets in fp32, and in fp16 as the engine runs them on CUDA (the head's Linear output and its window in
    fp16, the tails and the samples fp32 either way)."""
    _, _, voc = random_nets(3, hidden=64, dec_dim=32, dec_layers=1, voc_dim=48, voc_layers=1)
    return IncrementalVocos(voc.to(DEVICE, request.param).eval())


# (slot, start, count, limit) at the mel rate; a row's first frame is start - lag (lag 6 for these nets): rows at
# the stream start (all or some frames < 0, masked), a finished one (frames >= limit masked), rows narrower than the
# width (count 0 included), slots in no order and two left untouched
SPEC = [
    (3, 0, 6, NOT_FINISHED),
    (6, 3, 5, NOT_FINISHED),
    (0, 40, 2, 41),
    (5, 17, 6, NOT_FINISHED),
    (1, 9, 0, NOT_FINISHED),
    (2, 30, 6, 28),
]
SLOTS = 8


@pytest.mark.parametrize("width", [6, 9])
@torch.no_grad()
def test_fused_overlap_add_equals_torch(vocos: IncrementalVocos, width: int, monkeypatch) -> None:
    g = torch.Generator().manual_seed(width)
    vocos.resize(SLOTS)
    vocos.tails.copy_(torch.randn(vocos.tails.shape, generator=g))  # unfinished sums and envelopes of each slot
    old_tails = vocos.tails.clone()
    feats = torch.randn(len(SPEC), width, 48, generator=g).to(DEVICE, vocos.head.out.weight.dtype)
    rows = _rows(SPEC, width, vocos.reach)
    monkeypatch.setattr(incremental, "USE_TRITON", False)
    ref = vocos._overlap_add(feats, rows)
    ref_tails, vocos.tails = vocos.tails, old_tails.clone()
    out = istft_overlap_add(vocos.head, feats, rows, vocos.tails, vocos.lag)
    assert out.shape == ref.shape and out.dtype == ref.dtype == torch.float32
    # the sums and envelopes themselves: fp32 rounding (a product and a sum may contract into one fma)
    torch.testing.assert_close(vocos.tails, ref_tails, rtol=1e-5, atol=1e-6)
    # every sample, junk past a row's count included (both compute it by the same formula); where the window
    # envelope is near 0 (a row's first and last frames' edges) the division amplifies that rounding
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    untouched = [s for s in range(SLOTS) if s not in [r[0] for r in SPEC]]
    assert torch.equal(vocos.tails[untouched], old_tails[untouched])


@torch.no_grad()
def test_spectrum_equals_the_heads(vocos: IncrementalVocos) -> None:
    """The head's Linear output [B, W, n_fft + 2] -> ISTFTHead.spectrum's formula, frames contiguous: log-magnitudes
    past log(100) are clipped, phases far past pi keep their accuracy."""
    g = torch.Generator().manual_seed(1)
    head = vocos.head
    x = (torch.randn(3, 5, head.n_fft + 2, generator=g) * 4).to(DEVICE, head.out.weight.dtype)
    x[0, 0, :4] = torch.tensor([5.0, 4.6, 4.7, -30.0])
    x[0, 0, -1] = 40.0  # a phase of 40 rad
    mag, phase = x.float().chunk(2, dim=2)
    mag = torch.exp(mag).clamp(max=100.0)
    expected = torch.complex(mag * torch.cos(phase), mag * torch.sin(phase))
    got = spectrum(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-5)
