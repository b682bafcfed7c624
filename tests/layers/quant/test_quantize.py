"""Weight formats: int4 packing round trip, int8 / int4 error bounds, QuantConfig JSON, state-dict quantization."""

from __future__ import annotations

import pytest
import torch

from ttsserve.layers.quant.quantize import (
    LINEAR_NAMES,
    QuantConfig,
    dequantize_int4,
    dequantize_int8,
    is_linear_weight,
    pack_int4,
    quantize_gpt_state_dict,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


def test_pack_unpack_int4_round_trip_and_layout() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (5, 256), generator=g, dtype=torch.uint8)
    packed = pack_int4(q, 64)
    assert packed.shape == (5, 128) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, 64), q)
    # split halves: byte j of group 1 holds q[64 + j] (low nibble) and q[64 + 32 + j] (high nibble)
    assert int(packed[2, 32 + 7]) == int(q[2, 64 + 7]) | (int(q[2, 96 + 7]) << 4)
    with pytest.raises(ValueError, match="multiple of the"):
        pack_int4(q[:, :100], 64)


def test_int8_error_is_at_most_half_a_step_per_channel() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 96, generator=g) * torch.linspace(0.01, 3.0, 48)[:, None]  # rows of very different range
    w[5] = 0.0  # an all-zero row must not divide by zero
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (48,) and int(q.abs().max()) <= 127
    err = (dequantize_int8(q, s) - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-7).all())
    assert torch.equal(dequantize_int8(q, s)[5], torch.zeros(96))
    assert bool((q.abs().amax(1)[w.abs().amax(1) > 0] == 127).all())  # each row uses its full range


def test_int4_error_bound_grid_and_zero_point() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 256, generator=g) * 0.05 + 0.02  # off-centre groups need the zero point
    qw, s, z = quantize_int4(w, 128)
    assert qw.shape == (16, 128) and s.shape == (16, 2) and s.dtype == torch.float16 and z.dtype == torch.uint8
    deq = dequantize_int4(qw, s, z, 128)
    step = s.float().repeat_interleave(128, dim=1)
    assert bool(((deq - w).abs() <= step / 2 + 1e-6).all())
    assert int(unpack_int4(qw, 128).max()) <= 15 and int(z.max()) <= 15
    # the fp16-rounded scale is the one used: re-quantizing the dequantized weights is exact
    qw2, s2, z2 = quantize_int4(deq, 128)
    assert torch.allclose(dequantize_int4(qw2, s2, z2, 128), deq, atol=1e-6)


def test_quant_config_json_round_trip_and_errors() -> None:
    qc = QuantConfig.for_method("awq-int4", 64, calibration={"method": "awq", "samples": 3})
    back = QuantConfig.from_json(qc.to_json())
    assert back == qc and back.bits == 4 and back.zero_point and back.modules == LINEAR_NAMES
    assert QuantConfig.for_method("int8").group_size is None
    with pytest.raises(ValueError, match="missing key 'bits'"):
        QuantConfig.from_json({"method": "int8"})
    with pytest.raises(ValueError, match="version 9 is not supported"):
        QuantConfig.from_json(qc.to_json() | {"version": 9})
    with pytest.raises(ValueError, match="group_size must be a power of two"):
        QuantConfig("awq-int4", 4, 96)
    with pytest.raises(ValueError, match="method must be one of"):
        QuantConfig.for_method("int3")
    with pytest.raises(ValueError, match="has 8 bits"):
        QuantConfig("int8", 4, None)


def test_quantize_gpt_state_dict_replaces_only_linears() -> None:
    sd = {
        "layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
        "layers.0.mlp.down_proj.weight": torch.randn(64, 128),
        "layers.0.input_layernorm.weight": torch.ones(64),
        "norm.weight": torch.ones(64),
    }
    out = quantize_gpt_state_dict(sd, QuantConfig.for_method("awq-int4", 64))
    assert set(out) == {
        "layers.0.self_attn.q_proj.qweight",
        "layers.0.self_attn.q_proj.scales",
        "layers.0.self_attn.q_proj.qzeros",
        "layers.0.mlp.down_proj.qweight",
        "layers.0.mlp.down_proj.scales",
        "layers.0.mlp.down_proj.qzeros",
        "layers.0.input_layernorm.weight",
        "norm.weight",
    }
    assert out["layers.0.mlp.down_proj.qweight"].shape == (64, 64)
    assert out["norm.weight"] is sd["norm.weight"]
    assert is_linear_weight("model.layers.3.mlp.gate_proj.weight")
    assert not is_linear_weight("layers.3.post_attention_layernorm.weight")
