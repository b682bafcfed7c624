"""The whole ChatTTS model (GPT, embeddings/heads, audio decoders, vocoder, tokenizer) built from a checkpoint."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ttsserve.config import EngineConfig, GPTConfig
from ttsserve.model.loader import Checkpoint, load_checkpoint, resolve_checkpoint_root

logger = logging.getLogger(__name__)

DUMMY_WARNING = (
    "\n" + "!" * 100 + "\n"
    "!!  ttsserve is running a DUMMY model with RANDOM weights ({source}).\n"
    "!!  Every speed and memory figure is real, but the audio is noise, not speech.\n"
    "!!  Pass --model /path/to/ChatTTS (the folder holding asset/) or put the checkpoint in ./asset.\n"
    + "!" * 100
)


@dataclass
class ChatTTSModel:
    """Built modules plus the facts the engine needs. The GPT runs in `dtype`; the rest stays fp32."""

    gpt_config: GPTConfig
    gpt: torch.nn.Module
    embed: torch.nn.Module
    decoder: torch.nn.Module
    dvae: torch.nn.Module
    vocos: torch.nn.Module
    tokenizer: object  # ttsserve.text.tokenizer.TextTokenizer
    spk_stat: tuple[np.ndarray, np.ndarray] | None  # fp16 (std, mean), each [hidden_size]
    device: torch.device
    dtype: torch.dtype
    source: str
    is_dummy: bool

    @property
    def hidden_size(self) -> int:
        return self.gpt_config.hidden_size

    def weight_bytes(self) -> int:
        mods = (self.gpt, self.embed, self.decoder, self.dvae, self.vocos)
        return sum(p.numel() * p.element_size() for m in mods for p in m.parameters())


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA; fp32 on CPU (the parity path)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def read_checkpoint(cfg: EngineConfig) -> Checkpoint:
    """The checkpoint `cfg` names, or a dummy one (with a loud warning) when allowed and none is found."""
    if cfg.load_format == "dummy":
        from ttsserve.model.dummy import make_dummy_checkpoint

        return make_dummy_checkpoint(cfg.dummy_size, cfg.seed)
    root = resolve_checkpoint_root(cfg.model)
    if root is None:
        if cfg.load_format == "safetensors":
            raise ValueError("no ChatTTS checkpoint found: pass --model DIR (the folder holding asset/), set "
                             "$TTSSERVE_MODEL, or use --load-format dummy")
        from ttsserve.model.dummy import make_dummy_checkpoint

        logger.warning("no ChatTTS checkpoint found (--model, $TTSSERVE_MODEL, ./asset, hub cache): "
                       "falling back to --load-format dummy")
        return make_dummy_checkpoint(cfg.dummy_size, cfg.seed)
    return load_checkpoint(root, verify_sha256=cfg.verify_sha256)


def build_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> ChatTTSModel:
    """Build every module from `ckpt` (sizes inferred from the tensors; ValueError naming any bad tensor)."""
    from ttsserve.audio.decoder_net import DVAE, HiddenDecoder
    from ttsserve.audio.vocos import Vocos
    from ttsserve.model.embed import Embed
    from ttsserve.model.gpt import GPT
    from ttsserve.text.speaker import decode_spk_stat
    from ttsserve.text.tokenizer import TextTokenizer

    gpt_cfg = GPTConfig.from_hf_json(ckpt.gpt_config)
    embed = Embed.from_state_dict(ckpt.embed).to(device)
    if (embed.hidden_size, embed.num_text_tokens) != (gpt_cfg.hidden_size, gpt_cfg.num_text_tokens):
        raise ValueError(f"Embed.safetensors: hidden {embed.hidden_size} / text vocab {embed.num_text_tokens} "
                         f"disagree with gpt/config.json ({gpt_cfg.hidden_size} / {gpt_cfg.num_text_tokens})")
    tokenizer = TextTokenizer.from_dir(ckpt.tokenizer_dir)
    if tokenizer.vocab_size != embed.num_text_tokens:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but Embed.safetensors has "
                         f"{embed.num_text_tokens} text embeddings")
    spk_stat = None
    if ckpt.extra_config.get("spk_stat"):
        spk_stat = decode_spk_stat(ckpt.extra_config["spk_stat"])
    else:
        logger.warning("checkpoint has no spk_stat (chattts_config.json): random speakers are sampled from N(0, 1)")
    model = ChatTTSModel(
        gpt_config=gpt_cfg,
        gpt=GPT.from_state_dict(ckpt.gpt, gpt_cfg, dtype=dtype, device=device),
        embed=embed,
        decoder=HiddenDecoder.from_state_dict(ckpt.decoder, source="Decoder.safetensors").to(device),
        dvae=DVAE.from_state_dict(ckpt.dvae, source="DVAE.safetensors").to(device),
        vocos=Vocos.from_state_dict(ckpt.vocos, source="Vocos.safetensors").to(device),
        tokenizer=tokenizer, spk_stat=spk_stat, device=device, dtype=dtype, source=ckpt.source,
        is_dummy=ckpt.source.startswith("dummy"),
    )
    for m in (model.gpt, model.embed, model.decoder, model.dvae, model.vocos):
        m.eval().requires_grad_(False)
    return model


def load_model(cfg: EngineConfig) -> ChatTTSModel:
    device = resolve_device(cfg.device)
    ckpt = read_checkpoint(cfg)
    model = build_model(ckpt, device, resolve_dtype(cfg.dtype, device))
    if model.is_dummy:
        logger.warning(DUMMY_WARNING.format(source=ckpt.source))
    logger.info("loaded %s on %s (%s): %.1f MB of weights", model.source, device, model.dtype,
                model.weight_bytes() / 1e6)
    return model
