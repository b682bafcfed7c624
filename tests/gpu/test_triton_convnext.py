"""The Triton vocoder kernels (audio/triton_convnext.py) against the torch path: the fused incremental ConvNeXt
block against `block_torch`, the conv buffer against ConvState's torch buffer.

Runs on CUDA (fp16, as the engine runs the vocoder). Without CUDA it is skipped, unless TRITON_INTERPRET=1 and
triton is installed: then the block tests run small fp32 shapes through Triton's CPU interpreter (slow; a
development aid, not CI). Both paths start from the same cache; the outputs and the caches after the call must
agree, junk positions past a row's count included (both compute them by the same formula).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

from triton_env import require_cuda_or_interpreter  # noqa: E402

require_cuda_or_interpreter()

from ttsserve.audio import incremental  # noqa: E402
from ttsserve.audio.decoder_net import ConvNeXtBlock  # noqa: E402
from ttsserve.audio.incremental import NOT_FINISHED, ConvState, Rows, block_torch  # noqa: E402
from ttsserve.audio.triton_convnext import convnext_block, masked_buffer  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.float16 if DEVICE.type == "cuda" else torch.float32
# relative Frobenius error allowed: fp32 differs by summation order only; fp16 rounds at other points
REL_TOL = {torch.float16: 3e-3, torch.float32: 1e-5}


def _random_block(dim: int, dilation: int, scale_name: str, seed: int) -> ConvNeXtBlock:
    block = ConvNeXtBlock(dim, 2 * dim, 7, dilation, scale_name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.ndim > 1 else 0.3) + (1.0 if p.ndim == 1 else 0))
    return block.to(DEVICE, DTYPE).eval()


def _rows(starts, counts, limits, slots, width: int, reach: int) -> Rows:
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=DEVICE)
    return Rows(t(slots), t(starts), t(counts), t(limits), width, reach)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


# (dim, dilation, scale name, width, rows as (slot, start, count, limit)); lag 9, so a row's buffer holds frames
# start - 9 - 2r .. start - 9 + width - 1. Rows at the stream start (frames < 0 masked, in the cache and in x),
# finished ones (frames >= limit masked, from inside the cached part or inside x; start past limit: fed past the
# end), rows narrower than the width (count 0 included), slots in no order, several frame and channel tiles
CASES = {
    "decoder": (24, 2, "weight", 11, [(3, 0, 11, NOT_FINISHED), (0, 40, 5, 25), (5, 17, 9, NOT_FINISHED)]),
    "vocos": (24, 1, "gamma", 11, [(2, 2, 3, NOT_FINISHED), (4, 30, 11, 28), (1, 60, 0, 50), (0, 8, 7, 5)]),
    "tiles": (80, 2, "weight", 40, [(1, 5, 40, NOT_FINISHED), (3, 100, 33, 120), (0, 0, 17, NOT_FINISHED)]),
}


def _setup(conv: torch.nn.Conv1d, spec, width: int, layout: str, lag: int = 9):
    """Two ConvStates of `conv` with the same random cache (6 slots), the rows of `spec`, random x [B, C_in, W]."""
    ref_state, state = ConvState(conv, lag), ConvState(conv, lag)
    ref_state.resize(6)
    g = torch.Generator().manual_seed(3)
    ref_state.cache.copy_(torch.randn(ref_state.cache.shape, generator=g))
    state.cache = ref_state.cache.clone()
    slots, starts, counts, limits = (list(v) for v in zip(*spec))
    rows = _rows(starts, counts, limits, slots, width, reach=lag + 2 * ref_state.r + 3)
    x = torch.randn(len(spec), conv.in_channels, width, generator=g).to(DEVICE, DTYPE)
    if layout == "transposed":  # the Vocos' first block reads LN(x^T)^T: channels are the contiguous axis
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    return ref_state, state, rows, x


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@torch.no_grad()
def test_fused_block_equals_torch_block(name: str, layout: str, monkeypatch) -> None:
    dim, dilation, scale_name, width, spec = CASES[name]
    block = _random_block(dim, dilation, scale_name, seed=len(name) + dilation)
    ref_state, state, rows, x = _setup(block.dwconv, spec, width, layout)
    slots = [row[0] for row in spec]
    monkeypatch.setattr(incremental, "USE_TRITON", False)  # the reference: torch ops only, on CUDA too
    ref = block_torch(block, ref_state, x, rows)
    out = convnext_block(block, state, x, rows)
    assert out.shape == ref.shape and out.stride(1) == 1  # channels contiguous
    assert _rel(out, ref) < REL_TOL[DTYPE], _rel(out, ref)
    assert torch.equal(state.cache, ref_state.cache)  # the tail is a copy of masked inputs: exact
    untouched = [s for s in range(6) if s not in slots]
    assert torch.equal(state.cache[untouched], ref_state.cache[untouched])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@torch.no_grad()
def test_linear_gelu_epilogue_is_one_kernel_no_further_from_fp32(dtype: torch.dtype, monkeypatch) -> None:
    """The Vocos' Linear1 (512 -> 1536) + bias + GELU at 4,096 frames: with GELU in cuBLASLt's epilogue one kernel
    runs (the GEMM; cuBLASLt names it after its epilogue, e.g. `nvjet_sm90_..._gelubias_TNT`), and the result is no
    further from fp32 erf GELU than the separate GEMM and erf GELU's."""
    if DEVICE.type != "cuda":
        pytest.skip("cuBLASLt's epilogue: CUDA only (fp32 and the CPU keep erf GELU)")
    from ttsserve.audio import triton_convnext

    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(512, 1536)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / 512**0.5)
        lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.3)
    h = torch.randn(4096, 512, generator=g)
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(h.double(), lin.weight.double(), lin.bias.double()))
    lin, h = lin.to(DEVICE, dtype), h.to(DEVICE, dtype)

    def run(epilogue: bool) -> tuple[torch.Tensor, list[str]]:
        monkeypatch.setattr(triton_convnext, "GELU_EPILOGUE", epilogue)
        triton_convnext.linear_gelu(h, lin)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y = triton_convnext.linear_gelu(h, lin)
            torch.cuda.synchronize()
        return y, [e.key for e in prof.key_averages() if e.device_time_total > 0]

    fused, fused_kernels = run(True)
    separate, separate_kernels = run(False)
    assert any("gelu" in k.lower() for k in separate_kernels), separate_kernels  # the GEMM, then a GELU kernel
    assert len(fused_kernels) == 1 and "gelu" in fused_kernels[0].lower(), fused_kernels
    assert len(fused_kernels) < len(separate_kernels), (fused_kernels, separate_kernels)
    err = lambda y: float((y.double().cpu() - ref).norm() / ref.norm())  # noqa: E731
    assert err(fused) <= 1.05 * err(separate), (err(fused), err(separate))


