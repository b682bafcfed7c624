"""`ttsserve bench quality`: fidelity of a quantized model (weights and / or fp8 KV cache) to the dense one.

Both models read the SAME inputs: for each evaluation sentence (the bench corpus, disjoint from the
calibration corpus) the dense model samples a frame sequence once; then each model runs one teacher-forced
forward over prompt + frames. Compared, at every position that predicts a frame:
- per-codebook top-1 agreement of the code logits (the greedy choice is the same);
- per-codebook KL(dense || quantized) of the code distributions at temperature 1, in nats;
- the Decoder's mel features from each model's hidden states: relative L2 and mean |difference|
  (ChatTTS's default decoder reads hidden states, so this is what the vocoder hears);
- the relative L2 of the hidden states themselves.
On random (dummy) weights these figures say little about a real checkpoint: real weights and activations
have outlier channels that make quantization harder (and AWQ more useful) than Gaussian noise does.
Mounted by the bench CLI through add_quality_parser(bench_subparsers).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ttsserve.engine.args import add_model_args
from ttsserve.tools.quant.calibrate import TeacherForcedSample, teacher_forced_hidden

RANDOM_WEIGHTS_NOTE = (
    "note: measured on RANDOM (dummy) weights; they say little about a real checkpoint, whose "
    "outlier channels make quantization harder than Gaussian weights do"
)


@dataclass
class Fidelity:
    """top1_agreement / kl: one value per codebook; positions: frame-predicting positions compared."""

    top1_agreement: list[float]
    kl: list[float]
    mel_rel_l2: float
    mel_mae: float
    hidden_rel_l2: float
    texts: int
    positions: int
    frames: int

    def table(self) -> str:
        rows = ["codebook  top-1 agreement  KL(dense||quant) [nats]"]
        for q, (a, k) in enumerate(zip(self.top1_agreement, self.kl)):
            rows.append(f"{q:>8}  {a:>15.4f}  {k:>23.5f}")
        rows.append(
            f"mel features: relative L2 {self.mel_rel_l2:.4f}, mean |diff| {self.mel_mae:.4f}; hidden "
            f"states: relative L2 {self.hidden_rel_l2:.4f} ({self.texts} texts, {self.positions} "
            f"positions, {self.frames} frames)"
        )
        return "\n".join(rows)


@torch.no_grad()
def compare_models(ref, cand, samples: list[TeacherForcedSample], kv_fp8: bool = False) -> Fidelity:
    """ref / cand: ChatTTSModels (same sizes, same Embed / Decoder); kv_fp8: run cand with the CPU
    simulation of the fp8 KV cache (attention/dense.py FP8DenseAttention)."""
    from ttsserve.attention.dense import FP8DenseAttention

    num_vq = ref.gpt_config.num_vq
    agree, kl = torch.zeros(num_vq, dtype=torch.float64), torch.zeros(num_vq, dtype=torch.float64)
    n_pos = n_frames = 0
    mel_sq = mel_ref_sq = mel_abs = h_sq = h_ref_sq = 0.0
    mel_count = 0
    for s in samples:
        p, f = s.num_prompt, s.codes.shape[0]
        h_ref = teacher_forced_hidden(ref.gpt, s.embeds.to(ref.device, ref.dtype))
        ctx = FP8DenseAttention(len(cand.gpt.layers)) if kv_fp8 else None
        h_c = teacher_forced_hidden(cand.gpt, s.embeds.to(cand.device, cand.dtype), ctx).to(h_ref.device)
        sel = slice(p - 1, p + f)  # the f + 1 positions that predict frames 0..f
        lr, lc = ref.embed.code_logits(h_ref[sel]), ref.embed.code_logits(h_c[sel])  # [n, Q, V]
        agree += (lr.argmax(-1) == lc.argmax(-1)).sum(0).double().cpu()
        lp_r, lp_c = F.log_softmax(lr, -1), F.log_softmax(lc, -1)
        kl += (lp_r.exp() * (lp_r - lp_c)).sum(-1).sum(0).double().cpu()
        n_pos += lr.shape[0]
        h_sq += float(((h_c[sel] - h_ref[sel]) ** 2).sum())
        h_ref_sq += float((h_ref[sel] ** 2).sum())
        if f:
            mr = ref.decoder(h_ref[p - 1 : p - 1 + f].T[None].to(next(ref.decoder.parameters()).dtype))
            mc = ref.decoder(h_c[p - 1 : p - 1 + f].T[None].to(mr.dtype))
            mel_sq += float(((mc - mr) ** 2).sum())
            mel_ref_sq += float((mr**2).sum())
            mel_abs += float((mc - mr).abs().sum())
            mel_count += mr.numel()
            n_frames += f
    return Fidelity(
        top1_agreement=(agree / max(n_pos, 1)).tolist(),
        kl=(kl / max(n_pos, 1)).tolist(),
        mel_rel_l2=(mel_sq / max(mel_ref_sq, 1e-30)) ** 0.5,
        mel_mae=mel_abs / max(mel_count, 1),
        hidden_rel_l2=(h_sq / max(h_ref_sq, 1e-30)) ** 0.5,
        texts=len(samples),
        positions=n_pos,
        frames=n_frames,
    )


def add_quality_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Add `quality` to `ttsserve bench` (sets func(args) -> exit code)."""
    p = bench_subparsers.add_parser(
        "quality",
        help="fidelity of a quantized model to the dense one (top-1 agreement, KL, mel distance under teacher forcing)",
    )
    add_model_args(
        p,
        only=("model", "load_format", "dummy_size", "device", "kv_cache_dtype"),
        defaults={"device": "cpu"},
        helps={
            "model": "the dense reference checkpoint (holding asset/)",
            "kv_cache_dtype": "fp8: simulate the fp8 KV cache in the quantized model (alone when no weight method)",
        },
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--quantized", default=None, help="a checkpoint written by `ttsserve quantize`")
    src.add_argument(
        "--method",
        default=None,
        choices=["int8", "awq-int4", "rtn-int4"],
        help="quantize the reference in memory (awq-int4 calibrates on the calibration corpus; "
        "rtn-int4 is the same int4 format without AWQ scales, for comparison)",
    )
    p.add_argument("--group-size", type=int, default=128, help="int4 weights per scale (input columns)")
    p.add_argument("--calib-samples", type=int, default=16, help="calibration sentences for awq-int4")
    p.add_argument("--calib-frames", type=int, default=32, help="frames generated per calibration sentence")
    p.add_argument("--texts", type=int, default=8, help="evaluation sentences (bench corpus)")
    p.add_argument("--frames", type=int, default=64, help="frames sampled per evaluation sentence")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the evaluation frames")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="dtype of the unquantized layers"
    )
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.set_defaults(func=cmd_quality)
    return p


