"""What quantization saved, for the start-up memory report.

The engine calls `quantization_memory_report(model, kv_spec, weights_share_budget)` once after planning the
KV cache and logs the line when it is not None. "Instead of" figures are for the same memory: on a GPU
whose KV budget is what is left after the weights (weights_share_budget=True), the bytes the quantized
weights no longer take would have been weights, not KV blocks; with a fixed --kv-cache-memory they would not.
"""

from __future__ import annotations

from dataclasses import dataclass

from ttsserve.layers.quant.linear import quant_linears
from ttsserve.model.cpu_linear import DynamicInt8Linear, PackedInt4Linear, stored_weight_bytes
from ttsserve.runner.kv_cache import KVCacheSpec, kv_bytes_per_token


@dataclass(frozen=True)
class QuantMemorySavings:
    gpt_bytes: int  # the GPT as loaded
    gpt_dense_bytes: int  # the same GPT unquantized, in the model dtype
    kv_bytes_per_token: int
    kv_dense_bytes_per_token: int
    streams: int  # concurrent 30-s utterances that fit now
    streams_dense: int  # ... with neither weight nor KV quantization, in the same memory

    @property
    def weight_bytes_saved(self) -> int:
        return self.gpt_dense_bytes - self.gpt_bytes


def quantization_savings(model, kv_spec: KVCacheSpec, weights_share_budget: bool) -> QuantMemorySavings:
    """model: a ChatTTSModel; kv_spec: the plan in use (its kv_cache_dtype says whether KV is fp8)."""
    gpt_bytes = stored_weight_bytes(model.gpt)
    dense = gpt_bytes
    for ql in quant_linears(model.gpt):
        dense += ql.dense_bytes(model.dtype) - sum(b.numel() * b.element_size() for b in ql.buffers())
    for packed in (m for m in model.gpt.modules() if isinstance(m, DynamicInt8Linear | PackedInt4Linear)):
        dense += packed.dense_bytes(model.dtype) - packed.nbytes  # layers the CPU runner repacked
    per_token_dense = kv_bytes_per_token(model.gpt_config, model.dtype, "auto")
    budget = kv_spec.num_tokens * kv_spec.bytes_per_token
    if weights_share_budget:
        budget -= dense - gpt_bytes
    dense_spec = KVCacheSpec(
        max(int(budget // (per_token_dense * kv_spec.block_size)), 0), 0, kv_spec.block_size, per_token_dense
    )
    return QuantMemorySavings(
        gpt_bytes,
        dense,
        kv_spec.bytes_per_token,
        per_token_dense,
        kv_spec.concurrent_utterances(30.0),
        dense_spec.concurrent_utterances(30.0),
    )


def quantization_memory_report(model, kv_spec: KVCacheSpec, weights_share_budget: bool) -> str | None:
    """One log line on what weight / KV quantization saved; None when nothing is quantized."""
    if model.quant is None and kv_spec.kv_cache_dtype == "auto":
        return None
    s = quantization_savings(model, kv_spec, weights_share_budget)
    mib = 2**20
    weights = (
        f"GPT weights {model.quantization}: {s.gpt_bytes / mib:.0f} MiB instead of "
        f"{s.gpt_dense_bytes / mib:.0f} MiB ({s.weight_bytes_saved / mib:.0f} MiB saved"
        + (", given to the KV cache)" if weights_share_budget else ")")
        if model.quant is not None
        else "GPT weights dense"
    )
    kv = (
        f"KV cache {kv_spec.kv_cache_dtype}: {s.kv_bytes_per_token / 1024:.1f} KiB per frame instead of "
        f"{s.kv_dense_bytes_per_token / 1024:.1f} KiB"
        if kv_spec.kv_cache_dtype != "auto"
        else "KV cache in the model dtype"
    )
    gain = f" ({s.streams / s.streams_dense:.2f}x)" if s.streams_dense else ""
    return (
        f"quantization: {weights}; {kv}; fits {s.streams} concurrent 30-s utterances instead of {s.streams_dense}{gain}"
    )
