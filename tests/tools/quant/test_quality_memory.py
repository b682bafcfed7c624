"""`bench quality` metrics and the start-up savings report."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from ttsserve.layers.quant.linear import quant_linears
from ttsserve.model.chattts import build_model
from ttsserve.model.dummy import make_dummy_checkpoint
from ttsserve.runner.kv_cache import plan_kv_cache
from ttsserve.runner.memory_report import quantization_memory_report, quantization_savings
from ttsserve.tools.quant.calibrate import teacher_forced_samples
from ttsserve.tools.quant.quality import add_quality_parser, compare_models

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models():
    ckpt = make_dummy_checkpoint("tiny", 0)
    return build_model(ckpt, CPU, torch.float32), build_model(ckpt, CPU, torch.float32, quantization="awq-int4")


@pytest.fixture(scope="module")
def samples(models):
    return teacher_forced_samples(models[0], ["One two three.", "今天天气很好。"], frames=5, seed=2)


def test_identical_models_agree_perfectly(models, samples) -> None:
    ref, _ = models
    fid = compare_models(ref, ref, samples)
    assert fid.top1_agreement == [1.0] * 4 and max(fid.kl) < 1e-6
    assert fid.mel_rel_l2 < 1e-6 and fid.hidden_rel_l2 < 1e-6
    assert fid.positions == sum(s.codes.shape[0] + 1 for s in samples) and fid.frames == fid.positions - 2


def test_quantized_and_fp8_kv_differ_measurably(models, samples) -> None:
    ref, q4 = models
    fid = compare_models(ref, q4, samples)
    assert 0.5 < min(fid.top1_agreement) and min(fid.kl) > 1e-5 and 0 < fid.mel_rel_l2 < 0.5
    kv = compare_models(ref, ref, samples, kv_fp8=True)
    assert 0 < kv.hidden_rel_l2 < fid.hidden_rel_l2  # fp8 KV costs far less than int4 weights
    assert "top-1 agreement" in fid.table()


def test_quality_cli_writes_json(tmp_path, capsys) -> None:
    ap = argparse.ArgumentParser()
    add_quality_parser(ap.add_subparsers())
    out = tmp_path / "q.json"
    a = ap.parse_args(
        [
            "quality",
            "--load-format",
            "dummy",
            "--dummy-size",
            "tiny",
            "--method",
            "int8",
            "--texts",
            "1",
            "--frames",
            "4",
            "--json",
            str(out),
        ]
    )
    assert a.func(a) == 0
    printed = capsys.readouterr().out
    assert "fidelity of int8" in printed and "RANDOM (dummy) weights" in printed
    data = json.loads(out.read_text())
    assert data["candidate"] == "int8" and data["random_weights"] and len(data["kl"]) == 4
    a = ap.parse_args(
        [
            "quality",
            "--load-format",
            "dummy",
            "--dummy-size",
            "tiny",
            "--method",
            "rtn-int4",
            "--group-size",
            "64",
            "--texts",
            "1",
            "--frames",
            "4",
        ]
    )
    assert a.func(a) == 0 and "int4 without AWQ" in capsys.readouterr().out
    a = ap.parse_args(["quality", "--load-format", "dummy", "--dummy-size", "tiny"])
    assert a.func(a) == 2


def test_memory_report(models) -> None:
    ref, q4 = models
    spec = plan_kv_cache(ref.gpt_config, torch.float32, 16, 32 << 20, 0)
    assert quantization_memory_report(ref, spec, True) is None
    s = quantization_savings(q4, spec, weights_share_budget=True)
    linears = quant_linears(q4.gpt)
    dense_linear = sum(ql.in_features * ql.out_features * 4 for ql in linears)
    packed = sum(b.numel() * b.element_size() for ql in linears for b in ql.buffers())
    assert s.weight_bytes_saved == dense_linear - packed > 0
    # the saved bytes would have been weights, so the dense model has that much less KV memory
    dense_blocks = (spec.num_tokens * spec.bytes_per_token - s.weight_bytes_saved) // (s.kv_dense_bytes_per_token * 16)
    expected = type(spec)(dense_blocks, 0, 16, s.kv_dense_bytes_per_token).concurrent_utterances(30.0)
    assert s.streams_dense == expected <= s.streams == spec.concurrent_utterances(30.0)
    line = quantization_memory_report(q4, spec, True)
    assert "GPT weights awq-int4" in line and "given to the KV cache" in line
    fixed = quantization_savings(q4, spec, weights_share_budget=False)
    assert fixed.streams_dense == fixed.streams  # fixed KV memory, KV not fp8: no more streams
    fp8 = plan_kv_cache(ref.gpt_config, torch.float32, 16, 32 << 20, 0, "fp8")
    assert "KV cache fp8" in quantization_memory_report(ref, fp8, False)
