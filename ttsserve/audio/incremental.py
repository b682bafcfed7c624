"""Decoder/DVAE + Vocos run incrementally: each conv keeps the tail of its input per stream (MODEL.md §5.2-5.5).

The windowed stage re-decodes L + R = 104 frames of context around every chunk, 2.6-2.9x the real frames at
the default chunk sizes. Here every temporal conv of half width r keeps, per stream slot, the last 2r frames of
its input, and a call feeds each stream only its new frames: a conv's output then lags its input by r frames,
so the spectrum lags the mel input by D = sum(r) frames (102 for the real model) and the overlap-add by
n_fft/2 more samples. Pointwise layers (LayerNorm, the MLPs, the heads) need no state.

Exactness. The one-shot decode zero-pads every conv input outside [0, T). Here every conv input is masked by its
absolute frame index the same way (frames < 0 are the left padding; once a stream is finished, frames >= T are
the right padding), so each output frame in [0, T) sees exactly the inputs it sees in the one-shot decode. Rows
of a batch may carry fewer new frames than the widest row; their extra positions hold junk that only ever
reaches positions past the row's own, which are never kept (tails are gathered per row, and the overlap-add
leaves such frames out).

On CUDA (with triton) the conv buffers and the ConvNeXt blocks run as Triton kernels (audio/triton_convnext.py)
with the same masking, equal to this torch path within fp16 rounding, and with TRITON_ISTFT the ISTFT head's
spectrum and overlap-add as two more (audio/triton_istft.py), equal to it within fp32 rounding; the CPU runs the
torch path.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ttsserve.audio.decoder_net import ConvNeXtBlock, ConvNeXtStack
from ttsserve.audio.vocos import ISTFTHead, Vocos, overlap_add
from ttsserve.h2d import to_device

NOT_FINISHED = 1 << 40  # the `limit` of a stream whose length is not known yet


@dataclass
class Rows:
    """The rows of one incremental call, at the mel rate. All tensors [B] int64 on the nets' device.

    slots: state slot of each row; start: absolute mel frame of the row's first new input frame; count: new
    mel frames of the row (<= width); limit: the utterance's mel frames once finished, else NOT_FINISHED.
    """

    slots: Tensor
    start: Tensor
    count: Tensor
    limit: Tensor
    width: int  # new mel frames per row in the padded batch
    reach: int  # frames before `start` that some conv buffer of the pipeline covers (its `reach` attribute)

    def __post_init__(self) -> None:
        self._masks: dict[torch.dtype, Tensor] = {}  # built on first use: the Triton path needs none
        self._tails: dict[int, Tensor] = {}

    def frame_mask(self, lag: int, cached: int, dtype: torch.dtype) -> Tensor:
        """[B, 1, cached + width] (a view): 1 where the buffer position's frame lies in [0, limit). Position 0
        holds frame start - lag - cached."""
        offset = self.reach - lag - cached
        assert offset >= 0, "a conv reaches further back than the pipeline planned"
        if dtype not in self._masks:  # one mask per call, not one per conv: the GPU path is launch-bound
            frame = self.start[:, None] - self.reach + torch.arange(self.reach + self.width, device=self.start.device)
            in_range = (frame >= 0) & (frame < self.limit[:, None])  # [B, reach + width]
            self._masks[dtype] = in_range[:, None, :].to(dtype)
        return self._masks[dtype][..., offset : offset + cached + self.width]

    def tail_index(self, size: int) -> Tensor:
        """[B, 1, size]: positions count_b .. count_b + size - 1, the last `size` real positions of a buffer that
        starts with `size` cached ones."""
        if size not in self._tails:
            self._tails[size] = (self.count[:, None] + torch.arange(size, device=self.count.device))[:, None, :]
        return self._tails[size]


class ConvState:
    """One temporal conv run incrementally. cache: [num_slots, C_in, 2r], the last 2r frames of its masked input."""

    def __init__(self, conv: nn.Conv1d, lag: int) -> None:
        assert conv.stride[0] == 1 and conv.kernel_size[0] % 2 == 1, "only odd, stride-1 convs stream this way"
        self.conv = conv
        self.r = conv.dilation[0] * (conv.kernel_size[0] - 1) // 2
        self.lag = lag  # mel frames between the pipeline input and this conv's input
        w = conv.weight
        self.cache = torch.zeros(0, conv.in_channels, 2 * self.r, dtype=w.dtype, device=w.device)

    def resize(self, num_slots: int) -> None:
        extra = num_slots - self.cache.shape[0]
        if extra > 0:
            self.cache = torch.cat([self.cache, self.cache.new_zeros(extra, *self.cache.shape[1:])])

    def __call__(self, x: Tensor, rows: Rows) -> tuple[Tensor, Tensor]:
        """x: [B, C_in, width] new input frames -> (output [B, C_out, width], whose position k is frame
        start - lag - r + k; the masked input buffer [B, C_in, 2r + width], position 0 = frame start - lag - 2r)."""
        c = 2 * self.r
        if c and (kernels := triton_kernels(x)) is not None:
            buf = kernels.masked_buffer(self, x, rows)
            conv = self.conv
            return F.conv1d(buf, conv.weight, conv.bias, dilation=conv.dilation, groups=conv.groups), buf
        buf = torch.cat([self.cache.index_select(0, rows.slots), x], dim=2) * rows.frame_mask(self.lag, c, x.dtype)
        if c:
            tail = buf.gather(2, rows.tail_index(c).expand(-1, buf.shape[1], -1))
            self.cache.index_copy_(0, rows.slots, tail)
        conv = self.conv
        return F.conv1d(buf, conv.weight, conv.bias, dilation=conv.dilation, groups=conv.groups), buf


# On CUDA the conv buffers, the ConvNeXt blocks and the ISTFT head run as Triton kernels (audio/triton_convnext.py,
# audio/triton_istft.py); "0" keeps the torch path there too (the CPU always runs it)
USE_TRITON = os.environ.get("TTSSERVE_VOCODER_TRITON", "1") != "0"
# the ISTFT head's kernels where USE_TRITON applies: 790 -> 263 us a call at 512 rows x 24 mel frames on an H100
# (benchmarks/istft_micro.py). TTSSERVE_VOCODER_FUSED=0 turns this and triton_convnext.GELU_EPILOGUE off
TRITON_ISTFT = os.environ.get("TTSSERVE_VOCODER_FUSED", "1") != "0"


def triton_kernels(x: Tensor):
    """The Triton kernels (audio/triton_convnext.py, audio/triton_istft.py) for x's device, or None: off CUDA,
    USE_TRITON off, triton missing."""
    return _import_triton_kernels() if x.is_cuda and USE_TRITON else None


@functools.cache
def _import_triton_kernels():
    try:
        from ttsserve.audio import triton_convnext, triton_istft
    except ImportError:
        return None
    return SimpleNamespace(
        masked_buffer=triton_convnext.masked_buffer,
        convnext_block=triton_convnext.convnext_block,
        istft_overlap_add=triton_istft.istft_overlap_add,
    )


def _block(block: ConvNeXtBlock, state: ConvState, x: Tensor, rows: Rows) -> Tensor:
    """ConvNeXtBlock.forward, incrementally: the fused kernels on CUDA, else `block_torch`."""
    if (kernels := triton_kernels(x)) is not None:
        return kernels.convnext_block(block, state, x, rows)
    return block_torch(block, state, x, rows)


def block_torch(block: ConvNeXtBlock, state: ConvState, x: Tensor, rows: Rows) -> Tensor:
    """ConvNeXtBlock.forward, incrementally, in torch ops: the residual is the buffer at the conv's output frames."""
    y, buf = state(x, rows)
    y = block.pwconv2(F.gelu(block.pwconv1(block.norm(y.transpose(1, 2)))))
    r = state.r
    return buf[:, :, r : r + x.shape[2]] + (y * getattr(block, block.scale_name)).transpose(1, 2)


