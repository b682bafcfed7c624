"""The CPU fast-path formats as the engine serves them (linears packed by ModelRunner: oneDNN bf16, int8 via
fbgemm's W8A8 where the CPU has int8 dot products, else weight-only) against the fp32 model: top-1 agreement
under teacher forcing and KL within the bounds docs/benchmarks-history.md states, on the tiny and the real-size dummy
checkpoints; and the engine loads and generates in each format."""

from __future__ import annotations

import pytest
import torch

from ttsserve.model.chattts import build_model
from ttsserve.model.cpu_linear import (
    DynamicInt8Linear,
    PackedInt4Linear,
    PackedLinear,
    can_pack_int8,
    pack_linears_,
)
from ttsserve.model.dummy import make_dummy_checkpoint
from ttsserve.platform import cpu_has_native_bf16
from ttsserve.tools.quant.calibrate import teacher_forced_samples
from ttsserve.tools.quant.quality import compare_models

CPU = torch.device("cpu")
TEXTS = ["One two three, this is a test.", "今天天气很好。"]
# (min top-1 agreement over codebooks, max KL in nats): the bounds docs/benchmarks-history.md states for these formats.
BOUNDS = {"bf16": (0.90, 5e-3), "int8": (0.75, 5e-2)}


def _served(ckpt, fmt: str):
    model = build_model(ckpt, CPU, torch.bfloat16, quantization="int8" if fmt == "int8" else None)
    pack_linears_(model.gpt)
    return model


@pytest.mark.parametrize("size, frames", [("tiny", 24), ("real", 12)])
def test_cpu_formats_stay_within_their_fidelity_bounds(size: str, frames: int) -> None:
    ckpt = make_dummy_checkpoint(size, 0)
    ref = build_model(ckpt, CPU, torch.float32)
    samples = teacher_forced_samples(ref, TEXTS, frames, seed=3)
    for fmt, (min_top1, max_kl) in BOUNDS.items():
        cand = _served(ckpt, fmt)
        fid = compare_models(ref, cand, samples)
        assert min(fid.top1_agreement) >= min_top1 and max(fid.kl) <= max_kl, (size, fmt, fid.table())
        assert max(fid.kl) > 0  # a different format, measurably: the comparison is not vacuous


def test_int8_layers_are_served_by_the_w8a8_kernel_where_available(monkeypatch) -> None:
    ckpt = make_dummy_checkpoint("tiny", 0)
    model = _served(ckpt, "int8")
    kinds = {type(m) for m in model.gpt.layers[0].children()}
    assert (DynamicInt8Linear in kinds) == can_pack_int8(CPU)
    monkeypatch.setenv("TTSSERVE_CPU_INT8", "weight-only")
    assert not can_pack_int8(CPU)
    assert DynamicInt8Linear not in {type(m) for m in _served(ckpt, "int8").gpt.layers[0].children()}
    monkeypatch.setenv("TTSSERVE_CPU_INT8", "fast")
    with pytest.raises(ValueError, match="TTSSERVE_CPU_INT8 must be w8a8 or weight-only"):
        can_pack_int8(CPU)


@pytest.mark.skipif(not can_pack_int8(CPU), reason="needs fbgemm and VNNI / AMX int8 dot products")
@pytest.mark.parametrize("rows", [1, 5])
def test_w8a8_linear_matches_its_int8_weights(rows: int) -> None:
    from ttsserve.layers.quant.linear import QuantLinear
    from ttsserve.layers.quant.quantize import QuantConfig

    g = torch.Generator().manual_seed(rows)
    ql = QuantLinear.from_weight(torch.randn(96, 64, generator=g) * 0.05, QuantConfig.for_method("int8"))
    x = torch.randn(2, rows, 64, generator=g)
    want = x @ ql.dequantized_weight().T
    for dtype in (torch.float32, torch.bfloat16):
        got = DynamicInt8Linear(ql)(x.to(dtype))
        assert got.dtype == dtype and got.shape == want.shape
        rel = (got.float() - want).norm() / want.norm()
        assert 0 < rel < 0.02  # 8-bit activations: ~0.5-1% on Gaussian inputs, never exact


