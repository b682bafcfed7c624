"""AWQ: activation statistics, the scale search, and folds that leave the dense function unchanged."""

from __future__ import annotations

import pytest
import torch

from ttsserve.attention.dense import DenseAttention
from ttsserve.config import GPTConfig
from ttsserve.layers.quant.quantize import QuantConfig
from ttsserve.model.chattts import build_model
from ttsserve.model.dummy import make_dummy_checkpoint
from ttsserve.model.gpt import GPT
from ttsserve.tools.quant.calibrate import (
    ActStats,
    TeacherForcedSample,
    apply_awq,
    collect_activation_stats,
    load_calibration_corpus,
    search_awq_scale,
    teacher_forced_samples,
)


@pytest.fixture(scope="module")
def tiny():
    return make_dummy_checkpoint("tiny", 0)


def random_stats(cfg: GPTConfig, g: torch.Generator) -> dict:
    """Skewed per-channel activation scales, so every fold moves the weights a lot."""
    stats = {}
    for i in range(cfg.num_layers):
        for group, k in (
            ("qkv_proj", cfg.hidden_size),
            ("o_proj", cfg.hidden_size),
            ("gate_up_proj", cfg.hidden_size),
            ("down_proj", cfg.intermediate_size),
        ):
            spread = torch.rand(k, generator=g) * 20 + 0.05
            rows = torch.randn(64, k, generator=g) * spread
            stats[(i, group)] = ActStats(rows.abs().sum(0), 64, [rows])
    return stats


@torch.no_grad()
def test_awq_folds_preserve_the_dense_function(tiny) -> None:
    cfg = GPTConfig.from_hf_json(tiny.gpt_config)
    qc = QuantConfig.for_method("awq-int4", 64)
    scaled, report = apply_awq(
        tiny.gpt, random_stats(cfg, torch.Generator().manual_seed(10)), qc, cfg.num_layers, fold_o_proj=True, n_grid=10
    )
    assert report["loss_awq"] <= report["loss_rtn"]
    changed = [k for k in tiny.gpt if not torch.equal(scaled[k], tiny.gpt[k].float())]
    assert any(a > 0 for a in report["alpha"].values()) and changed
    x, pos = torch.randn(11, cfg.hidden_size, dtype=torch.float64), torch.arange(11)
    a = GPT.from_state_dict(tiny.gpt, cfg, dtype=torch.float64)(x, pos, DenseAttention(cfg.num_layers))
    b = GPT.from_state_dict(scaled, cfg, dtype=torch.float64)(x, pos, DenseAttention(cfg.num_layers))
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)  # only the fp32 rounding of the scaled weights


def test_awq_search_protects_salient_channels() -> None:
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 128, generator=g) * 0.02
    scale = torch.ones(128)
    scale[torch.randperm(128, generator=g)[:4]] = 50.0  # a few channels carry large activations
    x = torch.randn(256, 128, generator=g) * scale
    stats = ActStats(x.abs().sum(0), 256, [x])
    qc = QuantConfig.for_method("awq-int4", 64)
    alpha, s, losses = search_awq_scale(w, stats, qc, n_grid=10)
    assert len(losses) == 10 and alpha > 0 and min(losses) < 0.7 * losses[0]
    assert float(s.max() * s.min()) == pytest.approx(1.0, rel=1e-5)


@torch.no_grad()
def test_activation_stats_cover_prompt_and_frames(tiny) -> None:
    model = build_model(tiny, torch.device("cpu"), torch.float32)
    samples = teacher_forced_samples(model, ["Hello there.", "你好。"], frames=3, seed=1)
    assert all(s.codes.shape[1] == 4 and s.embeds.shape[0] == s.num_prompt + s.codes.shape[0] for s in samples)
    again = teacher_forced_samples(model, ["Hello there."], frames=3, seed=1)
    assert torch.equal(again[0].codes, samples[0].codes)  # seeded
    stats = collect_activation_stats(model.gpt, samples, max_rows=10)
    total = sum(s.embeds.shape[0] for s in samples)
    st = stats[(0, "qkv_proj")]
    assert st.count == total and 0 < st.sample.shape[0] <= total
    expected = torch.cat([model.gpt.layers[0].input_layernorm(s.embeds) for s in samples]).abs().mean(0)
    assert torch.allclose(st.mean_abs, expected, rtol=1e-5)
    assert stats[(1, "down_proj")].mean_abs.shape == (model.gpt_config.intermediate_size,)
    assert not any(layer._forward_pre_hooks for layer in model.gpt.layers[0].children())  # hooks removed
    assert isinstance(samples[0], TeacherForcedSample)


def test_calibration_corpus(tmp_path) -> None:
    texts = load_calibration_corpus()
    assert len(texts) >= 60 and not any(t.startswith("#") for t in texts)
    assert any("的" in t for t in texts) and any("the" in t for t in texts)
    f = tmp_path / "c.txt"
    f.write_text("# only a comment\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no sentences"):
        load_calibration_corpus(f)
    with pytest.raises(ValueError, match="calibration corpus"):
        load_calibration_corpus(tmp_path / "missing.txt")
