"""`ttsserve quantize` end to end on the tiny dummy checkpoint: files, loading, serving through TTS."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from ttsserve.layers.quant.linear import quant_linears
from ttsserve.model.chattts import build_model
from ttsserve.model.loader import load_checkpoint
from ttsserve.tools.quant.cli import add_quantize_parser


def run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    add_quantize_parser(ap.add_subparsers(dest="command"))
    a = ap.parse_args(["quantize", "--load-format", "dummy", "--dummy-size", "tiny", *argv])
    return a.func(a)


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("awq")
    assert (
        run(
            [
                "--method",
                "awq-int4",
                "--out",
                str(out),
                "--group-size",
                "64",
                "--calib-samples",
                "2",
                "--calib-frames",
                "4",
                "--n-grid",
                "5",
            ]
        )
        == 0
    )
    return out


def test_quantize_writes_the_published_layout(awq_dir) -> None:
    gpt_dir = awq_dir / "asset" / "gpt"
    for f in ("config.json", "model.safetensors", "quantization_config.json"):
        assert (gpt_dir / f).is_file()
    for f in ("Embed", "Decoder", "DVAE", "Vocos"):
        assert (awq_dir / "asset" / f"{f}.safetensors").is_file()
    qc = json.loads((gpt_dir / "quantization_config.json").read_text())
    assert qc == json.loads((gpt_dir / "config.json").read_text())["quantization_config"]
    assert (qc["method"], qc["bits"], qc["group_size"], qc["version"]) == ("awq-int4", 4, 64, 1)
    cal = qc["calibration"]
    assert cal["method"] == "awq" and cal["samples"] == 2 and len(cal["alpha"]) == 2 * 4
    ckpt = load_checkpoint(awq_dir)
    assert ckpt.gpt["layers.0.self_attn.q_proj.qweight"].dtype == torch.uint8
    assert "layers.0.self_attn.q_proj.weight" not in ckpt.gpt
    from ttsserve.model.dummy import make_dummy_checkpoint

    source = make_dummy_checkpoint("tiny", 0)
    assert torch.equal(ckpt.embed["emb_text.weight"], source.embed["emb_text.weight"])  # copied unchanged
    assert torch.equal(ckpt.vocos["head.out.weight"], source.vocos["head.out.weight"])


def test_quantized_checkpoint_loads_and_serves(awq_dir) -> None:
    from ttsserve.entrypoints.tts import TTS
    from ttsserve.params import SamplingParams

    m = build_model(load_checkpoint(awq_dir), torch.device("cpu"), torch.float32)
    assert m.quantization == "awq-int4" and len(quant_linears(m.gpt)) == 8
    tts = TTS(str(awq_dir), device="cpu", quantization="awq-int4", kv_cache_memory=64 << 20, swap_space=0)
    (wav,) = tts.generate("Hello world.", SamplingParams(max_new_tokens=6, min_new_tokens=6, seed=3))
    assert wav.dtype.name == "float32" and wav.size > 0 and bool((abs(wav) < 10).all())
    with pytest.raises(ValueError, match="is quantized with awq-int4"):
        TTS(str(awq_dir), device="cpu", quantization="int8")


def test_quantize_errors_and_int8(tmp_path, capsys) -> None:
    assert run(["--method", "awq-int4", "--out", str(tmp_path / "x")]) == 2  # group 128 > tiny K = 64
    assert "hidden_size 64 is not a multiple of --group-size 128" in capsys.readouterr().err
    assert run(["--method", "int8", "--out", str(tmp_path / "i8")]) == 0
    ckpt = load_checkpoint(tmp_path / "i8")
    assert json.loads((tmp_path / "i8/asset/gpt/quantization_config.json").read_text())["calibration"] == {
        "method": "round-to-nearest"
    }
    from ttsserve.tools.quant.cli import quantize_checkpoint

    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(ckpt, "int8")
