"""Parity of the plain-torch audio networks with the reference golden vectors (tests/golden/e_*.npz)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ttsserve.audio.decoder_net import DVAE, HiddenDecoder
from ttsserve.audio.gfsq import GFSQ
from ttsserve.audio.mel import MelSpectrogram
from ttsserve.audio.vocos import Vocos, istft_rows

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
ASSET = GOLDEN / "assets-tiny" / "asset"
MEL_ATOL, DVAE_MEL_ATOL, WAV_ATOL = 2e-5, 1e-5, 1e-5  # tests/golden/README.md "Tolerances"


@pytest.fixture(scope="module")
def sds() -> dict[str, dict[str, torch.Tensor]]:
    return {name: load_file(ASSET / f"{name}.safetensors") for name in ("Decoder", "DVAE", "Vocos")}


@pytest.fixture(scope="module")
def nets(sds):
    return (
        HiddenDecoder.from_state_dict(sds["Decoder"]),
        DVAE.from_state_dict(sds["DVAE"]),
        Vocos.from_state_dict(sds["Vocos"]),
    )


@pytest.fixture(scope="module")
def e() -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN / "e_decode.npz"))


def _max_diff(a: torch.Tensor, b: np.ndarray) -> float:
    return float(np.abs(a.detach().numpy() - b).max())


@torch.no_grad()
def test_sizes_inferred_from_tiny_checkpoint(nets) -> None:
    dec, dvae, vocos = nets
    assert dec.hidden_size == 64 and len(dec.decoder.decoder_block) == 2
    assert dec.decoder.decoder_block[0].pwconv1.out_features == 256
    assert dvae.num_vq == 4 and dvae.vq_layer.dim == 64
    assert vocos.n_mels == 100 and vocos.n_fft == 1024 and len(vocos.backbone.convnext) == 2
    # MODEL.md §5.6: per mel frame, conv_in 1+1, k7 dilation 2 blocks 6 each, out_conv 1; Vocos embed 3 + 3 per block
    assert dec.receptive_field == 2 + 2 * 6 + 1 and dvae.receptive_field == 15 and vocos.receptive_field == 3 + 2 * 3


@torch.no_grad()
def test_hidden_decoder_and_vocos_match_golden(nets, e) -> None:
    dec, _, vocos = nets
    hidden = torch.from_numpy(e["decoder_input_hiddens"]).T[None]  # [1, 64, 32]
    mel = dec(hidden)
    assert mel.shape == (1, 100, 64)
    assert _max_diff(mel[0], e["decoder_mel"]) < MEL_ATOL
    wav = vocos(mel)
    assert wav.shape == (1, 512 * 32 - 256)
    assert _max_diff(wav[0], e["decoder_wav"]) < WAV_ATOL


@torch.no_grad()
def test_dvae_decode_matches_golden(nets, e) -> None:
    _, dvae, vocos = nets
    codes = torch.from_numpy(e["dvae_input_codes"]).T[None]  # [1, 4, 24]
    mel = dvae.decode_codes(codes)
    assert mel.shape == (1, 100, 48)
    assert _max_diff(mel[0], e["dvae_mel"]) < DVAE_MEL_ATOL
    assert _max_diff(vocos(mel)[0], e["dvae_wav"]) < WAV_ATOL


@torch.no_grad()
def test_zero_padded_batch_matches_reference_and_masked_rows_match_single(nets, e) -> None:
    dec, _, vocos = nets
    hidden = torch.from_numpy(e["decoder_input_hiddens"]).T  # [64, 32]
    lengths = torch.from_numpy(e["batch_decoder_input_lengths"])  # [32, 24]
    batch = torch.zeros(2, 64, 32)
    batch[0] = hidden
    batch[1, :, :24] = hidden[:, :24]
    # the reference decodes the zero padding too (no lengths)
    assert _max_diff(vocos(dec(batch)), e["batch_decoder_wav"]) < WAV_ATOL
    # with lengths, the short row equals its own decode and is zero past 512 n - 256
    wav = vocos(dec(batch, lengths), 2 * lengths)
    single = vocos(dec(hidden[None, :, :24]))[0]
    n1 = 512 * 24 - 256
    assert (wav[1, :n1] - single).abs().max() < 1e-6
    assert wav[1, n1:].abs().max() == 0
    assert _max_diff(wav[0], e["batch_decoder_wav"][0]) < WAV_ATOL
    # padding leaks into the short row without the masks: the test above can fail
    assert (vocos(dec(batch))[1, :n1] - single).abs().max() > 1e-3


def test_masked_istft_equals_torch_istft() -> None:
    g = torch.Generator().manual_seed(0)
    spec = torch.complex(torch.randn(3, 513, 10, generator=g), torch.randn(3, 513, 10, generator=g))
    window = torch.hann_window(1024)
    ref = torch.istft(spec, 1024, 256, 1024, window, center=True)
    out = istft_rows(spec, window, 256, torch.ones(3, 10))
    assert (out - ref).abs().max() < 1e-5 * ref.abs().max()
    short = istft_rows(spec, window, 256, (torch.arange(10) < 6).float().expand(3, 10))
    ref6 = torch.istft(spec[:, :, :6], 1024, 256, 1024, window, center=True)
    assert (short[:, : 256 * 5] - ref6).abs().max() < 1e-5 * ref6.abs().max()
    assert short[:, 256 * 5 :].abs().max() == 0


def test_overlap_add_is_folds_overlap_add() -> None:
    """The slice adds (frame length a multiple of the hop) and the F.fold fallback (any other length) both
    give F.fold's overlap-add of frames [B, T, n] at stride hop."""
    import torch.nn.functional as F

    from ttsserve.audio.vocos import overlap_add

    g = torch.Generator().manual_seed(1)
    for n, hop, t in ((1024, 256, 7), (1024, 256, 1), (1000, 256, 5), (12, 4, 3)):
        frames = torch.randn(3, t, n, generator=g)
        want = F.fold(
            frames.transpose(1, 2), output_size=(1, n + hop * (t - 1)), kernel_size=(1, n), stride=(1, hop)
        ).reshape(3, -1)
        got = overlap_add(frames, hop)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_dvae_encode_reproduces_golden_codes(nets) -> None:
    _, dvae, _ = nets
    s = np.load(GOLDEN / "e_spk_encode.npz")
    codes = dvae.encode_wav(torch.from_numpy(s["input_wav"]))
    assert codes.dtype == torch.long and codes.shape == (1, 4, 32)
    assert np.array_equal(codes[0].numpy(), s["codes"].astype(np.int64))
    batched = dvae.encode_wav(torch.from_numpy(s["input_wav"]).expand(2, -1))
    assert torch.equal(batched, codes.expand(2, -1, -1))


