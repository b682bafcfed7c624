"""DecodeOps and fused_gpt_forward: the GPT step restructured for fusion, shared by the decode, piecewise prefill and
sampler graphs (runner/cuda_graphs.py, prefill_graphs.py, sampler_graphs.py)."""

from __future__ import annotations

from typing import ClassVar

import torch

from ttsserve.attention.backend import apply_rope
from ttsserve.config import DECODE_OPS_ENV as DECODE_OPS_ENV  # re-exported beside the ops it picks
from ttsserve.config import DECODE_OPS_MODES, decode_ops_mode

# A decode step is ~750 tiny kernels when run op by op (RMSNorm alone is 7, RoPE 10 per layer); inside a graph each
# still costs ~2.5 us of GPU time, 1.9 ms in all at batch 1 against a 0.09 ms weight-read floor. The functions
# below are the same arithmetic as GPT.forward / the sampler, written so torch.compile fuses each chain into one
# kernel (or replaced by the same chains as Triton kernels: layers/triton_fused.py); the linears (dense or
# quantized modules) and the paged attention are called as they are. RoPE goes to the attention as
# rope=(cos, sin): the Triton decode kernel rotates q and the new k as it loads them.


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x): the residual add of one block fused with the next norm."""
    s = residual + x
    return _rmsnorm(s, weight, eps), s


def _split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) * D] -> q [T, Hq, D], k / v [T, Hkv, D]: views (token stride (Hq + 2 Hkv) * D),
    which the attention backends take (any token / head stride, contiguous head_dim)."""
    t, q_width, kv_width = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_width].view(t, num_heads, head_dim)
    k = qkv[:, q_width : q_width + kv_width].view(t, num_kv_heads, head_dim)
    return q, k, qkv[:, q_width + kv_width :].view(t, num_kv_heads, head_dim)


