"""The ChatTTS GPT: an HF LlamaModel body without `embed_tokens`, over a flat batch of tokens (MODEL.md §3.1)."""

from __future__ import annotations

import torch
from torch import nn

from ttsserve.attention.backend import AttentionContext
from ttsserve.config import GPTConfig
from ttsserve.layers.quant.quantize import QuantConfig
from ttsserve.model.layers import RMSNorm, RotaryEmbedding, apply_rotary, silu_and_mul

# Keys of the HF checkpoint that the engine does not use.
_IGNORED_SUFFIXES = ("embed_tokens.weight", "rotary_emb.inv_freq")


class LlamaLayer(nn.Module):
    """One decoder layer; q/k/v and gate/up are fused at load time (a layout change only)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext, layer_idx: int
    ) -> torch.Tensor:
        t, nh, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(self.input_layernorm(x))
        nq, nkv = nh * d, self.num_kv_heads * d
        # q and k rotated as one [T, Hq + Hkv, D] view: the same elementwise math in half the ops (a decode
        # step's per-op host cost is most of a small model's step); q / k are views of that tensor
        qk = apply_rotary(qkv[:, : nq + nkv].view(t, nh + self.num_kv_heads, d), cos, sin)
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, nq + nkv :].view(t, self.num_kv_heads, d)
        attn = ctx.attend(layer_idx, q, k, v)
        x = x + self.o_proj(attn.reshape(t, nq))
        return x + self.down_proj(silu_and_mul(self.gate_up_proj(self.post_attention_layernorm(x))))


class GPT(nn.Module):
    """Llama body over a flat batch: the new tokens of many sequences laid end to end (no batch dim)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """x: [T, H] input embeddings (any float dtype; cast to the model dtype);
        positions: [T] int64, per-sequence positions (< max_position_embeddings).
        Returns the post-final-norm hidden states [T, H] in the model dtype.
        """
        h = x.to(self.dtype)
        cos, sin = self.rotary(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, ctx, i)
        return self.norm(h)

    @classmethod
    def from_state_dict(
        cls,
        sd: dict[str, torch.Tensor],
        cfg: GPTConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        source: str = "gpt/model.safetensors",
        quant: QuantConfig | None = None,
    ) -> GPT:
        """Build from an HF LlamaModel state dict (MODEL.md §1.4), keys with or without a `model.` prefix.

        `embed_tokens.weight` and `rotary_emb.inv_freq` are ignored. Raises ValueError naming the tensor
        for any missing, unexpected or mis-shaped tensor. With `quant` (a quantized checkpoint,
        ttsserve/layers/quant/quantize.py) each linear `X.weight` is replaced by `X.qweight` / `X.scales`
        (/ `X.qzeros`) and the layers are QuantLinears; their scales keep the stored dtype.
        """
        tensors = _strip_prefix(sd)
        packed = [k for k in tensors if k.endswith(".qweight")]
        if quant is None and packed:
            raise ValueError(
                f"{source}: holds quantized tensors ({packed[0]}, ...) but no quantization_config "
                f"(asset/gpt/config.json or quantization_config.json) says how to read them"
            )
        expected = _expected_shapes(cfg, quant)
        missing = [k for k in expected if k not in tensors]
        if missing:
            raise ValueError(f"{source}: missing tensor {missing[0]} ({len(missing)} missing in all)")
        unexpected = [k for k in tensors if k not in expected]
        if unexpected:
            raise ValueError(f"{source}: unexpected tensor {unexpected[0]} ({len(unexpected)} unexpected in all)")
        for name, (shape, want_dtype) in expected.items():
            got = tuple(tensors[name].shape)
            if got != shape:
                raise ValueError(f"{source}: {name} has shape {got} but config implies {shape}")
            if want_dtype is not None and tensors[name].dtype != want_dtype:
                raise ValueError(
                    f"{source}: {name} has dtype {tensors[name].dtype}, the {quant.method} format stores {want_dtype}"
                )
        with torch.device("meta"):
            model = cls(cfg)
            if quant is not None:
                from ttsserve.layers.quant.linear import replace_with_empty_quant_linears

                for layer in model.layers:
                    replace_with_empty_quant_linears(layer, quant)
        suffixes = ("weight",) if quant is None else quant.suffixes
        model.load_state_dict(_fuse(tensors, cfg, suffixes), assign=True, strict=True)
        # The rotary tables are computed, not loaded: rebuild them on a real device.
        model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        if quant is None:
            return model.to(device=device, dtype=dtype)
        from ttsserve.layers.quant.linear import cast_except_quant

        return cast_except_quant(model, torch.device(device), dtype)


def _strip_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        name = k[len("model.") :] if k.startswith("model.") else k
        if not name.endswith(_IGNORED_SUFFIXES):
            out[name] = v
    return out


def _expected_shapes(
    cfg: GPTConfig, quant: QuantConfig | None = None
) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """name -> (shape, dtype or None for "any float") of every tensor the checkpoint must hold."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    linears = {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        for name, (out_f, in_f) in linears.items():
            if quant is None:
                shapes[p + name + ".weight"] = ((out_f, in_f), None)
            else:
                for suffix, spec in quant.tensor_specs(out_f, in_f).items():
                    shapes[f"{p}{name}.{suffix}"] = spec
        shapes[p + "input_layernorm.weight"] = ((h,), None)
        shapes[p + "post_attention_layernorm.weight"] = ((h,), None)
    shapes["norm.weight"] = ((h,), None)
    return shapes


def _fuse(
    t: dict[str, torch.Tensor], cfg: GPTConfig, suffixes: tuple[str, ...] = ("weight",)
) -> dict[str, torch.Tensor]:
    """HF names -> this module's names, with q/k/v and gate/up concatenated along the output dim (dim 0 of
    every stored tensor of a linear: weight, or qweight / scales / qzeros)."""
    out = {"norm.weight": t["norm.weight"]}
    for n in range(cfg.num_layers):
        p, a, m = f"layers.{n}.", f"layers.{n}.self_attn.", f"layers.{n}.mlp."
        for x in suffixes:
            out[f"{p}qkv_proj.{x}"] = torch.cat([t[f"{a}q_proj.{x}"], t[f"{a}k_proj.{x}"], t[f"{a}v_proj.{x}"]])
            out[f"{p}o_proj.{x}"] = t[f"{a}o_proj.{x}"]
            out[f"{p}gate_up_proj.{x}"] = torch.cat([t[f"{m}gate_proj.{x}"], t[f"{m}up_proj.{x}"]])
            out[f"{p}down_proj.{x}"] = t[f"{m}down_proj.{x}"]
        out[p + "input_layernorm.weight"] = t[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = t[p + "post_attention_layernorm.weight"]
    return out
