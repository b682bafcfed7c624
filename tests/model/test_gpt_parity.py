"""GPT + Embed parity with the reference goldens (c_teacher_forced, d_greedy), dense and paged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ttsserve.attention.backend import PagedAttention, kv_cache_shape
from ttsserve.attention.dense import DenseAttention
from ttsserve.attention.torch_ref import TorchPagedAttention, make_metadata
from ttsserve.config import GPTConfig
from ttsserve.model.embed import Embed
from ttsserve.model.gpt import GPT
from ttsserve.model.oracle import generate_dense
from ttsserve.params import SamplingParams

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
ASSET = GOLDEN / "assets-tiny" / "asset"


@pytest.fixture(scope="module")
def cfg() -> GPTConfig:
    return GPTConfig.from_hf_json(json.loads((ASSET / "gpt" / "config.json").read_text()))


@pytest.fixture(scope="module")
def model(cfg: GPTConfig) -> tuple[GPT, Embed]:
    gpt = GPT.from_state_dict(load_file(ASSET / "gpt" / "model.safetensors"), cfg)
    return gpt.eval(), Embed.from_state_dict(load_file(ASSET / "Embed.safetensors"))


@pytest.fixture(scope="module")
def c_gold() -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN / "c_teacher_forced.npz"))


@pytest.fixture(scope="module")
def prompts() -> dict:
    return json.loads((GOLDEN / "a_prompts.json").read_text())


@pytest.fixture(scope="module")
def spk() -> torch.Tensor:
    return torch.from_numpy(np.load(GOLDEN / "b_speaker.npz")["tiny_spk_emb_fp16"])


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a))


def max_err(x: torch.Tensor, gold: np.ndarray) -> float:
    return float((x.double() - t(gold).double()).abs().max())


# ---------------------------------------------------------------- loading


def test_gpt_loader_accepts_prefix_and_rejects_bad_tensors(cfg: GPTConfig) -> None:
    sd = load_file(ASSET / "gpt" / "model.safetensors")
    prefixed = {"model." + k: v for k, v in sd.items()} | {"model.rotary_emb.inv_freq": torch.ones(8)}
    a, b = GPT.from_state_dict(sd, cfg), GPT.from_state_dict(prefixed, cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    missing = {k: v for k, v in sd.items() if k != "layers.1.mlp.down_proj.weight"}
    with pytest.raises(ValueError, match=r"missing tensor layers\.1\.mlp\.down_proj\.weight"):
        GPT.from_state_dict(missing, cfg)
    with pytest.raises(ValueError, match=r"unexpected tensor layers\.0\.self_attn\.q_proj\.bias"):
        GPT.from_state_dict(sd | {"layers.0.self_attn.q_proj.bias": torch.zeros(64)}, cfg)
    bad = sd | {"layers.1.mlp.up_proj.weight": torch.zeros(127, 64)}
    with pytest.raises(
        ValueError,
        match=r"gpt/model\.safetensors: layers\.1\.mlp\.up_proj\.weight has shape "
        r"\(127, 64\) but config implies \(128, 64\)",
    ):
        GPT.from_state_dict(bad, cfg)


def test_gpt_fuses_projections_and_casts(cfg: GPTConfig) -> None:
    sd = load_file(ASSET / "gpt" / "model.safetensors")
    gpt = GPT.from_state_dict(sd, cfg, dtype=torch.bfloat16)
    layer = gpt.layers[1]
    assert layer.qkv_proj.weight.dtype == torch.bfloat16 and gpt.dtype == torch.bfloat16
    assert torch.equal(layer.qkv_proj.weight[64:128].float(), sd["layers.1.self_attn.k_proj.weight"].bfloat16().float())
    assert torch.equal(layer.gate_up_proj.weight[128:].float(), sd["layers.1.mlp.up_proj.weight"].bfloat16().float())


def test_embed_loader_folds_weight_norm_and_rejects_bad_tensors() -> None:
    sd = load_file(ASSET / "Embed.safetensors")
    emb = Embed.from_state_dict(sd)
    assert (emb.num_text_tokens, emb.num_audio_tokens, emb.num_vq, emb.hidden_size) == (1024, 626, 4, 64)
    g, v = sd["head_code.2.parametrizations.weight.original0"], sd["head_code.2.parametrizations.weight.original1"]
    ref = (g.double() * v.double() / v.double().norm(dim=1, keepdim=True)).float()
    assert (emb.head_code[2 * 626 : 3 * 626] - ref).abs().max() < 3e-7
    torch_fold = torch._weight_norm(
        sd["head_text.parametrizations.weight.original1"], sd["head_text.parametrizations.weight.original0"], 0
    )
    assert (emb.head_text - torch_fold).abs().max() < 3e-7
    with pytest.raises(ValueError, match=r"missing tensor head_code\.3\.parametrizations\.weight\.original0"):
        Embed.from_state_dict({k: x for k, x in sd.items() if k != "head_code.3.parametrizations.weight.original0"})
    with pytest.raises(ValueError, match=r"head_text\.parametrizations\.weight\.original1 has shape \(1024, 63\)"):
        Embed.from_state_dict(sd | {"head_text.parametrizations.weight.original1": torch.zeros(1024, 63)})
    with pytest.raises(ValueError, match="unexpected tensor extra"):
        Embed.from_state_dict(sd | {"extra": torch.zeros(1)})


# ---------------------------------------------------------------- teacher forcing (c)


def test_code_teacher_forced(model, c_gold, prompts, spk) -> None:
    gpt, emb = model
    ids, mask = t(c_gold["code_input_ids"]), t(c_gold["code_text_mask"])
    with torch.no_grad():
        x = emb.embed_prompt(ids, mask, spk, prompts["special_ids"]["[spk_emb]"])
        h = gpt(x, torch.arange(len(ids)), DenseAttention(len(gpt.layers)))
        logits = emb.code_logits(h)
    assert max_err(x, c_gold["code_inputs_embeds"]) < 1e-6
    assert max_err(h, c_gold["code_hidden"]) < 1e-5
    assert logits.shape == (40, 4, 626) and max_err(logits, c_gold["code_logits"]) < 5e-5


def test_text_teacher_forced(model, c_gold) -> None:
    gpt, emb = model
    ids = t(c_gold["text_input_ids"])
    with torch.no_grad():
        x = emb.embed_text(ids)
        h = gpt(x, torch.arange(len(ids)), DenseAttention(len(gpt.layers)))
    assert max_err(x, c_gold["text_inputs_embeds"]) < 1e-6
    assert max_err(h, c_gold["text_hidden"]) < 1e-5
    assert max_err(emb.text_logits(h), c_gold["text_logits"]) < 5e-5


class PagedRun:
    """Feeds sequences through the GPT on a paged cache in caller-chosen steps (block_size 4, shuffled blocks)."""

    def __init__(self, gpt: GPT, lens: list[int], block_size: int = 4, device: str = "cpu") -> None:
        self.gpt, self.block_size, self.device = gpt, block_size, device
        per_seq = [-(-n // block_size) for n in lens]
        perm = torch.randperm(sum(per_seq) + 2, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables = [perm[sum(per_seq[:i]) : sum(per_seq[: i + 1])] for i in range(len(lens))]
        cfg = gpt.cfg
        shape = kv_cache_shape(len(perm), block_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [torch.zeros(shape, device=device) for _ in range(cfg.num_layers)]
        self.done = [0] * len(lens)

    def step(self, feeds: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """feeds: {seq: embeddings [n, H]} (a flat batch, in dict order) -> {seq: hidden [n, H]}."""
        seqs = list(feeds)
        news = [feeds[s].shape[0] for s in seqs]
        md = make_metadata(
            [self.tables[s] for s in seqs], [self.done[s] for s in seqs], news, self.block_size, self.device
        )
        positions = torch.cat(
            [torch.arange(self.done[s], self.done[s] + n, device=self.device) for s, n in zip(seqs, news)]
        )
        ctx = PagedAttention(TorchPagedAttention(), self.caches, md, self.gpt.cfg.head_dim**-0.5)
        with torch.no_grad():
            h = self.gpt(torch.cat([feeds[s] for s in seqs]), positions, ctx)
        out = {}
        for j, (s, n) in enumerate(zip(seqs, news)):
            out[s] = h[md.cu_seqlens_q_cpu[j] : md.cu_seqlens_q_cpu[j + 1]]
            self.done[s] += n
        return out


def test_code_paged_chunked_matches_dense_and_golden(model, c_gold, prompts, spk) -> None:
    gpt, emb = model
    ids, mask = t(c_gold["code_input_ids"]), t(c_gold["code_text_mask"])
    with torch.no_grad():
        x = emb.embed_prompt(ids, mask, spk, prompts["special_ids"]["[spk_emb]"])
        dense = gpt(x, torch.arange(len(ids)), DenseAttention(len(gpt.layers)))
    run = PagedRun(gpt, [len(ids)])
    bounds = [0, 6, 11, 16] + list(range(17, len(ids) + 1))  # prompt in 3 chunks, then one frame per step
    h = torch.cat([run.step({0: x[s:e]})[0] for s, e in zip(bounds, bounds[1:])])
    assert (h - dense).abs().max() < 1e-6
    assert max_err(h, c_gold["code_hidden"]) < 1e-5
    assert max_err(emb.code_logits(h), c_gold["code_logits"]) < 5e-5


def test_code_batch_paged_flat_batch(model, c_gold, prompts, spk) -> None:
    """The left-padded batch golden, run pad-free as two sequences in one flat batch: sequence 1 prefills
    in chunks while sequence 0 (prefilled whole) decodes, then both decode together."""
    gpt, emb = model
    seqs = []
    for b in range(2):
        keep = t(c_gold["code_batch_attention_mask"][b]).bool()
        ids, tm = t(c_gold["code_batch_input_ids"][b])[keep], t(c_gold["code_batch_text_mask"][b])[keep]
        seqs.append((emb.embed_prompt(ids, tm, spk, prompts["special_ids"]["[spk_emb]"]), keep))
    (x0, keep0), (x1, keep1) = seqs
    p0 = int(c_gold["code_batch_text_mask"][0].sum())
    run, outs = PagedRun(gpt, [len(x0), len(x1)]), {0: [], 1: []}
    for s, h in run.step({0: x0[:p0]}).items():
        outs[s].append(h)
    pos1 = 0
    for chunk in (5, 9, 11):  # sequence 1 prefills in chunks while 0 decodes (mixed batch)
        step = run.step({1: x1[pos1 : pos1 + chunk], 0: x0[run.done[0] : run.done[0] + 1]})
        pos1 += chunk
        for s, h in step.items():
            outs[s].append(h)
    while run.done[0] < len(x0) or run.done[1] < len(x1):
        feeds = {s: x[run.done[s] : run.done[s] + 1] for s, x in ((1, x1), (0, x0)) if run.done[s] < len(x)}
        for s, h in run.step(feeds).items():
            outs[s].append(h)
    for b, keep in ((0, keep0), (1, keep1)):
        logits = emb.code_logits(torch.cat(outs[b]))
        assert max_err(logits, c_gold["code_batch_logits"][b][keep.numpy()]) < 5e-5


# ---------------------------------------------------------------- greedy generation (d)

D_KEYS = ["en_simple", "zh_ctrl", "mixed"]


@pytest.fixture(scope="module")
def d_gold() -> tuple[dict, dict[str, np.ndarray]]:
    return json.loads((GOLDEN / "d_greedy.json").read_text()), dict(np.load(GOLDEN / "d_greedy.npz"))


def greedy_params(settings: dict, greedy: bool) -> SamplingParams:
    """The README's deterministic settings: greedy mode, or temperature 1e-30 sampling (same argmax)."""
    n = settings["max_new_token"]
    assert settings["min_new_token"] == n  # EOS banned at every step
    return SamplingParams(
        temperature=1e-30 if not greedy else 0.3,
        top_p=settings["top_P"],
        top_k=settings["top_K"],
        repetition_penalty=settings["repetition_penalty"],
        repetition_window=16,
        min_new_tokens=n,
        max_new_tokens=n,
        greedy=greedy,
        seed=0,
    )


