"""Shared by the streaming-stage tests (tests/audio, tests/gpu): the golden tiny networks, random real-shaped
networks, the one-shot reference decode, and drivers that stream frames through a stage and check the chunk
contract (contiguous start samples, one final chunk at the end)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ttsserve.audio.decoder_net import DVAE, ConvNeXtBlock, ConvNeXtStack, HiddenDecoder
from ttsserve.audio.gfsq import GFSQ
from ttsserve.audio.incremental_stage import IncrementalAudioStage
from ttsserve.audio.stage import AudioChunk, AudioStage
from ttsserve.audio.stream_base import StreamingStage
from ttsserve.audio.vocos import ISTFTHead, Vocos, VocosBackbone

ASSET = Path(__file__).resolve().parents[1] / "golden" / "assets-tiny" / "asset"
STAGES = [AudioStage, IncrementalAudioStage]


@pytest.fixture(scope="module")
def tiny() -> tuple[HiddenDecoder, DVAE, Vocos]:
    load = lambda name: load_file(ASSET / f"{name}.safetensors")  # noqa: E731
    return (
        HiddenDecoder.from_state_dict(load("Decoder")),
        DVAE.from_state_dict(load("DVAE")),
        Vocos.from_state_dict(load("Vocos")),
    )


@torch.no_grad()
def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights like the golden tiny checkpoint's: N(0, 1/fan_in), small biases, scales U(0.05, 0.2)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("weight", "gamma") and p.dim() == 1 and ".norm" not in name and "layer_norm" not in name:
            p.copy_(torch.rand(p.shape, generator=g) * 0.15 + 0.05)  # ConvNeXt layer scale
        elif p.dim() == 1:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 + (1.0 if "norm" in name else 0.0))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
    for name, b in module.named_buffers():
        if name.endswith("coef"):
            b.copy_(torch.rand(b.shape, generator=g) + 0.5)
    return module.eval()


def random_nets(
    seed: int, hidden: int, dec_dim: int, dec_layers: int, voc_dim: int, voc_layers: int, dvae: bool = False
) -> tuple[HiddenDecoder, DVAE | None, Vocos]:
    """Random Decoder (and DVAE) + Vocos; the real model is hidden 768, dec 512 x 12, Vocos 512 x 8."""
    dec = HiddenDecoder(ConvNeXtStack(hidden // 2, hidden // 2, dec_dim, 128, dec_layers, 4 * dec_dim), 100)
    voc = Vocos(VocosBackbone(100, voc_dim, 3 * voc_dim, voc_layers), ISTFTHead(voc_dim, 1024))
    dv = None
    if dvae:
        dv = DVAE(
            ConvNeXtStack(64, 128, 64, 16, dec_layers, 256),
            ConvNeXtStack(64, 64, 64, 16, dec_layers, 256),
            GFSQ(128),
            100,
            1024,
        )
        dv = _randomize(dv, seed + 2)
    return _randomize(dec, seed), dv, _randomize(voc, seed + 1)


@torch.no_grad()
def one_shot(dec, vocos, frames: torch.Tensor, codes: bool = False) -> np.ndarray:
    mel = dec.decode_codes(frames.T[None]) if codes else dec(frames.T[None])
    return vocos(mel)[0].numpy()


def stream(
    stage: StreamingStage, req_id: str, frames: torch.Tensor, bursts: list[int] | None = None, use_codes: bool = False
) -> list[AudioChunk]:
    """Feed frames in bursts (default: one per step), step after each, then finish and flush."""
    stage.add_request(req_id, use_codes=use_codes)
    chunks: list[AudioChunk] = []
    i = 0
    for k in bursts or [1] * frames.shape[0]:
        stage.append(req_id, frames[i : i + k])
        i += k
        chunks += stage.step()
    stage.finish(req_id)
    chunks += stage.step()
    return chunks + stage.flush()  # deferred stages hand the last decode over here


def joined(chunks: list[AudioChunk]) -> np.ndarray:
    """Concatenate, checking the chunk contract (contiguous start_sample, one final chunk at the end)."""
    pos = 0
    for i, ch in enumerate(chunks):
        assert ch.start_sample == pos and ch.samples.dtype == np.float32
        assert ch.is_final == (i == len(chunks) - 1)
        pos += len(ch.samples)
    return np.concatenate([ch.samples for ch in chunks])


def run_schedule(
    stage: IncrementalAudioStage, specs: list[tuple[int, int, int]], seed: int, width: int = 64
) -> dict[int, tuple[np.ndarray, torch.Tensor]]:
    """Streams (length, start step, burst) of random [n, width] frames appended step by step; -> each stream's
    (joined audio, frames)."""
    g = torch.Generator().manual_seed(seed)
    frames = [torch.randn(n, width, generator=g) for n, _, _ in specs]
    fed, got, finished = [0] * len(specs), {i: [] for i in range(len(specs))}, [False] * len(specs)
    for t in range(300):
        for i, (n, start, burst) in enumerate(specs):
            if t == start:
                stage.add_request(str(i))
            if start <= t and fed[i] < n:
                stage.append(str(i), frames[i][fed[i] : fed[i] + burst])
                fed[i] = min(n, fed[i] + burst)
            if start <= t and fed[i] == n and not finished[i]:
                stage.finish(str(i))
                finished[i] = True
        for ch in stage.step():
            got[int(ch.req_id)].append(ch)
        if t > max(s for _, s, _ in specs) and stage.num_requests == 0:
            break
    for ch in stage.flush():  # deferred stages hand the last decode over here
        got[int(ch.req_id)].append(ch)
    assert stage.num_requests == 0
    return {i: (joined(got[i]), frames[i]) for i in got}


def _edge_heavy_nets() -> tuple[HiddenDecoder, Vocos]:
    """Convs that only use their outermost taps: the edge of the receptive field matters at full strength."""
    dec, _, vocos = random_nets(0, hidden=64, dec_dim=64, dec_layers=2, voc_dim=64, voc_layers=2)
    with torch.no_grad():
        for m in [*dec.modules(), *vocos.modules()]:
            if isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] > 1:
                m.weight[..., 1:-1] = 0
            if isinstance(m, ConvNeXtBlock):
                getattr(m, m.scale_name).fill_(1.0)
    return dec, vocos
