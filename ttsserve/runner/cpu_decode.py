"""The GPT's decode step on the CPU through the fused kernels (layers/cpu): the GEMMs as before, everything between
them one kernel call each.

Per layer: add_rms_norm -> qkv GEMM -> decode_attention (RoPE, KV write, paged attention over the cache in
place) -> o GEMM -> add_rms_norm (residual + norm) -> gate_up GEMM -> silu_mul -> down GEMM; the last residual
joins the next layer's norm. That is 8 calls a layer where GPT.forward makes ~50 torch ops, and the attention
reads each context once instead of gathering it and copying it to fp32. The kernels feed each GEMM the dtype it
takes (fp32 for the fbgemm W8A8 linears) and round to the model dtype where GPT.forward does, so the result is
GPT.forward's up to fp32 summation order (tests/runner/test_cpu_decode.py).

`CpuFusedDecode.create` returns None where it does not apply (another dtype or KV dtype, no kernels); the runner
then keeps GPT.forward.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ttsserve.attention.backend import AttentionMetadata
from ttsserve.layers.cpu.kernels import KERNEL_DTYPES, CpuDecodeKernels, attention_scratch, fits, load
from ttsserve.model.cpu_linear import NO_TORCH_FUNCTION, DynamicInt8Linear, PackedLinear


def _linear_call(m: nn.Module, dtype: torch.dtype) -> tuple[object, torch.dtype]:
    """(fn(x [T, in]) -> [T, out], the dtype x must have): the packed ops called directly (no Module call, no
    casts: a W8A8 linear takes and returns fp32), any other linear as its module in the model dtype."""
    if isinstance(m, DynamicInt8Linear):
        op, packed = m._op, m.packed
        return (lambda x: op(x, packed, False)), torch.float32
    if isinstance(m, PackedLinear):
        op, packed, bias = m._op, m.packed, m.bias
        return (lambda x: op(x, packed, bias, "none", [], "")), m.dtype
    return m, dtype


class CpuFusedDecode:
    """gpt: the CPU model's GPT (linears packed); kv_layers: one [2, num_blocks, block_size, Hkv, D] cache per
    layer, in the model dtype; scale: the attention scale."""

    def __init__(self, gpt: nn.Module, kv_layers: list[Tensor], scale: float, kernels: CpuDecodeKernels) -> None:
        self.gpt, self.kv_layers, self.scale, self.k = gpt, kv_layers, scale, kernels
        cfg = gpt.cfg
        self.dtype, self.num_heads, self.eps = gpt.dtype, cfg.num_heads, cfg.rms_norm_eps
        self.round_bf16 = self.dtype == torch.bfloat16
        self.layers = [
            (
                layer.input_layernorm.weight.detach(),
                _linear_call(layer.qkv_proj, self.dtype),
                _linear_call(layer.o_proj, self.dtype),
                layer.post_attention_layernorm.weight.detach(),
                _linear_call(layer.gate_up_proj, self.dtype),
                _linear_call(layer.down_proj, self.dtype),
            )
            for layer in gpt.layers
        ]
        self.final_norm = gpt.norm.weight.detach()
        self._buffers: dict[tuple[int, str, torch.dtype], Tensor] = {}
        self._scores: Tensor | None = None  # the attention kernel's scratch (layers/cpu/kernels.py)

    @classmethod
    def create(cls, gpt: nn.Module, kv_layers: list[Tensor], scale: float) -> CpuFusedDecode | None:
        """The fused step for this model, or None where it does not apply."""
        cfg = gpt.cfg
        ok = (
            gpt.dtype in KERNEL_DTYPES
            and all(c.dtype == gpt.dtype and c.device.type == "cpu" and c.is_contiguous() for c in kv_layers)
            and fits(cfg.num_heads, cfg.head_dim)
            and cfg.num_heads % cfg.num_kv_heads == 0
            and all(p.dtype == gpt.dtype for n, p in gpt.named_parameters() if "norm" in n)
        )
        kernels = load() if ok else None
        return None if kernels is None else cls(gpt, kv_layers, scale, kernels)

    def _buffer(self, rows: int, name: str, width: int, dtype: torch.dtype) -> Tensor:
        """A reused [rows, width] activation buffer (each is consumed by the GEMM right after it is written)."""
        key = (rows, name, dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(rows, width, dtype=dtype)
        return buf

    @torch.inference_mode()
    def run(self, x: Tensor, positions: Tensor, md: AttentionMetadata) -> Tensor:
        """x: [B, H] input embeddings (one new token per sequence); positions: [B] int64 -> the final hidden
        states [B, H] in the model dtype (a new tensor). Writes every layer's new k / v into the caches."""
        with NO_TORCH_FUNCTION():  # plain tensors only; the packed GEMMs' dispatch is 4x cheaper without it
            return self._run(x, positions, md)

    def _run(self, x: Tensor, positions: Tensor, md: AttentionMetadata) -> Tensor:
        gpt, k, b = self.gpt, self.k, x.shape[0]
        cfg = gpt.cfg
        h = x.to(self.dtype, copy=True)  # the residual stream, updated in place by the kernels
        cos, sin = (t.float().reshape(b, cfg.head_dim).contiguous() for t in gpt.rotary(positions, self.dtype))
        slots = md.slot_mapping.to(torch.int64).contiguous()
        tables = md.block_tables.to(torch.int32).contiguous()
        seq_lens = md.seq_lens.to(torch.int32).contiguous()
        q_width, inter = cfg.num_heads * cfg.head_dim, cfg.intermediate_size
        scores = self._scores = attention_scratch(self._scores, self.num_heads, md.max_seq_len)
        delta = None
        for (w_in, qkv, o, w_post, gate_up, down), cache in zip(self.layers, self.kv_layers):
            xn = self._buffer(b, "xn", cfg.hidden_size, qkv[1])
            k.add_rms_norm(h, delta, w_in, self.eps, xn)
            attn = self._buffer(b, "attn", q_width, o[1])
            k.decode_attention(
                qkv[0](xn), cos, sin, cache, slots, tables, seq_lens, self.num_heads, self.scale,
                attn, self.round_bf16, scores,
            )  # fmt: skip
            xn = self._buffer(b, "xn2", cfg.hidden_size, gate_up[1])
            k.add_rms_norm(h, o[0](attn).contiguous(), w_post, self.eps, xn)
            act = self._buffer(b, "act", inter, down[1])
            k.silu_mul(gate_up[0](xn).contiguous(), act, self.round_bf16)
            delta = down[0](act).contiguous()
        out = torch.empty_like(h)
        k.add_rms_norm(h, delta, self.final_norm, self.eps, out)
        return out