class IncrementalDecoder:
    """ConvNeXtStack + out_conv (+ coef) of the HiddenDecoder or the DVAE: mel-rate x -> mel, lag = sum(r)."""

    def __init__(self, stack: ConvNeXtStack, out_conv: nn.Conv1d, coef: Tensor) -> None:
        self.conv_in = [ConvState(stack.conv_in[0], 0)]
        self.conv_in.append(ConvState(stack.conv_in[2], self.conv_in[0].r))
        lag = sum(s.r for s in self.conv_in)
        self.blocks = []
        for block in stack.decoder_block:
            self.blocks.append((block, ConvState(block.dwconv, lag)))
            lag += self.blocks[-1][1].r
        self.conv_out = stack.conv_out  # kernel 1: pointwise
        self.out_conv = ConvState(out_conv, lag)
        self.lag = lag + self.out_conv.r
        self.coef = coef
        self.states = [*self.conv_in, *(s for _, s in self.blocks), self.out_conv]
        self.reach = max(s.lag + 2 * s.r for s in self.states)  # Rows.reach of this pipeline

    def resize(self, num_slots: int) -> None:
        for s in self.states:
            s.resize(num_slots)

    def __call__(self, x: Tensor, rows: Rows) -> Tensor:
        """x: [B, C, width] (after halves_to_frames) -> mel [B, n_mels, width], position k = frame start - lag + k."""
        x = self.conv_in[0](x, rows)[0]
        x = self.conv_in[1](F.gelu(x), rows)[0]
        for block, state in self.blocks:
            x = _block(block, state, x, rows)
        return self.out_conv(self.conv_out(x), rows)[0] * self.coef


