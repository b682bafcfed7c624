"""--dtype auto on a CPU: bf16 where the CPU has native bf16, fp32 elsewhere, random weights included; the load
logs the choice and the int8 alternative in one line."""

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
    assert resolve_dtype("float32", CPU) == torch.float32 and resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("native", [True, False])
def test_dummy_weights_follow_auto_and_log_one_line(caplog, monkeypatch, native):
    monkeypatch.setattr(chattts, "cpu_has_native_bf16", lambda: native)
    with caplog.at_level(logging.INFO, logger=chattts.logger.name):
        model = load_model(EngineConfig(load_format="dummy", dummy_size="tiny", device="cpu"))
    assert model.dtype == (torch.bfloat16 if native else torch.float32)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU: ")]
    want = "bfloat16 (the CPU has native bf16)" if native else "float32 (no native bf16 on this CPU)"
    hint = "--quantization int8 is faster still on CPUs with VNNI / AMX int8 (a little less faithful)"
    assert lines == [f"CPU: --dtype auto picked {want}; {hint}"]


def test_explicit_dtype_and_quantization_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger=chattts.logger.name):
        chattts.log_cpu_dtype_choice("float32", torch.float32, "int8")
    assert "CPU: --dtype float32; --quantization int8" in caplog.text and "faster still" not in caplog.text