@pytest.mark.parametrize("kernel", [3, 7])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@torch.no_grad()
def test_buffer_kernel_equals_torch_buffer(kernel: int, layout: str, monkeypatch) -> None:
    """The dense convs' buffer (conv_in, out_conv: kernel 3; the Vocos embed: 7), 40 channels (two channel
    tiles), 70 frames (two position tiles): the buffer and the cache after the call are exact copies."""
    conv = torch.nn.Conv1d(40, 24, kernel, padding=kernel // 2).to(DEVICE, DTYPE)
    spec = [(4, 0, 70, NOT_FINISHED), (0, 90, 51, 100), (2, 20, 0, 12), (5, 7, 66, NOT_FINISHED)]
    ref_state, state, rows, x = _setup(conv, spec, 70, layout)
    old_cache = state.cache.clone()
    monkeypatch.setattr(incremental, "USE_TRITON", False)
    ref_out, ref_buf = ref_state(x, rows)
    buf = masked_buffer(state, x, rows)
    assert torch.equal(buf, ref_buf)
    assert torch.equal(state.cache, ref_state.cache)
    if DEVICE.type == "cuda":  # ConvState dispatches to the kernel on CUDA
        monkeypatch.setattr(incremental, "USE_TRITON", True)
        state.cache.copy_(old_cache)
        out, _ = state(x, rows)
        assert _rel(out, ref_out) < REL_TOL[DTYPE]


@torch.no_grad()
def test_masked_inputs_do_not_reach_the_output() -> None:
    """NaN in the cache at frames before the stream start and in x past a finished stream's limit: the torch path
    multiplies them by 0 (NaN), the fused one never loads them; both agree where the torch path is finite."""
    block = _random_block(16, 2, "weight", seed=7)
    state = ConvState(block.dwconv, 0)
    state.resize(2)
    state.cache.fill_(float("nan"))
    width = 8
    x = torch.randn(1, 16, width, generator=torch.Generator().manual_seed(1)).to(DEVICE, DTYPE)
    x[:, :, 5:] = float("nan")  # frames 5.. (limit 5)
    rows = _rows([0], [width], [5], [1], width, reach=2 * state.r)
    out = convnext_block(block, state, x, rows)
    assert torch.isfinite(out).all()
    assert torch.isfinite(state.cache[1]).all()


@torch.no_grad()
def test_interpreted_pipeline_equals_one_shot(monkeypatch) -> None:
    """Under the interpreter, every conv buffer, block and the ISTFT head of the streaming stage forced through the
    kernels (as on CUDA): staggered streams of the tiny golden nets, hidden states and DVAE codes, equal the
    one-shot decode (frames < 0 and past the end masked at every conv, the Vocos' transposed first-block input, the
    lags)."""
    if DEVICE.type == "cuda":
        pytest.skip("interpreter only: on CUDA the stage runs the kernels anyway (test_audio_stage_device)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "audio"))
    from audio_stage_testutil import ASSET, joined, one_shot
    from safetensors.torch import load_file

    from ttsserve.audio.decoder_net import DVAE, HiddenDecoder
    from ttsserve.audio.incremental_stage import IncrementalAudioStage
    from ttsserve.audio.vocos import Vocos

    monkeypatch.setattr(incremental, "triton_kernels", lambda x: incremental._import_triton_kernels())
    monkeypatch.setattr(incremental, "TRITON_ISTFT", True)
    dec, dvae, vocos = (
        cls.from_state_dict(load_file(ASSET / f"{name}.safetensors"))
        for cls, name in ((HiddenDecoder, "Decoder"), (DVAE, "DVAE"), (Vocos, "Vocos"))
    )
    stage = IncrementalAudioStage(dec, dvae, vocos, first_chunk_frames=4, max_chunk_frames=8)
    g = torch.Generator().manual_seed(5)
    inputs = {
        "h0": torch.randn(23, 64, generator=g),
        "h1": torch.randn(9, 64, generator=g),
        "c0": torch.randint(0, 625, (14, 4), generator=g),
    }
    starts = {"h0": 0, "h1": 3, "c0": 1}
    got = {k: [] for k in inputs}
    for t in range(60):
        for k, frames in inputs.items():
            if t == starts[k]:
                stage.add_request(k, use_codes=k.startswith("c"))
            if 0 <= t - starts[k] < len(frames):
                stage.append(k, frames[t - starts[k] : t - starts[k] + 1])
            elif t - starts[k] == len(frames):
                stage.finish(k)
        for ch in stage.step():
            got[ch.req_id].append(ch)
    for k, frames in inputs.items():
        ref = one_shot(dvae if k.startswith("c") else dec, vocos, frames, codes=k.startswith("c"))
        assert np.abs(joined(got[k]) - ref).max() < 1e-5, k


@pytest.fixture
def real_nets():
    if DEVICE.type != "cuda":
        pytest.skip("real-size pipeline: CUDA only")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "audio"))
    from audio_stage_testutil import random_nets

    dec, _, vocos = random_nets(11, hidden=768, dec_dim=512, dec_layers=12, voc_dim=512, voc_layers=8)
    return dec.cuda(), vocos.cuda()


