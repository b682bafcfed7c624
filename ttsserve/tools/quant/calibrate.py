"""Activation statistics from a calibration corpus, and the AWQ scale search for `awq-int4`.

Calibration inputs are whole code-stage sequences, not just prompts: the prompt of each text followed by
frames the dense model itself sampled for it (oracle loop, seeded), fed back teacher-forced. Most tokens a
TTS GPT sees are audio frames (sums of 4 code embeddings), whose activations differ from text positions;
a prompt-only calibration would tune the scales for the minority.

AWQ, per linear group of each layer (qkv, o, gate_up, down): the input channels that carry large
activations matter most, so scale them up before quantizing. For alpha in a grid over [0, 1):
s = mean|x|^alpha (normalised by sqrt(max * min)), W' = Q(W * diag(s)) / s, and keep the alpha with the
lowest output error ||X W'^T - X W^T||^2 on sampled activation rows X. The division by s is folded into
what produces x, so the layer itself runs Q(W * s) unchanged:
- qkv / gate_up: x = RMSNorm(h) * g, so g /= s (the norm weight);
- down: x = silu(gate) * up, so the up_proj rows /= s;
- o: x = softmax(QK^T) V, so the v_proj rows /= s (only when num_heads == num_kv_heads: with grouped KV
  heads one v channel feeds several o channels and the fold is impossible; o then keeps alpha = 0).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ttsserve.constants import speaker_stats
from ttsserve.layers.quant.quantize import QuantConfig, fake_quantize

logger = logging.getLogger(__name__)

CORPUS_PATH = Path(__file__).resolve().parents[2] / "data" / "calibration_corpus.txt"
GROUPS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def load_calibration_corpus(path: str | Path | None = None) -> list[str]:
    """Non-empty, non-comment lines of the corpus file (ValueError if none)."""
    path = Path(path) if path is not None else CORPUS_PATH
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"calibration corpus {path}: {e.strerror}") from None
    texts = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if not texts:
        raise ValueError(f"calibration corpus {path} holds no sentences")
    return texts


@dataclass
class TeacherForcedSample:
    """One code-stage sequence: embeds [P + F, H] fp32 (prompt, then the F sampled frames' embeddings);
    codes [F, num_vq] the frames; num_prompt = P. The hidden at position P - 1 + f produced frame f."""

    text: str
    embeds: torch.Tensor
    codes: torch.Tensor
    num_prompt: int


@torch.no_grad()
def teacher_forced_samples(model, texts: list[str], frames: int, seed: int = 0) -> list[TeacherForcedSample]:
    """Prompt each text (random seeded speaker, default code prompt) and let `model` (a ChatTTSModel, dense)
    sample up to `frames` frames with the default sampling settings (seed + i per text)."""
    from ttsserve.engine.frontend import FrontEnd
    from ttsserve.model.oracle import generate_dense
    from ttsserve.params import SamplingParams, Voice
    from ttsserve.text.speaker import sample_random_speaker

    front = FrontEnd(model.tokenizer, model.gpt_config.num_vq)
    std, mean = speaker_stats(model.spk_stat, model.hidden_size)
    out = []
    for i, text in enumerate(texts):
        spk = torch.from_numpy(sample_random_speaker(std, mean, seed + i))
        ids, mask = front.code_inputs(text, "[speed_5]", Voice(spk_emb=spk))
        prompt = model.embed.embed_prompt(
            ids.to(model.device), mask.to(model.device), spk.to(model.device), model.tokenizer.spk_emb_id
        )
        params = SamplingParams(max_new_tokens=frames, seed=seed + i)
        codes, _ = generate_dense(model.gpt, model.embed, prompt.to(model.dtype), "code", params)
        embeds = torch.cat([prompt, model.embed.embed_codes(codes)]) if codes.shape[0] else prompt
        out.append(TeacherForcedSample(text, embeds.float(), codes, prompt.shape[0]))
    return out


def teacher_forced_hidden(gpt, embeds: torch.Tensor, attention=None) -> torch.Tensor:
    """One causal forward over a whole sequence: embeds [L, H] -> post-norm hiddens [L, H] fp32."""
    from ttsserve.attention.dense import DenseAttention

    ctx = attention if attention is not None else DenseAttention(len(gpt.layers))
    positions = torch.arange(embeds.shape[0], device=embeds.device)
    return gpt(embeds, positions, ctx).float()


@dataclass
class ActStats:
    """Inputs of one linear: mean |x| per input channel [K] over all tokens, and up to max_rows sampled
    rows [R, K] (fp32, on the CPU)."""

    abs_sum: torch.Tensor
    count: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.count, 1)

    @property
    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)


@torch.no_grad()
def collect_activation_stats(
    gpt, samples: list[TeacherForcedSample], max_rows: int = 512, seed: int = 0
) -> dict[tuple[int, str], ActStats]:
    """Run every sample through `gpt` (dense) and record the inputs of each layer's 4 linears:
    {(layer, group): ActStats}. Rows are sampled uniformly (seeded) up to max_rows per linear in all."""
    total = sum(s.embeds.shape[0] for s in samples)
    keep_p = min(1.0, max_rows / max(total, 1))
    gen = torch.Generator().manual_seed(seed)
    stats: dict[tuple[int, str], ActStats] = {}
    hooks = []

    def hook(key: tuple[int, str]):
        def fn(_mod, args) -> None:
            x = args[0].detach().float().reshape(-1, args[0].shape[-1]).cpu()
            st = stats.setdefault(key, ActStats(torch.zeros(x.shape[1])))
            st.abs_sum += x.abs().sum(0)
            st.count += x.shape[0]
            pick = torch.rand(x.shape[0], generator=gen) < keep_p
            st.rows.append(x[pick])

        return fn

    for i, layer in enumerate(gpt.layers):
        for g in GROUPS:
            hooks.append(getattr(layer, g).register_forward_pre_hook(hook((i, g))))
    try:
        for s in samples:
            teacher_forced_hidden(gpt, s.embeds.to(gpt.dtype).to(next(gpt.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    return stats


def awq_scale_for(alpha: float, mean_abs: torch.Tensor) -> torch.Tensor:
    """s = mean|x|^alpha, normalised so that max(s) * min(s) = 1 (keeps W * s in range)."""
    s = mean_abs.clamp(min=1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def search_awq_scale(
    w: torch.Tensor, stats: ActStats, qc: QuantConfig, n_grid: int = 20
) -> tuple[float, torch.Tensor, list[float]]:
    """w: [N, K] fp32 (all linears sharing this input, stacked). Returns (best alpha, s [K], loss per alpha)
    for alpha in 0, 1/n_grid, ..., (n_grid-1)/n_grid; alpha = 0 (s = 1) is plain round-to-nearest."""
    x = stats.sample.to(w.device)
    ref = x @ w.T
    losses = []
    for i in range(n_grid):
        s = awq_scale_for(i / n_grid, stats.mean_abs.to(w.device))
        wq = fake_quantize(w * s[None, :], qc) / s[None, :]
        losses.append(float(((x @ wq.T - ref) ** 2).mean()))
    best = int(np.argmin(losses))
    return best / n_grid, awq_scale_for(best / n_grid, stats.mean_abs.to(w.device)), losses


def apply_awq(
    sd: dict[str, torch.Tensor],
    stats: dict[tuple[int, str], ActStats],
    qc: QuantConfig,
    num_layers: int,
    fold_o_proj: bool,
    n_grid: int = 20,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Search and fold AWQ scales into a copy of an HF-named fp32 GPT state dict (no `model.` prefix).

    Returns (scaled state dict, report {"alpha": {"layers.i.group": alpha}, "loss_rtn", "loss_awq"}); the
    scaled model computes the same function as the input in exact arithmetic.
    """
    out = {k: v.float().clone() for k, v in sd.items()}
    alphas: dict[str, float] = {}
    loss_rtn = loss_awq = 0.0
    for i in range(num_layers):
        p, a, m = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        plan = {  # group -> (linears reading x (scaled by s along K), tensor whose output is divided by s)
            "qkv_proj": ([a + "q_proj", a + "k_proj", a + "v_proj"], (p + "input_layernorm.weight", None)),
            "o_proj": ([a + "o_proj"], (a + "v_proj.weight", "rows")),
            "gate_up_proj": ([m + "gate_proj", m + "up_proj"], (p + "post_attention_layernorm.weight", None)),
            "down_proj": ([m + "down_proj"], (m + "up_proj.weight", "rows")),
        }
        for group, (linears, (fold_into, _)) in plan.items():
            if group == "o_proj" and not fold_o_proj:
                alphas[p + group] = 0.0
                continue
            w = torch.cat([out[n + ".weight"] for n in linears])
            alpha, s, losses = search_awq_scale(w, stats[(i, group)], qc, n_grid)
            alphas[p + group] = alpha
            loss_rtn += losses[0]
            loss_awq += min(losses)
            for n in linears:
                out[n + ".weight"] = out[n + ".weight"] * s[None, :]
            t = out[fold_into]
            out[fold_into] = t / s if t.dim() == 1 else t / s[:, None]
    report = {"alpha": alphas, "loss_rtn": loss_rtn, "loss_awq": loss_awq}
    logger.info(
        "AWQ: summed output MSE over all linear groups %.4g (round-to-nearest) -> %.4g (AWQ)", loss_rtn, loss_awq
    )
    return out, report