def _candidate(a: argparse.Namespace, ckpt, device: torch.device, dtype: torch.dtype):
    from ttsserve.model.chattts import build_model
    from ttsserve.model.loader import load_checkpoint, resolve_checkpoint_root

    if a.quantized:
        return build_model(load_checkpoint(resolve_checkpoint_root(a.quantized)), device, dtype)
    if a.method == "rtn-int4":
        from ttsserve.layers.quant.linear import cast_except_quant, quantize_gpt_
        from ttsserve.layers.quant.quantize import QuantConfig

        model = build_model(ckpt, device, torch.float32)
        qc = QuantConfig.for_method("awq-int4", a.group_size, calibration={"method": "round-to-nearest"})
        model.gpt = cast_except_quant(quantize_gpt_(model.gpt, qc), device, dtype)
        model.quant, model.dtype = qc, dtype
        return model
    if a.method:
        from ttsserve.tools.quant.cli import CalibrationSettings, quantize_checkpoint

        cal = CalibrationSettings(samples=a.calib_samples, frames=a.calib_frames, seed=a.seed)
        return build_model(quantize_checkpoint(ckpt, a.method, a.group_size, cal, device), device, dtype)
    return build_model(ckpt, device, dtype)  # dense weights: only the KV cache differs


def cmd_quality(a: argparse.Namespace) -> int:
    from ttsserve.bench.corpus import select_texts
    from ttsserve.config import EngineConfig
    from ttsserve.model.chattts import build_model, read_checkpoint, resolve_device
    from ttsserve.tools.quant.calibrate import teacher_forced_samples

    try:
        if not (a.quantized or a.method or a.kv_cache_dtype == "fp8"):
            raise ValueError("nothing to compare: pass --quantized DIR, --method or --kv-cache-dtype fp8")
        device = resolve_device(a.device)
        dtype = getattr(torch, a.dtype)
        ckpt = read_checkpoint(
            EngineConfig(model=a.model, load_format=a.load_format, dummy_size=a.dummy_size, seed=a.seed)
        )
        ref = build_model(ckpt, device, dtype)
        cand = _candidate(a, ckpt, device, dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    texts = [s.text for s in select_texts(a.texts, a.seed)]
    samples = teacher_forced_samples(ref, texts, a.frames, a.seed)
    fid = compare_models(ref, cand, samples, kv_fp8=a.kv_cache_dtype == "fp8")
    what = {"rtn-int4": "int4 without AWQ (round-to-nearest)"}.get(a.method, cand.quantization or "dense weights")
    print(
        f"fidelity of {what}{' + fp8 KV cache' if a.kv_cache_dtype == 'fp8' else ''} to the dense "
        f"{ref.source} ({a.dtype}, {device}):"
    )
    print(fid.table())
    if ref.is_dummy:
        print(RANDOM_WEIGHTS_NOTE)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "candidate": what,
                    "kv_cache_dtype": a.kv_cache_dtype,
                    "source": ref.source,
                    "random_weights": ref.is_dummy,
                    **asdict(fid),
                },
                f,
                indent=2,
            )
    return 0
