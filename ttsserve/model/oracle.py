"""The single-request generation loop (MODEL.md §4.2) on a dense cache: the oracle the paged engine is tested on."""

from __future__ import annotations

import torch

from ttsserve.attention.dense import DenseAttention
from ttsserve.model.embed import Embed
from ttsserve.model.gpt import GPT
from ttsserve.params import SamplingParams
from ttsserve.sample.sampler import make_sampling_batch, sample


@torch.no_grad()
def generate_dense(
    gpt: GPT,
    embed: Embed,
    prompt_embeds: torch.Tensor,
    mode: str,
    params: SamplingParams,
    max_new_tokens: int | None = None,
    eos_id: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate for one prompt, one token (text) or frame (code) per step, until EOS or the cap.

    prompt_embeds: [T, H] (Embed.embed_prompt / embed_text output); mode: "code" or "text".
    eos_id: defaults to embed.num_audio_tokens - 1 in code mode; required in text mode ([Ebreak]).
    A code frame ends the sequence if ANY codebook is EOS; the EOS step is not returned.
    seed: used when params.seed is None. max_new_tokens: defaults to params.max_new_tokens.
    Returns (tokens, hiddens): tokens [n, num_vq] (code) or [n] (text) int64, and hiddens [n, H] fp32,
    hiddens[k] = the post-norm hidden state from which token k was sampled (MODEL.md §4.5).
    """
    if mode not in ("code", "text"):
        raise ValueError(f"mode must be 'code' or 'text', got {mode!r}")
    if eos_id is None:
        if mode == "text":
            raise ValueError("eos_id ([Ebreak]) is required in text mode")
        eos_id = embed.num_audio_tokens - 1
    max_new = params.max_new_tokens if max_new_tokens is None else max_new_tokens
    num_rows = embed.num_vq if mode == "code" else 1
    seed = params.seed if params.seed is not None else seed
    device = prompt_embeds.device
    ctx = DenseAttention(len(gpt.layers))
    x, start = prompt_embeds, 0
    tokens: list[torch.Tensor] = []
    hiddens: list[torch.Tensor] = []
    for step in range(max_new):
        positions = torch.arange(start, start + x.shape[0], device=device)
        last = gpt(x, positions, ctx)[-1:].float()  # [1, H]
        start += x.shape[0]
        logits = embed.code_logits(last) if mode == "code" else embed.text_logits(last)[:, None, :]
        history = torch.stack(tokens) if tokens else torch.empty(0, num_rows, dtype=torch.int64)
        batch = make_sampling_batch([params], [seed], [step], [history.cpu()], num_rows, eos_id, device)
        tok = sample(logits, batch)[0]  # [R]
        if bool((tok == eos_id).any()):
            break
        tokens.append(tok)
        hiddens.append(last[0])
        x = embed.embed_codes(tok[None]) if mode == "code" else embed.embed_text(tok)
    hidden_size = prompt_embeds.shape[1]
    toks = torch.stack(tokens) if tokens else torch.empty(0, num_rows, dtype=torch.int64, device=device)
    hid = torch.stack(hiddens) if hiddens else torch.empty(0, hidden_size, device=device)
    return (toks if mode == "code" else toks[:, 0]), hid
