"""Random-weight ChatTTS checkpoints in the exact published layout (`--load-format dummy`, test fixtures).

Random weights cost exactly what real ones cost, so speed figures on them are real; the audio is not speech.
Initialisation follows the golden checkpoint's recipe (tests/golden/README.md): matrices N(0, 0.02), norm weights
1 + N(0, 0.02), weight-normed heads with g ~ U(1, 3), conv stacks N(0, 1/fan_in), layer scales U(0.05, 0.2),
`coef` U(0.5, 1.5), real Hann windows and HTK mel filterbanks; plus an EOS clock (model/dummy_eos.py), so that
a sentence gives seconds of noise rather than none or a minute.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ttsserve.constants import SAMPLE_RATE
from ttsserve.model.dummy_eos import add_eos_clock
from ttsserve.model.loader import Checkpoint

SPECIAL_TOKENS = (
    [
        "[Sasr]",
        "[Pasr]",
        "[Easr]",
        "[Stts]",
        "[Ptts]",
        "[Etts]",
        "[Sbreak]",
        "[Pbreak]",
        "[Ebreak]",
        "[uv_break]",
        "[v_break]",
        "[lbreak]",
        "[llbreak]",
        "[undefine]",
        "[laugh]",
        "[spk_emb]",
        "[empty_spk]",
        "[music]",
        "[pure]",
    ]
    + [f"[break_{i}]" for i in range(8)]
    + [f"[laugh_{i}]" for i in range(3)]
    + [f"[oral_{i}]" for i in range(10)]
    + [f"[speed_{i}]" for i in range(10)]
)


@dataclass(frozen=True)
class DummySize:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    num_wordpiece: int  # text vocab = num_wordpiece + 50 specials
    decoder: tuple[int, int, int]  # hidden, n_layer, bn  (idim = odim = hidden_size / 2)
    dvae_dim: int
    dvae: tuple[int, int, int]  # hidden, n_layer, bn; encoder odim = vq dim = 2 * dvae_dim
    vocos: tuple[int, int, int]  # dim, intermediate, n_layer
    eos_gain: float  # the EOS clock (model/dummy_eos.py): K = eos_gain * 0.04 / RMS of the last hidden state
    eos_rho: float  # ... and the first frame's EOS logit is K * (1 - eos_rho)
    text_eos_gain: float  # the refine stage's [Ebreak] logit: text_eos_gain * 0.04 / RMS


SIZES = {
    "real": DummySize(768, 3072, 20, 12, 21128, (512, 12, 128), 512, (256, 12, 128), (512, 1536, 8), 228.0, 1.2, 300.0),
    "tiny": DummySize(64, 128, 2, 4, 974, (64, 2, 16), 32, (64, 2, 16), (64, 192, 2), 6.5, 1.2, 3.5),
}
# Bump when the recipe's code changes: cached dummy checkpoints (model/dummy_cache.py) are keyed by recipe_id.
RECIPE_VERSION = 2


def recipe_id(size: str) -> str:
    """Names the weights make_dummy_checkpoint(size, seed) produces, up to the seed: the recipe version and a
    digest of the size's constants, so a cache never serves weights of an older recipe."""
    import hashlib

    return f"r{RECIPE_VERSION}-{hashlib.sha256(repr(SIZES[size]).encode()).hexdigest()[:8]}"


