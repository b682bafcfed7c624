"""DenseAttention: one sequence with a growing dense K/V cache (the single-request oracle, teacher forcing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttsserve.attention.backend import Rope, rope_qk
from ttsserve.layers.quant.kv_fp8 import fake_quantize_fp8


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the LAST q_len positions of a context over the whole context.

    q: [q_len, Hq, D]; k, v: [ctx_len, Hkv, D] with ctx_len >= q_len. Query i sits at context position
    ctx_len - q_len + i and sees keys 0..that position. Returns [q_len, Hq, D].
    """
    q_len, num_heads, _ = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    if num_heads != num_kv_heads:
        rep = num_heads // num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if q_len == ctx_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        # SDPA's is_causal aligns the mask top-left; the new queries are the bottom rows, so build it.
        offset = ctx_len - q_len
        mask = (
            torch.arange(ctx_len, device=q.device)[None, :] <= torch.arange(offset, ctx_len, device=q.device)[:, None]
        )
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


class DenseAttention:
    """AttentionContext for ONE sequence: each call appends its T tokens to the layer's cache and attends
    causally over everything cached so far. Feed the same positions to the GPT that this cache implies
    (0..n-1 in order); `num_cached` is the context length after the last full forward.
    """

    def __init__(self, num_layers: int, scale: float | None = None) -> None:
        self.k_cache: list[torch.Tensor | None] = [None] * num_layers
        self.v_cache: list[torch.Tensor | None] = [None] * num_layers
        self.scale = scale

    @property
    def num_cached(self) -> int:
        k = self.k_cache[-1]
        return 0 if k is None else k.shape[0]

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope | None = None
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D] (rope: AttentionContext.attend's)."""
        q, k = rope_qk(q, k, rope)
        kc, vc = self.k_cache[layer_idx], self.v_cache[layer_idx]
        kc = k if kc is None else torch.cat([kc, k])
        vc = v if vc is None else torch.cat([vc, v])
        self.k_cache[layer_idx], self.v_cache[layer_idx] = kc, vc
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        return causal_sdpa(q, kc, vc, scale)


class FP8DenseAttention(DenseAttention):
    """DenseAttention whose cache holds fp8-rounded k / v (per token and head, the rule of layers/quant/kv_fp8.py): the
    CPU simulation of an fp8 KV cache, for fidelity measurements (`ttsserve bench quality`)."""

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope | None = None
    ) -> torch.Tensor:
        q, k = rope_qk(q, k, rope)  # the rotated k is what the cache rounds
        return super().attend(layer_idx, q, fake_quantize_fp8(k), fake_quantize_fp8(v))
