"""ModelRunner: packs one step's scheduled requests into flat inputs, runs the GPT through paged attention,
applies the heads and the batched sampler, and returns sampled rows plus the hidden states the vocoder needs.

The runner never touches a queue; the scheduler never touches a tensor (ARCHITECTURE.md principle 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ttsserve.attention.backend import AttentionMetadata, PagedAttention, select_backend
from ttsserve.model.chattts import ChatTTSModel
from ttsserve.params import SamplingParams
from ttsserve.runner.kv_cache import KVCache, KVCacheSpec
from ttsserve.sample.sampler import SamplingBatch, sample


@dataclass
class SequenceInputs:
    """The prompt of one engine sequence, as the front end built it.

    ids: int64 [P, num_vq] (a text position repeats its id in every column; audio-prompt rows hold 4 codes).
    text_mask: bool [P] (False on audio-prompt rows).
    spk_emb: fp16 [hidden] or None (replaces the embedding at the [spk_emb] position).
    """

    ids: torch.Tensor
    text_mask: torch.Tensor
    spk_emb: torch.Tensor | None
    mode: str  # "code" | "text"
    params: SamplingParams
    seed: int


@dataclass
class _SequenceState:
    prompt_embeds: torch.Tensor  # [P, H] in the GPT dtype, on the device
    mode: str
    params: SamplingParams
    seed: int
    temperature: tuple[float, ...]


@dataclass
class RunnerOutput:
    """sampled[req_id]: a 4-tuple of codes (code) or a token id (text), for requests that sampled this step.
    stopped[req_id]: the sampled row is EOS (any codebook for code).
    hidden_ids / hiddens: code requests that sampled a non-EOS frame and the hidden state that produced it,
    [len(hidden_ids), H] fp32 on the device (the Decoder's input, spec 4.5).
    """

    sampled: dict[str, object] = field(default_factory=dict)
    stopped: dict[str, bool] = field(default_factory=dict)
    hidden_ids: list[str] = field(default_factory=list)
    hiddens: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: ChatTTSModel, kv_spec: KVCacheSpec, spk_emb_id: int, text_eos_id: int) -> None:
        self.model = model
        self.device, self.dtype = model.device, model.dtype
        self.cfg = model.gpt_config
        self.kv = KVCache(self.cfg, kv_spec, self.device, self.dtype)
        self.block_size = kv_spec.block_size
        self.backend = select_backend(self.device)
        self.scale = 1.0 / math.sqrt(self.cfg.head_dim)
        self.spk_emb_id, self.text_eos_id = spk_emb_id, text_eos_id
        self.states: dict[str, _SequenceState] = {}

    # ---- per-request state -------------------------------------------------------------------------------
    def add_sequence(self, req_id: str, inputs: SequenceInputs) -> None:
        ids = inputs.ids.to(self.device)
        with torch.inference_mode():
            spk = None if inputs.spk_emb is None else inputs.spk_emb.to(self.device)
            embeds = self.model.embed.embed_prompt(ids, inputs.text_mask.to(self.device), spk, self.spk_emb_id)
        rows = self.cfg.num_vq if inputs.mode == "code" else 1
        self.states[req_id] = _SequenceState(embeds.to(self.dtype), inputs.mode, inputs.params, inputs.seed,
                                             inputs.params.temperatures(rows))

    def remove_sequence(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    # ---- one step ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched, requests: dict) -> RunnerOutput:
        """sched: a SchedulerOutput; requests: req_id -> Request (for output_token_ids)."""
        self.kv.swap_out(sched.swap_out)
        self.kv.swap_in(sched.swap_in)
        if not sched.scheduled:
            return RunnerOutput()
        x, positions, md, last_index = self._prepare_inputs(sched, requests)
        ctx = PagedAttention(self.backend, self.kv.layers, md, self.scale)
        hidden = self.model.gpt(x, positions, ctx)
        samplers = [s for s in sched.scheduled if s.will_sample]
        return self._sample(samplers, hidden, last_index, requests)

    def _prepare_inputs(self, sched, requests: dict):
        bs = self.block_size
        pieces: list[torch.Tensor] = []
        code_rows: list[tuple[int, tuple]] = []  # (flat index, frame) for generated-frame inputs
        text_rows: list[tuple[int, int]] = []
        positions, slots, cu, seq_lens, tables, last_index = [], [], [0], [], [], {}
        flat = 0
        for s in sched.scheduled:
            st = self.states[s.request_id]
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            num_prompt = st.prompt_embeds.shape[0]
            if start < num_prompt:
                pieces.append(st.prompt_embeds[start:min(end, num_prompt)])
            outputs = requests[s.request_id].output_token_ids
            for pos in range(max(start, num_prompt), end):
                tok = outputs[pos - num_prompt]
                row = flat + pos - start
                (code_rows if st.mode == "code" else text_rows).append((row, tok))
                pieces.append(None)  # placeholder, filled below
            table = s.block_table
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            flat += end - start
            cu.append(flat)
            seq_lens.append(end)
            tables.append(table)
            last_index[s.request_id] = flat - 1
        x = self._assemble(pieces, code_rows, text_rows, flat)
        dev = self.device
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
        md = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(b - a for a, b in zip(cu, cu[1:])),
            max_seq_len=max(seq_lens), block_size=bs, cu_seqlens_q_cpu=cu, seq_lens_cpu=seq_lens,
        )
        return x, torch.tensor(positions, dtype=torch.int64, device=dev), md, last_index

    def _assemble(self, pieces: list, code_rows: list, text_rows: list, num_tokens: int) -> torch.Tensor:
        """Concatenate prompt-embedding slices and embed generated tokens into one [T, H] tensor."""
        embed = self.model.embed
        x = torch.empty(num_tokens, self.cfg.hidden_size, device=self.device, dtype=self.dtype)
        row = 0
        for piece in pieces:
            if piece is None:
                row += 1
                continue
            x[row:row + piece.shape[0]] = piece
            row += piece.shape[0]
        if code_rows:
            idx = torch.tensor([r for r, _ in code_rows], device=self.device)
            codes = torch.tensor([list(t) for _, t in code_rows], dtype=torch.int64, device=self.device)
            x[idx] = embed.embed_codes(codes).to(self.dtype)
        if text_rows:
            idx = torch.tensor([r for r, _ in text_rows], device=self.device)
            ids = torch.tensor([t for _, t in text_rows], dtype=torch.int64, device=self.device)
            x[idx] = embed.embed_text(ids).to(self.dtype)
        return x

    def _sample(self, scheduled: list, hidden: torch.Tensor, last_index: dict, requests: dict) -> RunnerOutput:
        out = RunnerOutput()
        groups = {"code": [s for s in scheduled if self.states[s.request_id].mode == "code"],
                  "text": [s for s in scheduled if self.states[s.request_id].mode == "text"]}
        results, code_hidden = [], None
        for mode, group in groups.items():
            if not group:
                continue
            idx = torch.tensor([last_index[s.request_id] for s in group], device=self.device)
            h = hidden[idx].float()
            if mode == "code":
                logits, eos, code_hidden = self.model.embed.code_logits(h), self.cfg.audio_eos_id, h
            else:
                logits, eos = self.model.embed.text_logits(h)[:, None, :], self.text_eos_id
            batch = self._sampling_batch(group, requests, logits.shape[1], eos)
            results.append((mode, group, sample(logits, batch)))
        host = torch.cat([t.reshape(-1) for _, _, t in results]).cpu().tolist()  # the one sync of the step
        offset = 0
        for mode, group, tokens in results:
            width = tokens.shape[1]
            for i, s in enumerate(group):
                row = host[offset + i * width: offset + (i + 1) * width]
                if mode == "code":
                    frame = tuple(row)
                    out.sampled[s.request_id] = frame
                    out.stopped[s.request_id] = self.cfg.audio_eos_id in frame
                else:
                    out.sampled[s.request_id] = row[0]
                    out.stopped[s.request_id] = row[0] == self.text_eos_id
            offset += len(group) * width
        keep = [i for i, s in enumerate(groups["code"]) if not out.stopped[s.request_id]]
        if keep:
            out.hidden_ids = [groups["code"][i].request_id for i in keep]
            out.hiddens = code_hidden[torch.tensor(keep, device=self.device)]
        return out

    def _sampling_batch(self, group: list, requests: dict, rows: int, eos_id: int) -> SamplingBatch:
        temps, top_p, top_k, rp, hist, banned, greedy, seeds, steps = [], [], [], [], [], [], [], [], []
        window = max(self.states[s.request_id].params.repetition_window for s in group)
        for s in group:
            st, req = self.states[s.request_id], requests[s.request_id]
            p, outs = st.params, req.output_token_ids
            temps.append(st.temperature)
            top_p.append(p.top_p)
            top_k.append(p.top_k)
            rp.append(p.repetition_penalty)
            recent = outs[-p.repetition_window:] if p.repetition_penalty != 1.0 else []
            cols = [[t[r] for t in recent] if rows > 1 else list(recent) for r in range(rows)]
            hist.append([c + [-1] * (window - len(c)) for c in cols])
            banned.append(len(outs) < p.min_new_tokens)
            greedy.append(p.greedy)
            seeds.append(st.seed)
            steps.append(len(outs))
        dev = self.device
        return SamplingBatch(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=dev),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=dev),
            repetition_penalty=torch.tensor(rp, dtype=torch.float32, device=dev),
            history=torch.tensor(hist, dtype=torch.int64, device=dev),
            eos_banned=torch.tensor(banned, dtype=torch.bool, device=dev),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=dev),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=dev),
            steps=torch.tensor(steps, dtype=torch.int64, device=dev),
            eos_id=eos_id,
        )
