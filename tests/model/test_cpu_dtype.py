"""--dtype auto on a CPU: bf16 where the CPU has native bf16, fp32 elsewhere and for random weights; the load
logs the choice and the int8 alternative."""

from __future__ import annotations

import logging

import pytest
import torch

from ttsserve.config import EngineConfig
from ttsserve.model import chattts
from ttsserve.model.chattts import load_model, resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_cpu(monkeypatch, native):
    monkeypatch.setattr(chattts, "cpu_has_native_bf16", lambda: native)
    assert resolve_dtype("auto", CPU) == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", CPU, dummy=True) == torch.float32
    assert resolve_dtype("float32", CPU) == torch.float32 and resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_load_logs_the_choice_and_int8(caplog, monkeypatch):
    monkeypatch.setattr(chattts, "cpu_has_native_bf16", lambda: True)
    with caplog.at_level(logging.INFO, logger=chattts.logger.name):
        load_model(EngineConfig(load_format="dummy", dummy_size="tiny", device="cpu"))
    text = caplog.text
    assert "--dtype auto picked float32" in text and "--quantization int8" in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=chattts.logger.name):
        chattts.log_cpu_dtype_choice("auto", resolve_dtype("auto", CPU), None)
    assert "--dtype auto picked bfloat16 (the CPU has native bf16)" in caplog.text
