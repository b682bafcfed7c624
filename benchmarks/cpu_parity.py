"""Parity of the CPU fast-path formats against the fp32 model, stated next to the speed figures.

GPT: teacher forcing (ttsserve.tools.quant.quality.compare_models): the fp32 model samples `--frames` frames for
each of `--texts` corpus sentences once; every candidate then runs one forward over the same prompt +
frames, and its code logits are compared with fp32's at every frame-predicting position: per-codebook
top-1 agreement, KL(fp32 || candidate) and the max / mean |logit difference|, plus the Decoder mel and
hidden-state relative L2. Candidates, each with its linears packed as the CPU engine serves them
(ttsserve/model/cpu_linear.py: `pack_linears_`) unless the name ends in "-unpacked": bf16 (oneDNN-packed);
int8 (W8A8: fbgemm's dynamic int8 x int8 GEMM on the int8 weights, bf16 elsewhere); awq-int4 (torch's CPU
int4 GEMM, round-to-nearest int4 weights of the dummy, no calibration); int8 weight-only with bf16
or fp32 activations (`torch._weight_int8pack_mm`, the QuantLinear kernel without packing).
Audio stage: the same fp32 hidden states through Decoder + Vocos in fp32 and with the networks in bf16 (the
ISTFT stays fp32): waveform relative L2 and SNR.

    python3 benchmarks/cpu_parity.py [--texts 4] [--frames 64] [--json out.json]

On random (dummy) weights these figures bound the arithmetic error of each format; a real checkpoint's
outlier channels make int8 weights somewhat worse (see ttsserve.tools.quant.quality.RANDOM_WEIGHTS_NOTE).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from ttsserve.config import EngineConfig  # noqa: E402
from ttsserve.model.chattts import build_model, read_checkpoint  # noqa: E402
from ttsserve.model.cpu_linear import pack_linears_  # noqa: E402

CANDIDATES = {
    "bf16": (torch.bfloat16, None),
    "int8": (torch.bfloat16, "int8"),
    "awq-int4": (torch.bfloat16, "awq-int4"),
    "int8+bf16-unpacked": (torch.bfloat16, "int8"),
    "int8+fp32-unpacked": (torch.float32, "int8"),
}


@torch.no_grad()
def logit_diff(ref, cand, samples) -> tuple[float, float]:
    """(max, mean) |code-logit difference| over the frame-predicting positions of all samples."""
    from ttsserve.tools.quant.calibrate import teacher_forced_hidden

    worst, total, count = 0.0, 0.0, 0
    for s in samples:
        sel = slice(s.num_prompt - 1, s.num_prompt + s.codes.shape[0])
        lr = ref.embed.code_logits(teacher_forced_hidden(ref.gpt, s.embeds.to(ref.dtype))[sel])
        lc = ref.embed.code_logits(teacher_forced_hidden(cand.gpt, s.embeds.to(cand.dtype))[sel])
        d = (lr - lc).abs()
        worst, total, count = max(worst, float(d.max())), total + float(d.sum()), count + d.numel()
    return worst, total / max(count, 1)


@torch.no_grad()
def audio_parity(model, samples) -> dict[str, float]:
    """fp32 vs bf16 Decoder + Vocos on the fp32 model's teacher-forced hidden states."""
    from ttsserve.tools.quant.calibrate import teacher_forced_hidden

    nets = {
        "fp32": (model.decoder, model.vocos),
        "bf16": (copy.deepcopy(model.decoder).to(torch.bfloat16), copy.deepcopy(model.vocos).to(torch.bfloat16)),
    }
    err = ref_sq = 0.0
    for s in samples:
        f = s.codes.shape[0]
        hidden = teacher_forced_hidden(model.gpt, s.embeds)[s.num_prompt - 1 : s.num_prompt - 1 + f]  # [f, H]
        wavs = {}
        for name, (dec, voc) in nets.items():
            dtype = next(dec.parameters()).dtype
            mel = dec(hidden.T[None].to(dtype))
            wavs[name] = voc(mel.to(next(voc.parameters()).dtype)).float()
        err += float(((wavs["bf16"] - wavs["fp32"]) ** 2).sum())
        ref_sq += float((wavs["fp32"] ** 2).sum())
    rel = (err / max(ref_sq, 1e-30)) ** 0.5
    return {"wav_rel_l2": rel, "wav_snr_db": float(-20 * torch.log10(torch.tensor(max(rel, 1e-12))))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--texts", type=int, default=4)
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: the real-size dummy)")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from ttsserve.bench.corpus import select_texts
    from ttsserve.tools.quant.calibrate import teacher_forced_samples
    from ttsserve.tools.quant.quality import RANDOM_WEIGHTS_NOTE, compare_models

    ckpt = read_checkpoint(EngineConfig(model=a.model, load_format="auto" if a.model else "dummy", seed=a.seed))
    cpu = torch.device("cpu")
    ref = build_model(ckpt, cpu, torch.float32)
    samples = teacher_forced_samples(ref, [s.text for s in select_texts(a.texts, a.seed)], a.frames, a.seed)
    results = {}
    for name in a.candidates.split(","):
        dtype, quant = CANDIDATES[name]
        cand = build_model(ckpt, cpu, dtype, quantization=quant)
        if not name.endswith("-unpacked"):
            pack_linears_(cand.gpt)
        fid = compare_models(ref, cand, samples)
        worst, mean = logit_diff(ref, cand, samples)
        results[name] = {
            "top1_agreement": fid.top1_agreement,
            "kl": fid.kl,
            "max_abs_logit_diff": worst,
            "mean_abs_logit_diff": mean,
            "mel_rel_l2": fid.mel_rel_l2,
            "hidden_rel_l2": fid.hidden_rel_l2,
            "positions": fid.positions,
        }
        agree = sum(fid.top1_agreement) / len(fid.top1_agreement)
        print(
            f"{name:>10}: top-1 agreement {agree:.4f} (per codebook {[round(x, 4) for x in fid.top1_agreement]}), "
            f"KL {max(fid.kl):.2e} nats (worst codebook), |logit diff| max {worst:.4f} mean {mean:.5f}, "
            f"mel rel L2 {fid.mel_rel_l2:.4f}, hidden rel L2 {fid.hidden_rel_l2:.4f} "
            f"({fid.positions} positions)",
            flush=True,
        )
        del cand
    results["audio_bf16"] = audio_parity(ref, samples)
    print(
        f"audio stage bf16 vs fp32 (same hiddens): waveform rel L2 {results['audio_bf16']['wav_rel_l2']:.4f}, "
        f"SNR {results['audio_bf16']['wav_snr_db']:.1f} dB"
    )
    if ref.is_dummy:
        print(RANDOM_WEIGHTS_NOTE)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
