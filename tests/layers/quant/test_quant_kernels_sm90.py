"""The quantized linears' Triton kernel compiles for sm_90 at every launch shape the engine precompiles, on a
machine without a GPU (tests/sm90_compile.py): `precompile_quant_linears` over the ChatTTS GPT's four linear
shapes (qkv, o, gate-up, down), int8 and AWQ int4, for 1..512 rows on an H100's 132 SMs, through QuantLinear's
forward as the engine calls it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sm90_compile import compile_only_for_sm90  # noqa: E402

from ttsserve.layers.quant import linear  # noqa: E402
from ttsserve.layers.quant.linear import QuantLinear, precompile_quant_linears  # noqa: E402
from ttsserve.layers.quant.quantize import QuantConfig  # noqa: E402
from ttsserve.layers.quant.triton_quant import TritonQuantKernels, first_rows_per_config  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, HEAD_DIM = 768, 3072, 12, 64
SHAPES = [(3 * HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
H100_SMS, MAX_ROWS = 132, 512


@pytest.mark.parametrize("method", ["int8", "awq-int4"])
def test_quant_kernels_compile_for_sm90(method: str, monkeypatch) -> None:
    qc = QuantConfig.for_method(method)
    module = nn.ModuleList(QuantLinear(k, n, qc) for n, k in SHAPES)
    kernels = TritonQuantKernels()
    kernels._num_sms[torch.device("cpu")] = H100_SMS  # the launch shapes an H100 gets
    monkeypatch.setattr(linear, "quant_kernels", lambda device_type: kernels)
    with compile_only_for_sm90() as compiled:
        calls = precompile_quant_linears(module, MAX_ROWS, torch.bfloat16)
    want = sum(len(first_rows_per_config(n, k, qc.bits, qc.group_size, MAX_ROWS, H100_SMS)) for n, k in SHAPES)
    assert calls == len(compiled) == want > len(SHAPES), (calls, len(compiled), want)
    assert {name for name, _ in compiled} == {"quant_matmul_kernel"}
    assert all(kw["BITS"] == qc.bits for _, kw in compiled)
    if qc.bits == 4:  # int4 programs walk one group a step
        assert all(kw["BLOCK_K"] == qc.group_size for _, kw in compiled)
