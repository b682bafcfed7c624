"""ChatTTS input embeddings (text + 4 codebooks), speaker injection, output heads (MODEL.md §1.5, §2.7, §3.2, §3.4).

Everything here is fp32: the embeddings are cast to the GPT dtype by the GPT, and hidden states are cast
back to fp32 before the heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embed(nn.Module):
    """Text / code embedding tables and the weight-norm heads, folded to plain matrices at load.

    Attributes: num_text_tokens (V_text), num_audio_tokens (V_audio, EOS = V_audio - 1), num_vq (Q),
    hidden_size (H).
    """

    def __init__(self, num_text_tokens: int, num_audio_tokens: int, num_vq: int, hidden_size: int) -> None:
        super().__init__()
        self.num_text_tokens, self.num_audio_tokens = num_text_tokens, num_audio_tokens
        self.num_vq, self.hidden_size = num_vq, hidden_size
        self.emb_text = nn.Parameter(torch.zeros(num_text_tokens, hidden_size), requires_grad=False)
        self.emb_code = nn.Parameter(torch.zeros(num_vq, num_audio_tokens, hidden_size), requires_grad=False)
        self.head_text = nn.Parameter(torch.zeros(num_text_tokens, hidden_size), requires_grad=False)
        # All Q code heads as one [Q * V_audio, H] matrix: one GEMM per step instead of Q.
        self.head_code = nn.Parameter(torch.zeros(num_vq * num_audio_tokens, hidden_size), requires_grad=False)

    @classmethod
    def from_state_dict(
        cls, sd: dict[str, torch.Tensor], device: torch.device | str = "cpu", source: str = "Embed.safetensors"
    ) -> Embed:
        """Build from `asset/Embed.safetensors` tensors (MODEL.md §1.5) on `device`, fp32 whatever the file dtype;
        dims are inferred from the shapes. The heads are folded in fp32 on the host.

        Raises ValueError naming any missing, unexpected or mis-shaped tensor.
        """
        for key in ("emb_text.weight", "emb_code.0.weight"):
            if key not in sd:
                raise ValueError(f"{source}: missing tensor {key}")
            if sd[key].dim() != 2:
                raise ValueError(f"{source}: {key} has shape {tuple(sd[key].shape)}, expected 2 dims")
        v_text, h = sd["emb_text.weight"].shape
        v_audio = sd["emb_code.0.weight"].shape[0]
        num_vq = 0
        while f"emb_code.{num_vq}.weight" in sd:
            num_vq += 1
        expected = _expected_shapes(v_text, v_audio, num_vq, h)
        for name, shape in expected.items():
            if name not in sd:
                raise ValueError(f"{source}: missing tensor {name}")
            if tuple(sd[name].shape) != shape:
                raise ValueError(f"{source}: {name} has shape {tuple(sd[name].shape)} but expected {shape}")
        extra = sorted(set(sd) - set(expected))
        if extra:
            raise ValueError(f"{source}: unexpected tensor {extra[0]} ({len(extra)} unexpected in all)")
        m = cls(v_text, v_audio, num_vq, h)
        f32 = {k: v.detach().to(torch.float32) for k, v in sd.items()}
        with torch.no_grad():
            m.emb_text.copy_(f32["emb_text.weight"])
            m.emb_code.copy_(torch.stack([f32[f"emb_code.{q}.weight"] for q in range(num_vq)]))
            m.head_text.copy_(_fold_weight_norm(f32, "head_text"))
            m.head_code.copy_(torch.cat([_fold_weight_norm(f32, f"head_code.{q}") for q in range(num_vq)]))
        return m.to(device)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [N] int64 text ids -> [N, H] fp32."""
        return self.emb_text[ids]

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: [N, Q] int64 -> sum over codebooks of emb_code[q][codes[:, q]]: [N, H] fp32."""
        q = torch.arange(self.num_vq, device=codes.device)
        return self.emb_code[q, codes].sum(dim=1)

    def embed_prompt(
        self, ids: torch.Tensor, text_mask: torch.Tensor, spk_emb: torch.Tensor | None, spk_emb_id: int
    ) -> torch.Tensor:
        """Prefill embeddings of one prompt (MODEL.md §3.2).

        ids: [T, Q] int64 (text positions hold the text id in every column); text_mask: [T] bool;
        spk_emb: [H] speaker vector (fp16 in the reference) or None; spk_emb_id: the `[spk_emb]` token id.
        Text rows get emb_text[ids[:, 0]]; other rows sum the code embeddings (text ids there are masked
        to 0 first, since they are out of range for the code tables). Every row with ids[:, 0] == spk_emb_id
        is replaced by the fp16 L2-normalized speaker vector, cast to fp32. Returns [T, H] fp32.
        """
        if ids.dim() != 2 or ids.shape[1] != self.num_vq:
            raise ValueError(f"ids must be [T, {self.num_vq}], got {tuple(ids.shape)}")
        if text_mask.shape != ids.shape[:1]:
            raise ValueError(f"text_mask must be [{ids.shape[0]}], got {tuple(text_mask.shape)}")
        text_mask = text_mask.to(torch.bool)
        text = self.embed_text(torch.where(text_mask, ids[:, 0], 0))
        code = self.embed_codes(torch.where(text_mask[:, None], 0, ids))
        out = torch.where(text_mask[:, None], text, code)
        if spk_emb is None:
            return out
        spk = self.normalize_speaker(spk_emb.to(ids.device))
        return torch.where((ids[:, 0] == spk_emb_id)[:, None], spk, out)  # REPLACES, does not add

    def normalize_speaker(self, spk_emb: torch.Tensor) -> torch.Tensor:
        """spk_emb [H] -> the vector that replaces the [spk_emb] position: L2-normalized in fp16 (as the
        reference does, the speaker tensor's dtype), then fp32, on spk_emb's device."""
        if spk_emb.shape != (self.hidden_size,):
            raise ValueError(f"spk_emb must be [{self.hidden_size}], got {tuple(spk_emb.shape)}")
        return F.normalize(spk_emb.to(torch.float16), dim=0, eps=1e-12).float()

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] (cast to fp32) -> [N, V_text] fp32."""
        return hidden.float() @ self.head_text.T

    def code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] (cast to fp32) -> [N, Q, V_audio] fp32, logits[n, q] = head_code[q](hidden[n])."""
        return (hidden.float() @ self.head_code.T).view(-1, self.num_vq, self.num_audio_tokens)


def _expected_shapes(v_text: int, v_audio: int, num_vq: int, h: int) -> dict[str, tuple[int, ...]]:
    shapes = {
        "emb_text.weight": (v_text, h),
        "head_text.parametrizations.weight.original0": (v_text, 1),
        "head_text.parametrizations.weight.original1": (v_text, h),
    }
    for q in range(num_vq):
        shapes[f"emb_code.{q}.weight"] = (v_audio, h)
        shapes[f"head_code.{q}.parametrizations.weight.original0"] = (v_audio, 1)
        shapes[f"head_code.{q}.parametrizations.weight.original1"] = (v_audio, h)
    return shapes


def _fold_weight_norm(sd: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """torch weight_norm(dim=0): W[r] = v[r] * (g[r] / ||v[r]||_2), no epsilon, in fp32."""
    g = sd[f"{prefix}.parametrizations.weight.original0"]
    v = sd[f"{prefix}.parametrizations.weight.original1"]
    return v * (g / torch.linalg.vector_norm(v, dim=1, keepdim=True))
