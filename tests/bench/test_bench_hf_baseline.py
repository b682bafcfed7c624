"""The HF-style baseline computes the same function as ChatTTS and as the ttsserve engine.

1. On the golden tiny checkpoint it reproduces the reference's greedy codes (batch of 3, left-padded) and
   hidden states, and the reference's decode of hiddens to a waveform.
2. On the tiny dummy model its greedy codes equal the engine's for the same prompts and seeds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from ttsserve.bench.baseline_hf import Generated, HFBaseline  # noqa: E402
from ttsserve.config import EngineConfig  # noqa: E402
from ttsserve.params import SamplingParams, SynthesisRequest  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
TEXTS = [
    "Hello world, this is a test of the speech model.",
    "今天天气真不错。",
    "ChatTTS 是一个 open source 的语音模型，very nice。",
]


@pytest.fixture(scope="module")
def golden_hf() -> HFBaseline:
    return HFBaseline(
        EngineConfig(model=str(GOLDEN / "assets-tiny"), load_format="safetensors", device="cpu", dtype="float32")
    )


def test_baseline_reproduces_reference_greedy_batch(golden_hf: HFBaseline) -> None:
    meta = json.loads((GOLDEN / "d_greedy.json").read_text())
    gold = np.load(GOLDEN / "d_greedy.npz")
    texts = {t["key"]: t for t in json.loads((GOLDEN / "a_prompts.json").read_text())["texts"]}
    spk = torch.from_numpy(np.load(GOLDEN / "b_speaker.npz")["tiny_spk_emb_fp16"])
    st = meta["code_settings"]
    params = SamplingParams(
        greedy=True,
        min_new_tokens=st["min_new_token"],
        max_new_tokens=st["max_new_token"],
        repetition_penalty=st["repetition_penalty"],
        top_p=st["top_P"],
        top_k=st["top_K"],
    )
    prompts = []
    for key in meta["keys"]:
        ids = torch.tensor(texts[key]["code"]["ids"])[:, None].repeat(1, 4)
        prompts.append((ids, torch.ones(len(ids), dtype=torch.bool), spk))
    assert len({p[0].shape[0] for p in prompts}) > 1  # really left-padded
    out = golden_hf.generate(prompts, [params] * 3, [0] * 3)
    for key, g in zip(meta["keys"], out):
        assert g.codes.tolist() == gold[f"{key}_code_ids"].tolist(), key
        assert float((g.hiddens - torch.from_numpy(gold[f"batch_{key}_code_hiddens"])).abs().max()) < 1e-5
        assert g.finish_reason == "length"
    e = np.load(GOLDEN / "e_decode.npz")
    (wav,) = golden_hf.decode([Generated(torch.zeros(32, 4), torch.from_numpy(e["decoder_input_hiddens"]), "stop")])
    assert wav.shape == e["decoder_wav"].shape
    assert float((wav - torch.from_numpy(e["decoder_wav"])).abs().max()) < 1e-4


def test_baseline_stops_rows_independently(golden_hf: HFBaseline) -> None:
    """EOS in a row ends that row (EOS frame dropped) while the others run on to their own caps."""
    ids = torch.tensor(json.loads((GOLDEN / "a_prompts.json").read_text())["texts"][0]["code"]["ids"])
    prompt = (ids[:, None].repeat(1, 4), torch.ones(len(ids), dtype=torch.bool), None)
    first = golden_hf.generate([prompt], [SamplingParams(greedy=True, min_new_tokens=6, max_new_tokens=6)], [0])[0]
    eos = golden_hf.eos_id
    golden_hf.eos_id = int(first.codes[3, 0])  # pretend codebook 0's step-3 token is EOS
    try:
        p_free = SamplingParams(greedy=True, max_new_tokens=6)
        p_banned = SamplingParams(greedy=True, min_new_tokens=5, max_new_tokens=5)
        a, b = golden_hf.generate([prompt, prompt], [p_free, p_banned], [0, 0])
    finally:
        golden_hf.eos_id = eos
    if golden_hf.eos_id in first.codes[:3, 0].tolist():
        pytest.skip("degenerate: the chosen token occurs earlier")
    assert a.finish_reason == "stop" and torch.equal(a.codes, first.codes[:3])
    assert b.finish_reason == "length" and b.codes.shape[0] == 5


def test_baseline_greedy_equals_engine_tiny() -> None:
    from ttsserve.engine.engine import Engine

    cfg = EngineConfig(load_format="dummy", dummy_size="tiny", dtype="float32", device="cpu")
    engine = Engine(cfg)
    hf = HFBaseline(cfg)
    params = [
        SamplingParams(greedy=True, min_new_tokens=n, max_new_tokens=n, seed=7 + i) for i, n in enumerate((24, 17, 30))
    ]
    # the engine: all three at once, capturing each sequence's sampled frames and hidden states
    frames: dict[str, list] = {}
    hiddens: dict[str, list] = {}
    # the runner's RunnerOutput comes from wait() (launch/wait split) or, in older runners, from execute()
    name = "wait" if hasattr(engine.runner, "wait") else "execute"
    original = getattr(engine.runner, name)

    def spy(*args):
        out = original(*args)
        for rid, row in out.sampled.items():
            if not out.stopped.get(rid):
                frames.setdefault(rid, []).append(list(row))
        for ids, h in out.frames:  # h: [m, len(ids), H], every frame sampled (m = 1 here), EOS frames included
            for frame in h:
                for i, rid in enumerate(ids):
                    if not out.stopped.get(rid):
                        hiddens.setdefault(rid, []).append(frame[i].float().cpu())
        return out

    setattr(engine.runner, name, spy)
    rids = [
        engine.add_synthesis(SynthesisRequest(t, code_params=p, split=False, request_id=f"r{i}"))
        for i, (t, p) in enumerate(zip(TEXTS, params))
    ]
    while engine.has_unfinished():
        engine.step()
    # the baseline: one static batch of the same prompts (built by the same front end) and seeds
    prompts = []
    for t, p in zip(TEXTS, params):
        req = SynthesisRequest(t, code_params=p, split=False)
        (seg,) = hf.frontend.segments(req)
        ids, mask = hf.frontend.code_inputs(seg.text, req.code_prompt, req.voice)
        prompts.append((ids, mask, None))
    out = hf.generate(prompts, params, [p.seed for p in params])
    for rid, g, p in zip(rids, out, params):
        (seq_id,) = [k for k in frames if k.startswith(rid + "/")]
        assert g.codes.shape == (p.max_new_tokens, 4)
        assert g.codes.tolist() == frames[seq_id], rid
        assert torch.allclose(g.hiddens, torch.stack(hiddens[seq_id]), atol=1e-4), rid
