"""QuantLinear and its CPU kernels (the reference of the Triton ones); quantized GPT loading and build_model."""

from __future__ import annotations

import pytest
import torch

from ttsserve.attention.dense import DenseAttention
from ttsserve.config import GPTConfig
from ttsserve.layers.quant.linear import QuantLinear, TorchQuantKernels, quant_kernels, quant_linears, quantize_gpt_
from ttsserve.layers.quant.quantize import QuantConfig, quantize_gpt_state_dict
from ttsserve.model.chattts import build_model
from ttsserve.model.dummy import make_dummy_checkpoint
from ttsserve.model.gpt import GPT

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny():
    return make_dummy_checkpoint("tiny", 0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("method", ["int8", "awq-int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_matches_dequantized_weight(method: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 256, generator=g) * 0.02
    x = torch.randn(2, 7, 256, generator=g).to(dtype)
    qc = QuantConfig.for_method(method, 64)
    lin = QuantLinear.from_weight(w, qc)
    y = lin(x)
    assert y.shape == (2, 7, 96) and y.dtype == dtype
    ref = x.double() @ lin.dequantized_weight().double().T
    assert rel(y, ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    # and the quantized layer is close to the dense one (int8 far closer than int4)
    assert rel(y, x.double() @ w.double().T) < (0.01 if method == "int8" else 0.12)


def test_int8_fallback_path_equals_int8pack_mm() -> None:
    g = torch.Generator().manual_seed(5)
    lin = QuantLinear.from_weight(torch.randn(64, 128, generator=g), QuantConfig.for_method("int8"))
    x = torch.randn(5, 128, generator=g)
    fast = TorchQuantKernels()
    slow = TorchQuantKernels()
    slow.has_int8pack_mm = False
    a = fast.int8_linear(x, lin.qweight, lin.scales)
    b = slow.int8_linear(x, lin.qweight, lin.scales)
    assert rel(a, b) < 1e-6
    assert quant_kernels("cpu").name == "torch"


def test_quantized_fused_layer_equals_quantized_parts() -> None:
    """Quantizing q/k/v separately (the file) and quantizing the fused qkv_proj (at load) agree exactly."""
    g = torch.Generator().manual_seed(6)
    parts = [torch.randn(64, 128, generator=g) for _ in range(3)]
    for method in ("int8", "awq-int4"):
        qc = QuantConfig.for_method(method, 64)
        fused = QuantLinear.from_weight(torch.cat(parts), qc)
        separate = torch.cat([QuantLinear.from_weight(p, qc).dequantized_weight() for p in parts])
        assert torch.equal(fused.dequantized_weight(), separate)


@pytest.mark.parametrize("method", ["int8", "awq-int4"])
@torch.no_grad()
def test_gpt_loads_quantized_state_dict(tiny, method: str) -> None:
    cfg = GPTConfig.from_hf_json(tiny.gpt_config)
    qc = QuantConfig.for_method(method, 64)
    qsd = quantize_gpt_state_dict(tiny.gpt, qc)
    gpt = GPT.from_state_dict(qsd, cfg, dtype=torch.bfloat16, quant=qc)
    assert len(quant_linears(gpt)) == 4 * cfg.num_layers
    assert gpt.norm.weight.dtype == torch.bfloat16
    expected_scale_dtype = torch.float32 if method == "int8" else torch.float16
    assert gpt.layers[0].qkv_proj.scales.dtype == expected_scale_dtype  # not rounded to bf16
    # loading the file == quantizing the dense model in memory
    dense = GPT.from_state_dict(tiny.gpt, cfg)
    in_memory = quantize_gpt_(GPT.from_state_dict(tiny.gpt, cfg), qc)
    loaded = GPT.from_state_dict(qsd, cfg, quant=qc)
    x, pos = torch.randn(9, cfg.hidden_size), torch.arange(9)
    a = loaded(x, pos, DenseAttention(cfg.num_layers))
    assert torch.allclose(a, in_memory(x, pos, DenseAttention(cfg.num_layers)), atol=1e-5)
    assert rel(a, dense(x, pos, DenseAttention(cfg.num_layers))) < (0.02 if method == "int8" else 0.2)


def test_gpt_quantized_loading_errors(tiny) -> None:
    cfg = GPTConfig.from_hf_json(tiny.gpt_config)
    qc = QuantConfig.for_method("int8")
    qsd = quantize_gpt_state_dict(tiny.gpt, qc)
    with pytest.raises(ValueError, match=r"holds quantized tensors .*but no quantization_config"):
        GPT.from_state_dict(qsd, cfg)
    bad = qsd | {"layers.0.self_attn.q_proj.scales": qsd["layers.0.self_attn.q_proj.scales"].half()}
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj\.scales has dtype torch\.float16"):
        GPT.from_state_dict(bad, cfg, quant=qc)
    with pytest.raises(ValueError, match=r"missing tensor layers\.0\.self_attn\.q_proj\.qzeros"):
        GPT.from_state_dict(qsd, cfg, quant=QuantConfig.for_method("awq-int4", 64))


def test_build_model_quantization_flag(tiny) -> None:
    m = build_model(tiny, CPU, torch.float32, quantization="int8")  # dummy: quantized at load
    assert m.quantization == "int8" and len(quant_linears(m.gpt)) == 8
    assert m.weight_bytes() < build_model(tiny, CPU, torch.float32).weight_bytes()
    assert m.quant.calibration == {"method": "round-to-nearest"}
    m4 = build_model(tiny, CPU, torch.float32, quantization="awq-int4")
    assert m4.quant.group_size == 64  # the tiny model's K of 64 forbids 128
    real_dense = type(tiny)(**{**tiny.__dict__, "source": "/ckpt/asset"})
    with pytest.raises(ValueError, match="is not quantized: make a quantized copy with `ttsserve quantize"):
        build_model(real_dense, CPU, torch.float32, quantization="int8")
