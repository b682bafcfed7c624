"""The dummy checkpoints' EOS clock (model/dummy_eos.py): random weights speak for seconds, longer for longer
texts, never for nothing. Its structure on both sizes, the clock through the real engine, and the lengths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ttsserve.model.dummy import SIZES, SPECIAL_TOKENS, _embed, _gpt
from ttsserve.model.dummy_eos import BIAS, CLOCK, EOS_ID, SOURCE, add_eos_clock
from ttsserve.model.embed import Embed
from ttsserve.params import SamplingParams, Voice

READERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")


@pytest.mark.parametrize("size", ["tiny", "real"])
def test_the_reserved_channels_and_the_clock_head(size):
    s = SIZES[size]
    gpt, embed = _gpt(torch.Generator().manual_seed(0), s), _embed(torch.Generator().manual_seed(0), s)
    ebreak = s.num_wordpiece + SPECIAL_TOKENS.index("[Ebreak]")
    add_eos_clock(gpt, embed, s.hidden, s.layers, s.heads, s.eos_gain, s.eos_rho, ebreak, s.text_eos_gain)
    r, d = [BIAS, SOURCE, CLOCK], s.hidden // s.heads
    for i in range(s.layers):  # no random weight reads or writes them
        for name in READERS:
            w = gpt[f"layers.{i}.{name}.weight"]
            assert not (w[d:] if (i, name) == (0, "self_attn.v_proj") else w)[:, r].any()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            w = gpt[f"layers.{i}.{name}.weight"]
            assert not w[r][:, d:].any() and w[:-3].abs().sum() > 0  # the other channels stay random
    q, v, o = (gpt[f"layers.0.self_attn.{n}_proj.weight"] for n in "qvo")
    assert not q[:d].any() and q[d:].abs().sum() > 0  # head 0 attends uniformly, the others as they were
    assert v[:d].nonzero().tolist() == [[0, s.hidden + SOURCE]]  # reads SOURCE only
    assert o[:, :d].nonzero().tolist() == [[s.hidden + CLOCK, 0]]  # writes CLOCK only
    code = sum(embed[f"emb_code.{k}.weight"] for k in range(4))
    assert torch.allclose(code[:, BIAS], torch.tensor(0.04)) and not code[:, [SOURCE, CLOCK]].any()
    text = embed["emb_text.weight"]
    assert torch.allclose(text[:, BIAS], torch.tensor(0.04)) and torch.allclose(text[:, SOURCE], torch.tensor(0.02))
    heads = Embed.from_state_dict(embed)
    code_heads = heads.head_code.view(4, EOS_ID + 1, s.hidden)
    assert not code_heads[:, :EOS_ID][..., r].any() and not code_heads[1:, EOS_ID].any()
    eos = code_heads[0, EOS_ID]
    assert eos.nonzero().flatten().tolist() == [s.hidden + CLOCK, s.hidden + BIAS]
    assert torch.allclose(eos[[BIAS, CLOCK]], torch.tensor([s.eos_gain, -s.eos_gain * s.eos_rho]))
    assert heads.head_text[ebreak].nonzero().flatten().tolist() == [s.hidden + BIAS]
    assert not heads.head_text[torch.arange(len(heads.head_text)) != ebreak][:, r].any()


@pytest.fixture(scope="module")
def tiny_tts():
    from ttsserve.entrypoints.tts import TTS

    return TTS(load_format="dummy", dummy_size="tiny", dtype="float32", device="cpu")


def test_the_clock_counts_the_prompts_share_of_the_context(tiny_tts, monkeypatch):
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    code_logits = Embed.code_logits

    def recording(self, hidden):
        out = code_logits(self, hidden)
        seen.append((hidden[0, [BIAS, CLOCK]].float(), out[0, :, EOS_ID]))
        return out

    monkeypatch.setattr(Embed, "code_logits", recording)
    frames = 120
    tiny_tts.generate(
        "Hello world, this is ttsserve.",
        SamplingParams(seed=1, min_new_tokens=frames, max_new_tokens=frames),
        voice=Voice(spk_emb=tiny_tts.speaker(1)),
    )
    h = torch.stack([x for x, _ in seen])  # [frames, 2]: BIAS, CLOCK of the state each frame is sampled from
    eos = torch.stack([y for _, y in seen])  # [frames, 4]
    assert h.shape == (frames, 2) and not eos[:, 1:].any()
    # Uniform attention over the P prompt positions (text ones marked) and the t frames since:
    # CLOCK / BIAS = n_text / (P + t), so its inverse is a line in t, of slope 1 / n_text and intercept P / n_text.
    slope, intercept = np.polyfit(np.arange(frames), (h[:, 0] / h[:, 1]).numpy(), 1)
    fit = (intercept + slope * np.arange(frames)) * (h[:, 1] / h[:, 0]).numpy()
    prompt, n_text = intercept / slope, 1 / slope
    assert np.abs(fit - 1).max() < 0.02 and 10 < prompt < 40 and prompt - 2 < n_text < prompt, (prompt, n_text)
    k = eos[:, 0]
    assert k[0] < 0 and k[:10].max() < k[-20:].min()  # the EOS logit rises: never EOS at the first frames
    assert 4.5 < float(k[-20:].mean()) < 6.0  # ... towards K, about where the top codes are


def test_lengths_grow_with_the_text_on_tiny_weights(tiny_tts):
    def seconds(text: str, seed: int) -> float:
        (wav,) = tiny_tts.generate(text, SamplingParams(seed=seed), voice=Voice(spk_emb=tiny_tts.speaker(seed)))
        assert next(iter(tiny_tts.last_results.values())).finish_reason == "stop"  # EOS, not the cap
        return wav.size / tiny_tts.sample_rate

    short = [seconds("Hello!", seed) for seed in range(6)]
    long = [seconds("The quick brown fox jumps over the lazy dog.", seed) for seed in range(6)]
    assert min(short) > 0.3 and 0.6 < float(np.median(short)) < 3.0, short
    assert 2.0 < float(np.median(long)) < 8.0 and np.median(long) > 2 * np.median(short), long
