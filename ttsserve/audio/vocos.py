"""Vocos mel -> waveform in plain torch (MODEL.md §1.8, §5.5): ConvNeXt backbone + ISTFT head, weights from the file.

`forward(mel)` uses torch.istft (the parity path). With per-row `lengths` it runs the same ISTFT as an explicit
overlap-add whose window envelope is computed per row, so each row of a zero-padded batch equals that row alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ttsserve.audio.decoder_net import ConvNeXtBlock, count_blocks, frame_mask, load_checked, tensor_shape


class VocosBackbone(nn.Module):
    """mel [B, n_mels, T] -> features [B, T, dim]: embed conv, LN, ConvNeXt blocks (dilation 1), final LN."""

    def __init__(
        self, n_mels: int, dim: int, intermediate: int, n_layers: int, embed_kernel: int = 7, block_kernel: int = 7
    ):
        super().__init__()
        self.embed = nn.Conv1d(n_mels, dim, embed_kernel, padding=embed_kernel // 2)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.convnext = nn.ModuleList(
            ConvNeXtBlock(dim, intermediate, block_kernel, dilation=1, scale_name="gamma") for _ in range(n_layers)
        )
        self.final_layer_norm = nn.LayerNorm(dim, eps=1e-6)

    @property
    def half_width(self) -> int:
        return self.embed.kernel_size[0] // 2 + sum(b.half_width for b in self.convnext)

    def forward(self, mel: Tensor, mask: Tensor | None = None) -> Tensor:
        x = self.embed(mel if mask is None else mel * mask)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        for block in self.convnext:
            x = block(x, mask)
        return self.final_layer_norm(x.transpose(1, 2))


def overlap_add(frames: Tensor, hop: int) -> Tensor:
    """frames [B, T, n] -> [B, n + hop * (T - 1)]: frame k added in at sample hop * k (F.fold's overlap-add).

    With n a multiple of hop (the vocoder's 1024 / 256) it is n / hop shifted adds of [B, T, hop] slices:
    F.fold's col2im kernel took 0.22 ms a call at 512 rows on an H100 (it reads the frames with a stride)."""
    b, t, n = frames.shape
    r = n // hop
    if r * hop != n:
        fold = {"output_size": (1, n + hop * (t - 1)), "kernel_size": (1, n), "stride": (1, hop)}
        return F.fold(frames.transpose(1, 2), **fold).reshape(b, -1)
    parts = frames.reshape(b, t, r, hop)
    out = frames.new_zeros(b, t + r - 1, hop)
    for j in range(r):
        out[:, j : j + t] += parts[:, :, j]
    return out.reshape(b, -1)


def istft_rows(spec: Tensor, window: Tensor, hop_length: int, frame_mask: Tensor) -> Tensor:
    """torch.istft(center=True) as an explicit overlap-add, frames past each row's length left out.

    spec: complex [B, n_fft/2+1, T]; window: [n_fft]; frame_mask: [B, T] (1 = valid frame).
    Returns [B, hop*(T-1)]; samples past a row's own hop*(T_b-1) are 0.
    """
    n_fft = window.numel()
    t = spec.shape[2]
    frames = torch.fft.irfft(spec.transpose(1, 2), n=n_fft, dim=2) * window * frame_mask[:, :, None]
    y = overlap_add(frames, hop_length)
    env = overlap_add((window * window) * frame_mask[:, :, None], hop_length)
    start, end = n_fft // 2, n_fft // 2 + hop_length * (t - 1)
    y, env = y[:, start:end], env[:, start:end]
    # torch.istft requires env > 1e-11 everywhere; here it vanishes past a row's end, where the samples are zeroed
    num_samples = hop_length * (frame_mask.sum(1, keepdim=True) - 1)
    valid = torch.arange(end - start, device=y.device)[None, :] < num_samples
    return torch.where(valid, y / env.clamp(min=1e-11), torch.zeros_like(y))


class ISTFTHead(nn.Module):
    """features [B, T, dim] -> wav [B, hop*(T-1)]: Linear to log-magnitude and phase, exp clipped at 100."""

    def __init__(self, dim: int, n_fft: int, hop_length: int = 256):
        super().__init__()
        self.n_fft, self.hop_length = n_fft, hop_length
        self.out = nn.Linear(dim, n_fft + 2)
        self.register_buffer("window", torch.hann_window(n_fft))

    def spectrum(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """features [B, T, dim] -> (complex spectrum [B, n_fft/2+1, T], the window), both in fp32 (or fp64)
        whatever the backbone dtype."""
        x = self.out(x).transpose(1, 2)
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        mag, phase = x.chunk(2, dim=1)
        mag = torch.exp(mag).clamp(max=100.0)
        return torch.complex(mag * torch.cos(phase), mag * torch.sin(phase)), self.window.to(x.dtype)

    def forward(self, x: Tensor, frame_mask: Tensor | None = None) -> Tensor:
        spec, window = self.spectrum(x)
        if frame_mask is None:
            return torch.istft(spec, self.n_fft, self.hop_length, self.n_fft, window, center=True)
        return istft_rows(spec, window, self.hop_length, frame_mask.to(window.dtype))


class Vocos(nn.Module):
    """asset/Vocos.safetensors: mel [B, n_mels, T] -> wav [B, hop*(T-1)] at 24 kHz."""

    def __init__(self, backbone: VocosBackbone, head: ISTFTHead):
        super().__init__()
        self.backbone = backbone
        self.head = head

    @property
    def n_mels(self) -> int:
        return self.backbone.embed.in_channels

    @property
    def hop_length(self) -> int:
        return self.head.hop_length

    @property
    def n_fft(self) -> int:
        return self.head.n_fft

    @property
    def receptive_field(self) -> int:
        """Mel frames each side that one spectrum frame depends on (the ISTFT overlap comes on top)."""
        return self.backbone.half_width

    def forward(self, mel: Tensor, lengths: Tensor | None = None) -> Tensor:
        """mel: [B, n_mels, T]; lengths: [B] valid mel frames per row -> wav [B, hop*(T-1)].

        With `lengths`, row b's first hop*(lengths[b]-1) samples equal the decode of mel[b, :, :lengths[b]].
        """
        if mel.dim() != 3 or mel.shape[1] != self.n_mels:
            raise ValueError(f"Vocos: mel must be [B, {self.n_mels}, T], got {tuple(mel.shape)}")
        mask = frame_mask(lengths, mel.shape[-1], mel.dtype)
        x = self.backbone(mel, mask)
        return self.head(x, None if mask is None else mask[:, 0])

    @classmethod
    def from_state_dict(cls, sd: dict[str, Tensor], source: str = "Vocos.safetensors", hop_length: int = 256) -> Vocos:
        dim, n_mels, embed_kernel = tensor_shape(sd, "backbone.embed.weight", source, 3)
        n_layers = count_blocks(sd, "backbone.convnext", source)
        intermediate = tensor_shape(sd, "backbone.convnext.0.pwconv1.weight", source, 2)[0]
        block_kernel = tensor_shape(sd, "backbone.convnext.0.dwconv.weight", source, 3)[2]
        n_fft = tensor_shape(sd, "head.istft.window", source, 1)[0]
        backbone = VocosBackbone(n_mels, dim, intermediate, n_layers, embed_kernel, block_kernel)
        module = cls(backbone, ISTFTHead(dim, n_fft, hop_length))
        # the feature extractor (wav -> mel) is only used for training
        load_checked(module, sd, source, {"head.istft.": "head."}, ignore_prefixes=("feature_extractor.",))
        return module
