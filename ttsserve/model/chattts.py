"""The whole ChatTTS model (GPT, embeddings/heads, audio decoders, vocoder, tokenizer) built from a checkpoint."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ttsserve.config import EngineConfig, GPTConfig
from ttsserve.layers.quant.quantize import QuantConfig
from ttsserve.model.loader import Checkpoint, load_checkpoint, missing_files, resolve_checkpoint_root
from ttsserve.platform import cpu_has_native_bf16

logger = logging.getLogger(__name__)

DUMMY_WARNING = (
    "\n" + "!" * 100 + "\n"
    "!!  ttsserve is running a DUMMY model with RANDOM weights ({source}).\n"
    "!!  Every speed and memory figure is real, but the audio is noise, not speech.\n"
    "!!  Pass --model /path/to/ChatTTS (the folder holding asset/) or put the checkpoint in ./asset.\n" + "!" * 100
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
    quant: QuantConfig | None = None  # the GPT's weight quantization (None: dense)

    @property
    def hidden_size(self) -> int:
        return self.gpt_config.hidden_size

    @property
    def quantization(self) -> str | None:
        return None if self.quant is None else self.quant.method

    def weight_bytes(self) -> int:
        """Bytes of every stored tensor (parameters, quantized-weight buffers, CPU-packed weights)."""
        from ttsserve.model.cpu_linear import stored_weight_bytes

        return sum(stored_weight_bytes(m) for m in (self.gpt, self.embed, self.decoder, self.dvae, self.vocos))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be auto|cpu|cuda[:N], got {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA; on a CPU, bf16 where it has native bf16 (AVX512_BF16 / AMX: oneDNN's bf16 GEMMs, faster
    than fp32) and fp32 elsewhere, where bf16 is emulated and slower. Random (dummy) weights follow the same rule,
    because users measure speed on them; tests that compare against fp32 references pin dtype="float32"."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def log_cpu_dtype_choice(name: str, dtype: torch.dtype, quantization: str | None) -> None:
    """One line on a CPU: the GPT's dtype, why (what --dtype auto found), and the faster int8 alternative."""
    picked = str(dtype).removeprefix("torch.")
    if name == "auto":
        why = "the CPU has native bf16" if dtype == torch.bfloat16 else "no native bf16 on this CPU"
        picked = f"--dtype auto picked {picked} ({why})"
    else:
        picked = f"--dtype {name}"
    hint = (
        f"; --quantization {quantization}"
        if quantization is not None
        else "; --quantization int8 is faster still on CPUs with VNNI / AMX int8 (a little less faithful)"
    )
    logger.info("CPU: %s%s", picked, hint)


def locate_checkpoint(cfg: EngineConfig) -> Path | None:
    """The folder holding asset/ that `cfg` loads, or None for random weights (--load-format dummy, or auto
    when no checkpoint is found). Reads no weights, so a server can check its flags before the slow load.

    Raises ValueError for a --model that is not a checkpoint or lacks a published file, and for
    --load-format safetensors when no checkpoint is found.
    """
    if cfg.load_format == "dummy":
        return None
    root = resolve_checkpoint_root(cfg.model)
    if root is None:
        if cfg.load_format == "safetensors":
            raise ValueError(
                "no ChatTTS checkpoint found: pass --model DIR (the folder holding asset/), set "
                "$TTSSERVE_MODEL, or use --load-format dummy"
            )
        return None
    missing = missing_files(root)
    if missing:
        raise ValueError(f"checkpoint {root}: missing file(s): {', '.join(missing)}")
    return root


def read_checkpoint(cfg: EngineConfig) -> Checkpoint:
    """The checkpoint `cfg` names, or a dummy one (with a loud warning) when allowed and none is found."""
    root = locate_checkpoint(cfg)
    if root is None:
        if cfg.load_format != "dummy":
            logger.warning(
                "no ChatTTS checkpoint found (--model, $TTSSERVE_MODEL, ./asset, hub cache): "
                "falling back to --load-format dummy"
            )
        return _dummy_checkpoint(cfg)
    return load_checkpoint(root, verify_sha256=cfg.verify_sha256)


