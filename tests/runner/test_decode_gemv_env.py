"""$TTSSERVE_DECODE_GEMV (config.decode_gemv) and which GPTs the one-row GEMV forward may run (cuda_graphs._dense):
the switch is checked, and a quantized GPT keeps the GEMM path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ttsserve.config import DECODE_GEMV_ENV, GPTConfig, decode_gemv
from ttsserve.layers.quant.linear import quantize_gpt_
from ttsserve.layers.quant.quantize import QuantConfig
from ttsserve.model.gpt import GPT
from ttsserve.runner.cuda_graphs import _dense


def test_the_switch_is_on_unless_set_to_0_and_rejects_other_values(monkeypatch) -> None:
    monkeypatch.delenv(DECODE_GEMV_ENV, raising=False)
    assert decode_gemv() is True
    monkeypatch.setenv(DECODE_GEMV_ENV, "1")
    assert decode_gemv() is True
    monkeypatch.setenv(DECODE_GEMV_ENV, "0")
    assert decode_gemv() is False
    monkeypatch.setenv(DECODE_GEMV_ENV, "yes")
    with pytest.raises(ValueError, match=DECODE_GEMV_ENV):
        decode_gemv()


def test_only_dense_linears_take_the_gemv_forward() -> None:
    cfg = GPTConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=4)
    gpt = GPT(cfg)
    runner = SimpleNamespace(model=SimpleNamespace(gpt=gpt))
    assert _dense(runner)
    quantize_gpt_(gpt, QuantConfig.for_method("int8"))
    assert not _dense(runner)