@pytest.mark.parametrize("fmt", ["bf16", "int8", "awq-int4"])
def test_engine_generates_in_each_cpu_format(fmt: str) -> None:
    from ttsserve.config import EngineConfig
    from ttsserve.engine.engine import Engine
    from ttsserve.params import SamplingParams, SynthesisRequest

    eng = Engine(
        EngineConfig(
            load_format="dummy",
            dummy_size="tiny",
            device="cpu",
            dtype="bfloat16",
            quantization=None if fmt == "bf16" else fmt,
            swap_space=0,
            kv_cache_memory=1 << 24,
        )
    )
    qkv = eng.model.gpt.layers[0].qkv_proj
    if fmt == "int8":
        assert isinstance(qkv, DynamicInt8Linear) == can_pack_int8(CPU)
    elif fmt == "awq-int4":
        assert isinstance(qkv, PackedInt4Linear) == hasattr(torch, "_weight_int4pack_mm_for_cpu")
    else:
        assert isinstance(qkv, PackedLinear) == cpu_has_native_bf16()
    params = SamplingParams(min_new_tokens=20, max_new_tokens=20, seed=1)
    rid = eng.add_synthesis(SynthesisRequest("hello there", code_params=params, split=False))
    samples, finished = 0, False
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid:
                samples += out.samples.size
                finished = finished or out.finished
    assert finished and samples > 0


def test_the_memory_report_counts_cpu_packed_int8_weights() -> None:
    """After the runner packs the GPT, the report still says what int8 saved (it once said 0 MiB)."""
    from ttsserve.config import EngineConfig
    from ttsserve.engine.engine import Engine
    from ttsserve.runner.memory_report import quantization_savings

    eng = Engine(
        EngineConfig(
            load_format="dummy",
            dummy_size="tiny",
            device="cpu",
            dtype="bfloat16",
            quantization="int8",
            swap_space=0,
            kv_cache_memory=1 << 22,
        )
    )
    s = quantization_savings(eng.model, eng.kv_spec, weights_share_budget=False)
    linears = [m for m in eng.model.gpt.modules() if isinstance(m, DynamicInt8Linear)]
    dense_linear_bytes = sum(m.in_features * m.out_features * 2 for m in linears)
    assert linears or not can_pack_int8(CPU)
    assert s.weight_bytes_saved > 0 and s.gpt_dense_bytes > s.gpt_bytes
    if linears:  # int8 weights + fp32 scales in place of bf16 weights
        assert s.weight_bytes_saved == dense_linear_bytes - sum(m.nbytes for m in linears)


@pytest.mark.skipif(not hasattr(torch, "_weight_int4pack_mm_for_cpu"), reason="needs torch's CPU int4 kernel")
def test_packed_int4_computes_with_the_same_weights() -> None:
    """PackedInt4Linear repacks awq-int4 weights for torch's kernel: in fp32 the product is that of the
    stored weights (scales are fp16, so nothing rounds); a bf16 model rounds the scales once."""
    from ttsserve.layers.quant.linear import QuantLinear
    from ttsserve.layers.quant.quantize import QuantConfig

    g = torch.Generator().manual_seed(0)
    ql = QuantLinear.from_weight(torch.randn(96, 256, generator=g) * 0.05, QuantConfig.for_method("awq-int4"))
    x = torch.randn(2, 3, 256, generator=g)
    want = x @ ql.dequantized_weight().T
    layer = PackedInt4Linear(ql)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        got = layer(x.to(dtype))
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.float() - want).norm() / want.norm() < tol

    ckpt = make_dummy_checkpoint("tiny", 0)
    unpacked = build_model(ckpt, CPU, torch.float32, quantization="awq-int4")
    packed = build_model(ckpt, CPU, torch.float32, quantization="awq-int4")
    pack_linears_(packed.gpt)
    assert isinstance(packed.gpt.layers[0].down_proj, PackedInt4Linear)
    fid = compare_models(unpacked, packed, teacher_forced_samples(unpacked, TEXTS, 16, seed=4))
    assert fid.top1_agreement == [1.0] * 4 and fid.hidden_rel_l2 < 1e-5