class IncrementalVocos:
    """Vocos backbone + ISTFT head with a streaming overlap-add. Its Rows count frames at its own input (the mel).

    tails: [num_slots, 2, n_fft - hop] fp32, the unfinished overlap-add sums and window envelope of each slot.
    """

    def __init__(self, vocos: Vocos) -> None:
        bb = vocos.backbone
        self.backbone, self.head = bb, vocos.head
        self.embed = ConvState(bb.embed, 0)
        lag = self.embed.r
        self.blocks = []
        for block in bb.convnext:
            self.blocks.append((block, ConvState(block.dwconv, lag)))
            lag += self.blocks[-1][1].r
        self.lag = lag  # of the spectrum frames
        self.states = [self.embed, *(s for _, s in self.blocks)]
        self.reach = max(s.lag + 2 * s.r for s in self.states)  # Rows.reach of this pipeline
        self.tails = torch.zeros(0, 2, self.head.n_fft - self.head.hop_length, device=bb.embed.weight.device)
        self._resets: list[int] = []  # slots whose tails are to be zeroed before the next call

    def resize(self, num_slots: int) -> None:
        for s in self.states:
            s.resize(num_slots)
        extra = num_slots - self.tails.shape[0]
        if extra > 0:
            self.tails = torch.cat([self.tails, self.tails.new_zeros(extra, *self.tails.shape[1:])])

    def reset(self, slot: int) -> None:
        """A new stream in this slot: its overlap-add starts empty (conv caches are masked, no reset needed).
        Queued, not written: flush_resets() zeroes the queued slots in one write before the next call (a write
        per admitted stream was a device op per request on the engine's thread)."""
        self._resets.append(slot)

    def flush_resets(self) -> None:
        """Zero the tails of the slots reset since the last flush (before any call reads them)."""
        if self._resets:
            self.tails.index_fill_(0, to_device(self._resets, self.tails.device), 0.0)
            self._resets = []

    def __call__(self, mel: Tensor, rows: Rows) -> Tensor:
        """mel: [B, n_mels, width] -> wav [B, hop * width]: position i is the overlap-add at sample
        hop * (start - lag) + i of the centre-padded signal, final for i < hop * count_b (one-shot sample
        i - n_fft / 2), already divided by the window envelope."""
        x = self.embed(mel, rows)[0]
        x = self.backbone.norm(x.transpose(1, 2)).transpose(1, 2)
        for block, state in self.blocks:
            x = _block(block, state, x, rows)
        return self._overlap_add(self.backbone.final_layer_norm(x.transpose(1, 2)), rows)

    def _overlap_add(self, feats: Tensor, rows: Rows) -> Tensor:
        head: ISTFTHead = self.head
        if TRITON_ISTFT and (kernels := triton_kernels(feats)) is not None:
            return kernels.istft_overlap_add(head, feats, rows, self.tails, self.lag)
        n_fft, hop, width = head.n_fft, head.hop_length, rows.width
        spec, window = head.spectrum(feats)
        k = torch.arange(width, device=spec.device)[None, :]
        valid = self._spectrum_frames_valid(rows, k).to(window.dtype)  # [B, width]
        frames = torch.fft.irfft(spec.transpose(1, 2), n=n_fft, dim=2) * window * valid[:, :, None]
        z = overlap_add(frames, hop)
        env = overlap_add((window * window) * valid[:, :, None], hop)
        acc = torch.stack([z, env], dim=1)  # [B, 2, hop * width + n_fft - hop]
        ov = n_fft - hop
        acc[:, :, :ov] += self.tails.index_select(0, rows.slots).to(acc.dtype)
        idx = (hop * rows.count[:, None] + torch.arange(ov, device=spec.device))[:, None, :].expand(-1, 2, -1)
        self.tails.index_copy_(0, rows.slots, acc.gather(2, idx).to(self.tails.dtype))
        done = acc[:, :, : hop * width]
        return done[:, 0] / done[:, 1].clamp(min=1e-11)

    def _spectrum_frames_valid(self, rows: Rows, k: Tensor) -> Tensor:
        frame = rows.start[:, None] - self.lag + k
        return (frame >= 0) & (frame < rows.limit[:, None]) & (k < rows.count[:, None])