@pytest.mark.parametrize("greedy", [True, False])
def test_greedy_code_and_refine(model, prompts, spk, d_gold, greedy: bool) -> None:
    gpt, emb = model
    meta, gold = d_gold
    assert meta["keys"] == D_KEYS
    texts = {x["key"]: x for x in prompts["texts"]}
    special = prompts["special_ids"]
    code_params = greedy_params(meta["code_settings"], greedy)
    refine_params = greedy_params(meta["refine_settings"], greedy)
    for key in D_KEYS:
        ids = torch.tensor(texts[key]["code"]["ids"])
        x = emb.embed_prompt(
            ids[:, None].repeat(1, 4), torch.ones(len(ids), dtype=torch.bool), spk, special["[spk_emb]"]
        )
        codes, hiddens = generate_dense(gpt, emb, x, "code", code_params)
        assert codes.tolist() == gold[f"{key}_code_ids"].tolist(), key
        assert max_err(hiddens, gold[f"{key}_code_hiddens"]) < 1e-5
        ids = torch.tensor(texts[key]["refine"]["ids"])
        toks, _ = generate_dense(gpt, emb, emb.embed_text(ids), "text", refine_params, eos_id=special["[Ebreak]"])
        assert toks.tolist() == gold[f"{key}_refine_ids"].tolist(), key


