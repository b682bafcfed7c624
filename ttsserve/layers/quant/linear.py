"""QuantLinear: the weight-only quantized replacement of the GPT's nn.Linear layers, and its kernels.

Kernels are chosen by the device type of the activations, once per device type (like attention backends):
- CPU (and the test oracle): `TorchQuantKernels`. int8 uses `torch._weight_int8pack_mm` (PyTorch's CPU
  weight-only int8 GEMM, bf16 / fp16 / fp32 activations) when present, else multiplies by the int8 weight
  cast to the activation dtype and scales the output; int4 unpacks, dequantizes and multiplies.
- CUDA: `TritonQuantKernels` (triton_quant.py): dequantize-and-multiply kernels, a small-M (decode)
  configuration with split-K and a GEMM (prefill) configuration.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ttsserve.layers.quant.quantize import QuantConfig, dequantize_int4, dequantize_int8, quantize_weight

# The GPT's fused linear layers (gpt.py); each stores its rows in the order of the HF tensors it fuses.
GPT_LINEARS = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


class QuantKernels(Protocol):
    name: str

    def int8_linear(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x: [M, K] float; qweight int8 [N, K]; scales fp32 [N] -> x @ (qweight * scales)^T: [M, N], x's dtype."""
        ...

    def int4_linear(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        """x: [M, K]; qweight uint8 [N, K/2] (split halves); scales fp16 / qzeros uint8 [N, K/G] -> [M, N]."""
        ...


class TorchQuantKernels:
    """The CPU path and the reference every other kernel is tested against."""

    name = "torch"

    def __init__(self) -> None:
        self.has_int8pack_mm = hasattr(torch, "_weight_int8pack_mm")

    def int8_linear(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if (
            self.has_int8pack_mm
            and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        ):
            return torch._weight_int8pack_mm(x.contiguous(), qweight, scales.to(x.dtype))
        # Integers up to 127 are exact in every float dtype, so only the output scaling rounds.
        return F.linear(x, qweight.to(x.dtype)) * scales.to(x.dtype)

    def int4_linear(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        w = dequantize_int4(qweight, scales, qzeros, group_size)
        return F.linear(x, w.to(x.dtype))


@functools.cache
def quant_kernels(device_type: str) -> QuantKernels:
    """The kernels for activations on `device_type`: Triton on "cuda", torch elsewhere (cached per type)."""
    if device_type == "cuda":
        from ttsserve.layers.quant.triton_quant import TritonQuantKernels  # CUDA-only import

        return TritonQuantKernels()
    return TorchQuantKernels()


class DenseSize:
    """dense_bytes() for a quantized linear layer (QuantLinear and its packed CPU forms) of in/out_features."""

    in_features: int
    out_features: int

    def dense_bytes(self, dtype: torch.dtype) -> int:
        """Bytes the same layer takes unquantized in `dtype` (for the memory report)."""
        return self.in_features * self.out_features * dtype.itemsize


class QuantLinear(DenseSize, nn.Module):
    """y = x @ W^T (no bias) with W stored in a QuantConfig format as buffers `qweight`, `scales` (and
    `qzeros` for int4). The scales keep their stored dtype (fp32 / fp16) whatever the activation dtype."""

    def __init__(
        self, in_features: int, out_features: int, qc: QuantConfig, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = qc.bits, qc.group_size
        for suffix, (shape, dtype) in qc.tensor_specs(out_features, in_features).items():
            self.register_buffer(suffix, torch.empty(shape, dtype=dtype, device=device))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, qc: QuantConfig) -> QuantLinear:
        """Round-to-nearest quantization of a dense [out, in] weight (on its device)."""
        m = cls(weight.shape[1], weight.shape[0], qc, device=weight.device)
        for suffix, t in quantize_weight(weight.detach(), qc).items():
            getattr(m, suffix).copy_(t)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features] in x's dtype."""
        kernels = quant_kernels(x.device.type)
        x2 = x.reshape(-1, self.in_features)
        if self.bits == 8:
            y = kernels.int8_linear(x2, self.qweight, self.scales)
        else:
            y = kernels.int4_linear(x2, self.qweight, self.scales, self.qzeros, self.group_size)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [out, in]: the weight this layer multiplies by."""
        if self.bits == 8:
            return dequantize_int8(self.qweight, self.scales)
        return dequantize_int4(self.qweight, self.scales, self.qzeros, self.group_size)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}{g}"


def quantize_gpt_(gpt: nn.Module, qc: QuantConfig) -> nn.Module:
    """Replace every dense linear of a built GPT (gpt.py) by its round-to-nearest QuantLinear, in place.

    Quantizing a fused weight equals quantizing its parts: int8 scales are per row and int4 groups run
    along a row, so no group ever straddles two fused tensors.
    """
    for layer in gpt.layers:
        for attr in GPT_LINEARS:
            lin = getattr(layer, attr)
            if isinstance(lin, nn.Linear):
                setattr(layer, attr, QuantLinear.from_weight(lin.weight, qc))
    return gpt


def replace_with_empty_quant_linears(layer: nn.Module, qc: QuantConfig) -> None:
    """Swap a LlamaLayer's dense linears for empty QuantLinears of the same shape (to be loaded next);
    under `torch.device("meta")` this allocates nothing."""
    for attr in GPT_LINEARS:
        lin = getattr(layer, attr)
        setattr(layer, attr, QuantLinear(lin.in_features, lin.out_features, qc))


def quant_linears(module: nn.Module) -> list[QuantLinear]:
    return [m for m in module.modules() if isinstance(m, QuantLinear)]


def precompile_quant_linears(module: nn.Module, max_rows: int, dtype: torch.dtype) -> int:
    """Compile the device kernels of the module's QuantLinears for every row count up to max_rows (a step's
    tokens at most), where the kernels compile per launch shape (Triton) -> the calls made (0: none to do)."""
    linears = quant_linears(module)
    if not linears:
        return 0
    kernels = quant_kernels(linears[0].qweight.device.type)
    precompile = getattr(kernels, "precompile", None)
    return 0 if precompile is None else precompile(linears, max_rows, dtype)


def cast_except_quant(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """model.to(device, dtype) except that QuantLinears only move: a cast would round their scales."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)

    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.to(device)
        else:
            m._apply(cast, recurse=False)
    return model
