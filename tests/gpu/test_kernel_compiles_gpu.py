"""No Triton compile in a served step: once TritonPagedAttention.precompile_decode has run, the eager decode path
(any batch, context, split count or block-table width) launches only kernels already compiled, and once
TritonQuantKernels.precompile has, the quantized linears at any row count; counted by the real JIT hooks
(runner/kernel_compiles.py), the results still right. CUDA only: the interpreter compiles nothing, so its hooks
never run."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("the JIT hooks run where Triton compiles: CUDA", allow_module_level=True)
triton = pytest.importorskip("triton")

from triton_attention_util import check, make_case, to_fp8_cache  # noqa: E402

from ttsserve.attention.triton_paged import TritonPagedAttention, choose_num_splits  # noqa: E402
from ttsserve.layers.quant.linear import QuantLinear, precompile_quant_linears  # noqa: E402
from ttsserve.layers.quant.quantize import QuantConfig  # noqa: E402
from ttsserve.runner.kernel_compiles import kernel_compiles  # noqa: E402


def _rope(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin as GPT.rotary gives them to the decode graphs' fused step: [B, 1, 64] rows of a bf16 table."""
    table = torch.randn(2, 4096, 64, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    rows = torch.randint(0, 4096, (batch,), generator=gen).cuda()
    return table[0].index_select(0, rows)[:, None, :], table[1].index_select(0, rows)[:, None, :]


def test_the_hooks_see_a_real_compile():
    import triton.language as tl

    @triton.jit
    def _fill(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, i.to(tl.float32), mask=i < n)

    kc = kernel_compiles()
    before = kc.count, kc.seconds
    x = torch.empty(8, device="cuda")
    _fill[(1,)](x, 8, BLOCK=8)
    torch.cuda.synchronize()
    assert kc.count == before[0] + 1 and kc.seconds > before[1]
    assert kc.last.startswith("_fill(BLOCK=8;") and "ints divisible by 16: []" in kc.last  # n = 8
    assert x.tolist() == list(range(8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_decode_compiles_nothing_after_precompile(dtype):
    gen = torch.Generator().manual_seed(7)
    backend = TritonPagedAttention()
    first = make_case([3], [1], 16, dtype, gen)
    backend.precompile_decode(first.kv_cache, 12, dtype)
    kc = kernel_compiles()
    compiled = kc.count
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = set()
    for batch, ctx in [(1, 40), (1, 900), (3, 300), (5, 2000), (2, 17), (16, 128), (64, 700), (1, 3000)]:
        lens = torch.randint(max(ctx // 2, 1), ctx + 1, (batch,), generator=gen).tolist()
        case = make_case(lens, [1] * batch, 16, dtype, gen)  # block tables as wide as the longest context
        splits.add(choose_num_splits(batch * 12, max(lens) + 1, sms, backend.tuning))
        check(case, backend)
        if dtype == torch.bfloat16:  # and RoPE in the kernel, as in the decode graphs
            cos, sin = _rope(batch, gen)
            out = backend.forward(case.q, case.k, case.v, case.kv_cache, case.md, case.scale, (cos, sin))
            assert bool(torch.isfinite(out).all())
    assert len(splits) >= 4  # one split, several, and 16 or more among them
    assert kc.count == compiled, "a decode launch compiled a kernel after precompile_decode"


def test_fp8_lanes_compile_nothing_after_precompile():
    """The fp8 cache decodes through the lanes, one KV head a program at few rows, two, four at many, with RoPE
    before the kernel (the eager path) or in it (the decode graphs, whose buckets of tens of rows are captured
    after start-up): each precompiled."""
    gen = torch.Generator().manual_seed(8)
    backend = TritonPagedAttention()
    first = make_case([3], [1], 16, torch.bfloat16, gen)
    backend.precompile_decode(to_fp8_cache(first.kv_cache), 12, torch.bfloat16)
    kc = kernel_compiles()
    compiled = kc.count
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heads = set()
    for batch, ctx in [(1, 40), (3, 900), (16, 128), (sms, 60), (2 * sms, 60), (4 * sms, 30)]:
        lens = torch.randint(max(ctx // 2, 1), ctx + 1, (batch,), generator=gen).tolist()
        case = make_case(lens, [1] * batch, 16, torch.bfloat16, gen)
        heads.add(backend.tuning.lanes_heads(batch, 12, sms))
        for rope in (None, _rope(batch, gen)):
            out = backend.forward(case.q, case.k, case.v, to_fp8_cache(case.kv_cache), case.md, case.scale, rope)
            assert bool(torch.isfinite(out).all())
    assert heads == {1, 2, 4}
    assert kc.count == compiled, "an fp8 decode launch compiled a kernel after precompile_decode"


@pytest.mark.parametrize("method", ["int8", "awq-int4"])
def test_quantized_linears_compile_nothing_after_precompile(method):
    g = torch.Generator(device="cuda").manual_seed(3)
    qc = QuantConfig.for_method(method)
    linears = [
        QuantLinear.from_weight(torch.randn(n, k, generator=g, device="cuda") / k**0.5, qc)
        for n, k in [(2304, 768), (768, 3072)]
    ]
    calls = precompile_quant_linears(torch.nn.ModuleList(linears), 700, torch.bfloat16)
    assert calls >= 8  # several launch shapes per linear
    kc = kernel_compiles()
    compiled = kc.count
    for m in [1, 2, 3, 7, 16, 17, 33, 100, 257, 512, 513, 700]:
        for lin in linears:
            x = torch.randn(m, lin.in_features, generator=g, device="cuda").to(torch.bfloat16)
            ref = x.double() @ lin.dequantized_weight().double().T
            got = lin(x).double()
            assert float((got - ref).norm() / ref.norm()) < 2e-2
    assert kc.count == compiled, "a quantized linear compiled a kernel after precompile"