def checkpoint_quant_config(ckpt: Checkpoint) -> QuantConfig | None:
    """The QuantConfig of a quantized checkpoint: `quantization_config` inside asset/gpt/config.json (the HF
    convention; `ttsserve quantize` writes it there and to asset/gpt/quantization_config.json), or that file
    beside a checkpoint read from disk. None for a dense checkpoint."""
    import json

    if "quantization_config" in ckpt.gpt_config:
        return QuantConfig.from_json(ckpt.gpt_config["quantization_config"], "asset/gpt/config.json")
    path = Path(ckpt.source) / "gpt" / "quantization_config.json"
    if ckpt.source and path.is_file():
        return QuantConfig.from_json(json.loads(path.read_text()), str(path))
    return None


def resolve_quantization(ckpt: Checkpoint, requested: str | None) -> tuple[QuantConfig | None, QuantConfig | None]:
    """(stored, on_the_fly): the checkpoint's own quantization, and what to apply at load.

    requested None: use whatever the checkpoint holds. A request that disagrees with a quantized checkpoint,
    or asks a dense real checkpoint for a method, is a ValueError (quantizing needs `ttsserve quantize`);
    a dense DUMMY checkpoint is quantized at load by round-to-nearest (no calibration: random weights).
    """
    stored = checkpoint_quant_config(ckpt)
    if requested is None or (stored is not None and stored.method == requested):
        return stored, None
    if stored is not None:
        raise ValueError(
            f"--quantization {requested} but checkpoint {ckpt.source} is quantized with "
            f"{stored.method}: pass --quantization {stored.method} (or leave it unset)"
        )
    if not ckpt.source.startswith("dummy"):
        raise ValueError(
            f"--quantization {requested} but checkpoint {ckpt.source} is not quantized: make a "
            f"quantized copy with `ttsserve quantize --method {requested} --model <this checkpoint> "
            f"--out DIR` and serve --model DIR"
        )
    group = _largest_group(GPTConfig.from_hf_json(ckpt.gpt_config))
    return None, QuantConfig.for_method(requested, group_size=group, calibration={"method": "round-to-nearest"})


def _largest_group(cfg: GPTConfig) -> int:
    """128 when every linear's input size allows it, else the largest power of two >= 32 that does."""
    for g in (128, 64, 32):
        if cfg.hidden_size % g == 0 and cfg.intermediate_size % g == 0 and (cfg.num_heads * cfg.head_dim) % g == 0:
            return g
    raise ValueError(
        f"hidden size {cfg.hidden_size} / intermediate size {cfg.intermediate_size} allow no int4 group of 32 or more"
    )


def _dummy_checkpoint(cfg: EngineConfig) -> Checkpoint:
    """Random weights, generated once and then read back memory-mapped from a cache folder (fast restarts)."""
    from ttsserve.model.dummy_cache import cached_dummy_checkpoint

    try:
        path = cached_dummy_checkpoint(cfg.dummy_size, cfg.seed)
    except OSError as e:  # read-only home or full disk: build in memory instead
        from ttsserve.model.dummy import make_dummy_checkpoint

        logger.info("dummy checkpoint cache unavailable (%s); generating in memory", e)
        return make_dummy_checkpoint(cfg.dummy_size, cfg.seed)
    ckpt = load_checkpoint(path)
    ckpt.source = f"dummy ({cfg.dummy_size}, seed {cfg.seed}, cached in {path})"
    return ckpt