def _normal(g: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * std


def _uniform(g: torch.Generator, *shape: int, lo: float, hi: float) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(*shape, generator=g)


def _gpt(g: torch.Generator, s: DummySize) -> dict[str, torch.Tensor]:
    sd = {"norm.weight": 1 + _normal(g, s.hidden, std=0.02)}
    for i in range(s.layers):
        p = f"layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = _normal(g, s.hidden, s.hidden, std=0.02)
        sd[p + "mlp.gate_proj.weight"] = _normal(g, s.intermediate, s.hidden, std=0.02)
        sd[p + "mlp.up_proj.weight"] = _normal(g, s.intermediate, s.hidden, std=0.02)
        sd[p + "mlp.down_proj.weight"] = _normal(g, s.hidden, s.intermediate, std=0.02)
        sd[p + "input_layernorm.weight"] = 1 + _normal(g, s.hidden, std=0.02)
        sd[p + "post_attention_layernorm.weight"] = 1 + _normal(g, s.hidden, std=0.02)
    return sd


def _embed(g: torch.Generator, s: DummySize, num_vq: int = 4, num_audio: int = 626) -> dict[str, torch.Tensor]:
    num_text = s.num_wordpiece + len(SPECIAL_TOKENS)
    sd = {"emb_text.weight": _normal(g, num_text, s.hidden, std=0.02)}

    def head(prefix: str, rows: int) -> None:
        sd[prefix + ".parametrizations.weight.original0"] = _uniform(g, rows, 1, lo=1.0, hi=3.0)
        sd[prefix + ".parametrizations.weight.original1"] = _normal(g, rows, s.hidden, std=0.02)

    for q in range(num_vq):
        sd[f"emb_code.{q}.weight"] = _normal(g, num_audio, s.hidden, std=0.02)
    head("head_text", num_text)
    for q in range(num_vq):
        head(f"head_code.{q}", num_audio)
    return sd


def _conv(g: torch.Generator, sd: dict, key: str, out_ch: int, in_ch: int, k: int, bias: bool = True) -> None:
    sd[key + ".weight"] = _normal(g, out_ch, in_ch, k, std=1 / math.sqrt(in_ch * k))
    if bias:
        sd[key + ".bias"] = _normal(g, out_ch, std=0.02)


def _linear(g: torch.Generator, sd: dict, key: str, out_f: int, in_f: int) -> None:
    sd[key + ".weight"] = _normal(g, out_f, in_f, std=1 / math.sqrt(in_f))
    sd[key + ".bias"] = _normal(g, out_f, std=0.02)


def _layer_norm(g: torch.Generator, sd: dict, key: str, dim: int) -> None:
    sd[key + ".weight"] = 1 + _normal(g, dim, std=0.02)
    sd[key + ".bias"] = _normal(g, dim, std=0.02)


def _convnext(g: torch.Generator, sd: dict, key: str, dim: int, inter: int, scale_name: str) -> None:
    sd[key + ".dwconv.weight"] = _normal(g, dim, 1, 7, std=1 / math.sqrt(7))
    sd[key + ".dwconv.bias"] = _normal(g, dim, std=0.02)
    _layer_norm(g, sd, key + ".norm", dim)
    _linear(g, sd, key + ".pwconv1", inter, dim)
    _linear(g, sd, key + ".pwconv2", dim, inter)
    sd[key + "." + scale_name] = _uniform(g, dim, lo=0.05, hi=0.2)


def _dvae_stack(
    g: torch.Generator, sd: dict, key: str, idim: int, odim: int, hidden: int, n_layer: int, bn: int
) -> None:
    _conv(g, sd, key + ".conv_in.0", bn, idim, 3)
    _conv(g, sd, key + ".conv_in.2", hidden, bn, 3)
    for k in range(n_layer):
        _convnext(g, sd, f"{key}.decoder_block.{k}", hidden, 4 * hidden, "weight")
    _conv(g, sd, key + ".conv_out", odim, hidden, 1, bias=False)


def hann_window(n: int = 1024) -> torch.Tensor:
    return torch.hann_window(n, periodic=True)


def htk_mel_filterbank(n_freqs: int = 513, n_mels: int = 100, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Triangular HTK-scale filters without area normalisation, [n_freqs, n_mels] (torchaudio's convention)."""

    def hz_to_mel(f: torch.Tensor) -> torch.Tensor:
        return 2595.0 * torch.log10(1.0 + f / 700.0)

    all_freqs = torch.linspace(0, sample_rate // 2, n_freqs, dtype=torch.float64)
    m_pts = torch.linspace(0.0, float(hz_to_mel(torch.tensor(sample_rate / 2.0))), n_mels + 2, dtype=torch.float64)
    f_pts = 700.0 * (10 ** (m_pts / 2595.0) - 1.0)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts[None, :] - all_freqs[:, None]
    down = -slopes[:, :-2] / f_diff[:-1]
    up = slopes[:, 2:] / f_diff[1:]
    return torch.clamp(torch.minimum(down, up), min=0.0).float()


def _decoder(g: torch.Generator, s: DummySize) -> dict[str, torch.Tensor]:
    hidden, n_layer, bn = s.decoder
    dim = s.hidden // 2
    sd = {"coef": _uniform(g, 1, 100, 1, lo=0.5, hi=1.5)}
    _dvae_stack(g, sd, "decoder", dim, dim, hidden, n_layer, bn)
    _conv(g, sd, "out_conv", 100, dim, 3, bias=False)
    return sd


def _dvae(g: torch.Generator, s: DummySize) -> dict[str, torch.Tensor]:
    dim, (hidden, n_layer, bn) = s.dvae_dim, s.dvae
    vq_dim = 2 * dim
    sd = {"coef": _uniform(g, 1, 100, 1, lo=0.5, hi=1.5)}
    _conv(g, sd, "downsample_conv.0", dim, 100, 3)
    _conv(g, sd, "downsample_conv.2", dim, dim, 4)
    _dvae_stack(g, sd, "encoder", dim, vq_dim, hidden, n_layer, bn)
    _dvae_stack(g, sd, "decoder", dim, dim, hidden, n_layer, bn)
    _conv(g, sd, "out_conv", 100, dim, 3, bias=False)
    for grp in range(2):
        _linear(g, sd, f"vq_layer.quantizer.rvqs.{grp}.project_in", 4, vq_dim // 2)
        _linear(g, sd, f"vq_layer.quantizer.rvqs.{grp}.project_out", vq_dim // 2, 4)
    sd["preprocessor_mel.mel_spec.spectrogram.window"] = hann_window()
    sd["preprocessor_mel.mel_spec.mel_scale.fb"] = htk_mel_filterbank()
    return sd


def _vocos(g: torch.Generator, s: DummySize) -> dict[str, torch.Tensor]:
    dim, inter, n_layer = s.vocos
    sd = {
        "feature_extractor.mel_spec.spectrogram.window": hann_window(),
        "feature_extractor.mel_spec.mel_scale.fb": htk_mel_filterbank(),
    }
    _conv(g, sd, "backbone.embed", dim, 100, 7)
    _layer_norm(g, sd, "backbone.norm", dim)
    for k in range(n_layer):
        _convnext(g, sd, f"backbone.convnext.{k}", dim, inter, "gamma")
    _layer_norm(g, sd, "backbone.final_layer_norm", dim)
    _linear(g, sd, "head.out", 1026, dim)
    sd["head.istft.window"] = hann_window()
    return sd


def gpt_config_json(s: DummySize) -> dict:
    """`asset/gpt/config.json` with the published keys (MODEL.md §1.3), sized for `s`."""
    return {
        "architectures": ["LlamaModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": s.hidden,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate,
        "max_position_embeddings": 4096,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": s.heads,
        "num_hidden_layers": s.layers,
        "num_key_value_heads": s.heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.41.2",
        "use_cache": False,
        "vocab_size": 32000,
        "num_audio_tokens": 626,
        "num_text_tokens": s.num_wordpiece + len(SPECIAL_TOKENS),
        "num_vq": 4,
        "spk_emb_dim": 192,
        "spk_KL": False,
    }


def make_dummy_checkpoint(size: str = "real", seed: int = 0, tokenizer_dir: Path | None = None) -> Checkpoint:
    """An in-memory random checkpoint; `tokenizer_dir` receives generated tokenizer files (a temp dir if None)."""
    if size not in SIZES:
        raise ValueError(f"dummy size must be one of {sorted(SIZES)}, got {size!r}")
    import tempfile

    from ttsserve.model.dummy_tokenizer import write_tokenizer

    s = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    tok_dir = Path(tokenizer_dir or tempfile.mkdtemp(prefix="ttsserve-dummy-tok-"))
    write_tokenizer(tok_dir, s.num_wordpiece, SPECIAL_TOKENS)
    std = _uniform(g, s.hidden, lo=1.64, hi=15.7).half()
    mean = _normal(g, s.hidden, std=4.0).clamp(-8.8, 8.9).half()
    from ttsserve.text.speaker import encode_spk_stat

    gpt, embed = _gpt(g, s), _embed(g, s)
    add_eos_clock(
        gpt,
        embed,
        s.hidden,
        s.layers,
        s.heads,
        s.eos_gain,
        s.eos_rho,
        text_eos_id=s.num_wordpiece + SPECIAL_TOKENS.index("[Ebreak]"),
        text_gain=s.text_eos_gain,
    )
    return Checkpoint(
        gpt_config=gpt_config_json(s),
        gpt=gpt,
        embed=embed,
        decoder=_decoder(g, s),
        dvae=_dvae(g, s),
        vocos=_vocos(g, s),
        tokenizer_dir=tok_dir,
        extra_config={
            "size": size,
            "seed": seed,
            "recipe": recipe_id(size),
            "spk_stat": encode_spk_stat(std.numpy(), mean.numpy()),
        },
        source=f"dummy ({size}, seed {seed})",
    )


def save_checkpoint(ckpt: Checkpoint, root: str | Path) -> Path:
    """Write `ckpt` in the published ChatTTS layout under `root` (returns root)."""
    import shutil

    from safetensors.torch import save_file

    root = Path(root)
    (root / "asset/gpt").mkdir(parents=True, exist_ok=True)
    (root / "asset/tokenizer").mkdir(parents=True, exist_ok=True)
    (root / "asset/gpt/config.json").write_text(json.dumps(ckpt.gpt_config, indent=2))
    meta = {"format": "pt"}
    save_file({k: v.contiguous() for k, v in ckpt.gpt.items()}, str(root / "asset/gpt/model.safetensors"), meta)
    for name, sd in (("Embed", ckpt.embed), ("Decoder", ckpt.decoder), ("DVAE", ckpt.dvae), ("Vocos", ckpt.vocos)):
        save_file({k: v.contiguous() for k, v in sd.items()}, str(root / f"asset/{name}.safetensors"), meta)
    for f in ckpt.tokenizer_dir.iterdir():
        if f.resolve() != (root / "asset/tokenizer" / f.name).resolve():
            shutil.copy(f, root / "asset/tokenizer" / f.name)
    if ckpt.extra_config:
        (root / "chattts_config.json").write_text(json.dumps(ckpt.extra_config, indent=2))
    return root


def main(argv: list[str] | None = None) -> None:
    """`python -m ttsserve.model.dummy OUT [--size real|tiny] [--seed N]`: write a random checkpoint."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("out")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(save_checkpoint(make_dummy_checkpoint(a.size, a.seed), a.out))


if __name__ == "__main__":
    main()
