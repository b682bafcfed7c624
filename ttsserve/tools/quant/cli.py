"""`ttsserve quantize`: write a weight-quantized copy of a ChatTTS checkpoint.

    ttsserve quantize --method awq-int4 --model ./ChatTTS --out ./ChatTTS-awq [--calibration corpus.txt]
    ttsserve serve --model ./ChatTTS-awq            # the quantization is read from the checkpoint

The copy has the published layout (MODEL.md §1.1): asset/gpt/model.safetensors holds the quantized linears
(`X.qweight`, `X.scales`, `X.qzeros`; quantize.py) and the norms; asset/gpt/config.json gains the HF-style
"quantization_config" entry and asset/gpt/quantization_config.json repeats it. Embed, Decoder, DVAE, Vocos
and the tokenizer are copied unchanged. Mounted by ttsserve/entrypoints/cli.py through add_quantize_parser(subparsers).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

import torch

from ttsserve.engine.args import add_model_args
from ttsserve.layers.quant.quantize import METHODS, QuantConfig, quantize_gpt_state_dict
from ttsserve.model.loader import Checkpoint

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CalibrationSettings:
    """texts: calibration sentences (the built-in corpus when None); samples: how many of them; frames: frames
    sampled per text; max_rows: activation rows kept per linear for the search; n_grid: alphas tried."""

    texts: tuple[str, ...] | None = None
    samples: int = 32
    frames: int = 48
    max_rows: int = 512
    n_grid: int = 20
    seed: int = 0
    source: str = "built-in"


def quantize_checkpoint(
    ckpt: Checkpoint,
    method: str,
    group_size: int = 128,
    calibration: CalibrationSettings | None = None,
    device: torch.device | str = "cpu",
) -> Checkpoint:
    """A copy of `ckpt` whose GPT tensors are quantized with `method` ("int8": round-to-nearest per channel;
    "awq-int4": AWQ scales from a calibration run on `device`, then group-wise int4). Other components are
    shared, not copied. ValueError for an already quantized checkpoint or a group size the shapes forbid."""
    from ttsserve.config import GPTConfig
    from ttsserve.model.chattts import checkpoint_quant_config
    from ttsserve.model.gpt import _strip_prefix

    if method not in METHODS:
        raise ValueError(f"--method must be one of {sorted(METHODS)}, got {method!r}")
    if checkpoint_quant_config(ckpt) is not None:
        raise ValueError(f"checkpoint {ckpt.source} is already quantized")
    cfg = GPTConfig.from_hf_json(ckpt.gpt_config)
    if METHODS[method] == 4:
        for name, k in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size)):
            if k % group_size:
                raise ValueError(f"{name} {k} is not a multiple of --group-size {group_size}")
    sd = _strip_prefix(ckpt.gpt)
    provenance: dict = {"method": "round-to-nearest"}
    if method == "awq-int4":
        sd, provenance = _awq(
            ckpt,
            sd,
            cfg,
            QuantConfig.for_method(method, group_size),
            calibration or CalibrationSettings(),
            torch.device(device),
        )
    qc = QuantConfig.for_method(method, group_size, calibration=provenance)
    gpt_config = dict(ckpt.gpt_config) | {"quantization_config": qc.to_json()}
    return dataclasses.replace(
        ckpt, gpt=quantize_gpt_state_dict(sd, qc), gpt_config=gpt_config, source=f"{ckpt.source} ({method})"
    )


def _awq(
    ckpt: Checkpoint, sd: dict[str, torch.Tensor], cfg, qc: QuantConfig, cal: CalibrationSettings, device: torch.device
) -> tuple[dict[str, torch.Tensor], dict]:
    from ttsserve.model.chattts import build_model
    from ttsserve.tools.quant.calibrate import (
        apply_awq,
        collect_activation_stats,
        load_calibration_corpus,
        teacher_forced_samples,
    )

    t0 = time.perf_counter()
    texts = list(cal.texts) if cal.texts is not None else load_calibration_corpus()
    texts = texts[: cal.samples]
    model = build_model(ckpt, device, torch.float32)  # calibrate the dense model in fp32
    samples = teacher_forced_samples(model, texts, cal.frames, cal.seed)
    stats = collect_activation_stats(model.gpt, samples, cal.max_rows, cal.seed)
    t1 = time.perf_counter()
    scaled, report = apply_awq(
        sd, stats, qc, cfg.num_layers, fold_o_proj=cfg.num_heads == cfg.num_kv_heads, n_grid=cal.n_grid
    )
    tokens = sum(s.embeds.shape[0] for s in samples)
    logger.info(
        "AWQ calibration: %d texts, %d tokens (%d sampled frames): %.1f s statistics, %.1f s search",
        len(samples),
        tokens,
        sum(s.codes.shape[0] for s in samples),
        t1 - t0,
        time.perf_counter() - t1,
    )
    return scaled, {
        "method": "awq",
        "corpus": cal.source,
        "samples": len(samples),
        "tokens": tokens,
        "frames_per_text": cal.frames,
        "max_rows": cal.max_rows,
        "n_grid": cal.n_grid,
        "seed": cal.seed,
        **report,
    }


def save_quantized_checkpoint(ckpt: Checkpoint, out: str | Path) -> Path:
    """Write a quantize_checkpoint() result in the published layout plus asset/gpt/quantization_config.json."""
    from ttsserve.model.dummy import save_checkpoint

    root = save_checkpoint(ckpt, out)
    qc = QuantConfig.from_json(ckpt.gpt_config["quantization_config"])
    (root / "asset/gpt/quantization_config.json").write_text(qc.dumps())
    return root


def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    """Add `quantize` (sets func(args) -> exit code)."""
    p = subparsers.add_parser("quantize", help="write a weight-quantized (int8 / AWQ int4) copy of a checkpoint")
    p.add_argument(
        "--method",
        required=True,
        choices=sorted(METHODS),
        help="int8: per-channel weights; awq-int4: group-wise int4 with AWQ scales from a calibration run",
    )
    add_model_args(
        p,
        only=("model", "load_format", "dummy_size", "device"),
        defaults={"device": "cpu"},
        helps={
            "model": "source checkpoint folder (holding asset/) or hub id",
            "device": "device of the calibration run (cpu | cuda)",
        },
    )
    p.add_argument("--out", required=True, help="folder to write the quantized checkpoint to")
    p.add_argument(
        "--calibration",
        default=None,
        help="calibration text file, one sentence per line (default: the built-in mixed zh/en corpus); awq-int4 only",
    )
    p.add_argument("--group-size", type=int, default=128, help="int4 group size along the input dim")
    p.add_argument("--calib-samples", type=int, default=32, help="calibration sentences used")
    p.add_argument("--calib-frames", type=int, default=48, help="frames sampled per calibration sentence")
    p.add_argument("--n-grid", type=int, default=20, help="AWQ exponents tried per linear group")
    p.add_argument("--max-rows", type=int, default=512, help="activation rows kept per linear for the search")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the calibration run")
    p.set_defaults(func=cmd_quantize)
    return p


def cmd_quantize(a: argparse.Namespace) -> int:
    from ttsserve.config import EngineConfig
    from ttsserve.model.chattts import read_checkpoint, resolve_device
    from ttsserve.tools.quant.calibrate import load_calibration_corpus

    try:
        ckpt = read_checkpoint(
            EngineConfig(model=a.model, load_format=a.load_format, dummy_size=a.dummy_size, seed=a.seed)
        )
        texts = tuple(load_calibration_corpus(a.calibration)) if a.calibration else None
        cal = CalibrationSettings(
            texts=texts,
            samples=a.calib_samples,
            frames=a.calib_frames,
            max_rows=a.max_rows,
            n_grid=a.n_grid,
            seed=a.seed,
            source=a.calibration or "built-in",
        )
        q = quantize_checkpoint(ckpt, a.method, a.group_size, cal, resolve_device(a.device))
        root = save_quantized_checkpoint(q, a.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {root} ({a.method}): serve it with `ttsserve serve --model {root}`")
    return 0
