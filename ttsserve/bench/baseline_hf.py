"""The HuggingFace-style baseline: ChatTTS's own way of generating (MODEL.md §3-4), for `bench --backend hf`.

`transformers.LlamaModel` built from the checkpoint's gpt/config.json and weights (`embed_tokens` removed, as
the reference does; inputs_embeds come from our Embed), static batches left-padded with an attention mask,
position ids cumsum(mask) - 1, a dense DynamicCache, and a Python decode loop: heads on the last position,
the same sampler as the engine (ttsserve.sample), finished rows kept in the batch until every row is done,
and one Decoder + Vocos pass over the whole batch at the end (the reference's non-streaming path).

transformers is an optional dependency (the `bench` extra): it is imported only when a baseline is built.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ttsserve.bench.offline import BatchRun
from ttsserve.bench.results import RequestRecord
from ttsserve.bench.sysinfo import PeakMemory
from ttsserve.config import EngineConfig
from ttsserve.params import SamplingParams, SynthesisRequest
from ttsserve.sample.sampler import SamplingBatch, sample

SEGMENT_SEED_STRIDE = 1  # the engine seeds segment k of a request with seed + k; so does the baseline


def build_llama(
    gpt_config: dict, state_dict: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """A transformers LlamaModel holding the checkpoint's GPT weights, without embed_tokens.

    vocab_size is set to 1 because embed_tokens is deleted after load, as the reference does: only its
    size would change, never the function computed.
    """
    try:
        from transformers import LlamaConfig, LlamaModel
    except ImportError as e:
        raise ValueError("the hf baseline needs transformers (pip install 'ttsserve[bench]')") from e
    conf = {k: v for k, v in gpt_config.items() if k not in ("torch_dtype", "dtype", "transformers_version")}
    conf.update(vocab_size=1, bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=True)
    config = LlamaConfig(**conf)
    config._attn_implementation = "sdpa"  # the reference's default (MODEL.md §3.2: all-masked rows give 0)
    with torch.device("meta"):
        model = LlamaModel(config)
    sd = {(k[len("model.") :] if k.startswith("model.") else k): v for k, v in state_dict.items()}
    sd = {k: v for k, v in sd.items() if not k.endswith(("embed_tokens.weight", "rotary_emb.inv_freq"))}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not k.startswith("embed_tokens")]
    if missing or unexpected:
        raise ValueError(
            f"gpt/model.safetensors does not fit LlamaModel: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model.embed_tokens = None
    # Buffers were created on meta: rebuild the rotary table for real.
    model.rotary_emb = type(model.rotary_emb)(config=config)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


@dataclass
class Generated:
    """One sequence's result: codes int64 [n, num_vq] (no EOS frame), hiddens fp32 [n, H] (the state each
    frame was sampled from, MODEL.md §4.5); `finish_reason` "stop" (EOS) or "length"."""

    codes: torch.Tensor
    hiddens: torch.Tensor
    finish_reason: str


class HFBaseline:
    """The baseline model: our Embed / Decoder / Vocos / tokenizer around a transformers LlamaModel."""

    name = "hf"

    def __init__(self, cfg: EngineConfig) -> None:
        from ttsserve.engine.frontend import FrontEnd
        from ttsserve.model.chattts import build_model, read_checkpoint, resolve_device, resolve_dtype

        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        ckpt = read_checkpoint(cfg)
        self.model = build_model(ckpt, device, dtype)
        self.model.gpt = None  # not used: the LlamaModel below does the GPT's work
        self.llama = build_llama(ckpt.gpt_config, ckpt.gpt, device, dtype)
        del ckpt
        self.device, self.dtype = device, dtype
        self.embed = self.model.embed
        self.frontend = FrontEnd(self.model.tokenizer, self.model.gpt_config.num_vq)
        self.eos_id = self.model.gpt_config.audio_eos_id
        self.kv_bytes_per_token = self.model.gpt_config.kv_bytes_per_token(torch.tensor([], dtype=dtype).element_size())
        # transformers renamed past_key_values -> cache (5.x deprecates the old name).
        self._cache_arg = "cache" if "cache" in inspect.signature(self.llama.forward).parameters else "past_key_values"

    # ---- one static batch -----------------------------------------------------------------------------
    def _forward(self, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        out = self.llama(
            inputs_embeds=x.to(self.dtype),
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_arg: cache},
        )
        return out.last_hidden_state[:, -1].float()  # [B, H]: heads on the last position only

    def _prefill_inputs(self, prompts: Sequence[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-pad [(ids [T, Q], text_mask [T], spk_emb [H] | None)] -> embeds [B, L, H], mask [B, L] int64.

        A pad row holds ids 0 and text_mask 0 (the reference's tokenizer padding), so it embeds as the sum of
        the codebooks' entry 0; the attention mask hides it from every valid position.
        """
        length = max(p[0].shape[0] for p in prompts)
        embeds, masks = [], []
        spk_id = self.model.tokenizer.spk_emb_id
        for ids, text_mask, spk in prompts:
            pad = length - ids.shape[0]
            ids = torch.cat([ids.new_zeros(pad, ids.shape[1]), ids]).to(self.device)
            tm = torch.cat([text_mask.new_zeros(pad), text_mask]).to(self.device)
            spk_t = None if spk is None else torch.as_tensor(spk).to(self.device)
            embeds.append(self.embed.embed_prompt(ids, tm, spk_t, spk_id))
            masks.append(torch.cat([torch.zeros(pad, dtype=torch.int64), torch.ones(length - pad, dtype=torch.int64)]))
        return torch.stack(embeds), torch.stack(masks).to(self.device)

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[tuple], params: Sequence[SamplingParams], seeds: Sequence[int], on_step=None
    ) -> list[Generated]:
        """Generate one static batch to the end (every row finished or the largest max_new_tokens reached).

        prompts[i]: (ids int64 [T_i, num_vq], text_mask bool [T_i], spk_emb fp16 [H] or None), as
        FrontEnd.code_inputs builds them. seeds[i]: that row's sampling seed. on_step(num_live_rows) is
        called after each step (for a progress bar).
        """
        b, device = len(prompts), self.device
        x, mask = self._prefill_inputs(prompts)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        cache = self._new_cache()
        batch = self._sampling_batch(params, seeds)
        window = torch.tensor([p.repetition_window for p in params], device=device)
        min_new = torch.tensor([p.min_new_tokens for p in params], device=device)
        max_new = torch.tensor([p.max_new_tokens for p in params], device=device)
        live = torch.ones(b, dtype=torch.bool, device=device)
        lengths = torch.zeros(b, dtype=torch.int64, device=device)
        tokens, hiddens, stopped = [], [], torch.zeros(b, dtype=torch.bool, device=device)
        hidden = self._forward(x, mask, positions, cache)
        for step in range(int(max_new.max())):
            batch.steps.fill_(step)
            batch.eos_banned = step < min_new
            tok = sample(self.embed.code_logits(hidden), batch)  # [B, Q]
            eos = (tok == self.eos_id).any(dim=-1)
            stopped |= live & eos
            live &= ~eos
            tokens.append(tok)
            hiddens.append(hidden)
            lengths += live.long()
            live &= lengths < max_new
            if on_step is not None:
                on_step(int(live.sum()))
            if not bool(live.any()):  # the reference's loop: finished rows ride along until all are done
                break
            hist = torch.cat([batch.history[:, :, 1:], tok[:, :, None]], dim=2)
            age = torch.arange(hist.shape[2] - 1, -1, -1, device=device)
            batch.history = torch.where(age[None, None, :] < window[:, None, None], hist, -1)
            mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)
            positions = positions[:, -1:] + 1
            hidden = self._forward(self.embed.embed_codes(tok)[:, None, :], mask, positions, cache)
        self.last_cache_tokens, self.last_steps = b * mask.shape[1], len(tokens)
        toks, hids = torch.stack(tokens, dim=1), torch.stack(hiddens, dim=1)  # [B, S, Q], [B, S, H]
        return [
            Generated(toks[i, :n], hids[i, :n], "stop" if bool(stopped[i]) else "length")
            for i, n in enumerate(lengths.tolist())
        ]

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache()

    def _sampling_batch(self, params: Sequence[SamplingParams], seeds: Sequence[int]) -> SamplingBatch:
        """The sampler's state for the whole batch, kept on the device and updated by tensor ops each step."""
        dev, q = self.device, self.embed.num_vq
        window = max(p.repetition_window for p in params)
        return SamplingBatch(
            temperature=torch.tensor([p.temperatures(q) for p in params], dtype=torch.float32, device=dev),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
            repetition_penalty=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev),
            history=torch.full((len(params), q, window), -1, dtype=torch.int64, device=dev),
            eos_banned=torch.zeros(len(params), dtype=torch.bool, device=dev),
            greedy=torch.tensor([p.greedy for p in params], dtype=torch.bool, device=dev),
            seeds=torch.tensor(list(seeds), dtype=torch.int64, device=dev),
            steps=torch.zeros(len(params), dtype=torch.int64, device=dev),
            eos_id=self.eos_id,
        )

    @torch.inference_mode()
    def decode(self, results: Sequence[Generated]) -> list[torch.Tensor]:
        """All sequences' hiddens through Decoder + Vocos in one zero-padded batch (the reference's
        `_decode_to_wavs`); returns fp32 waveforms, n frames -> 512 n - 256 samples (empty for n = 0)."""
        lengths = torch.tensor([r.hiddens.shape[0] for r in results], device=self.device)
        n_max = int(lengths.max()) if len(results) else 0
        if n_max == 0:
            return [torch.zeros(0) for _ in results]
        h = torch.zeros(len(results), n_max, self.embed.hidden_size, device=self.device)
        for i, r in enumerate(results):
            h[i, : r.hiddens.shape[0]] = r.hiddens
        mel = self.model.decoder(h.transpose(1, 2), lengths.clamp(min=1))
        wav = self.model.vocos(mel, 2 * lengths.clamp(min=1))
        hop = self.model.vocos.hop_length
        return [
            wav[i, : max(0, hop * (2 * n - 1))].float().cpu() if n else torch.zeros(0)
            for i, n in enumerate(lengths.tolist())
        ]

    # ---- the bench interface (same as TTSServeBackend) ----------------------------------------------------
    def run_batch(self, sentences, params: Sequence[SamplingParams], split: bool, bar=None) -> BatchRun:
        """One static batch of all segments of all requests; every request's audio comes at the end."""
        mem = PeakMemory(str(self.device))
        mem.start()
        t0 = time.perf_counter()
        prompts, seg_params, seg_seeds, owner = [], [], [], []
        for i, (s, p) in enumerate(zip(sentences, params)):
            req = SynthesisRequest(s.text, code_params=p, split=split)
            for seg in self.frontend.segments(req):
                ids, text_mask = self.frontend.code_inputs(seg.text, req.code_prompt, req.voice)
                prompts.append((ids, text_mask, None))
                seg_params.append(p)
                seg_seeds.append(((p.seed or 0) + seg.index * SEGMENT_SEED_STRIDE) % (1 << 62))
                owner.append(i)

        def on_step(live: int) -> None:
            mem.sample()
            if bar is not None:
                bar.update(len(prompts))

        gen = self.generate(prompts, seg_params, seg_seeds, on_step)
        wavs = self.decode(gen)
        wall = time.perf_counter() - t0
        records = [
            RequestRecord(f"hf-{i}", s.id, latency_s=wall, ttfa_s=wall, finish_reason="stop", num_segments=0)
            for i, s in enumerate(sentences)
        ]
        for g, w, i in zip(gen, wavs, owner):
            rec = records[i]
            rec.num_frames += g.codes.shape[0]
            rec.num_samples += w.numel()
            rec.num_segments += 1
            if g.finish_reason == "length":
                rec.finish_reason = "length"
        return BatchRun(
            wall,
            records,
            mem.peak(),
            mem.kind,
            None,
            self.last_cache_tokens * self.kv_bytes_per_token,
            0,
            self.last_steps,
            extra={"static_batch_rows": len(prompts)},
        )

    def describe(self) -> dict:
        import transformers

        return {
            "backend": self.name,
            "device": str(self.device),
            "dtype": str(self.dtype),
            "transformers": transformers.__version__,
            "attention": "sdpa, DynamicCache",
        }
