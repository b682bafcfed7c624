"""ChatTTS audio decoders in plain torch (MODEL.md §1.6, §1.7, §5.2-5.4).

- `ConvNeXtBlock` / `ConvNeXtStack`: the DVAE-style conv stack (dwconv k7 dilation 2, LayerNorm eps 1e-6, MLP with
  exact-erf GELU, layer scale named `weight`); Vocos reuses the block with dilation 1 and scale `gamma`.
- `HiddenDecoder` (asset/Decoder.safetensors): GPT hiddens [B, H, N] -> mel [B, n_mels, 2N].
- `DVAE` (asset/DVAE.safetensors): codes [B, 4, N] -> mel [B, n_mels, 2N], and wav -> codes.

Every size is read from the checkpoint tensors. Each forward takes optional per-row `lengths`: the input of
every temporal conv is zeroed past a row's length, so a row of a zero-padded batch equals that row decoded alone
(its conv zero padding lands exactly where the single decode's would).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ttsserve.audio.gfsq import GFSQ
from ttsserve.audio.mel import MelSpectrogram


def frame_mask(lengths: Tensor | None, num_frames: int, dtype: torch.dtype) -> Tensor | None:
    """lengths: [B] valid frames per row -> [B, 1, num_frames] mask of ones then zeros (None passes through)."""
    if lengths is None:
        return None
    pos = torch.arange(num_frames, device=lengths.device)
    return (pos[None, :] < lengths[:, None]).unsqueeze(1).to(dtype)


def _masked(x: Tensor, mask: Tensor | None) -> Tensor:
    return x if mask is None else x * mask


def halves_to_frames(x: Tensor) -> Tensor:
    """[B, C, N] -> [B, C/2, 2N]: frame 2t takes channels 0..C/2-1 of step t, frame 2t+1 the other half."""
    b, c, n = x.shape
    return x.view(b, 2, c // 2, n).permute(0, 2, 3, 1).flatten(2)


class ConvNeXtBlock(nn.Module):
    """x [B, dim, T] -> x + scale * MLP(LN(dwconv(x))); `scale_name` is `weight` (DVAE files) or `gamma` (Vocos)."""

    def __init__(
        self, dim: int, intermediate: int, kernel_size: int = 7, dilation: int = 2, scale_name: str = "weight"
    ):
        super().__init__()
        self.dwconv = nn.Conv1d(
            dim, dim, kernel_size, padding=dilation * (kernel_size - 1) // 2, dilation=dilation, groups=dim
        )
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, intermediate)
        self.pwconv2 = nn.Linear(intermediate, dim)
        self.scale_name = scale_name
        self.register_parameter(scale_name, nn.Parameter(torch.ones(dim)))

    @property
    def half_width(self) -> int:
        return self.dwconv.dilation[0] * (self.dwconv.kernel_size[0] - 1) // 2

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        y = self.dwconv(_masked(x, mask)).transpose(1, 2)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + (y * getattr(self, self.scale_name)).transpose(1, 2)


class ConvNeXtStack(nn.Module):
    """The reference's `DVAEDecoder`: conv_in (conv, GELU, conv) -> ConvNeXt blocks -> conv_out (k1, no bias).

    x [B, idim, T] -> [B, odim, T]; T is unchanged (every conv is 'same' padded).
    """

    def __init__(
        self,
        idim: int,
        odim: int,
        hidden: int,
        bn_dim: int,
        n_layers: int,
        intermediate: int,
        in_kernel: int = 3,
        block_kernel: int = 7,
        dilation: int = 2,
    ):
        super().__init__()
        self.conv_in = nn.Sequential(
            nn.Conv1d(idim, bn_dim, in_kernel, padding=in_kernel // 2),
            nn.GELU(),
            nn.Conv1d(bn_dim, hidden, in_kernel, padding=in_kernel // 2),
        )
        self.decoder_block = nn.ModuleList(
            ConvNeXtBlock(hidden, intermediate, block_kernel, dilation) for _ in range(n_layers)
        )
        self.conv_out = nn.Conv1d(hidden, odim, 1, bias=False)

    @property
    def half_width(self) -> int:
        """Frames each side that one output frame depends on (sum of the convs' half widths)."""
        convs = (self.conv_in[0], self.conv_in[2])
        return sum(c.kernel_size[0] // 2 for c in convs) + sum(b.half_width for b in self.decoder_block)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = self.conv_in[0](_masked(x, mask))
        x = self.conv_in[2](_masked(F.gelu(x), mask))
        for block in self.decoder_block:
            x = block(x, mask)
        return self.conv_out(x)


# ---------------------------------------------------------------- checkpoint reading


def tensor_shape(sd: dict[str, Tensor], key: str, source: str, ndim: int) -> tuple[int, ...]:
    """Shape of sd[key], or ValueError naming the file-level key when it is missing or has the wrong rank."""
    if key not in sd:
        raise ValueError(f"{source}: missing tensor {key!r}")
    shape = tuple(sd[key].shape)
    if len(shape) != ndim:
        raise ValueError(f"{source}: tensor {key!r} must be {ndim}-D, got shape {list(shape)}")
    return shape


def count_blocks(sd: dict[str, Tensor], prefix: str, source: str) -> int:
    """Number of `{prefix}.{k}.*` blocks (max index + 1; a gap shows up later as a missing tensor)."""
    pat = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    idx = {int(m.group(1)) for k in sd if (m := pat.match(k))}
    if not idx:
        raise ValueError(f"{source}: no tensors {prefix}.<k>.*")
    return max(idx) + 1


def stack_from_state_dict(sd: dict[str, Tensor], prefix: str, source: str) -> ConvNeXtStack:
    """Build (not load) a ConvNeXtStack whose sizes are read from `{prefix}.*` tensors."""
    bn_dim, idim, in_kernel = tensor_shape(sd, f"{prefix}.conv_in.0.weight", source, 3)
    hidden = tensor_shape(sd, f"{prefix}.conv_in.2.weight", source, 3)[0]
    odim = tensor_shape(sd, f"{prefix}.conv_out.weight", source, 3)[0]
    n_layers = count_blocks(sd, f"{prefix}.decoder_block", source)
    intermediate = tensor_shape(sd, f"{prefix}.decoder_block.0.pwconv1.weight", source, 2)[0]
    block_kernel = tensor_shape(sd, f"{prefix}.decoder_block.0.dwconv.weight", source, 3)[2]
    if in_kernel % 2 == 0 or block_kernel % 2 == 0:
        raise ValueError(f"{source}: {prefix} conv kernels must be odd, got {in_kernel} and {block_kernel}")
    return ConvNeXtStack(idim, odim, hidden, bn_dim, n_layers, intermediate, in_kernel, block_kernel)


def load_checked(
    module: nn.Module,
    sd: dict[str, Tensor],
    source: str,
    renames: dict[str, str] | None = None,
    ignore_prefixes: tuple[str, ...] = (),
) -> None:
    """Strict load of `sd` into `module` (values cast to the module's dtype).

    renames: file-key prefix -> module-key prefix. Raises ValueError naming the file-level key of the first
    unexpected, mis-shaped or missing tensor.
    """
    renames = renames or {}

    def rename(key: str, table: dict[str, str]) -> str:
        for old, new in table.items():
            if key.startswith(old):
                return new + key[len(old) :]
        return key

    expected = module.state_dict()
    mapped: dict[str, Tensor] = {}
    for fkey, t in sd.items():
        if fkey.startswith(ignore_prefixes):
            continue
        mkey = rename(fkey, renames)
        if mkey not in expected:
            raise ValueError(f"{source}: unexpected tensor {fkey!r}")
        if tuple(t.shape) != tuple(expected[mkey].shape):
            raise ValueError(
                f"{source}: tensor {fkey!r} has shape {list(t.shape)}, expected {list(expected[mkey].shape)}"
            )
        mapped[mkey] = t
    missing = [k for k in expected if k not in mapped]
    if missing:
        inverse = {new: old for old, new in renames.items()}
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{source}: missing tensor {rename(missing[0], inverse)!r}{more}")
    module.load_state_dict(mapped, strict=True)


# ---------------------------------------------------------------- the two decoders


class HiddenDecoder(nn.Module):
    """asset/Decoder.safetensors: GPT hidden states -> log-mel-like features for Vocos (MODEL.md §5.2)."""

    def __init__(self, decoder: ConvNeXtStack, n_mels: int, out_kernel: int = 3):
        super().__init__()
        self.decoder = decoder
        odim = decoder.conv_out.out_channels
        self.out_conv = nn.Conv1d(odim, n_mels, out_kernel, padding=out_kernel // 2, bias=False)
        self.register_buffer("coef", torch.ones(1, n_mels, 1))

    @property
    def hidden_size(self) -> int:
        return 2 * self.decoder.conv_in[0].in_channels

    @property
    def receptive_field(self) -> int:
        """Mel frames each side that one output mel frame depends on."""
        return self.decoder.half_width + self.out_conv.kernel_size[0] // 2

    def forward(self, hidden: Tensor, lengths: Tensor | None = None) -> Tensor:
        """hidden: [B, H, N] (H = hidden_size); lengths: [B] valid steps per row -> mel [B, n_mels, 2N].

        With `lengths`, mel frames past 2 * lengths[b] are zero and valid frames equal the unpadded decode.
        """
        if hidden.dim() != 3 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"HiddenDecoder: hidden must be [B, {self.hidden_size}, N], got {tuple(hidden.shape)}")
        x = halves_to_frames(hidden)
        mask = frame_mask(None if lengths is None else 2 * lengths, x.shape[-1], x.dtype)
        x = self.decoder(x, mask)
        return _masked(self.out_conv(_masked(x, mask)) * self.coef, mask)

    @classmethod
    def from_state_dict(cls, sd: dict[str, Tensor], source: str = "Decoder.safetensors") -> HiddenDecoder:
        stack = stack_from_state_dict(sd, "decoder", source)
        n_mels, _, out_kernel = tensor_shape(sd, "out_conv.weight", source, 3)
        module = cls(stack, n_mels, out_kernel)
        load_checked(module, sd, source)
        return module


class DVAE(nn.Module):
    """asset/DVAE.safetensors: codes <-> mel through the GFSQ (MODEL.md §5.3 decode, §5.4 encode)."""

    def __init__(
        self,
        encoder: ConvNeXtStack,
        decoder: ConvNeXtStack,
        vq: GFSQ,
        n_mels: int,
        n_fft: int,
        out_kernel: int = 3,
        hop_length: int = 256,
    ):
        super().__init__()
        dim = encoder.conv_in[0].in_channels
        self.downsample_conv = nn.Sequential(
            nn.Conv1d(n_mels, dim, 3, padding=1), nn.GELU(), nn.Conv1d(dim, dim, 4, stride=2, padding=1), nn.GELU()
        )
        self.encoder = encoder
        self.decoder = decoder
        odim = decoder.conv_out.out_channels
        self.out_conv = nn.Conv1d(odim, n_mels, out_kernel, padding=out_kernel // 2, bias=False)
        self.register_buffer("coef", torch.ones(1, n_mels, 1))
        self.vq_layer = vq
        self.preprocessor_mel = MelSpectrogram(n_fft, n_mels, hop_length)

    @property
    def num_vq(self) -> int:
        return self.vq_layer.num_codebooks

    @property
    def receptive_field(self) -> int:
        """Mel frames each side that one decoded mel frame depends on (the GFSQ is per frame)."""
        return self.decoder.half_width + self.out_conv.kernel_size[0] // 2

    def decode_codes(self, codes: Tensor, lengths: Tensor | None = None) -> Tensor:
        """codes: LongTensor [B, 4, N]; lengths: [B] valid steps per row -> mel [B, n_mels, 2N]."""
        latent = self.vq_layer.dequantize(codes)  # [B, dim, N]
        x = halves_to_frames(latent)
        mask = frame_mask(None if lengths is None else 2 * lengths, x.shape[-1], x.dtype)
        x = self.decoder(x, mask)
        return _masked(self.out_conv(_masked(x, mask)) * self.coef, mask)

    @torch.no_grad()
    def encode_wav(self, wav: Tensor) -> Tensor:
        """wav: [S] or [B, S] at 24 kHz -> LongTensor codes [B, 4, N], N = (S // hop + 1) // 2."""
        mel = self.preprocessor_mel(wav.to(self.coef.dtype))
        x = torch.log(mel.clamp(min=1e-5)) / self.coef
        x = self.encoder(self.downsample_conv(x))
        return self.vq_layer.quantize(x)

    @classmethod
    def from_state_dict(cls, sd: dict[str, Tensor], source: str = "DVAE.safetensors") -> DVAE:
        encoder = stack_from_state_dict(sd, "encoder", source)
        decoder = stack_from_state_dict(sd, "decoder", source)
        n_mels, _, out_kernel = tensor_shape(sd, "out_conv.weight", source, 3)
        n_groups = count_blocks(sd, "vq_layer.quantizer.rvqs", source)
        fsq_dim, group_dim = tensor_shape(sd, "vq_layer.quantizer.rvqs.0.project_in.weight", source, 2)
        n_fft = tensor_shape(sd, "preprocessor_mel.mel_spec.spectrogram.window", source, 1)[0]
        vq = GFSQ(group_dim * n_groups, n_groups, num_residuals=2, fsq_dim=fsq_dim)
        if encoder.conv_out.out_channels != vq.dim:
            raise ValueError(
                f"{source}: tensor 'encoder.conv_out.weight' gives {encoder.conv_out.out_channels} "
                f"channels, but the GFSQ groups need {vq.dim}"
            )
        if 2 * decoder.conv_in[0].in_channels != vq.dim:
            raise ValueError(
                f"{source}: tensor 'decoder.conv_in.0.weight' takes {decoder.conv_in[0].in_channels} "
                f"channels, but the GFSQ latent gives {vq.dim} // 2"
            )
        module = cls(encoder, decoder, vq, n_mels, n_fft, out_kernel)
        renames = {
            "vq_layer.quantizer.": "vq_layer.",
            "preprocessor_mel.mel_spec.spectrogram.window": "preprocessor_mel.window",
            "preprocessor_mel.mel_spec.mel_scale.fb": "preprocessor_mel.fb",
        }
        load_checked(module, sd, source, renames)
        return module