def _qkv_rotary(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_split_qkv with q and k rotated as one [T, Hq + Hkv, D] tensor, so the compiled op is one kernel (two
    outputs were two: ~7 us each per layer at 512 rows on an H200); q and k are its head-strided views.
    For the piecewise prefill graphs, whose attention takes q / k rotated."""
    t, qk_width = qkv.shape[0], (num_heads + num_kv_heads) * head_dim
    qk = apply_rope(qkv[:, :qk_width].reshape(t, num_heads + num_kv_heads, head_dim), cos, sin)
    return qk[:, :num_heads], qk[:, num_heads:], qkv[:, qk_width:].reshape(t, num_kv_heads, head_dim)


def _embed_rows(emb_code: torch.Tensor, last_tokens: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype):
    """[B, H] in dtype: the code embedding of each row's last frame (Embed.embed_codes)."""
    q = torch.arange(emb_code.shape[0], device=emb_code.device)
    return emb_code[q, last_tokens[rows, : emb_code.shape[0]]].sum(dim=1).to(dtype)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# $TTSSERVE_DECODE_OPS (config.py) -> (Triton norms / SiLU / RoPE, the sampler's implementation)
_MODES = {
    "triton": (True, "triton"),
    "triton-compiled-sampler": (True, "compile"),
    "triton-eager-sampler": (True, "eager"),
    "compile": (False, "compile"),
}
assert tuple(_MODES) == DECODE_OPS_MODES


class DecodeOps:
    """The fusable pieces of a decode step (and of the piecewise prefill / sampler graphs, which share them):
    plain functions, or Triton kernels for the norms / SiLU / RoPE and the sampler, with the rest torch.compile'd
    (dynamic batch) where `compile`. The decode graph's body calls all but qkv_rotary (its attention applies
    RoPE); the prefill graphs call qkv_rotary. `compiled`: anything but the plain functions, which are the
    fallback when those fail (or_uncompiled)."""

    _compiled: ClassVar[dict[str, object]] = {}  # one compilation per process, shared by every engine

    def __init__(self, compile: bool, triton: bool = False, sampler: str = "compile") -> None:
        """compile: torch.compile what Triton does not take (nothing when False); triton: the Triton norms / SiLU /
        RoPE; sampler: "triton" (sample/triton_sampler.py), "compile" or "eager" (sample/sampler.py)."""
        from ttsserve.sample.sampler import sample, sample_and_record

        fns = {
            "rmsnorm": _rmsnorm,
            "add_rmsnorm": _add_rmsnorm,
            "qkv_rotary": _qkv_rotary,
            "silu_mul": _silu_mul,
            "embed_rows": _embed_rows,
            "sample": sample,
        }
        to_compile = [] if triton else ["rmsnorm", "add_rmsnorm", "qkv_rotary", "silu_mul"]
        to_compile += ["sample"] if sampler == "compile" else []
        for name in to_compile if compile else ():
            if name not in DecodeOps._compiled:
                DecodeOps._compiled[name] = torch.compile(fns[name], dynamic=True)
            fns[name] = DecodeOps._compiled[name]
        if triton:
            from ttsserve.layers import triton_fused

            for name in ("rmsnorm", "add_rmsnorm", "qkv_rotary", "silu_mul", "embed_rows"):
                fns[name] = getattr(triton_fused, name)
        # sample_record(logits, state, rows, steps, eos_id): the sampler on a SamplingState's rows, recorded
        fns["sample_record"] = lambda *args: sample_and_record(fns["sample"], *args)
        if sampler == "triton":
            from ttsserve.sample.triton_sampler import sample_and_record_or_reference, sample_or_reference

            fns["sample"], fns["sample_record"] = sample_or_reference, sample_and_record_or_reference
        self.compiled = bool(to_compile and compile) or triton or sampler == "triton"
        self.traced = bool(to_compile and compile)  # torch.compile traces at first call: precompile() does it early
        for name, fn in fns.items():
            setattr(self, name, fn)

    @classmethod
    def for_device(cls, device: torch.device) -> DecodeOps:
        """The ops of $TTSSERVE_DECODE_OPS on CUDA; the plain functions elsewhere."""
        if device.type != "cuda":
            return cls(compile=False)
        triton, sampler = _MODES[decode_ops_mode()]
        return cls(compile=True, triton=triton, sampler=sampler)


def fused_gpt_forward(gpt, ops: DecodeOps, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
    """GPT.forward (model/gpt.py) restructured for fusion: each block's residual add goes into the next
    RMSNorm, RoPE goes into the attention (ctx.attend(..., rope=(cos, sin)) on unrotated q / k views),
    SiLU-and-mul is one op. Same arithmetic; x: [T, H] -> [T, H]."""
    cfg = gpt.cfg
    h = x.to(gpt.dtype)
    cos, sin = gpt.rotary(positions, h.dtype)
    t, residual = h.shape[0], None
    for i, layer in enumerate(gpt.layers):
        norm = layer.input_layernorm
        if residual is None:
            normed, residual = ops.rmsnorm(h, norm.weight, norm.eps), h
        else:
            normed, residual = ops.add_rmsnorm(h, residual, norm.weight, norm.eps)
        q, k, v = _split_qkv(layer.qkv_proj(normed), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        attn = ctx.attend(i, q, k, v, rope=(cos, sin))
        norm = layer.post_attention_layernorm
        normed, residual = ops.add_rmsnorm(layer.o_proj(attn.reshape(t, -1)), residual, norm.weight, norm.eps)
        h = layer.down_proj(ops.silu_mul(layer.gate_up_proj(normed)))
    return ops.add_rmsnorm(h, residual, gpt.norm.weight, gpt.norm.eps)[0]


def gemv_gpt_forward(gpt, ops: DecodeOps, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
    """fused_gpt_forward for one row through layers/triton_gemv.py: each norm inside the GEMV that reads it,
    SiLU-and-mul inside gate_up, no split-K reduce: 5 kernels a layer instead of 9. Dense weights only (the
    linears' .weight [N, K]); x: [1, H] -> [1, H]."""
    from ttsserve.layers import triton_gemv

    cfg = gpt.cfg
    h = x.to(gpt.dtype)
    cos, sin = gpt.rotary(positions, h.dtype)
    residual = None
    for i, layer in enumerate(gpt.layers):
        norm = layer.input_layernorm
        qkv, residual = triton_gemv.norm_linear(h, residual, norm.weight, norm.eps, layer.qkv_proj.weight)
        q, k, v = _split_qkv(qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        h = triton_gemv.linear(ctx.attend(i, q, k, v, rope=(cos, sin)).reshape(1, -1), layer.o_proj.weight)
        norm = layer.post_attention_layernorm
        act, residual = triton_gemv.norm_linear(
            h, residual, norm.weight, norm.eps, layer.gate_up_proj.weight, gated=True
        )
        h = triton_gemv.linear(act, layer.down_proj.weight)
    return ops.add_rmsnorm(h, residual, gpt.norm.weight, gpt.norm.eps)[0]