def build_model(
    ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, quantization: str | None = None
) -> ChatTTSModel:
    """Build every module from `ckpt` (sizes inferred from the tensors; ValueError naming any bad tensor).

    quantization: None (whatever the checkpoint holds), "int8" or "awq-int4"; see resolve_quantization.
    """
    from ttsserve.audio.decoder_net import DVAE, HiddenDecoder
    from ttsserve.audio.vocos import Vocos
    from ttsserve.model.embed import Embed
    from ttsserve.model.gpt import GPT
    from ttsserve.text.speaker import decode_spk_stat
    from ttsserve.text.tokenizer import TextTokenizer

    gpt_cfg = GPTConfig.from_hf_json(ckpt.gpt_config)
    stored, on_the_fly = resolve_quantization(ckpt, quantization)
    embed = Embed.from_state_dict(ckpt.embed).to(device)
    if (embed.hidden_size, embed.num_text_tokens) != (gpt_cfg.hidden_size, gpt_cfg.num_text_tokens):
        raise ValueError(
            f"Embed.safetensors: hidden {embed.hidden_size} / text vocab {embed.num_text_tokens} "
            f"disagree with gpt/config.json ({gpt_cfg.hidden_size} / {gpt_cfg.num_text_tokens})"
        )
    tokenizer = TextTokenizer.from_dir(ckpt.tokenizer_dir)
    if tokenizer.vocab_size != embed.num_text_tokens:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens but Embed.safetensors has "
            f"{embed.num_text_tokens} text embeddings"
        )
    spk_stat = None
    if ckpt.extra_config.get("spk_stat"):
        spk_stat = decode_spk_stat(ckpt.extra_config["spk_stat"])
    else:
        logger.warning("checkpoint has no spk_stat (chattts_config.json): random speakers are sampled from N(0, 1)")
    if on_the_fly is None:
        gpt = GPT.from_state_dict(ckpt.gpt, gpt_cfg, dtype=dtype, device=device, quant=stored)
    else:
        from ttsserve.layers.quant.linear import cast_except_quant, quantize_gpt_

        logger.warning("quantizing the dummy GPT at load (%s, round-to-nearest, no calibration)", on_the_fly.method)
        gpt = GPT.from_state_dict(ckpt.gpt, gpt_cfg, dtype=torch.float32, device=device)  # quantize from fp32
        gpt = cast_except_quant(quantize_gpt_(gpt, on_the_fly), device, dtype)
    model = ChatTTSModel(
        gpt_config=gpt_cfg,
        gpt=gpt,
        embed=embed,
        decoder=HiddenDecoder.from_state_dict(ckpt.decoder, source="Decoder.safetensors").to(device),
        dvae=DVAE.from_state_dict(ckpt.dvae, source="DVAE.safetensors").to(device),
        vocos=Vocos.from_state_dict(ckpt.vocos, source="Vocos.safetensors").to(device),
        tokenizer=tokenizer,
        spk_stat=spk_stat,
        device=device,
        dtype=dtype,
        source=ckpt.source,
        is_dummy=ckpt.source.startswith("dummy"),
        quant=stored or on_the_fly,
    )
    for m in (model.gpt, model.embed, model.decoder, model.dvae, model.vocos):
        m.eval().requires_grad_(False)
    return model


def load_model(cfg: EngineConfig) -> ChatTTSModel:
    device = resolve_device(cfg.device)
    ckpt = read_checkpoint(cfg)
    dtype = resolve_dtype(cfg.dtype, device)
    model = build_model(ckpt, device, dtype, quantization=cfg.quantization)
    if device.type == "cpu":
        log_cpu_dtype_choice(cfg.dtype, dtype, cfg.quantization)
    if model.is_dummy:
        logger.warning(DUMMY_WARNING.format(source=ckpt.source))
    quant = f", GPT weights {model.quantization}" if model.quant is not None else ""
    logger.info(
        "loaded %s on %s (%s%s): %.1f MB of weights",
        model.source,
        device,
        model.dtype,
        quant,
        model.weight_bytes() / 1e6,
    )
    return model