SPECS = [(200, 0, 1), (61, 3, 1), (140, 5, 2), (90, 9, 1), (33, 14, 3), (170, 20, 1)]  # (frames, start, burst)


@pytest.mark.parametrize("graphs", [False, True])
def test_pipeline_fused_equals_unfused(real_nets, graphs: bool, monkeypatch) -> None:
    """Decoder + Vocos streamed by the incremental stage in fp16: the fused kernels (eager, and inside the captured
    vocoder graphs) give the torch path's audio within fp16 rounding, and are no further than it from the fp32
    torch path's."""
    from audio_stage_testutil import run_schedule

    from ttsserve.audio.incremental_stage import IncrementalAudioStage

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)

    def audio(fused: bool, dtype: torch.dtype, captured: bool = False) -> dict:
        monkeypatch.setattr(incremental, "USE_TRITON", fused)
        stage = IncrementalAudioStage(real_nets[0], None, real_nets[1], net_dtype=dtype, deferred=True)
        if captured:
            stage.enable_cuda_graphs(max_streams=8)
        out = run_schedule(stage, SPECS, seed=4, width=768)
        if captured:
            assert stage.graphs[False].replays == stage.calls_total > 5
        return {i: v[0] for i, v in out.items()}

    rel = lambda a, b: np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-9)
    exact = audio(False, torch.float32)
    unfused = audio(False, torch.float16)
    fused = audio(True, torch.float16, captured=graphs)
    for i in exact:
        assert fused[i].shape == unfused[i].shape == exact[i].shape
        assert rel(fused[i], unfused[i]) < 5e-3, f"stream {i}"
        assert rel(fused[i], exact[i]) < max(1.5 * rel(unfused[i], exact[i]), 1e-3), f"stream {i}"
