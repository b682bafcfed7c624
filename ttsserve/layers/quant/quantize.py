"""Weight formats of the quantized GPT, and quantizing a GPT state dict (HF names, MODEL.md §1.4).

int8 ("int8"): per-output-channel symmetric. qweight int8 [N, K] with values in [-127, 127];
    scales fp32 [N]; W[n, k] ~= qweight[n, k] * scales[n].
int4 ("awq-int4"): group-wise asymmetric along the input dim (group G, 128 by default).
    q in [0, 15]; scales fp16 [N, K / G]; qzeros uint8 [N, K / G] in [0, 15];
    W[n, k] ~= (q[n, k] - qzeros[n, k // G]) * scales[n, k // G].
    Packed two to a byte, "split halves" within each group: byte j (0 <= j < G / 2) of group g holds
    q[g*G + j] in its low nibble and q[g*G + G/2 + j] in its high nibble, so qweight is uint8 [N, K / 2].
    A kernel that walks one group per step unpacks with a mask and a shift into two [G/2] halves that
    multiply the two halves of the activation slice: no interleaving needed on either side.

Only the seven linears of each layer are quantized; norms stay as stored (AWQ folds scales into them).
The embeddings, heads and audio stages live in other files and are never touched.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

import torch

METHODS = {"int8": 8, "awq-int4": 4}
FORMAT_VERSION = 1
LINEAR_NAMES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
INT8_MAX = 127
INT4_MAX = 15


@dataclass(frozen=True)
class QuantConfig:
    """What `asset/gpt/quantization_config.json` holds (also embedded in config.json as "quantization_config",
    the HF convention, so the loader finds it without reading another file).

    group_size: None for int8 (per output channel); the int4 group along the input dim.
    calibration: provenance only (corpus, sample count, the AWQ exponent chosen per linear group).
    """

    method: str
    bits: int
    group_size: int | None
    version: int = FORMAT_VERSION
    zero_point: bool = False
    modules: tuple[str, ...] = LINEAR_NAMES
    calibration: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization method must be one of {sorted(METHODS)}, got {self.method!r}")
        if self.bits != METHODS[self.method]:
            raise ValueError(f"quantization {self.method} has {METHODS[self.method]} bits, config says {self.bits}")
        if self.version != FORMAT_VERSION:
            raise ValueError(
                f"quantization_config version {self.version} is not supported (this build reads "
                f"version {FORMAT_VERSION})"
            )
        if self.bits == 4:
            g = self.group_size
            if g is None or g < 32 or g & (g - 1):
                raise ValueError(f"int4 group_size must be a power of two >= 32, got {g}")
        elif self.group_size is not None:
            raise ValueError("int8 is per output channel: group_size must be null")

    @classmethod
    def for_method(cls, method: str, group_size: int = 128, calibration: dict | None = None) -> QuantConfig:
        if method not in METHODS:
            raise ValueError(f"quantization method must be one of {sorted(METHODS)}, got {method!r}")
        bits = METHODS[method]
        return cls(
            method, bits, group_size if bits == 4 else None, zero_point=bits == 4, calibration=dict(calibration or {})
        )

    def to_json(self) -> dict:
        d = asdict(self)
        d["modules"] = list(self.modules)
        return d

    @classmethod
    def from_json(cls, d: dict, source: str = "quantization_config.json") -> QuantConfig:
        try:
            return cls(
                method=d["method"],
                bits=int(d["bits"]),
                group_size=d.get("group_size"),
                version=int(d.get("version", FORMAT_VERSION)),
                zero_point=bool(d.get("zero_point", False)),
                modules=tuple(d.get("modules", LINEAR_NAMES)),
                calibration=dict(d.get("calibration", {})),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing key {e.args[0]!r}") from None
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The stored tensors of each quantized linear `X`: X.qweight, X.scales (, X.qzeros)."""
        return ("qweight", "scales") if self.bits == 8 else ("qweight", "scales", "qzeros")

    def tensor_specs(self, out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """suffix -> (shape, dtype) of the stored tensors of one [out, in] linear."""
        n, k = out_features, in_features
        if self.bits == 8:
            return {"qweight": ((n, k), torch.int8), "scales": ((n,), torch.float32)}
        g = self.group_size
        if k % g:
            raise ValueError(f"in_features {k} is not a multiple of the int4 group size {g}")
        return {
            "qweight": ((n, k // 2), torch.uint8),
            "scales": ((n, k // g), torch.float16),
            "qzeros": ((n, k // g), torch.uint8),
        }


# ---------------------------------------------------------------------------------------------- int8


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (qweight int8 [N, K], scales fp32 [N]); an all-zero row gets scale 1."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.clamp(torch.round(w / scales[:, None]), -INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """-> fp32 [N, K]."""
    return qweight.float() * scales.float()[:, None]


# ---------------------------------------------------------------------------------------------- int4


def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """q: uint8 [N, K] with values in [0, 15] -> uint8 [N, K / 2] in the split-halves layout (module doc)."""
    n, k = q.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"K={k} must be a multiple of the (even) group size {group_size}")
    g = q.reshape(n, k // group_size, 2, group_size // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [N, K / 2] -> uint8 [N, K] with values in [0, 15]."""
    n, half_k = packed.shape
    p = packed.reshape(n, -1, 1, group_size // 2)
    return torch.cat([p & 0xF, p >> 4], dim=2).reshape(n, 2 * half_k)


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (qweight uint8 [N, K/2], scales fp16 [N, K/G], qzeros uint8 [N, K/G]).

    Each group maps [min, max] (widened to include 0) onto 0..15. The scale is rounded to fp16 BEFORE the
    weights are quantized, so dequantization reproduces exactly the grid the rounding used.
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo = g.amin(dim=2).clamp(max=0.0)
    hi = g.amax(dim=2).clamp(min=0.0)
    scales = ((hi - lo) / INT4_MAX).clamp(min=1e-6).half()
    s = scales.float()
    zeros = torch.clamp(torch.round(-lo / s), 0, INT4_MAX)
    q = torch.clamp(torch.round(g / s[..., None]) + zeros[..., None], 0, INT4_MAX).to(torch.uint8)
    return pack_int4(q.reshape(n, k), group_size), scales, zeros.to(torch.uint8)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """-> fp32 [N, K]."""
    q = unpack_int4(qweight, group_size).float()
    n, k = q.shape
    q = q.reshape(n, k // group_size, group_size)
    return ((q - qzeros.float()[..., None]) * scales.float()[..., None]).reshape(n, k)


# ---------------------------------------------------------------------------------------------- both


def quantize_weight(w: torch.Tensor, qc: QuantConfig) -> dict[str, torch.Tensor]:
    """One [N, K] weight -> its stored tensors {suffix: tensor} (see QuantConfig.tensor_specs)."""
    if qc.bits == 8:
        q, s = quantize_int8(w)
        return {"qweight": q, "scales": s}
    q, s, z = quantize_int4(w, qc.group_size)
    return {"qweight": q, "scales": s, "qzeros": z}


def dequantize_weight(t: dict[str, torch.Tensor], qc: QuantConfig) -> torch.Tensor:
    """The inverse of quantize_weight up to rounding: -> fp32 [N, K]."""
    if qc.bits == 8:
        return dequantize_int8(t["qweight"], t["scales"])
    return dequantize_int4(t["qweight"], t["scales"], t["qzeros"], qc.group_size)


def fake_quantize(w: torch.Tensor, qc: QuantConfig) -> torch.Tensor:
    """Quantize then dequantize (fp32 [N, K]): what the quantized layer will multiply by."""
    return dequantize_weight(quantize_weight(w, qc), qc)


_LINEAR_RE = re.compile(r"(?:^|\.)layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight$")


def is_linear_weight(name: str) -> bool:
    """True for `[model.]layers.{i}.<one of LINEAR_NAMES>.weight`."""
    return _LINEAR_RE.search(name) is not None


def quantize_gpt_state_dict(sd: dict[str, torch.Tensor], qc: QuantConfig) -> dict[str, torch.Tensor]:
    """HF-named GPT tensors -> the quantized file's tensors: every linear `X.weight` becomes `X.qweight`,
    `X.scales` (and `X.qzeros` for int4); everything else is copied unchanged (norms stay fp32)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if is_linear_weight(name):
            base = name.removesuffix(".weight")
            for suffix, q in quantize_weight(t, qc).items():
                out[f"{base}.{suffix}"] = q.contiguous()
        else:
            out[name] = t
    return out
