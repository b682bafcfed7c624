"""When random weights stop talking: the dummy checkpoints' EOS clock.

With every head row random, the EOS logit is as random as any code's, and a random GPT's hidden states lean on
their context: for some texts and voices EOS tops a codebook's list at the first frame (the README's curl got
an empty mp3 on real-size weights), for others it never comes (43 s of noise at the 2048-frame cap, minutes
of CPU). A trained ChatTTS stops once it has spoken the text. Random weights cannot know that, but a few fixed
weights can count: codebook 0's EOS logit is made

    logit(t) ~ K * (1 - rho * P / (P + t))      P: prompt positions, t: frames generated so far

below zero for the first frames, then rising towards K (5.7 on tiny, 6.4 on real-size weights). EOS comes once
it nears the top (penalized) code logits, about 5 at the default sampling (temperature 0.3, top_p 0.7, top_k 20,
repetition penalty 1.05): after some 5-10 frames per prompt position, so the longer the text, the longer the
noise, as with speech. A fixed
length would be simpler, but a server that says "Hello!" and a paragraph in the same time is not a plausible
stand-in. Measured at the defaults (10 seeds on tiny, 4 on real; `say` also varies with the refined text's length):

    text (voice)                                  tiny: median (range)   real: median (range)
    "Hello!" (alloy, the README's curl)           1.1 s (0.7-1.6)        1.7 s (1.3-1.7)
    "Hello world, this is ttsserve." (say)        2.7 s (1.0-6.2)        2.3 s (0.7-8.1)
    "The quick brown fox jumps ..." (random)      3.2 s (1.8-4.3)        2.9 s (2.6-4.3)

The refine stage (`say` runs it by default) gets a constant [Ebreak] logit instead: its context is all text,
so the clock says nothing there: 4-28 refined tokens (either size) where a random [Ebreak] row ran to the 384-token
cap (and made the code prompt, hence the noise, that long).

How, with three hidden channels no random weight touches (zero columns in every q/k/v/gate/up projection and
head row, zero rows in every o/down projection; norm weights 1):
  BIAS  carries a constant c: every embedding row puts it there (a code frame sums num_vq rows: c / num_vq each).
  SOURCE  carries a text position's mark: text embedding rows hold `a` there, code rows 0.
  CLOCK  layer 0's head 0 attends uniformly (zero query rows: every score 0, weights 1 / (p + 1) over the
        causal context) to SOURCE alone and writes the average into CLOCK: c * (text positions) / (p + 1).
The final norm divides both by the same RMS, so their ratio is the prompt's share of the context. Codebook 0's
EOS row reads gain * (BIAS - rho * CLOCK); the other codebooks' EOS rows are zero (logit 0: never in the top-k);
the refine stage's [Ebreak] row reads text_gain * BIAS. The prompt's [spk_emb] position holds the speaker
vector instead of an embedding, a random SOURCE value: the count is off by about one position.
Magnitudes stay those of layer 0's random inputs (c, a ~ the embeddings' spread), so no RMSNorm or per-token
activation quantizer (W8A8) on the way sees an outlier channel; only the fp32 head scales them up.
"""

from __future__ import annotations

import torch

EOS_ID = 625
BIAS, SOURCE, CLOCK = -1, -2, -3  # the reserved hidden channels: the last three
BIAS_C = 0.04  # about the spread of a code frame's embedding sum (4 rows of N(0, 0.02))
SOURCE_A = 0.02  # one embedding standard deviation: a text position's normalized SOURCE is ~1
_READERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_WRITERS = ("self_attn.o_proj", "mlp.down_proj")


def add_eos_clock(
    gpt: dict[str, torch.Tensor],
    embed: dict[str, torch.Tensor],
    hidden: int,
    layers: int,
    heads: int,
    gain: float,
    rho: float,
    text_eos_id: int,
    text_gain: float,
    num_vq: int = 4,
) -> None:
    """Rewrite random GPT and Embed state dicts (published key names) in place to carry the clock above.

    gain: codebook 0's EOS logit per unit of normalized BIAS (so K = gain * c / RMS of the last hidden state).
    rho: how far below 0 the clock starts (in units of K): the first frame's EOS logit is K * (1 - rho).
    text_eos_id / text_gain: the refine stage's EOS ([Ebreak]) and its logit per unit of normalized BIAS.
    """
    bias, source, clock = hidden + BIAS, hidden + SOURCE, hidden + CLOCK
    reserved = [bias, source, clock]
    for i in range(layers):
        for name in _READERS:
            gpt[f"layers.{i}.{name}.weight"][:, reserved] = 0.0
        for name in _WRITERS:
            gpt[f"layers.{i}.{name}.weight"][reserved, :] = 0.0
        gpt[f"layers.{i}.input_layernorm.weight"][reserved] = 1.0
    gpt["norm.weight"][reserved] = 1.0
    head = slice(0, hidden // heads)  # layer 0, head 0: uniform attention, SOURCE in, CLOCK out
    gpt["layers.0.self_attn.q_proj.weight"][head] = 0.0
    gpt["layers.0.self_attn.v_proj.weight"][head] = 0.0
    gpt["layers.0.self_attn.v_proj.weight"][0, source] = 1.0
    gpt["layers.0.self_attn.o_proj.weight"][:, head] = 0.0
    gpt["layers.0.self_attn.o_proj.weight"][clock, 0] = BIAS_C  # a text-only context: CLOCK = BIAS
    text = embed["emb_text.weight"]
    text[:, reserved] = 0.0
    text[:, bias], text[:, source] = BIAS_C, SOURCE_A
    head_text = embed["head_text.parametrizations.weight.original1"]
    head_text[:, reserved] = 0.0
    head_text[text_eos_id] = 0.0
    head_text[text_eos_id, bias] = 1.0
    embed["head_text.parametrizations.weight.original0"][text_eos_id] = text_gain
    for q in range(num_vq):
        emb = embed[f"emb_code.{q}.weight"]
        emb[:, reserved] = 0.0
        emb[:, bias] = BIAS_C / num_vq
        v = embed[f"head_code.{q}.parametrizations.weight.original1"]
        v[:, reserved] = 0.0
        v[EOS_ID] = 0.0
        v[EOS_ID, bias], v[EOS_ID, clock] = 1.0, -rho  # weight norm: W = g * v / |v|, hence g below
        g = embed[f"head_code.{q}.parametrizations.weight.original0"]
        g[EOS_ID] = gain * float(v[EOS_ID].norm()) if q == 0 else 0.0
