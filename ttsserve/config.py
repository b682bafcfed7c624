"""ModelConfig: every size read from the checkpoint (never hard-coded)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTConfig:
    """The Llama body plus ChatTTS's vocabularies (spec 1.3). head_dim = hidden_size / num_heads."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    num_text_tokens: int = 21178
    num_audio_tokens: int = 626
    num_vq: int = 4

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def audio_eos_id(self) -> int:
        return self.num_audio_tokens - 1

    @classmethod
    def from_hf_json(cls, cfg: dict) -> GPTConfig:
        """Build from `asset/gpt/config.json` (an HF LlamaConfig with ChatTTS extras)."""
        try:
            return cls(
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=int(cfg["num_attention_heads"]),
                num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                num_text_tokens=int(cfg.get("num_text_tokens", 21178)),
                num_audio_tokens=int(cfg.get("num_audio_tokens", 626)),
                num_vq=int(cfg.get("num_vq", 4)),
            )
        except KeyError as e:
            raise ValueError(f"asset/gpt/config.json: missing key {e.args[0]!r}") from None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one position (one frame)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
