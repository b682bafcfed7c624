"""Magnitude mel spectrogram in plain torch, equal to torchaudio's `MelSpectrogram(center=True, power=1)`.

The window (periodic Hann) and the HTK filterbank are checkpoint buffers (`...spectrogram.window`,
`...mel_scale.fb`), so nothing here recomputes them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class MelSpectrogram(nn.Module):
    """wav [B, S] or [S] -> mel [B, n_mels, S // hop + 1] (reflect center padding, |STFT|, fb projection).

    window: [n_fft]; fb: [n_fft // 2 + 1, n_mels].
    """

    def __init__(self, n_fft: int = 1024, n_mels: int = 100, hop_length: int = 256) -> None:
        super().__init__()
        self.n_fft, self.n_mels, self.hop_length = n_fft, n_mels, hop_length
        self.register_buffer("window", torch.hann_window(n_fft))
        self.register_buffer("fb", torch.zeros(n_fft // 2 + 1, n_mels))

    def forward(self, wav: Tensor) -> Tensor:
        if wav.dim() == 1:
            wav = wav.unsqueeze(0)
        if wav.dim() != 2:
            raise ValueError(f"MelSpectrogram: wav must be [S] or [B, S], got {tuple(wav.shape)}")
        if wav.shape[-1] <= self.n_fft // 2:
            # reflect padding needs more samples than the pad width
            raise ValueError(f"MelSpectrogram: need more than {self.n_fft // 2} samples, got {wav.shape[-1]}")
        spec = torch.stft(
            wav,
            n_fft=self.n_fft,
            hop_length=self.hop_length,
            win_length=self.n_fft,
            window=self.window,
            center=True,
            pad_mode="reflect",
            normalized=False,
            onesided=True,
            return_complex=True,
        ).abs()  # [B, n_fft/2+1, T]
        return torch.matmul(spec.transpose(-1, -2), self.fb).transpose(-1, -2)
