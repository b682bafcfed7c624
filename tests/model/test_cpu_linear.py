"""PackedLinear (model/cpu_linear.py): oneDNN-packed weights give F.linear's result, packing is in place and
selective, and the engine's CPU runner packs the GPT without changing its greedy output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ttsserve.model.cpu_linear import PackedLinear, can_pack, pack_linears_
from ttsserve.platform import cpu_has_native_bf16

needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@needs_mkldnn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_packed_matches_f_linear_fp32(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(48, 40, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 48, generator=g))
    x = torch.randn(2, rows, 48, generator=g)  # any leading dims
    want = lin(x)
    got = PackedLinear(lin)(x)
    assert got.shape == want.shape and (got - want).abs().max() < 1e-4  # summation order only


@needs_mkldnn
@pytest.mark.skipif(not cpu_has_native_bf16(), reason="bf16 packing needs AVX512_BF16 / AMX")
def test_packed_bf16_matches_fp32_math_to_bf16_rounding() -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 96, generator=g), torch.randn(5, 96, generator=g)
    lin = nn.Linear(96, 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w.to(torch.bfloat16))
    got = PackedLinear(lin)(x.to(torch.bfloat16))
    exact = x.to(torch.bfloat16).double() @ lin.weight.double().T
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-2).all()


@needs_mkldnn
def test_pack_linears_in_place_and_selective() -> None:
    from ttsserve.config import GPTConfig
    from ttsserve.model.gpt import GPT

    gpt = GPT(GPTConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=4)).eval()
    assert pack_linears_(gpt) == 8  # qkv / o / gate_up / down of 2 layers
    assert all(
        isinstance(getattr(layer, n), PackedLinear)
        for layer in gpt.layers
        for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    )
    assert pack_linears_(gpt) == 0  # already packed
    assert not can_pack(torch.device("cpu"), torch.float16) and not can_pack(torch.device("cuda"), torch.float32)
    half = nn.Sequential(nn.Linear(4, 4).half())
    assert pack_linears_(half) == 0 and type(half[0]) is nn.Linear


def _greedy_codes(monkeypatch, pack: bool) -> list:
    import ttsserve.model.cpu_linear as cpu_linear
    from ttsserve.config import EngineConfig
    from ttsserve.engine.engine import Engine
    from ttsserve.params import SamplingParams, SynthesisRequest

    if not pack:
        monkeypatch.setattr(cpu_linear, "pack_linears_", lambda module: 0)
    eng = Engine(
        EngineConfig(
            load_format="dummy", dummy_size="tiny", device="cpu", dtype="float32", swap_space=0, kv_cache_memory=1 << 24
        )
    )
    assert isinstance(eng.model.gpt.layers[0].qkv_proj, PackedLinear) == pack
    params = SamplingParams(greedy=True, min_new_tokens=24, max_new_tokens=24, seed=1)
    rid = eng.add_synthesis(SynthesisRequest("hello there, how are you", code_params=params, split=False))
    req = eng.sequences[f"{rid}/0/code"].request
    while eng.has_unfinished():
        eng.step()
    return list(req.output_token_ids)


@needs_mkldnn
def test_engine_output_unchanged_by_packing(monkeypatch) -> None:
    """The CPU runner packs the GPT; the greedy codes of the tiny dummy engine are those of the unpacked one."""
    packed = _greedy_codes(monkeypatch, pack=True)
    assert len(packed) == 24 and packed == _greedy_codes(monkeypatch, pack=False)