@torch.no_grad()
def test_mel_matches_direct_dft(sds) -> None:
    mel = MelSpectrogram()
    mel.window.copy_(sds["DVAE"]["preprocessor_mel.mel_spec.spectrogram.window"])
    mel.fb.copy_(sds["DVAE"]["preprocessor_mel.mel_spec.mel_scale.fb"])
    wav = torch.from_numpy(np.random.default_rng(0).standard_normal(3000).astype(np.float32))
    out = mel(wav)
    assert out.shape == (1, 100, 3000 // 256 + 1)
    padded = np.pad(wav.double().numpy(), 512, mode="reflect")
    win, fb = mel.window.double().numpy(), mel.fb.double().numpy()
    for t in (0, 5, 11):
        mag = np.abs(np.fft.rfft(padded[256 * t : 256 * t + 1024] * win))
        assert np.abs(mag @ fb - out[0, :, t].double().numpy()).max() < 1e-4
    with pytest.raises(ValueError, match="more than 512 samples"):
        mel(wav[:512])


def test_gfsq_digit_order_and_residual_scale() -> None:
    vq = GFSQ(dim=8, num_groups=2, num_residuals=2)
    with torch.no_grad():
        for grp in vq.rvqs:  # identity projections expose the FSQ values
            grp.project_out.weight.copy_(torch.eye(4))
            grp.project_out.bias.zero_()
    # group 0: r0 = idx 1 (digit0 = 1, others 0), r1 = idx 624 (all digits 4); group 1: r0 = 5^3 * 4, r1 = 0
    codes = torch.tensor([[1, 624, 4 * 125, 0]]).T[None]  # [1, 4, 1]
    z = vq.dequantize(codes)[0, :, 0]
    g0 = torch.tensor([-0.5, -1, -1, -1]) + 0.25 * torch.tensor([1.0, 1, 1, 1])
    g1 = torch.tensor([-1.0, -1, -1, 1]) + 0.25 * torch.tensor([-1.0, -1, -1, -1])
    assert torch.equal(z, torch.cat([g0, g1]))


def test_quantize_is_unclamped_2002_tanh() -> None:
    vq = GFSQ(dim=8, num_groups=2, num_residuals=2)
    with torch.no_grad():
        for grp in vq.rvqs:
            grp.project_in.weight.copy_(torch.eye(4))
            grp.project_in.bias.zero_()
    # z = 0.8: 2.002 tanh(0.8) = 1.328 -> q0 = 1/2, res 0.3 -> 2.002 tanh(1.2) = 1.667 -> q1 = 1 (idx digit 4)
    # z = 3.0 (no clamp): q0 = 1 -> res 2.0 -> q1 = 1; z = -0.2: q0 = 0 -> 2.002 tanh(-0.8) -> -1/2 (digit 1)
    x = torch.tensor([0.8, 3.0, -0.2, 0.0, 0.8, 3.0, -0.2, 0.0])[None, :, None]
    codes = vq.quantize(x)[0, :, 0]
    basis = torch.tensor([1, 5, 25, 125])
    r0 = (torch.tensor([3, 4, 2, 2]) * basis).sum()
    r1 = (torch.tensor([4, 4, 1, 2]) * basis).sum()
    assert codes.tolist() == [r0, r1, r0, r1]


@pytest.mark.parametrize("cls,name", [(HiddenDecoder, "Decoder"), (DVAE, "DVAE"), (Vocos, "Vocos")])
def test_from_state_dict_names_bad_tensors(sds, cls, name) -> None:
    sd = dict(sds[name])
    src = f"{name}.safetensors"
    key = next(k for k in sd if ".1.pwconv2.weight" in k)
    missing = {k: v for k, v in sd.items() if k != key}
    with pytest.raises(ValueError, match=rf"{src}: missing tensor '{key}'"):
        cls.from_state_dict(missing, src)
    with pytest.raises(ValueError, match=rf"{src}: unexpected tensor 'extra.weight'"):
        cls.from_state_dict({**sd, "extra.weight": torch.zeros(1)}, src)
    with pytest.raises(ValueError, match=rf"{src}: tensor '{key}' has shape \[64, 7\]"):
        cls.from_state_dict({**sd, key: torch.zeros(64, 7)}, src)


def test_from_state_dict_renamed_keys_are_reported_by_file_name(sds) -> None:
    sd = {k: v for k, v in sds["DVAE"].items() if k != "vq_layer.quantizer.rvqs.1.project_out.bias"}
    with pytest.raises(ValueError, match=r"missing tensor 'vq_layer.quantizer.rvqs.1.project_out.bias'"):
        DVAE.from_state_dict(sd)
    sd = {k: v for k, v in sds["Vocos"].items() if k != "head.istft.window"}
    with pytest.raises(ValueError, match=r"Vocos.safetensors: missing tensor 'head.istft.window'"):
        Vocos.from_state_dict(sd)
    # the training-only feature extractor may be absent
    sd = {k: v for k, v in sds["Vocos"].items() if not k.startswith("feature_extractor.")}
    assert Vocos.from_state_dict(sd).n_fft == 1024