def test_oracle_stops_at_eos_and_excludes_it(model, prompts, spk) -> None:
    """Sampling (not greedy) with EOS allowed: the output ends before the first frame holding EOS."""
    gpt, emb = model
    ids = torch.tensor(prompts["texts"][0]["code"]["ids"])
    x = emb.embed_prompt(ids[:, None].repeat(1, 4), torch.ones(len(ids), dtype=torch.bool), spk, 989)
    # Declare as "EOS" the codebook-1 token that greedy emits at step 2: generation must stop there.
    first, _ = generate_dense(gpt, emb, x, "code", SamplingParams(greedy=True, max_new_tokens=4, min_new_tokens=4))
    stop_id = int(first[2, 1])
    assert stop_id not in first[:2].tolist()[0] + first[:2].tolist()[1]
    toks, hid = generate_dense(gpt, emb, x, "code", SamplingParams(greedy=True, max_new_tokens=4), eos_id=stop_id)
    assert toks.shape == (2, 4) and hid.shape == (2, 64)
    assert torch.equal(toks, first[:2])


@pytest.mark.gpu
def test_cuda_fp32_parity_dense_and_paged(cfg, c_gold, prompts, spk, d_gold) -> None:
    """The same modules on CUDA (fp32, TF32 off): goldens within the CPU tolerances, greedy ids exact."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    gpt = GPT.from_state_dict(load_file(ASSET / "gpt" / "model.safetensors"), cfg, device=dev)
    emb = Embed.from_state_dict(load_file(ASSET / "Embed.safetensors"), device=dev)
    ids, mask = t(c_gold["code_input_ids"]).to(dev), t(c_gold["code_text_mask"]).to(dev)
    with torch.no_grad():
        x = emb.embed_prompt(ids, mask, spk.to(dev), prompts["special_ids"]["[spk_emb]"])
        h = gpt(x, torch.arange(len(ids), device=dev), DenseAttention(cfg.num_layers))
    assert max_err(x.cpu(), c_gold["code_inputs_embeds"]) < 1e-6
    assert max_err(emb.code_logits(h).cpu(), c_gold["code_logits"]) < 5e-5
    run = PagedRun(gpt, [len(ids)], device="cuda")
    bounds = [0, 6, 11, 16] + list(range(17, len(ids) + 1))
    hp = torch.cat([run.step({0: x[s:e]})[0] for s, e in zip(bounds, bounds[1:])])
    assert max_err(emb.code_logits(hp).cpu(), c_gold["code_logits"]) < 5e-5
    meta, gold = d_gold
    texts = {x["key"]: x for x in prompts["texts"]}
    for key in D_KEYS:
        cid = torch.tensor(texts[key]["code"]["ids"], device=dev)
        xp = emb.embed_prompt(
            cid[:, None].repeat(1, 4),
            torch.ones(len(cid), dtype=torch.bool, device=dev),
            spk.to(dev),
            prompts["special_ids"]["[spk_emb]"],
        )
        codes, hiddens = generate_dense(gpt, emb, xp, "code", greedy_params(meta["code_settings"], True))
        assert codes.cpu().tolist() == gold[f"{key}_code_ids"].tolist(), key
        assert max_err(hiddens.cpu(), gold[f"{key}_code_hiddens"]) < 1e-5
